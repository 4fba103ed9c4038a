"""The native (C) one-token steps (`attnopt/kernels/native`): in float32, started from the fp64
oracle's state of a prefix and stepped one token at a time, their outputs and the state they advance
equal the fp64 oracles of one whole causal pass (tolerances of float32 rounding), they are the path
taken, and inputs they cannot take fall back to the torch ops. Without a C compiler the tests that
need the library skip (the loader's own tests still run)."""

import math

import pytest
import torch

from attnopt.forms.window.decode import RingStep, ring_of, window_cache_from_keys
from attnopt.kernels import native
from attnopt.kernels.token_step import PackedStateStep, elu_plus_one
from oracles import decay_oracle, decay_state_oracle, linear_oracle, linear_state_oracle, window_oracle

F32, F64 = torch.float32, torch.float64
B, H, HKV, N, PREFIX, D, DV = 2, 4, 2, 23, 9, 8, 5
needs_library = pytest.mark.skipif(native.library() is None, reason=f"no native library: {native.why_not()}")


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, N, D, generator=g, dtype=F64), torch.randn(B, HKV, N, D, generator=g, dtype=F64),
            torch.randn(B, HKV, N, DV, generator=g, dtype=F64))


def _hf_layout(x, t):
    """Token t of x [B, h, N, d] as HF hands it to attention: a [B, 1, h, d] tensor seen as [B, h, 1, d]."""
    return x[:, :, t].to(F32).unsqueeze(1).contiguous().transpose(1, 2)


def _steps(step, q, k, v):
    outs = [step(_hf_layout(q, t), _hf_layout(k, t), _hf_layout(v, t)) for t in range(PREFIX, N)]
    for out in outs:
        assert out.shape == (B, 1, H, DV) and out.dtype == F32 and out.is_contiguous()
    return torch.cat(outs, dim=1).transpose(1, 2).double()  # [B, H, steps, Dv]


def _linear_step(q, k, v, decay=None, normalize=True):
    if decay is None:
        S, z = linear_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], name="elu", scale=1.0, H=H)
    else:
        S, z = decay_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], gammas=decay, feature_map="elu", H=H)
    T = (torch.cat([S, z[..., None]], dim=-1) if normalize else S).to(F32).contiguous()
    state = (T[..., :DV], T[..., DV]) if normalize else (T, None)
    step = PackedStateStep(T, state, F32, elu_plus_one, kv_heads=HKV, normalize=normalize, eps=1e-6,
                           decay_H=None if decay is None else torch.tensor(decay), out_scale=0.3)
    return step, state


def _no_torch_step(monkeypatch):
    """Make the torch ops of both steppers fail, so a passing test took the C step."""
    def refuse(*a, **k):
        raise AssertionError("the torch step ran")
    monkeypatch.setattr(PackedStateStep, "_advance", refuse)
    monkeypatch.setattr(RingStep, "_write", refuse)


@needs_library
def test_native_linear_step_equals_one_whole_pass(monkeypatch):
    _no_torch_step(monkeypatch)
    q, k, v = _inputs()
    step, state = _linear_step(q, k, v)
    out = _steps(step, q, k, v)
    ref = linear_oracle(q, k, v, name="elu", causal=True, scale=1.0, eps=1e-6)[:, :, PREFIX:]
    assert (out - ref).abs().max() < 2e-6 * ref.abs().max()
    S_all, z_all = linear_state_oracle(k, v, name="elu", scale=1.0, H=H)
    assert (state[0].double() - S_all).abs().max() < 2e-6 * S_all.abs().max()
    assert (state[1].double() - z_all).abs().max() < 2e-6 * z_all.abs().max()


@needs_library
@pytest.mark.parametrize("normalize", [True, False])
def test_native_decay_step_equals_one_whole_pass(monkeypatch, normalize):
    _no_torch_step(monkeypatch)
    q, k, v = _inputs(1)
    gammas = [0.9, 0.8, 0.97, 1.0]
    step, state = _linear_step(q, k, v, decay=gammas, normalize=normalize)
    out = _steps(step, q, k, v)
    ref = decay_oracle(q, k, v, gammas=gammas, feature_map="elu", normalize=normalize, scale=0.3,
                       eps=1e-6)[:, :, PREFIX:]
    assert (out - ref).abs().max() < 2e-6 * ref.abs().max()
    S_all, z_all = decay_state_oracle(k, v, gammas=gammas, feature_map="elu", H=H)
    assert (state[0].double() - S_all).abs().max() < 2e-6 * S_all.abs().max()
    if normalize:
        assert (state[1].double() - z_all).abs().max() < 2e-6 * z_all.abs().max()


@needs_library
@pytest.mark.parametrize("window,sinks", [(4, 2), (6, 0), (1, 1)])
def test_native_ring_step_equals_one_whole_pass(monkeypatch, window, sinks):
    _no_torch_step(monkeypatch)
    q, k, v = _inputs(3)
    ring = ring_of(window_cache_from_keys(k[:, :, :PREFIX].to(F32), v[:, :, :PREFIX].to(F32), None, window=window,
                                          sinks=sinks))
    step = RingStep(ring, F32, None, gqa=True)
    out = _steps(step, q, k, v)
    ref = window_oracle(q, k, v, window=window, causal=True, sinks=sinks, scale=1 / math.sqrt(D))[:, :, PREFIX:]
    assert (out - ref).abs().max() < 2e-6 * ref.abs().max()
    assert ring.columns == N


@needs_library
def test_inputs_the_native_step_cannot_take_run_the_torch_step():
    """A query that is not dense, or of another dtype, takes the torch ops on the same state: the
    sequence stays right across the switch."""
    q, k, v = _inputs(4)
    step, _ = _linear_step(q, k, v)
    outs = []
    for t in range(PREFIX, N):
        qt, kt, vt = _hf_layout(q, t), _hf_layout(k, t), _hf_layout(v, t)
        if t % 3 == 1:
            qt = torch.cat([qt, qt], dim=-1)[..., :D]  # a strided view: not dense
            assert not qt.is_contiguous() and not step._native.takes(qt, kt, vt)
        outs.append(step(qt, kt, vt))
    out = torch.cat(outs, dim=1).transpose(1, 2).double()
    ref = linear_oracle(q, k, v, name="elu", causal=True, scale=1.0, eps=1e-6)[:, :, PREFIX:]
    assert (out - ref).abs().max() < 2e-6 * ref.abs().max()
    wide = _hf_layout(q, PREFIX).double()
    assert not step._native.takes(wide, wide[:, :HKV], wide[:, :HKV, :, :DV])


@needs_library
def test_native_step_is_not_bound_to_other_shapes_or_dtypes():
    q, k, v = _inputs(5)
    T = torch.zeros(B, H, D, DV + 1)
    assert PackedStateStep(T, (T[..., :DV], T[..., DV]), F32, elu_plus_one, kv_heads=HKV)._native is not None
    assert PackedStateStep(T.double(), None, F64, elu_plus_one, kv_heads=HKV)._native is None
    assert PackedStateStep(T, None, torch.bfloat16, elu_plus_one, kv_heads=HKV)._native is None
    assert PackedStateStep(T, None, F32, lambda x: x, kv_heads=HKV)._native is None  # only φ = ELU + 1


def test_switched_off_the_steppers_run_torch_and_say_why(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.library() is None and native.ENV_SWITCH in native.why_not()
    T = torch.zeros(B, H, D, DV + 1)
    assert PackedStateStep(T, (T[..., :DV], T[..., DV]), F32, elu_plus_one, kv_heads=HKV)._native is None


def test_a_failing_compiler_leaves_no_library_and_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1 without writing anything
    native._load.cache_clear()
    try:
        assert native.library() is None
        assert "failed" in native.why_not() or "no C compiler" in native.why_not()
        assert list(tmp_path.iterdir()) == []  # no half-written library left behind
    finally:
        monkeypatch.undo()
        native._load.cache_clear()


@needs_library
def test_the_library_builds_into_an_empty_folder(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    native._load.cache_clear()
    try:
        assert native.library() is not None and native.why_not() == ""
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
    finally:
        monkeypatch.undo()
        native._load.cache_clear()
