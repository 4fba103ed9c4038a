"""ONNX lowering of `attnopt::block_sparse_attention` (both targets) in standard ops: gathers.

Each query's K·b key columns (offset + block·b + slot) are gathered from k and v per row
(GatherND, batch_dims 1), scored against the query alone, masked (empty slot, column past the
keys, padding, causality, a query before its row's offset) and normalised: O(Nq·K·b) work, and
O(Nq·K·b·Hkv·D) memory for the gathered keys (the torch op gathers per query block instead;
ONNX has no loop over lists that would not unroll).
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset18 as op

from attnopt.kernels.onnx.functions import dim, f32, i64, static_dim
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import arange


def gathered_softmax(q, k, v, blocks, block: int, causal: bool, scale: float, key_mask, offsets):
    """The op's definition in standard ops: q [B, H, Nq, D] over each query's listed blocks of
    k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]; blocks [B, Nq, K] int64; key_mask [B, Nk] bool or None;
    offsets [B] int64 or None. Returns [B, H, Nq, Dv]."""
    H, Hkv, D, Dv = static_dim(q, 1, "H"), static_dim(k, 1, "Hkv"), static_dim(q, 3, "D"), static_dim(v, 3, "Dv")
    K = static_dim(blocks, 2, "list slots")
    G = H // Hkv
    Nq, Nk = dim(q, 2), dim(k, 2)
    off = i64([0]) if offsets is None else op.Unsqueeze(offsets, i64([1, 2]))  # [B, 1, 1]
    slot = op.Unsqueeze(arange(i64([block])), i64([0, 1, 2]))  # [1, 1, 1, b]
    ids = op.Unsqueeze(op.Cast(blocks, to=7), i64([3]))  # [B, Nq, K, 1]
    kpos = op.Add(op.Mul(op.Max(ids, i64([0])), i64([block])), slot)  # [B, Nq, K, b] positions
    kpos = op.Reshape(kpos, op.Concat(i64([0, 0]), i64([K * block]), axis=0))  # [B, Nq, K·b]
    cols = op.Add(kpos, off)
    ok = op.And(op.Reshape(op.Expand(op.GreaterOrEqual(ids, i64([0])), op.Concat(i64([1, 1, 1]), i64([block]),
                                                                                    axis=0)),
                           op.Concat(i64([0, 0]), i64([K * block]), axis=0)),
                op.Less(cols, Nk))
    qpos = op.Sub(op.Add(arange(Nq), op.Sub(Nk, Nq)), op.Squeeze(off, i64([2])) if offsets is not None else i64([0]))
    qpos = op.Unsqueeze(qpos, i64([-1])) if offsets is not None else op.Unsqueeze(qpos, i64([0, 2]))  # [B|1, Nq, 1]
    ok = op.And(ok, op.GreaterOrEqual(qpos, i64([0])))
    if causal:
        ok = op.And(ok, op.LessOrEqual(kpos, qpos))
    safe = op.Where(ok, cols, i64([0]))  # [B, Nq, K·b]
    if key_mask is not None:
        flat = op.Reshape(safe, i64([0, -1]))
        ok = op.And(ok, op.Reshape(op.GatherElements(key_mask, flat, axis=1), op.Shape(safe)))
    index = op.Unsqueeze(op.Reshape(safe, i64([0, -1])), i64([2]))  # [B, Nq·K·b, 1]

    def gathered(x, width):  # [B, Hkv, Nk, w] -> [B, Hkv, 1, Nq, K·b, w]
        rows = op.GatherND(op.Transpose(x, perm=[0, 2, 1, 3]), index, batch_dims=1)  # [B, Nq·K·b, Hkv, w]
        rows = op.Reshape(rows, op.Concat(i64([0]), Nq, i64([K * block, Hkv, width]), axis=0))
        return op.Unsqueeze(op.Transpose(rows, perm=[0, 3, 1, 2, 4]), i64([2]))

    k_g, v_g = gathered(k, D), gathered(v, Dv)
    q6 = op.Unsqueeze(op.Reshape(q, op.Concat(i64([0, Hkv, G]), Nq, i64([D]), axis=0)), i64([4]))  # [B, Hkv, G, Nq, 1, D]
    scores = op.MatMul(op.Mul(q6, op.CastLike(f32(scale), q6)), op.Transpose(k_g, perm=[0, 1, 2, 3, 5, 4]))
    visible = op.Unsqueeze(ok, i64([1, 2, 4]))  # [B, 1, 1, Nq, 1, K·b]
    masked = op.Where(visible, scores, op.CastLike(f32(-np.inf), scores))
    m = op.ReduceMax(masked, i64([-1]), keepdims=1)
    m = op.Where(op.IsInf(m), op.CastLike(f32(0.0), m), m)
    e = op.Exp(op.Sub(masked, m))
    den = op.ReduceSum(e, i64([-1]), keepdims=1)
    out = op.Div(op.MatMul(e, v_g), op.Max(den, op.CastLike(f32(1.0), den)))  # a query that sees nothing: 0
    return op.Reshape(out, op.Concat(i64([0, H]), Nq, i64([Dv]), axis=0))


def block_sparse_std(q, k, v, blocks, block, causal, scale, key_mask, offsets):
    return gathered_softmax(q, k, v, blocks, int(block), bool(causal), float(scale), key_mask, offsets)


LOWERING = OpLowering("attnopt::block_sparse_attention", {"ort": block_sparse_std, "onnx-std": block_sparse_std})
