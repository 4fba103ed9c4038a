"""Cached decoding with the gated forms equals a full forward at every step, on Llama and Qwen2, and a
left-padded row equals the same row generated alone; each site decodes from its fixed-size state."""

import pytest
import torch
from test_decode_consistency import (
    NEW,
    PAD,
    PROMPT,
    _full_logits,
    _model,
    _prompt,
    _step_logits,
)

import attnopt
from attnopt.forms import SiteModule
from attnopt.hf.cache import SiteCacheLayer

transformers = pytest.importorskip("transformers")

# No compile-time fit here (fit_steps 0): decoding must equal the forward whatever the gates hold.
# (gla with per-head gates and elu is decoded by tests/backends/test_gated_decode_export.py.)
# "delta+taps": delta with random short-convolution taps (identity at init), so its history is exercised.
POLICIES = ["gla+fit_steps:0", "gla+window:6+sinks:2+fit_steps:0", "delta+fit_steps:0", "delta+taps"]


def _compile(base, policy, example):
    taps = policy == "delta+taps"
    opt = attnopt.compile(base, "delta+fit_steps:0" if taps else policy, example_inputs=example, tolerance=10.0,
                          e2e_tolerance=None)
    if taps:
        gen = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for m in opt.modules():
                if isinstance(m, SiteModule):
                    m.conv_HkvWK.add_(0.4 * torch.randn(m.conv_HkvWK.shape, generator=gen))
    return opt


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return request.param, _model(request.param)


@pytest.mark.parametrize("policy", POLICIES)
def test_cached_steps_equal_a_full_forward_and_padding_changes_nothing(model, policy):
    kind, base = model
    ids, am = _prompt()
    opt = _compile(base, policy, {"input_ids": ids, "attention_mask": am, "use_cache": False})
    assert opt.attnopt_report.count("rewritten") == 4, [r.outcome.reason for r in opt.attnopt_report.sites]
    seq, steps, cache = _step_logits(opt, ids, am)
    sizes = set()
    for r in opt.attnopt_report.sites:
        layer = cache.layers[opt.get_submodule(r.site.module_path).layer_idx]
        assert isinstance(layer, SiteCacheLayer) and layer.get_seq_length() == PROMPT + NEW - 1, r.site.id
        state = layer.state.form_state
        sizes.add(sum(t.numel() for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)))
    assert max(sizes) < 2 * 40 * (PROMPT + NEW)  # a fixed state, not a K/V cache of every token
    full = _full_logits(opt, seq, am)
    assert (steps - full).abs().max() < 1e-5
    alone_seq, alone, _ = _step_logits(opt, ids[1:, PAD:], am[1:, PAD:])
    assert torch.equal(alone_seq[0, -NEW:], seq[1, -NEW:])
    assert (alone[0] - steps[1]).abs().max() < 1e-5
    with torch.no_grad():  # the rewrite changed the model: the comparison above is not trivially true
        assert not torch.allclose(opt(input_ids=seq, use_cache=False).logits, base(input_ids=seq, use_cache=False).logits)
    assert all(m.decodes for m in opt.modules() if isinstance(m, SiteModule))
