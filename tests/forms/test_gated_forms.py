"""The gated forms (gla, gla+window, delta): gate construction, applicability, the compile-time fit,
compile + verify on a tiny decoder, and calibration of their gate tensors."""

import math

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import forms
from attnopt.calibration.train import trainable_tensors
from attnopt.forms import SiteModule
from attnopt.forms.common.base import BuildContext
from attnopt.forms.gla.form import (
    GATE_NORMALIZER,
    decay_for_lag,
    gate_bias_for,
    init_gates_from_calls,
    mean_lags,
)
from attnopt.ir.calls import SiteCall
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes
from attnopt.passes.verify import site_drift

GATED = ("gla", "gla+window", "delta")
B, H, HKV, N, D = 2, 4, 2, 96, 8


def _site(causal=True, q_len=N, kv_len=N, mask=None):
    return AttentionSite(
        id="a#0", module_path="a", module_type="A", layer=0, source="sdpa", batch=B, heads=H, kv_heads=HKV,
        q_len=q_len, kv_len=kv_len, head_dim=D, v_head_dim=D, scale=D ** -0.5, causal=causal,
        mask=mask or MaskInfo(form="is_causal" if causal else "none", causal=causal), window=None, dropout_p=0.0,
        dtype="float32", nodes=SiteNodes(query="q", key="k", value="v", output="o"),
    )


def _call(seed=0, locality=0.0):
    """Causal softmax attention on keys and queries that share a smooth positional code of amplitude
    `locality`: q_i·k_j falls with |i − j|, so the larger it is, the more recent the keys it reads."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g)
    if locality:
        angle = torch.arange(N, dtype=torch.float32)[:, None] * torch.arange(1, D // 2 + 1) * math.pi / (4 * N)
        code = torch.cat([angle.cos(), angle.sin()], dim=-1) * locality  # [N, D]
        q, k = 0.3 * q + code, 0.3 * k + code
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True,
                                         scale=D ** -0.5)
    return SiteCall(q, k, v, None, out)


def _module(name, **params):
    form = forms.get(name)
    p = form.validate({"window": 16, **params} if name == "gla+window" else params)
    return form, form.build(_site(), p, BuildContext())


def test_gla_gates_start_as_liger_pooled_keys():
    _, m = _module("gla", feature_map="elu")
    k = torch.randn(B, HKV, N, D)
    assert torch.allclose(m.gates.log_gates(k), F.logsigmoid(k) / GATE_NORMALIZER)  # Liger: logsigmoid(pool(k))/16
    _, m = _module("gla", gate="head")
    assert torch.allclose(m.gates.log_gates(k), F.logsigmoid(k.mean(-1)) / GATE_NORMALIZER, atol=1e-6)
    _, m = _module("gla")  # hedgehog: 2·D features, each half gated by the key channel its projection reads
    g = m.gates.log_gates(k)
    assert g.shape == (B, HKV, N, 2 * D) and torch.allclose(g[..., :D], g[..., D:])


def test_gate_bias_matches_the_measured_look_back():
    # γ/(1 − γ) is the mean look-back of geometric weights, and the bias puts logsigmoid(b)/16 at log γ.
    for lag in (0.5, 3.0, 40.0):
        gamma = decay_for_lag(torch.tensor([lag], dtype=torch.float64))
        assert math.isclose(float(gamma / (1 - gamma)), lag, rel_tol=1e-9)
        b = gate_bias_for(gamma)
        assert math.isclose(float(F.logsigmoid(b) / GATE_NORMALIZER), math.log(float(gamma)), rel_tol=1e-9)
    _, m = _module("gla")
    local, wide = mean_lags(m, [_call(locality=12.0)]), mean_lags(m, [_call(locality=0.0)])
    assert (local < 0.5 * wide).all() and (wide > 20.0).all(), (local, wide)  # diffuse over ~48-96 keys: ~35
    # Initialised from those calls, a local site forgets faster than a wide one.
    biases = {}
    for name, call in (("local", _call(locality=12.0)), ("wide", _call(locality=0.0))):
        form, m = _module("gla", fit_steps=0)
        init_gates_from_calls(m, m.gates, [call])
        biases[name] = m.gates.log_gates(call.k).mean()
    assert biases["local"] < biases["wide"] < 0


@pytest.mark.parametrize("name", GATED)
def test_fit_lowers_the_drift_and_transfers_to_held_out_calls(name):
    form, m = _module(name, fit_steps=25)
    calls, held = [_call(0, locality=2.0)], [_call(1, locality=2.0)]
    fresh = site_drift(form.build(_site(), m.params, BuildContext()), held).rel_rms
    before = site_drift(m, calls).rel_rms
    fit = form.fit(m, calls)
    after = site_drift(m, calls).rel_rms
    assert abs(fit.rel_rms_before - before) < 1e-4 and abs(fit.rel_rms_after - after) < 1e-4
    # gla+window's window is exact already: only the part beyond it (a smaller share of the error) moves.
    assert after < {"gla": 0.9, "delta": 0.9, "gla+window": 0.97}[name] * before, (before, after)
    assert site_drift(m, held).rel_rms < fresh
    assert not any(p.requires_grad for p in m.parameters())  # inference builds no autograd graph


@pytest.mark.parametrize("name", GATED)
def test_why_not_names_the_reason(name):
    form = forms.get(name)
    p = form.validate({})
    assert form.why_not(_site(), p) is None
    assert "causal by construction" in form.why_not(_site(causal=False), p)
    assert "self-attention" in form.why_not(_site(q_len=N, kv_len=2 * N), p)
    arbitrary = MaskInfo(form="additive", causal=True, arbitrary=True)
    assert "only exact attention" in form.why_not(_site(mask=arbitrary), p)


@pytest.mark.parametrize("name", GATED)
def test_parameters_are_checked_with_one_line_errors(name):
    form = forms.get(name)
    bad = {"gla": {"feature_map": "taylor"}, "gla+window": {"window": 0}, "delta": {"beta": 1.5}}[name]
    with pytest.raises(attnopt.PolicyError) as err:
        form.validate(bad)
    assert name in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def tiny_llama():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "calibration"))
    from calib_models import id_batches, random_llama

    return random_llama(layers=2), id_batches(3, length=40)


@pytest.mark.parametrize("policy", ["gla+fit_steps:2", "gla+window:8+sinks:2+fit_steps:2", "delta+fit_steps:2"])
def test_compile_verifies_and_calibrate_trains_the_gate_tensors(tiny_llama, policy):
    model, batches = tiny_llama
    opt = attnopt.compile(model, policy, example_inputs=batches[0], tolerance=10.0, e2e_tolerance=None)
    rep = opt.attnopt_report
    assert rep.count("rewritten") == 2, [r.outcome.reason for r in rep.sites]
    assert all(r.outcome.drift is not None and r.outcome.drift.rel_rms < 10.0 for r in rep.sites)
    modules = [m for m in opt.modules() if isinstance(m, SiteModule)]
    names = sorted(trainable_tensors(modules[0]))
    assert any("gate" in n for n in names), names
    before = [t.detach().clone() for t in trainable_tensors(modules[0]).values()]
    attnopt.calibrate(opt, batches[:2], held_out=batches[2:], steps=3, progress=False)
    trained = [s for s in rep.calibration["sites"] if s["status"] in ("trained", "unchanged")]
    assert len(trained) == 2 and all(s["tensors"] == names for s in trained[:1])
    moved = [not torch.equal(a, b) for a, b in zip(before, trainable_tensors(modules[0]).values())]
    assert any(moved) or trained[0]["status"] == "unchanged"


@pytest.mark.parametrize("name", GATED)
def test_a_masked_decoding_token_leaves_its_row_as_if_it_were_not_there(name):
    """Site decoding: a prefill, then one-token steps where row 1's first new token is masked. Every real
    query's output equals the site's own forward over the whole sequence with that key dropped."""
    _, m = _module(name, fit_steps=0, **({"window": 4, "sinks": 1} if name == "gla+window" else {}))
    c = _call(seed=3)
    n0, n = 20, 24
    q, k, v = c.q[:, :, :n], c.k[:, :, :n], c.v[:, :, :n]
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[1, n0] = False
    with torch.no_grad():
        want = m.attend(q, k, v, keep, None, None)
        out, state = m.decode(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], keep[:, :n0], None)
        outs = [out]
        for t in range(n0, n):
            sl = slice(t, t + 1)
            out, state = m.decode(q[:, :, sl], k[:, :, sl], v[:, :, sl], keep[:, sl], state)
            outs.append(out)
    got = torch.cat(outs, dim=2)
    real = keep[:, None, :, None]
    assert torch.allclose(got * real, want * real, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", GATED)
def test_gates_stay_finite_and_bounded_however_far_the_gate_tensors_move(name):
    _, m = _module(name, fit_steps=0)
    k = torch.randn(B, HKV, N, D)
    for bias in (-1e30, 1e30):
        with torch.no_grad():
            m.gates.gate_bias_HkvG.fill_(bias)
        g = m.gates.log_gates(k)
        assert torch.isfinite(g).all() and float(g.min()) >= -60.0 / GATE_NORMALIZER - 1e-6 and float(g.max()) <= 0


def test_gla_window_fit_loss_equals_the_module_loss():
    """The fit computes each call's window softmax once: its loss must be the module's own, with and
    without a padding mask."""
    from attnopt.forms.gla.form import module_loss
    from attnopt.forms.gla_window.form import window_fixed_loss

    _, m = _module("gla+window", fit_steps=0, sinks=2)
    c = _call(seed=4, locality=2.0)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :7] = False  # left padding: a [B, 1, 1, N] keep mask
    masked = SiteCall(c.q, c.k, c.v, keep[:, None, None, :], c.out)
    with torch.no_grad():
        m.gates.gate_bias_HkvG.add_(torch.randn(m.gates.gate_bias_HkvG.shape))
        m.log_beta.add_(0.3)
        for calls in ([c], [masked], [c, masked]):
            assert torch.allclose(window_fixed_loss(m, calls)(), module_loss(m, calls), rtol=1e-5, atol=1e-7)


def test_compile_tells_the_progress_callback_each_fit_step(tiny_llama):
    model, batches = tiny_llama
    seen = []
    attnopt.compile(model, "gla+fit_steps:10", example_inputs=batches[0], tolerance=10.0, e2e_tolerance=None,
                    progress=lambda text, done=None, total=None: seen.append((text, done, total)))
    fit = [s for s in seen if s[0].startswith("fit site")]
    assert ("fit site 1/2: step 5/10", 0, 2) in fit and ("fit site 2/2: step 10/10", 1, 2) in fit, seen
