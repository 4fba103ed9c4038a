"""The cache layer's lean decode paths: the in-place one-token step (`SiteModule.decode_token`)
gives the general step's logits, and is really taken; a site inside its min_seq_len runs the
model's own attention from a plain KV cache (the site module is never called), so prefill and
decoding there equal the original model exactly; crossing the threshold builds the state from
those keys and continues as a full forward does."""

import pytest
import torch

import attnopt
from attnopt.forms.common.base import SiteModule
from attnopt.forms.window.decode import WindowRing

transformers = pytest.importorskip("transformers")

from attnopt.hf.cache import SiteCacheLayer, make_cache  # noqa: E402

VOCAB, PROMPT, NEW = 97, 20, 12


@pytest.fixture(scope="module")
def base():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(batch=2, n=PROMPT):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(7))


def _compile(base, policy):
    return attnopt.compile(base, policy, example_inputs={"input_ids": _ids(), "use_cache": False}, e2e_tolerance=None)


@torch.no_grad()
def _steps(model, ids, new=NEW):
    """Per-step logits of a manual cache loop (greedy) and the cache."""
    cache = make_cache(model) if hasattr(model, "attnopt_report") else transformers.DynamicCache()
    logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:]
    out = [logits]
    for _ in range(new - 1):
        logits = model(input_ids=logits.argmax(-1), past_key_values=cache, use_cache=True).logits[:, -1:]
        out.append(logits)
    return torch.cat(out, dim=1), cache


@pytest.mark.parametrize("policy", ["linear", "linear:hedgehog", "ssm", "window:8+sinks:2", "linear+window:8+sinks:2"])
def test_in_place_step_equals_the_general_step_and_is_taken(base, policy, monkeypatch):
    opt = _compile(base, policy)
    taken = []
    real = SiteModule.decode_token
    for cls in {type(m) for m in opt.modules() if isinstance(m, SiteModule)}:
        own = cls.decode_token

        def counted(self, q, k, v, state, own=own):
            result = own(self, q, k, v, state)
            taken.append(result is not None)
            return result

        monkeypatch.setattr(cls, "decode_token", counted)
    fast, cache = _steps(opt, _ids())
    assert sum(taken) == 2 * (NEW - 1)  # both sites, every step after the prefill
    for layer in cache.layers:
        assert isinstance(layer, SiteCacheLayer)
        fs = layer.state.form_state
        if "window" in policy:  # the band lives in a ring written in place
            assert isinstance(fs if policy.startswith("window") else fs.window, WindowRing)
        else:  # S and z are views of one packed buffer
            assert fs[0]._base is not None and fs[0]._base is fs[1]._base
    for cls in {type(m) for m in opt.modules() if isinstance(m, SiteModule)}:
        monkeypatch.setattr(cls, "decode_token", real)  # the base class's: None, the general step
    general, _ = _steps(opt, _ids())
    assert (fast - general).abs().max() < 1e-5  # measured about 1e-7 (fp32)
    # and after beam-style reordering the in-place step continues from the reordered state
    cache.reorder_cache(torch.tensor([1, 0]))
    assert all(layer.state.form_state is not None for layer in cache.layers)


def test_a_site_inside_min_seq_len_is_the_original_model_and_never_runs(base, monkeypatch):
    opt = _compile(base, {"rules": [{"form": "linear", "min_seq_len": 40}]})
    ids = _ids()

    def refuse(*args, **kwargs):
        raise AssertionError("the site module ran below its threshold")

    for name in ("forward", "decode", "decode_token", "decode_from_keys"):
        monkeypatch.setattr(type(opt.model.layers[0].self_attn.attnopt_site), name, refuse)
    mine, cache = _steps(opt, ids)  # 20 + 11 columns: inside 40 throughout
    theirs, _ = _steps(base, ids)
    assert torch.equal(mine, theirs)
    assert all(layer.state is None and layer.kept == PROMPT + NEW - 1 for layer in cache.layers)
    with torch.no_grad():
        assert torch.equal(opt(input_ids=ids, use_cache=False).logits, base(input_ids=ids, use_cache=False).logits)


def test_crossing_min_seq_len_from_a_kept_kv_cache_matches_a_full_forward(base):
    opt = _compile(base, {"rules": [{"form": "linear", "min_seq_len": 24}]})
    ids = _ids()
    steps, cache = _steps(opt, ids)  # the prompt (20) inside 24, the 5th new column past it
    seq = torch.cat([ids, steps[:, :-1].argmax(-1)], dim=1)
    with torch.no_grad():
        full = opt(input_ids=seq, use_cache=False).logits[:, PROMPT - 1:]
    assert (steps - full).abs().max() < 1e-5
    assert all(layer.kept == 0 and layer.state.prefix is None and layer.state.columns == PROMPT + NEW - 1
               for layer in cache.layers)
    with torch.no_grad():  # past the threshold the form acts: not the original model
        assert not torch.allclose(full, base(input_ids=seq, use_cache=False).logits[:, PROMPT - 1:], atol=1e-4)
