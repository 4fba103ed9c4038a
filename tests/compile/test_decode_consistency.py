"""Cached decoding of a compiled decoder equals a full forward at every step, for every form, and a
left-padded row equals the same row generated alone; including a model that slides its own window
(Mistral, window 16), decoding well past it."""

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, PAD = 89, 20, 9, 5  # 20 + 9 tokens: past Mistral's 16-key window


def _model(kind):
    common = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(sliding_window=16, **common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
    }[kind]()
    torch.manual_seed(0)
    return getattr(transformers, {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                  "qwen2": "Qwen2ForCausalLM"}[kind])(cfg).eval()


def _prompt():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=g)
    am = torch.ones(2, PROMPT, dtype=torch.long)
    ids[1, :PAD], am[1, :PAD] = 0, 0  # row 1 is left-padded
    return ids, am


def _step_logits(model, ids, am):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return out.sequences, torch.stack(out.logits, dim=1), cache  # [B, NEW, V]


def _assert_sites_decode_from_their_state(opt, cache):
    """Every site whose form keeps a state ran through a SiteCacheLayer (not HF's growing KV cache)."""
    from attnopt.hf.cache import SiteCacheLayer

    stateful = 0
    for r in opt.attnopt_report.sites:
        layer = cache.layers[opt.get_submodule(r.site.module_path).layer_idx]
        if r.outcome.final_form in ("linear", "ssm", "window", "linear+window"):
            assert isinstance(layer, SiteCacheLayer) and layer.get_seq_length() == PROMPT + NEW - 1, r.site.id
            stateful += 1
        else:  # an exact site keeps HF's own cache layer (a sliding one where the model slides its window)
            assert not isinstance(layer, SiteCacheLayer), r.site.id
            assert getattr(layer, "is_sliding", False) == (r.site.window is not None), r.site.id
    assert stateful >= 1


def _full_logits(model, seq, am):
    am = torch.cat([am, torch.ones(am.shape[0], seq.shape[1] - am.shape[1], dtype=am.dtype)], dim=1)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=am, position_ids=pos, use_cache=False).logits
    return logits[:, PROMPT - 1 : PROMPT - 1 + NEW]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def model(request):
    return request.param, _model(request.param)


@pytest.mark.parametrize("policy", ["linear", "ssm", "window:8+sinks:2", "hybrid", "linear+window:8+sinks:2"])
def test_cached_steps_equal_a_full_forward_and_padding_changes_nothing(model, policy):
    kind, base = model
    ids, am = _prompt()
    opt = attnopt.compile(base, policy, example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False})
    rep = opt.attnopt_report
    assert rep.count("rewritten") >= 1, [r.outcome.reason for r in rep.sites]
    seq, steps, cache = _step_logits(opt, ids, am)
    _assert_sites_decode_from_their_state(opt, cache)
    full = _full_logits(opt, seq, am)
    assert (steps - full).abs().max() < 1e-5  # measured about 1e-7 (fp32)
    # Row 1 generated alone (no padding) gives the same step logits as inside the padded batch.
    alone_seq, alone, _ = _step_logits(opt, ids[1:, PAD:], am[1:, PAD:])
    assert torch.equal(alone_seq[0, -NEW:], seq[1, -NEW:])
    assert (alone[0] - steps[1]).abs().max() < 1e-5
    # And the rewrite did change the model (the comparison above is not between identical programs).
    with torch.no_grad():
        assert not torch.allclose(opt(input_ids=seq, use_cache=False).logits, base(input_ids=seq, use_cache=False).logits)


def test_mistral_keeps_its_own_window():
    # attnopt changes no layer's type or window: rewritten sites decode from their own state, exact
    # ones keep the model's band and its sliding cache (attnopt.hf.install).
    base = _model("mistral")
    ids, am = _prompt()
    policy = {"rules": [{"layers": "1", "form": "linear"}]}
    opt = attnopt.compile(base, policy, example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False},
                          e2e_tolerance=None)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "linear", "exact", "exact"]
    assert opt.config.sliding_window == base.config.sliding_window == 16
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():  # layer 0, before the rewritten one, is the original's bit for bit
        got, want = (m(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False,
                       output_hidden_states=True).hidden_states for m in (opt, base))
    assert torch.equal(got[1], want[1]) and not torch.allclose(got[2], want[2])
