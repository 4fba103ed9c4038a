"""Decoding from a fixed-size state equals the oracle of one whole pass, for every split of the
sequence into a prefill and steps, under left padding and rows with fewer real tokens than sinks;
and the state stays the size the form promises."""

import math

import pytest
import torch

from attnopt.kernels.feature_maps import make_feature_map
from attnopt.forms.linear.reference import linear_attention
from attnopt.forms.linear_window.decode import linear_window_decode
from attnopt.forms.window.decode import window_decode
from oracles import linear_oracle, linear_window_oracle, window_oracle

F64 = torch.float64
B, H, HKV, N, D, DV = 3, 4, 2, 37, 8, 5
SPLITS = {"whole": [N], "prefill+steps": [9] + [1] * 28, "chunks": [3, 5, 1, 1, 20, 7], "steps": [1] * N}


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=F64)
    k = torch.randn(B, HKV, N, D, generator=g, dtype=F64)
    v = torch.randn(B, HKV, N, DV, generator=g, dtype=F64)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :6] = False  # left padding
    keep[2, :31] = False  # fewer real tokens than a prefill of 9 holds: sinks arrive while decoding
    return q, k, v, keep


def _run(step, q, k, v, keep, splits, **kw):
    outs, state, i = [], None, 0
    for n in splits:
        o, state = step(q[:, :, i:i + n], k[:, :, i:i + n], v[:, :, i:i + n], state, key_mask=keep[:, i:i + n], **kw)
        outs.append(o)
        i += n
    return torch.cat(outs, dim=2), state


def _assert_real_rows(out, ref, keep, tol=1e-12):
    rows = keep[:, None, :, None].expand_as(out)
    err = (out - ref)[rows].abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"max abs err {err:.3e}"


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("window,sinks", [(1, 0), (4, 2), (7, 3), (64, 2)])
def test_window_decode_equals_one_pass(split, window, sinks):
    q, k, v, keep = _inputs()
    out, cache = _run(window_decode, q, k, v, keep, SPLITS[split], window=window, sinks=sinks)
    ref = window_oracle(q, k, v, window=window, causal=True, sinks=sinks, scale=1 / math.sqrt(D), key_mask=keep)
    _assert_real_rows(out, ref, keep)
    assert cache.k_BHkvLD.shape[2] == min(N, window - 1) and cache.columns == N
    # Row 2 has 6 real tokens: every sink slot it can fill is filled, with its first real columns.
    assert cache.sink_col_BS[2, :min(sinks, 6)].tolist() == list(range(31, 31 + min(sinks, 6)))


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("name", ["elu", "hedgehog", "favor"])
@pytest.mark.parametrize("window,sinks", [(1, 0), (5, 2), (64, 1)])
def test_linear_window_decode_equals_one_pass(split, name, window, sinks):
    q, k, v, keep = _inputs(1)
    fm = make_feature_map(name, D, H, seed=3).to(F64)
    if name == "hedgehog":  # off the identity init, so heads really differ
        with torch.no_grad():
            fm.weight_HDP.add_(0.4 * torch.randn(fm.weight_HDP.shape, generator=torch.Generator().manual_seed(4), dtype=F64))
    beta = torch.tensor([0.3, 1.0, 2.0, 0.7], dtype=F64)
    out, state = _run(linear_window_decode, q, k, v, keep, SPLITS[split], window=window, sinks=sinks, feature_map=fm,
                      linear_weight=beta)
    ref = linear_window_oracle(q, k, v, window=window, causal=True, sinks=sinks, name=name, fmap=fm, beta=beta,
                               key_mask=keep)
    _assert_real_rows(out, ref, keep, tol=1e-10)
    assert state.window.k_BHkvLD.shape[2] == min(N, window - 1)
    M = fm.num_features(D)
    assert tuple(state.S_BHMDv.shape) == (B, H, M, DV) and tuple(state.z_BHM.shape) == (B, H, M)


@pytest.mark.parametrize("name", ["elu", "hedgehog", "taylor", "favor"])
def test_linear_state_steps_equal_one_pass(name):
    q, k, v, keep = _inputs(2)
    fm = make_feature_map(name, D, H, seed=3).to(F64)
    M = fm.num_features(D)
    state0 = (torch.zeros(B, H, M, DV, dtype=F64), torch.zeros(B, H, M, dtype=F64))
    eps = 0.0 if name == "favor" else 1e-6  # favor's stabilised units make ε per call (see linear.py)

    def step(q_, k_, v_, state, key_mask):
        return linear_attention(q_, k_, v_, feature_map=fm, causal=True, eps=eps, key_mask=key_mask,
                                state=state0 if state is None else state)

    out, _ = _run(step, q, k, v, keep, SPLITS["prefill+steps"])
    ref = linear_oracle(q, k, v, name=name, weight=fm.op_weight(), causal=True, scale=1 / math.sqrt(D), eps=eps,
                        key_mask=keep)
    _assert_real_rows(out, ref, keep, tol=1e-10)


def test_window_decode_rejects_a_cache_of_another_window():
    q, k, v, keep = _inputs()
    _, cache = window_decode(q[:, :, :5], k[:, :, :5], v[:, :, :5], None, window=4, sinks=1)
    with pytest.raises(ValueError, match="built for window 4, sinks 1"):
        window_decode(q[:, :, 5:6], k[:, :, 5:6], v[:, :, 5:6], cache, window=8, sinks=1)
    with pytest.raises(ValueError, match="new tokens' q, k and v alike"):
        window_decode(q[:, :, 5:6], k[:, :, :5], v[:, :, :5], cache, window=4, sinks=1)
