"""ONNX lowering of `attnopt::linear_window_attention` (both targets: standard ops, no contrib op fits).

oᵢ = (Σ_{W(i)} e^{s·q·k − m} v + β e^{−m} Σ_{L(i)} φ(q)·φ(k) v) / (the same sums without v), as the
kernel: the window sums come from window.banded_sums (shifted by the row's window max m), the
linear sums over the keys j ≤ pᵢ − W from the causal chunked scan run on keys shifted W places to
the right (a zero key adds nothing), and for bidirectional sites the same on the reversed sequence
(keys j ≥ pᵢ + W). Sinks belong to the window, so their φ(k) is zeroed on the linear side. FAVOR+
keeps the query row's stabiliser c_q here: it would not cancel against the softmax terms, so the
linear sums are rescaled by e^{c_q + c_k − m}. O(N·(Bq + W + S)·D + N·C·(M + Dv) + N·M·Dv).

Decode step (`attnopt::linear_window_step`, forms/linear_window/step.py): the window form's step
sums (window/onnx.py) plus the linear sums: the carried S ‖ z of every key that has left the buffer,
and, inside the call, the keys leaving it before each query (an exclusive causal scan over the
first T columns of buffer ‖ new); the present adds those T columns (pads and sinks excluded).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.forms.window.onnx import arange, banded_sums, holds_sink, ones_keep, window_step_sums
from attnopt.kernels.onnx.functions import (
    CHUNK,
    causal_linear_chunks,
    causal_prefill_dims,
    dim,
    expand_heads,
    f32,
    favor_exponent,
    feature_count,
    features,
    head_dims,
    i64,
    keep_BN1,
    slice_axis,
    static_dim,
    with_ones_column,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import branch, one_token


def _shift_right(x_BHNX, n: int, X: int):
    """Keys moved n places later (zeros in front, the last n dropped): key j lands at j + n."""
    N = dim(x_BHNX, 2)
    pads = i64([0, 0, n, 0, 0, 0, 0, 0])
    return slice_axis(op.Pad(x_BHNX, pads), 2, i64([0]), N)


def _reverse(x_BHNX):
    return op.Slice(x_BHNX, i64([-1]), i64([-(2 ** 63)]), i64([2]), i64([-1]))


def _linear_features(name, q, k, scale, weight, keep_BN, H, D):
    """φ(q), φ(k) [B, H, N, M] (keys dropped or sinks: 0) and log c [B, H, N, 1] for FAVOR+ (else None)."""
    if name != "favor":
        phi_q, phi_k = features(name, q, scale, weight, D), features(name, k, scale, weight, D)
        return phi_q, op.Mul(phi_k, keep_BN1(keep_BN, phi_k)), None
    inv_sqrt_m = op.CastLike(f32(1.0 / math.sqrt(static_dim(weight, 1, "FAVOR+ feature count"))), q)
    a_q = favor_exponent(q, scale, weight)
    c_q = op.ReduceMax(a_q, i64([-1]), keepdims=1)  # [B, H, N, 1]
    phi_q = op.Mul(op.Exp(op.Sub(a_q, c_q)), inv_sqrt_m)
    a_k = op.Where(op.Unsqueeze(keep_BN, i64([1, 3])), favor_exponent(k, scale, weight), op.CastLike(f32(-np.inf), q))
    c_k = op.ReduceMax(a_k, i64([2, 3]), keepdims=1)  # one constant per (batch, head): keys not reweighted
    c_k = op.Where(op.IsInf(c_k), op.CastLike(f32(0.0), c_k), c_k)
    phi_k = op.Mul(op.Exp(op.Sub(a_k, c_k)), inv_sqrt_m)
    return phi_q, phi_k, op.Add(c_q, c_k)


def linear_window_std(q, k, v, key_mask, window, causal, sinks, scale, feature_map, feature_weight, linear_weight,
                      block_size, chunk_size):
    H, Hkv, D, Dv = causal_prefill_dims(q, k, v, "linear+window")
    k_H, v_H = expand_heads(k, Hkv, H, D), expand_heads(v, Hkv, H, Dv)
    keep = ones_keep(q) if key_mask is None else key_mask
    num, den, m, seen = banded_sums(q, k_H, v_H, keep, window, causal, sinks, scale, block_size, D, Dv)

    lin_keep = keep
    if sinks:  # each row's first S kept keys are sinks: window keys, never linear ones
        kept_BN = op.CumSum(op.Cast(keep, to=ir.DataType.INT64), op.Constant(value_int=1))
        lin_keep = op.And(keep, op.Greater(kept_BN, i64([sinks])))
    phi_q, phi_k, log_c = _linear_features(feature_map, q, k_H, scale, feature_weight, lin_keep, H, D)
    M = feature_count(feature_map, D, feature_weight)
    v1 = with_ones_column(v_H)
    lin = causal_linear_chunks(phi_q, _shift_right(phi_k, window, M), _shift_right(v1, window, Dv + 1), M, Dv + 1,
                               CHUNK)
    if not causal:
        back = causal_linear_chunks(_reverse(phi_q), _shift_right(_reverse(phi_k), window, M),
                                    _shift_right(_reverse(v1), window, Dv + 1), M, Dv + 1, CHUNK)
        lin = op.Add(lin, _reverse(back))

    log_factor = op.Neg(m) if log_c is None else op.Sub(log_c, m)
    log_factor = op.Where(seen, log_factor, op.CastLike(f32(0.0), m))  # empty window: a common factor, use 1
    beta_1H11 = op.Reshape(op.CastLike(linear_weight, q), i64([1, H, 1, 1]))
    factor = op.Mul(beta_1H11, op.Exp(log_factor))  # [B, H, N, 1]
    num = op.Add(num, op.Mul(factor, slice_axis(lin, 3, i64([0]), i64([Dv]))))
    den = op.Add(den, op.Mul(factor, slice_axis(lin, 3, i64([Dv]), i64([Dv + 1]))))
    positive = op.Greater(den, op.CastLike(f32(0.0), den))
    return op.Div(num, op.Where(positive, den, op.CastLike(f32(1.0), den)))


LOWERING = OpLowering("attnopt::linear_window_attention", {"ort": linear_window_std, "onnx-std": linear_window_std})


# ---------------------------------------------------------------- decode step (forms/linear_window/step.py)


def _leaving_keys(s, q, T, window: int, sinks: int):
    """The call's first T columns of buffer ‖ new, which leave the buffer: (k, v, keep), sinks and pads
    dropped. Query i of the call sees those before it (index < i) as linear keys."""
    k_out = slice_axis(s.k_all, 2, i64([0]), T)
    v_out = slice_axis(s.v_all, 2, i64([0]), T)
    keep = slice_axis(s.keep_all, 1, i64([0]), T)
    if sinks:
        cols1 = op.Add(arange(T), op.Add(s.past, i64([2 - window])))  # column + 1 of leaving index x: P − L + x
        keep = op.And(keep, op.Not(holds_sink(s.sink_pos1, cols1)))
    return k_out, v_out, keep


def linear_window_step(q, k, v, mask, buffer, slots, linear, feature_map, weight, beta, window, sinks, scale):
    if feature_map == "favor":
        raise ValueError("ONNX decode lowering of linear+window: the favor map's stabiliser is not lowered")
    H, Hkv, D, Dv = head_dims(q, k, v)
    W = Dv + 1
    s = window_step_sums(q, k, v, mask, buffer, slots, window, sinks, scale)
    T = dim(q, 2)
    k_out, v_out, keep_out = _leaving_keys(s, q, T, window, sinks)
    phi_q, phi_out, _ = _linear_features(feature_map, q, expand_heads(k_out, Hkv, H, D), scale, weight, keep_out, H, D)
    M = feature_count(feature_map, D, weight)
    v1 = with_ones_column(expand_heads(v_out, Hkv, H, Dv))
    carried = op.MatMul(phi_q, linear)
    # One token: no key of the call has left before it, so only the carried sums (no chunk padded to C).
    [lin] = branch(one_token(q), lambda: op.Identity(carried), lambda: op.Add(carried, causal_linear_chunks(
        phi_q, _shift_right(phi_out, 1, M), _shift_right(v1, 1, W), M, W, CHUNK)), num_outputs=1, like=q,
        name="linear_window_step")
    present = op.Add(linear, op.MatMul(op.Transpose(phi_out, perm=[0, 1, 3, 2]), v1))
    factor = op.Mul(op.Reshape(op.CastLike(beta, q), i64([1, H, 1, 1])), op.Exp(op.Neg(s.m)))
    num = op.Add(s.num, op.Mul(factor, slice_axis(lin, 3, i64([0]), i64([Dv]))))
    den = op.Add(s.den, op.Mul(factor, slice_axis(lin, 3, i64([Dv]), i64([W]))))
    positive = op.Greater(den, op.CastLike(f32(0.0), den))
    return op.Div(num, op.Where(positive, den, op.CastLike(f32(1.0), den))), s.buffer, s.slots, present


DECODE_LOWERING = OpLowering("attnopt::linear_window_step", {"ort": linear_window_step, "onnx-std": linear_window_step})
