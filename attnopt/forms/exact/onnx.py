"""ONNX lowering of `attnopt::exact_step` (forms/exact/step.py): softmax attention over past ++ new.

ort: com.microsoft.GroupQueryAttention with past K/V (BNSH), seqlens_k = total − 1 for every row,
total = the mask's column count (so present = past ++ new) and query_seqlens = T (needed for T > 1
after a past at batch > 1). GQA assumes each row's tokens are right-aligned in the cache, so padding
is hidden by an attention_bias where(mask, 0, −1e9) [B, 1, T, total] (finite: a fully masked pad row
stays finite); an If skips the bias when no column is a pad, the usual unpadded prefill, which then
builds nothing T × total. Head dims must be equal and a multiple of 8 (the kernel's rule); other
sites get the standard-op form.

onnx-std: Concat, then the masked softmax in standard ops (O(T × total), as softmax attention is).

`attnopt::exact_prefix_step` (a rewritten site under min_seq_len = T; forms/exact/step.py), both
targets standard ops: an If on "some row has fewer than T real tokens before this call" runs the
exact prefix (write the new real tokens into their slots by a one-hot [B, T, new] product, softmax
over the slots up to each query's real position, O(new × T)); else the form's output and the prefix
pass through, so decoding past T pays one comparison.
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
    head_dims,
    i64,
    pack_heads,
    static_dim,
    unpack_heads,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import arange, branch, new_columns_keep, split_last

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
    H, Hkv, D, Dv = head_dims(q, k, v)
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


def _real_positions(mask_BN, keep_BT):
    """(positions [B, T] int64 as forms/exact/step.py's real_positions_of, real tokens before [B, 1])."""
    kept = op.Cast(keep_BT, to=ir.DataType.INT64)
    before = op.Sub(op.ReduceSum(op.Cast(mask_BN, to=ir.DataType.INT64), i64([1]), keepdims=1),
                    op.ReduceSum(kept, i64([1]), keepdims=1))
    return op.Sub(op.Add(before, op.CumSum(kept, op.Constant(value_int=1))), i64([1])), before


def _prefix_attention(q, k, v, prefix, form_out, keep, pos_BT, scale, H, Hkv, D, Dv, slots):
    """(out, present prefix) when some query may lie below the threshold."""
    write_BT = op.And(keep, op.Less(pos_BT, i64([slots])))
    slot_1S1 = i64(range(slots))
    onehot_BST = op.And(op.Equal(op.Unsqueeze(pos_BT, i64([1])), op.Reshape(slot_1S1, i64([1, slots, 1]))),
                        op.Unsqueeze(write_BT, i64([1])))  # slot s takes new token j
    kv = op.CastLike(op.Concat(k, v, axis=-1), prefix)
    written = op.MatMul(op.Unsqueeze(op.CastLike(onehot_BST, prefix), i64([1])), kv)  # [B, Hkv, slots, D + Dv]
    filled_BS = op.Cast(op.ReduceMax(op.Cast(onehot_BST, to=ir.DataType.INT32), i64([2]), keepdims=0),
                        to=ir.DataType.BOOL)
    present = op.Where(op.Unsqueeze(filled_BS, i64([1, 3])), written, prefix)
    K, V = split_last(present, D, D + Dv)
    visible = op.LessOrEqual(op.Reshape(slot_1S1, i64([1, 1, slots])), op.Unsqueeze(pos_BT, i64([2])))  # [B, T, S]
    exact = masked_softmax(q, expand_heads(op.CastLike(K, q), Hkv, H, D), expand_heads(op.CastLike(V, q), Hkv, H, Dv),
                           op.Unsqueeze(visible, i64([1])), scale)
    below = op.Unsqueeze(op.Less(pos_BT, i64([slots])), i64([1, 3]))
    return op.Where(below, op.CastLike(exact, form_out), form_out), present


def exact_prefix_step(q, k, v, mask, prefix, form_out, scale):
    H, Hkv, D, Dv = head_dims(q, k, v)
    slots = static_dim(prefix, 2, "exact prefix slots")
    keep = new_columns_keep(mask, q)
    pos_BT, before_B1 = _real_positions(mask, keep)
    some_row_below = op.Less(op.ReduceMin(before_B1, keepdims=0), op.Constant(value_int=slots))
    return branch(some_row_below,
                  lambda: _prefix_attention(q, k, v, prefix, form_out, keep, pos_BT, scale, H, Hkv, D, Dv, slots),
                  lambda: (op.Identity(form_out), op.Identity(prefix)), num_outputs=2, like=form_out,
                  name="exact_prefix")


PREFIX_LOWERING = OpLowering("attnopt::exact_prefix_step", {"ort": exact_prefix_step, "onnx-std": exact_prefix_step})
