"""ONNX lowering of `attnopt::exact_step` (forms/exact/step.py): softmax attention over past ++ new.

ort: com.microsoft.GroupQueryAttention with past K/V (BNSH), seqlens_k = total − 1 for every row,
total = the mask's column count (so present = past ++ new) and query_seqlens = T (needed for T > 1
after a past at batch > 1). GQA assumes each row's tokens are right-aligned in the cache, so padding
is hidden by an attention_bias where(mask, 0, −1e9) [B, 1, T, total] (finite: a fully masked pad row
stays finite); an If skips the bias when no column is a pad, the usual unpadded prefill, which then
builds nothing T × total. Head dims must be equal and a multiple of 8 (the kernel's rule); other
sites get the standard-op form.

onnx-std: Concat, then the masked softmax in standard ops (O(T × total), as softmax attention is).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.kernels.onnx.functions import (
    MS_DOMAIN,
    contrib_node,
    dim,
    expand_heads,
    f32,
    i64,
    pack_heads,
    static_dim,
    unpack_heads,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import arange, branch

PAD_BIAS = -1e9


def masked_softmax(q, K_H, V_H, visible, scale: float):
    """softmax(scale·q Kᵀ) V over the visible keys; a row that sees none gets 0."""
    scores = op.MatMul(op.Mul(q, op.CastLike(f32(scale), q)), op.Transpose(K_H, perm=[0, 1, 3, 2]))
    masked = op.Where(visible, scores, op.CastLike(f32(-np.inf), scores))
    m = op.ReduceMax(masked, i64([-1]), keepdims=1)
    m = op.Where(op.IsInf(m), op.CastLike(f32(0.0), m), m)
    e = op.Exp(op.Sub(masked, m))
    den = op.ReduceSum(e, i64([-1]), keepdims=1)  # >= 1 where a key is seen (its max term is e^0)
    return op.Div(op.MatMul(e, V_H), op.Max(den, op.CastLike(f32(1.0), den)))


def causal_visible(mask_BN, q):
    """Bool [B, 1, T, N]: column j is real and j ≤ the query's column P + i."""
    N, T = dim(mask_BN, 1), dim(q, 2)
    col_q = op.Add(arange(T), op.Sub(N, T))  # [T]
    causal = op.LessOrEqual(op.Unsqueeze(arange(N), i64([0])), op.Unsqueeze(col_q, i64([1])))  # [T, N]
    return op.And(op.Unsqueeze(causal, i64([0, 1])), op.Unsqueeze(mask_BN, i64([1, 2])))


def exact_step_std(q, k, v, mask, past_key, past_value, scale):
    H, Hkv, D, Dv = static_dim(q, 1, "H"), static_dim(k, 1, "Hkv"), static_dim(q, 3, "D"), static_dim(v, 3, "Dv")
    K, V = op.Concat(past_key, k, axis=2), op.Concat(past_value, v, axis=2)
    out = masked_softmax(q, expand_heads(K, Hkv, H, D), expand_heads(V, Hkv, H, Dv), causal_visible(mask, q), scale)
    return out, K, V


def _gqa(q, k, v, past_key, past_value, mask, scale, bias: bool):
    H, Hkv = static_dim(q, 1, "H"), static_dim(k, 1, "Hkv")
    B, T, N = op.Shape(q, start=0, end=1), dim(q, 2), dim(mask, 1)
    total32 = op.Cast(N, to=ir.DataType.INT32)
    seqlens_k = op.Expand(op.Sub(total32, op.Constant(value=ir.tensor(np.asarray([1], np.int32)))), B)
    query_lens = op.Expand(op.Cast(T, to=ir.DataType.INT32), B)
    attention_bias = None
    if bias:
        pads = op.Where(mask, op.CastLike(f32(0.0), q), op.CastLike(f32(PAD_BIAS), q))  # [B, N]
        attention_bias = op.Expand(op.Unsqueeze(pads, i64([1, 2])), op.Concat(B, i64([1]), T, N, axis=0))
    inputs = [pack_heads(q), pack_heads(k), pack_heads(v), past_key, past_value, seqlens_k,
              op.Squeeze(total32, i64([0])), None, None, None, attention_bias, None, None, None, None, None, query_lens]
    out, key, value = contrib_node(MS_DOMAIN, "GroupQueryAttention", inputs,
                                   {"num_heads": H, "kv_num_heads": Hkv, "scale": float(scale)}, num_outputs=3, like=q)
    return unpack_heads(out, H), key, value


def exact_step_ort(q, k, v, mask, past_key, past_value, scale):
    D, Dv = static_dim(q, 3, "D"), static_dim(v, 3, "Dv")
    if D != Dv or D % 8:
        return exact_step_std(q, k, v, mask, past_key, past_value, scale)
    unpadded = op.Cast(op.ReduceMin(op.Cast(mask, to=ir.DataType.INT32), keepdims=0), to=ir.DataType.BOOL)
    out, key, value = branch(unpadded, lambda: _gqa(q, k, v, past_key, past_value, mask, scale, bias=False),
                             lambda: _gqa(q, k, v, past_key, past_value, mask, scale, bias=True),
                             num_outputs=3, like=q, name="exact_gqa")
    return out, key, value


LOWERING = None  # exact sites call no attnopt op in a prefill export: they export as the model wrote them
DECODE_LOWERING = OpLowering("attnopt::exact_step", {"ort": exact_step_ort, "onnx-std": exact_step_std})
