"""The linear+window form: preset syntax, its fit formula, its relation to window, and compile."""

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.forms.linear_window.form import row_terms, rows_output
from attnopt.ir.calls import SiteCall
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes
from attnopt.policy import Policy, PolicyError

FORM = forms.get("linear+window")
B, H, HKV, N, D, DV = 2, 6, 3, 53, 8, 5  # pairwise distinct


def _site(causal, n=N, padding=True):
    mask = MaskInfo(form="bool" if padding else "is_causal", causal=causal, padding=padding, keep_when="true")
    return AttentionSite(
        id="a#0", module_path="a", module_type="A", layer=1, source="sdpa", batch=B, heads=H, kv_heads=HKV,
        q_len=n, kv_len=n, head_dim=D, v_head_dim=DV, scale=0.27, causal=causal, mask=mask, window=None,
        dropout_p=0.0, dtype="float64", nodes=SiteNodes(query="q", key="k", value="v", output="o"),
    )


def _inputs(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, n, DV, generator=g, dtype=torch.float64)
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[1, :11] = False  # left padding on row 1
    return q, k, v, keep[:, None, None, :].expand(B, 1, n, n)


def test_preset_syntax_and_defaults():
    (rule,) = Policy.parse("linear+window:64+sinks:4+map:elu").rules
    assert rule.form == "linear+window"
    assert (rule.params["window"], rule.params["sinks"], rule.params["feature_map"]) == (64, 4, "elu")
    (rule,) = Policy.parse("linear+window:32").rules
    assert (rule.params["window"], rule.params["feature_map"], rule.params["beta"]) == (32, "hedgehog", 1.0)
    with pytest.raises(PolicyError, match="given twice"):
        Policy.parse("linear+window:64+window:32")
    with pytest.raises(PolicyError, match="map"):
        Policy.parse("linear+window:64+map:softmax")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fmap", ["hedgehog", "elu"])
def test_fit_formula_equals_the_op(causal, fmap):
    """The dense row formula the fit differentiates is the op's output (fp64, padding, GQA, sinks)."""
    site = _site(causal)
    module = FORM.build(site, FORM.validate({"window": 7, "sinks": 3, "feature_map": fmap, "beta": 0.6}),
                        BuildContext()).double()
    with torch.no_grad():
        module.log_beta.copy_(torch.linspace(-0.7, 0.9, H, dtype=torch.float64))  # distinct β per head
    q, k, v, mask = _inputs()
    out = module(q, k, v, mask)
    got = rows_output(module, row_terms(module, SiteCall(q, k, v, mask, out)))
    assert (got - out).abs().max() < 1e-12
    sampled = row_terms(module, SiteCall(q, k, v, mask, out), rows=9)
    assert sampled.q.shape[2] == 9 and (rows_output(module, sampled) - sampled.ref).abs().max() < 1e-12


def test_beta_zero_is_the_window_form_and_a_wide_window_is_softmax():
    site = _site(True)
    q, k, v, mask = _inputs(1)
    zero = FORM.build(site, FORM.validate({"window": 9, "sinks": 2, "beta": 0.0, "feature_map": "elu"}), BuildContext())
    window = forms.get("window").build(site, forms.get("window").validate({"window": 9, "sinks": 2}), BuildContext())
    assert (zero(q, k, v, mask) - window(q, k, v, mask)).abs().max() < 1e-12
    wide = FORM.build(site, FORM.validate({"window": N, "feature_map": "elu"}), BuildContext()).double()
    causal_keep = mask & torch.ones(N, N, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=causal_keep,
                                         scale=0.27)
    got = wide(q, k, v, mask)
    assert (got[0] - ref[0]).abs().max() < 1e-12 and (got[1, :, 11:] - ref[1, :, 11:]).abs().max() < 1e-12


def test_fit_moves_only_phi_and_beta_and_lowers_the_drift():
    site = _site(False, padding=False)
    module = FORM.build(site, FORM.validate({"window": 8, "sinks": 1, "fit_steps": 30}), BuildContext()).double()
    q, k, v, _ = _inputs(2)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.27)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fit = FORM.fit(module, [SiteCall(q, k, v, None, out)])
    assert fit.rel_rms_after < 0.9 * fit.rel_rms_before
    moved = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"log_beta", "feature_map.weight_HDP"} and not any(p.requires_grad for p in module.parameters())


def test_cost_is_between_window_and_exact_at_long_lengths():
    site = _site(True, n=256, padding=False)
    p = FORM.validate({"window": 64, "sinks": 4})
    long = 256 * 16
    exact, hybrid = forms.get("exact").cost(site, {}, 1, long, long), FORM.cost(site, p, 1, long, long)
    window = forms.get("window").cost(site, forms.get("window").validate({"window": 64, "sinks": 4}), 1, long, long)
    assert window.flops < hybrid.flops < 0.1 * exact.flops


@pytest.mark.slow
def test_minilm_every_site_verified_and_close(minilm, english_256):
    model, _ = minilm
    opt = attnopt.compile(model, "linear+window:64+sinks:4", example_inputs=english_256)
    rep = opt.attnopt_report
    assert [str(r.outcome.status) for r in rep.sites] == ["rewritten"] * 6, [r.outcome.reason for r in rep.sites]
    assert all(r.outcome.final_form == "linear+window" and 0 < r.outcome.drift.rel_rms < 0.4 for r in rep.sites)
    assert all("hedgehog map and β fitted" in r.outcome.reason for r in rep.sites)
    assert rep.end_to_end.embedding_cosine >= 0.98  # in-sample: fitted and verified on the same batch
    assert "linear+window" in rep.to_markdown() and "linear+window" in rep.to_html()
