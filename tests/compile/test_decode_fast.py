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


class _Counted:
    """A token stepper that counts its steps (the layer reads `.state` and `.q_dtype` of it)."""

    def __init__(self, step, taken):
        self.step, self.taken, self.q_dtype = step, taken, step.q_dtype

    @property
    def state(self):
        return self.step.state

    def __call__(self, q, k, v):
        self.taken.append(True)
        return self.step(q, k, v)


def _count_fast_steps(opt, monkeypatch, off: bool = False):
    """Count the steps the in-place paths take (a stepper's calls, or a form's own decode_token);
    with `off`, turn both off instead (the general step)."""
    taken, built = [], []
    for cls in {type(m) for m in opt.modules() if isinstance(m, SiteModule)}:
        own_stepper, own_token = cls.token_stepper, cls.decode_token

        def stepper(self, fs, q, k, own=own_stepper):
            step = None if off else own(self, fs, q, k)
            built.append(step is not None)
            return None if step is None else _Counted(step, taken)

        monkeypatch.setattr(cls, "token_stepper", stepper)
        if own_token is not SiteModule.decode_token:  # a form with a one-token step but no stepper

            def token(self, q, k, v, state, own=own_token):
                result = None if off else own(self, q, k, v, state)
                taken.append(result is not None)
                return result

            monkeypatch.setattr(cls, "decode_token", token)
    return taken, built


@pytest.mark.parametrize("policy", ["linear", "linear:hedgehog", "ssm", "ssm+normalize:false+tolerance:1000", "window:8+sinks:2",
                                    "linear+window:8+sinks:2"])
def test_in_place_step_equals_the_general_step_and_is_taken(base, policy, monkeypatch):
    opt = _compile(base, policy)
    taken, built = _count_fast_steps(opt, monkeypatch)
    fast, cache = _steps(opt, _ids())
    assert sum(taken) == 2 * (NEW - 1)  # both sites, every step after the prefill
    if not policy.startswith("linear+window"):  # a stepper is made once per layer and sequence, not per token
        assert sum(built) == 2
    for layer in cache.layers:
        assert isinstance(layer, SiteCacheLayer)
        # the per-row count of real tokens is current when read, though the step does not add it per token
        assert layer.state.real_B.tolist() == [PROMPT + NEW - 1] * 2 and layer.state.columns == PROMPT + NEW - 1
        fs = layer.state.form_state
        if "window" in policy:  # the band lives in a ring written in place
            assert isinstance(fs if policy.startswith("window") else fs.window, WindowRing)
        elif fs[1] is None:  # ssm without the normaliser: S alone, advanced in place
            assert fs[0].is_contiguous()
        else:  # S and z are views of one packed buffer
            assert fs[0]._base is not None and fs[0]._base is fs[1]._base
    monkeypatch.undo()
    taken_off, _ = _count_fast_steps(opt, monkeypatch, off=True)
    general, _ = _steps(opt, _ids())
    assert not any(taken_off)
    assert (fast - general).abs().max() < 1e-5  # measured about 1e-7 (fp32)
    # and after beam-style reordering the in-place step continues from the reordered state, made anew
    monkeypatch.undo()
    taken, built = _count_fast_steps(opt, monkeypatch)
    _, cache = _steps(opt, _ids())
    cache.reorder_cache(torch.tensor([1, 0]))
    steps_before, built_before = sum(taken), sum(built)
    with torch.no_grad():
        out = opt(input_ids=torch.tensor([[3], [5]]), past_key_values=cache, use_cache=True).logits
    assert torch.isfinite(out).all() and sum(taken) == steps_before + 2
    if not policy.startswith("linear+window"):
        assert sum(built) == built_before + 2


@pytest.mark.parametrize("policy", ["linear", "ssm", "window:8+sinks:2"])
def test_decoding_with_autograd_on_takes_the_general_step_and_gives_the_same_logits(base, policy, monkeypatch):
    opt = _compile(base, policy)
    fast, _ = _steps(opt, _ids())
    taken, _ = _count_fast_steps(opt, monkeypatch)
    cache = make_cache(opt)
    logits = opt(input_ids=_ids(), past_key_values=cache, use_cache=True).logits[:, -1:]  # grad mode: no no_grad()
    steps = [logits]
    for _ in range(NEW - 1):
        logits = opt(input_ids=logits.argmax(-1), past_key_values=cache, use_cache=True).logits[:, -1:]
        steps.append(logits)
    grad_mode = torch.cat(steps, dim=1)
    assert grad_mode.requires_grad and not any(taken)
    assert (grad_mode.detach() - fast).abs().max() < 1e-5


@pytest.fixture(scope="module")
def granite():
    """A decoder whose attention scale is not SDPA's default 1/√D (attention_multiplier): a path that
    dropped the model's `scaling` would still match Llama, never this one."""
    cfg = transformers.GraniteConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     attention_multiplier=0.5)
    torch.manual_seed(0)
    return transformers.GraniteForCausalLM(cfg).eval()


@pytest.mark.parametrize("model_name", ["base", "granite"])
def test_a_site_inside_min_seq_len_is_the_original_model_and_never_runs(model_name, request, monkeypatch):
    base = request.getfixturevalue(model_name)
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


@pytest.mark.parametrize("with_config", [True, False])
def test_a_cache_the_caller_made_is_bound_before_any_layer_runs(base, with_config):
    """The compiled model's pre-hook swaps every site's layer into a cache it is given, so none is
    swapped from inside the forward (where a torch.compile'd model would trace it): checked at the
    first attention module's call, for a cache with HF's layers already made and for an empty one."""
    opt = _compile(base, "linear")
    cache = transformers.DynamicCache(config=base.config) if with_config else transformers.DynamicCache()
    seen = []

    def look(module, args, kwargs):
        seen.append([type(layer).__name__ for layer in cache.layers])

    handle = opt.model.layers[0].self_attn.register_forward_pre_hook(look, with_kwargs=True)
    try:
        with torch.no_grad():
            opt(input_ids=_ids(), past_key_values=cache, use_cache=True)
    finally:
        handle.remove()
    assert seen[0] == ["SiteCacheLayer", "SiteCacheLayer"]


@pytest.mark.parametrize("policy", ["linear", {"rules": [{"layers": 1, "form": "linear"}, {"form": "exact"}]}])
def test_a_cache_the_model_makes_inside_its_forward_holds_every_sites_state(base, policy):
    """A call given no cache makes its own inside the forward: the first module to decode binds
    every site's layer in it (the only one hooked), so continuing from that cache equals a full
    forward; with layer 0 exact, layer 0 keeps HF's keys and the hooked module is layer 1's."""
    opt = _compile(base, policy)
    ids = _ids()
    with torch.no_grad():
        out = opt(input_ids=ids, use_cache=True)
        cache, logits = out.past_key_values, [out.logits[:, -1:]]
        for _ in range(4):
            logits.append(opt(input_ids=logits[-1].argmax(-1), past_key_values=cache, use_cache=True).logits[:, -1:])
        seq = torch.cat([ids] + [x.argmax(-1) for x in logits[:-1]], dim=1)
        full = opt(input_ids=seq, use_cache=False).logits[:, PROMPT - 1:]
    sites = [i for i, layer in enumerate(opt.model.layers) if "attnopt_site" in layer.self_attn._modules]
    assert [isinstance(layer, SiteCacheLayer) and layer.state is not None for layer in cache.layers] == \
        [i in sites for i in range(len(cache.layers))]
    assert (torch.cat(logits, dim=1) - full).abs().max() < 1e-5
    hooked = [i for i, layer in enumerate(opt.model.layers) if layer.self_attn._forward_pre_hooks]
    assert hooked == sites[:1]
