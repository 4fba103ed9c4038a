"""ONNX lowering of `attnopt::reuse_attention` (both targets): softmax attention on the anchor's q, k
concatenated with the rank-r residual (x A)(x B)ᵀ, as the kernel's one SDPA call.

Reuse saves the q/k projections, not attention work, so this is exact softmax attention in
standard ops (O(N²), like the exact sites of the same model), with the causal and key masks
applied by Where before the Softmax.
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset18 as op

from attnopt.forms.exact.onnx import causal_visible, masked_softmax
from attnopt.forms.window.onnx import arange
from attnopt.kernels.onnx.functions import dim, expand_heads, f32, i64, static_dim
from attnopt.kernels.onnx.lowering import OpLowering


def _project(x_BNC, F_HCr, C: int):
    """x̂ F per head -> [B, H, N, r]; a C+1-th row of F is the bias of the homogeneous coordinate."""
    rows = static_dim(F_HCr, 1, "residual rows")
    out = op.MatMul(op.Unsqueeze(x_BNC, i64([1])), op.Slice(F_HCr, i64([0]), i64([C]), i64([1])))
    if rows == C + 1:
        out = op.Add(out, op.Unsqueeze(op.Slice(F_HCr, i64([C]), i64([C + 1]), i64([1])), i64([0])))
    return out


def reuse_std(q_anchor, k_anchor, v, x, A, B_, scale, causal, key_mask):
    H, Ha, D, Dv = (static_dim(q_anchor, 1, "H"), static_dim(k_anchor, 1, "Hkv"), static_dim(q_anchor, 3, "D"),
                    static_dim(v, 3, "Dv"))
    q, k = q_anchor, expand_heads(k_anchor, Ha, H, D)
    if A is not None and static_dim(A, 2, "rank") > 0:
        C = static_dim(x, 2, "layer width")
        q = op.Concat(q, _project(x, A, C), axis=-1)
        k = op.Concat(k, _project(x, B_, C), axis=-1)
    v_H = expand_heads(v, static_dim(v, 1, "Hkv"), H, Dv)
    scores = op.Mul(op.MatMul(q, op.Transpose(k, perm=[0, 1, 3, 2])), op.CastLike(f32(scale), q))
    visible = None
    if causal:
        pos = arange(dim(q, 2))
        visible = op.GreaterOrEqual(op.Unsqueeze(pos, i64([1])), op.Unsqueeze(pos, i64([0])))  # [N, N]
    if key_mask is not None:
        keep = op.Unsqueeze(key_mask, i64([1, 2]))  # [B, 1, 1, N]
        visible = keep if visible is None else op.And(keep, visible)
    if visible is not None:
        scores = op.Where(visible, scores, op.CastLike(f32(-np.inf), scores))
    return op.MatMul(op.Softmax(scores, axis=-1), v_H)


LOWERING = OpLowering("attnopt::reuse_attention", {"ort": reuse_std, "onnx-std": reuse_std})


def reuse_step_lowering(q_anchor, k_anchor, v, mask, past_value, x, A, B, past_residual, scale):
    """Decode step (forms/reuse/step.py): the softmax over [q_a, x̂A]·[k_a, x̂B]ᵀ of every column so far."""
    H, Ha, D, Dv = (static_dim(q_anchor, 1, "H"), static_dim(k_anchor, 1, "Hkv"), static_dim(q_anchor, 3, "D"),
                    static_dim(v, 3, "Dv"))
    V = op.Concat(past_value, v, axis=2)
    q, k = q_anchor, expand_heads(k_anchor, Ha, H, D)
    residual = V  # rank 0 has no residual state: a placeholder output nothing reads
    if A is not None:
        C = static_dim(x, 2, "layer width")
        residual = op.Concat(past_residual, _project(x, B, C), axis=2)
        q, k = op.Concat(q, _project(x, A, C), axis=-1), op.Concat(k, residual, axis=-1)
    out = masked_softmax(q, k, expand_heads(V, static_dim(v, 1, "Hkv"), H, Dv), causal_visible(mask, q), scale)
    return out, V, residual


DECODE_LOWERING = OpLowering("attnopt::reuse_step", {"ort": reuse_step_lowering, "onnx-std": reuse_step_lowering})
