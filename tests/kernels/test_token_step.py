"""The in-place one-token steppers (`attnopt.kernels.token_step.PackedStateStep`, the window's
`RingStep`): started from the state of a prefix, then stepped one token at a time, every output
(returned [B, 1, H, Dv], dense, as attention functions return it) equals the fp64 oracle of one
whole causal pass, the state they advance equals the oracle's state,
and nothing else of theirs is touched between steps. The start state is built by the oracle too
(by hand from φ), so the steppers are checked against no code of theirs."""

import math

import pytest
import torch

from attnopt.forms.window.decode import RingStep, ring_of, window_cache_from_keys
from attnopt.kernels.feature_maps import make_feature_map
from attnopt.kernels.token_step import PackedStateStep, elu_plus_one
from oracles import decay_oracle, decay_state_oracle, linear_oracle, linear_state_oracle, window_oracle

F64 = torch.float64
B, H, HKV, N, PREFIX, D, DV = 2, 4, 2, 23, 9, 8, 5


def _inputs(seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=F64)
    k = torch.randn(B, HKV, N, D, generator=g, dtype=F64)
    v = torch.randn(B, HKV, N, DV, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _stacked(outs, b=B):
    """Per-step outputs [B, 1, H, Dv] (each dense: a model views it as [B, 1, H·Dv]) as [B, H, steps, Dv]."""
    for out in outs:
        assert out.shape[:3] == (b, 1, H) and out.is_contiguous()
    return torch.cat(outs, dim=1).transpose(1, 2)


def _linear_features(name, fmap, scale):
    if name == "elu":
        return elu_plus_one
    weight = fmap.op_weight()  # (a decoding step needs no gradient of the map's weights: see the cache layer)
    return lambda x: type(fmap).features(x, scale, None if weight is None else weight.detach().to(x.dtype))


@pytest.mark.parametrize("name", ["elu", "relu", "hedgehog", "taylor"])
def test_linear_stepper_equals_one_whole_pass(name):
    q, k, v = _inputs()
    scale = 1 / math.sqrt(D)
    fmap = make_feature_map(name, D, H, seed=3)
    weight = None if fmap.op_weight() is None else fmap.op_weight().detach()
    S, z = linear_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], name=name, weight=weight, scale=scale, H=H)
    T = torch.cat([S, z[..., None]], dim=-1).contiguous()
    state = (T[..., :DV], T[..., DV])
    step = PackedStateStep(T, state, F64, _linear_features(name, fmap, scale), kv_heads=HKV, per_head=fmap.per_head,
                           eps=1e-6)
    outs = [step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(PREFIX, N)]
    ref = linear_oracle(q, k, v, name=name, weight=weight, causal=True, scale=scale, eps=1e-6)[:, :, PREFIX:]
    assert (_stacked(outs) - ref).abs().max() < 1e-12
    S_all, z_all = linear_state_oracle(k, v, name=name, weight=weight, scale=scale, H=H)
    assert step.state is state and (state[0] - S_all).abs().max() < 1e-12 and (state[1] - z_all).abs().max() < 1e-12


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("feature_map", ["elu", "identity"])
def test_decay_stepper_equals_one_whole_pass(normalize, feature_map):
    q, k, v = _inputs(1)
    gammas = [0.9, 0.8, 0.97, 1.0]
    scale = 0.3
    S, z = decay_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], gammas=gammas, feature_map=feature_map, H=H)
    T = torch.cat([S, z[..., None]], dim=-1).contiguous() if normalize else S.clone()
    state = (T[..., :DV], T[..., DV]) if normalize else (T, None)
    phi = elu_plus_one if feature_map == "elu" else (lambda x: x)
    step = PackedStateStep(T, state, F64, phi, kv_heads=HKV, normalize=normalize, eps=1e-6,
                           guard_zero=feature_map == "identity", decay_H=torch.tensor(gammas, dtype=F64), out_scale=scale)
    outs = [step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(PREFIX, N)]
    ref = decay_oracle(q, k, v, gammas=gammas, feature_map=feature_map, normalize=normalize, scale=scale,
                       eps=1e-6)[:, :, PREFIX:]
    # identity φ with the normaliser: φ(q)ᵀz can be near 0, which amplifies rounding (measured 3e-13 of 63)
    tol = (1e-10 if feature_map == "identity" and normalize else 1e-12) * max(1.0, ref.abs().max().item())
    assert (_stacked(outs) - ref).abs().max() < tol
    S_all, z_all = decay_state_oracle(k, v, gammas=gammas, feature_map=feature_map, H=H)
    assert (state[0] - S_all).abs().max() < 1e-12
    if normalize:
        assert (state[1] - z_all).abs().max() < 1e-12


def test_stepper_in_half_precision_computes_in_fp32_and_returns_the_query_dtype():
    q, k, v = _inputs(2, torch.bfloat16)
    S, z = linear_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], name="elu", scale=1.0, H=H)
    T = torch.cat([S, z[..., None]], dim=-1).float().contiguous()
    step = PackedStateStep(T, (T[..., :DV], T[..., DV]), torch.bfloat16, elu_plus_one, kv_heads=HKV, eps=1e-6)
    out = step(q[:, :, PREFIX:PREFIX + 1], k[:, :, PREFIX:PREFIX + 1], v[:, :, PREFIX:PREFIX + 1])
    ref = linear_oracle(q[:, :, :PREFIX + 1], k[:, :, :PREFIX + 1], v[:, :, :PREFIX + 1], name="elu", causal=True,
                        scale=1.0, eps=1e-6)[:, :, -1:]
    assert out.dtype == torch.bfloat16 and T.dtype == torch.float32
    assert (_stacked([out]).double() - ref).abs().max() < 2e-2  # bf16 inputs and output, fp32 sums


@pytest.mark.parametrize("window,sinks", [(4, 2), (6, 0), (1, 1)])
def test_ring_stepper_equals_one_whole_pass(window, sinks):
    q, k, v = _inputs(3)
    scale = 1 / math.sqrt(D)
    cache = window_cache_from_keys(k[:, :, :PREFIX], v[:, :, :PREFIX], None, window=window, sinks=sinks)
    ring = ring_of(cache)
    step = RingStep(ring, F64, scale, gqa=True)
    outs = [step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(PREFIX, N)]
    ref = window_oracle(q, k, v, window=window, causal=True, sinks=sinks, scale=scale)[:, :, PREFIX:]
    assert (_stacked(outs) - ref).abs().max() < 1e-12
    assert step.state is ring and ring.columns == N


@pytest.mark.parametrize("kind", ["linear", "decay", "ring"])
@pytest.mark.parametrize("user_mode", ["no_grad", "inference_mode"])
def test_steppers_return_normal_tensors_the_model_may_modify(kind, user_mode):
    """The steppers update their state under inference mode; what they return must stay an ordinary
    tensor (a model may add into its attention output in place), and their state stays usable
    outside that mode, under the user's no_grad or inference_mode alike."""
    q, k, v = _inputs(4, torch.float32)
    if kind == "ring":
        ring = ring_of(window_cache_from_keys(k[:, :, :PREFIX], v[:, :, :PREFIX], None, window=4, sinks=1))
        step, held = RingStep(ring, torch.float32, 0.3, gqa=True), (ring.k_BHkvKD, ring.v_BHkvKD)
    else:
        S, z = linear_state_oracle(k[:, :, :PREFIX].double(), v[:, :, :PREFIX].double(), name="elu", scale=1.0, H=H)
        T = torch.cat([S, z[..., None]], dim=-1).float().contiguous()
        decay = torch.tensor([0.9, 0.8, 0.97, 1.0]) if kind == "decay" else None
        step, held = PackedStateStep(T, (T[..., :DV], T[..., DV]), torch.float32, elu_plus_one, kv_heads=HKV,
                                     eps=1e-6, decay_H=decay), (T,)
    mode = torch.no_grad() if user_mode == "no_grad" else torch.inference_mode()
    with mode:
        outs = [step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(PREFIX, PREFIX + 3)]
    for out in outs:
        assert out.is_inference() == (user_mode == "inference_mode")
    with torch.no_grad():
        if user_mode == "no_grad":
            outs[-1].add_(1.0)  # an inference tensor would refuse this outside inference mode
            assert all(not t.is_inference() for t in held)
        assert torch.isfinite(torch.stack(outs)).all() and (held[0].sum() * 2).isfinite()


@pytest.mark.parametrize("kind", ["linear", "decay", "ring"])
def test_steppers_at_batch_one_equal_one_whole_pass(kind):
    """Batch 1, the usual decoding shape (buffers whose batch and head axes merge)."""
    q, k, v = (t[1:] for t in _inputs(5))
    scale = 1 / math.sqrt(D)
    if kind == "ring":
        step = RingStep(ring_of(window_cache_from_keys(k[:, :, :PREFIX], v[:, :, :PREFIX], None, window=5, sinks=2)),
                        F64, scale, gqa=True)
        ref = window_oracle(q, k, v, window=5, causal=True, sinks=2, scale=scale)
    elif kind == "linear":
        S, z = linear_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], name="elu", scale=scale, H=H)
        T = torch.cat([S, z[..., None]], dim=-1).contiguous()
        step = PackedStateStep(T, (T[..., :DV], T[..., DV]), F64, elu_plus_one, kv_heads=HKV, eps=1e-6)
        ref = linear_oracle(q, k, v, name="elu", causal=True, scale=scale, eps=1e-6)
    else:
        gammas = [0.5, 0.99, 0.9, 0.7]
        S, z = decay_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], gammas=gammas, feature_map="elu", H=H)
        T = torch.cat([S, z[..., None]], dim=-1).contiguous()
        step = PackedStateStep(T, (T[..., :DV], T[..., DV]), F64, elu_plus_one, kv_heads=HKV, eps=1e-6,
                               decay_H=torch.tensor(gammas, dtype=F64))
        ref = decay_oracle(q, k, v, gammas=gammas, feature_map="elu", normalize=True, scale=1.0, eps=1e-6)
    outs = [step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(PREFIX, N)]
    assert (_stacked(outs, b=1) - ref[:, :, PREFIX:]).abs().max() < 1e-12


@pytest.mark.parametrize("kind", ["linear", "ring"])
def test_a_state_made_under_inference_mode_steps_under_no_grad(kind):
    """A prefill under torch.inference_mode leaves inference tensors; decoding then under no_grad
    (as generate() does) must still write them in place, and give the oracle's outputs."""
    q, k, v = _inputs(6)
    scale = 1 / math.sqrt(D)
    with torch.inference_mode():
        if kind == "ring":
            step = RingStep(ring_of(window_cache_from_keys(k[:, :, :PREFIX], v[:, :, :PREFIX], None, window=4, sinks=1)),
                            F64, scale, gqa=True)
            held = step.state.k_BHkvKD
        else:
            S, z = linear_state_oracle(k[:, :, :PREFIX], v[:, :, :PREFIX], name="elu", scale=scale, H=H)
            held = torch.cat([S, z[..., None]], dim=-1).contiguous()
            step = PackedStateStep(held, (held[..., :DV], held[..., DV]), F64, elu_plus_one, kv_heads=HKV, eps=1e-6)
    assert held.is_inference()
    with torch.no_grad():
        outs = [step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(PREFIX, N)]
    if kind == "ring":
        ref = window_oracle(q, k, v, window=4, causal=True, sinks=1, scale=scale)
    else:
        ref = linear_oracle(q, k, v, name="elu", causal=True, scale=scale, eps=1e-6)
    assert (_stacked(outs) - ref[:, :, PREFIX:]).abs().max() < 1e-12
