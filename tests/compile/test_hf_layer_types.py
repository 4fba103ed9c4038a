"""Models whose layer types mean more than a mask: Gemma3 picks each layer's RoPE base by type
(sliding 1e4, full 1e6), Cohere2 applies RoPE on sliding layers only, Gemma2 and Qwen2 mix sliding
and full layers. attnopt changes no layer's type or window (attnopt.hf.install):

- every layer a policy keeps exact computes what the original's does, bit for bit: its RoPE and mask
  (captured on both models from the same input) and its output for the same input (the original's
  layer run on what the compiled layer received);
- cached generate() gives, step by step, the logits of one full forward over the generated tokens,
  past the model's window and with a left-padded row;
- exact layers keep HF's own cache layer (a sliding one where the model slides), rewritten ones
  decode from their own state.

Tiny random models, window 4, prompts of 12 tokens plus 6 generated, so the window acts.
"""

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")

from attnopt.hf.cache import SiteCacheLayer  # noqa: E402

V, N, NEW, PAD, W = 97, 12, 6, 3, 4
S, F = "sliding_attention", "full_attention"
LM = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, max_position_embeddings=128)


def _model(family):
    tf = transformers
    torch.manual_seed(0)
    if family == "gemma3-mixed":  # Gemma3's own pattern: five sliding layers, then a full one
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**LM, num_hidden_layers=6, sliding_window=W,
                                                         layer_types=[S] * 5 + [F]))
    elif family == "gemma3-sliding":  # every layer slides
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**LM, num_hidden_layers=2, sliding_window=W,
                                                         layer_types=[S, S]))
    elif family == "gemma2":  # no softcaps here: those keep a site exact (tested below)
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**LM, num_hidden_layers=4, sliding_window=W,
                                                     layer_types=[S, F, S, F], attn_logit_softcapping=None,
                                                     final_logit_softcapping=None))
    elif family == "cohere2":  # RoPE on the sliding layers only
        model = tf.Cohere2ForCausalLM(tf.Cohere2Config(**{k: v for k, v in LM.items() if k != "head_dim"},
                                                       num_hidden_layers=4, sliding_window=W,
                                                       layer_types=[S, S, S, F]))
    elif family == "qwen2":  # layer_types from use_sliding_window: layers past max_window_layers slide
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{k: v for k, v in LM.items() if k != "head_dim"},
                                                   num_hidden_layers=4, use_sliding_window=True, sliding_window=W,
                                                   max_window_layers=2))
    else:
        raise ValueError(family)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def _prompt():
    ids = torch.randint(3, V, (2, N), generator=torch.Generator().manual_seed(3))
    am = torch.ones(2, N, dtype=torch.long)
    ids[1, :PAD], am[1, :PAD] = 0, 0  # row 1 left-padded
    return ids, am


def _sliding(model) -> list:
    return [t == S for t in model.config.layer_types]


def _compile(model, policy, ids, am):
    return attnopt.compile(model, policy, example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False},
                           dispatch="off", tolerance=0.99, e2e_tolerance=None)


def _policy(kind, model):
    if kind == "exact":
        return "exact"
    if kind == "linear":
        return "linear"
    # a window form on one sliding layer past the first: the layers before it see the same inputs
    first = next(i for i, s in enumerate(_sliding(model)) if s and i > 0)
    return {"rules": [{"layers": str(first), "form": "window", "window": 3, "sinks": 1}]}


class LayerTaps:
    """Forward hooks on every decoder layer: its inputs (args, kwargs) and output, per call."""

    def __init__(self, model):
        self.layers = model.model.layers
        self.calls = {i: [] for i in range(len(self.layers))}
        self.hooks = [layer.register_forward_hook(self._tap(i), with_kwargs=True) for i, layer in enumerate(self.layers)]

    def _tap(self, i):
        def hook(module, args, kwargs, out):
            self.calls[i].append((args, dict(kwargs), out[0] if isinstance(out, tuple) else out))
        return hook

    def close(self):
        for h in self.hooks:
            h.remove()


def _run_tapped(model, **inputs):
    taps = LayerTaps(model)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        taps.close()
    return taps.calls


def _position_and_mask(kwargs):
    """What a decoder layer receives that depends on the input alone: its RoPE (cos, sin) and its mask."""
    cos_sin = kwargs.get("position_embeddings")
    return [t for t in (*(cos_sin or ()), kwargs.get("attention_mask")) if isinstance(t, torch.Tensor)]


def assert_exact_layers_are_the_originals(opt, base, ids, am):
    """Each exact layer: the original's RoPE and mask for this input, and the original's output for
    the input it received; the rewritten layers must differ (the check is not of a model with itself)."""
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    inputs = dict(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False)
    got, want = _run_tapped(opt, **inputs), _run_tapped(base, **inputs)
    forms = {int(r.site.module_path.split(".")[2]): r.outcome.final_form for r in opt.attnopt_report.sites}
    for i, form in sorted(forms.items()):
        (args, kwargs, out), = got[i]
        with torch.no_grad():
            again = base.model.layers[i](*args, **kwargs)
        again = again[0] if isinstance(again, tuple) else again
        if form != "exact":
            assert not torch.allclose(again, out), i
            continue
        ours, theirs = _position_and_mask(kwargs), _position_and_mask(want[i][0][1])
        assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs)), i
        assert torch.equal(again, out), (i, (again - out).abs().max())


@torch.no_grad()
def _generate(model, ids, am):
    out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1), out.past_key_values


@torch.no_grad()
def _full_logits(model, seq, am):
    am = torch.cat([am, torch.ones(am.shape[0], seq.shape[1] - am.shape[1], dtype=am.dtype)], 1)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=seq, attention_mask=am, position_ids=pos, use_cache=False).logits[:, N - 1: N - 1 + NEW]


def assert_cached_equals_full(opt, ids, am):
    seq, steps, cache = _generate(opt, ids, am)
    assert (steps - _full_logits(opt, seq, am)).abs().max() < 1e-5  # measured ≤ 5e-7
    forms = {r.site.module_path: r.outcome.final_form for r in opt.attnopt_report.sites}
    for path, form in forms.items():
        i = opt.get_submodule(path).layer_idx
        layer = cache.layers[i]
        if form == "exact":  # HF's own layer, sliding where the model slides
            assert not isinstance(layer, SiteCacheLayer) and getattr(layer, "is_sliding", False) == _sliding(opt)[i]
        else:
            assert isinstance(layer, SiteCacheLayer) and layer.get_seq_length() == N + NEW - 1, path
    return seq


FAMILIES = ["gemma3-mixed", "gemma3-sliding", "gemma2", "cohere2", "qwen2"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["window-one-layer", "linear", "exact"])
def test_layer_types_stay_and_exact_layers_are_the_originals(family, kind):
    base = _model(family)
    types, window = list(base.config.layer_types), base.config.sliding_window
    ids, am = _prompt()
    opt = _compile(base, _policy(kind, base), ids, am)
    rep = opt.attnopt_report
    finals = [r.outcome.final_form for r in rep.sites]
    if kind == "exact":
        assert finals == ["exact"] * len(types)
    elif kind == "linear":
        assert finals == ["linear"] * len(types), [r.outcome.reason for r in rep.sites]
    else:
        assert finals.count("window") == 1 and finals.count("exact") == len(types) - 1, finals
    # Nothing of the model's own changed: not on the copy, not on the user's model.
    assert list(opt.config.layer_types) == list(base.config.layer_types) == types
    assert opt.config.sliding_window == base.config.sliding_window == window
    assert [r.site.window for r in rep.sites] == [W if s else None for s in _sliding(base)]
    assert any("slide their own window" in n for n in rep.notes)
    assert_exact_layers_are_the_originals(opt, base, ids, am)
    seq = assert_cached_equals_full(opt, ids, am)
    if kind == "exact":  # the whole model is the original's, generation included
        assert torch.equal(seq, _generate(base, ids, am)[0])


def test_a_threshold_past_the_models_window_is_capped_and_decoding_still_equals_a_full_forward():
    # min_seq_len 10 on a layer that slides 4 keys: below 4 the band hides nothing, so exact there is
    # the model's own attention in a prefill and in decoding; the layer holds at most 3 columns as
    # plain K/V (HF sizes its mask like the other sliding layers') before its state takes over.
    base = _model("gemma3-mixed")
    ids, am = _prompt()
    policy = {"rules": [{"layers": "1..2", "form": "linear", "min_seq_len": 10}]}
    opt = _compile(base, policy, ids, am)
    rewritten = [r for r in opt.attnopt_report.sites if r.outcome.final_form == "linear"]
    assert [r.threshold.min_seq_len for r in rewritten] == [W, W]
    assert all("capped at the model's sliding window 4" in r.threshold.detail for r in rewritten)
    # Decoding starts inside the threshold, with a left-padded row (its padding must survive the
    # switch from the kept keys to the state).
    short_ids, short_am = ids[:, -3:].clone(), torch.ones(2, 3, dtype=torch.long)
    short_ids[1, 0], short_am[1, 0] = 0, 0
    seq, steps, _ = _generate(opt, short_ids, short_am)
    seq_am = torch.cat([short_am, torch.ones(2, NEW - 1, dtype=torch.long)], 1)
    with torch.no_grad():
        full = opt(input_ids=seq[:, :-1], attention_mask=seq_am, position_ids=(seq_am.cumsum(-1) - 1).clamp(min=0),
                   use_cache=False).logits[:, 2:2 + NEW]
    assert (steps - full).abs().max() < 1e-5
    assert_exact_layers_are_the_originals(opt, base, ids, am)


def test_softcapped_gemma2_and_sinks_of_gpt_oss_stay_exact_and_generate_as_the_original():
    tf = transformers
    torch.manual_seed(0)
    gemma2 = tf.Gemma2ForCausalLM(tf.Gemma2Config(**LM, num_hidden_layers=2, sliding_window=W)).eval()
    torch.manual_seed(0)
    gpt_oss = tf.GptOssForCausalLM(tf.GptOssConfig(**LM, num_hidden_layers=2, sliding_window=W, num_local_experts=2,
                                                   num_experts_per_tok=1)).eval()
    ids, am = _prompt()
    for base, why in ((gemma2, "softcap"), (gpt_oss, "learned attention sinks")):
        base.generation_config.eos_token_id = None
        opt = _compile(base, "linear", ids, am)
        assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "exact"]
        assert all(why in r.outcome.reason for r in opt.attnopt_report.sites), [r.outcome.reason for r in opt.attnopt_report.sites]
        assert torch.equal(_generate(opt, ids, am)[1], _generate(base, ids, am)[1])


def test_a_layer_that_slides_never_anchors_reuse_and_a_full_one_does_past_the_window():
    # Gemma2 [S, F, S, F]: a sliding layer's cache holds only its window, so no selection can be read
    # from it while decoding. Layer 1 asking for sliding layer 0 is kept exact and says why; layer 3
    # reading full layer 1 is rewritten and decodes past the window like a full forward.
    base = _model("gemma2")
    ids, am = _prompt()
    rule = {"form": "reuse", "block": 2, "top_k": 1, "window": 0, "sinks": 1}
    policy = {"rules": [{"layers": "1", "anchor": 0, **rule}, {"layers": "3", "anchor": 1, **rule}]}
    opt = _compile(base, policy, ids, am)
    sites = opt.attnopt_report.sites
    assert [r.outcome.final_form for r in sites] == ["exact", "exact", "exact", "reuse"]
    assert "anchor layer 0 slides its own window (4)" in sites[1].outcome.reason
    seq, steps, _ = _generate(opt, ids, am)
    assert (steps - _full_logits(opt, seq, am)).abs().max() < 1e-5
    # The measured plan leaves sliding layers out of its chain: the full layers 1 and 3 are all it has.
    measured = _compile(base, "reuse:1+block:2", ids, am)
    plan = measured.attnopt_report.counts["verify"]["plans"]["reuse"]
    assert [sid.split(".")[2] for sid in plan["site_ids"]] == ["1", "3"]
