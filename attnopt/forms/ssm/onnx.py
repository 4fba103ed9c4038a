"""ONNX lowerings of `attnopt::decay_attention` (the ssm form): S_t = γ_h S_{t−1} + φ(k_t) v_tᵀ.

ort: com.microsoft.LinearAttention with update_rule="gated" and the decay in log space, log γ_h
per head and token ([B, N, H]); φ, the scale (normalize=False) and the normaliser (normalize=True,
a ones column on v) are standard ops around it. γ differs per query head, so keys and values are
repeated to the query heads first (kv_num_heads = H), as the torch kernel keeps one state per
query head.

onnx-std: chunks of C. In a chunk the decay matrix γ^(r−l) (l ≤ r) weights the C×C block; across
chunks a Scan carries the [B, H, M, W] state, S_c = γ^C S_{c−1} + U_c, so the cost is O(N·C·(M+W)
+ N·M·W) and the memory one state per chunk, never one per position. Every decay factor is γ to
a non-negative power (built in log space and masked before the exp), so nothing overflows.

Decode step (`attnopt::decay_step`, forms/ssm/step.py): the carried state [B, H, D, W] is
LinearAttention's past_state (ort), or the Scan's initial state plus γ^T·state + Σ γ^(T−1−j) φ(k_j)v_jᵀ
for the present (onnx-std). A pad adds no key and still decays the state, as in torch.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.kernels.onnx.functions import (
    CHUNK,
    MS_DOMAIN,
    causal_prefill_dims,
    contrib_node,
    dim,
    expand_heads,
    f32,
    features,
    i64,
    keep_BN1,
    pack_heads,
    pad_axis,
    ratio_of_ones_column,
    slice_axis,
    unpack_heads,
    with_ones_column,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import add_real_tokens, arange, linear_attention, new_columns_keep


def _inputs(q, k, v, key_mask, feature_map, normalize, scale):
    """φ(q) (scaled unless normalised), φ(k), v repeated to H heads, and (H, D, W)."""
    H, Hkv, D, Dv = causal_prefill_dims(q, k, v, "ssm")
    phi_q = features(feature_map, q, scale, None, D)
    if not normalize:
        phi_q = op.Mul(phi_q, op.CastLike(f32(scale), phi_q))
    phi_k = features(feature_map, expand_heads(k, Hkv, H, D), scale, None, D)
    if key_mask is not None:  # a dropped key adds nothing, but its position still decays the state
        phi_k = op.Mul(phi_k, keep_BN1(key_mask, phi_k))
    v_H = expand_heads(v, Hkv, H, Dv)
    if normalize:
        v_H = with_ones_column(v_H)
    return phi_q, phi_k, v_H, (H, D, Dv + 1 if normalize else Dv)


def decay_ort(q, k, v, decay, key_mask, feature_map, normalize, scale, eps, chunk_size):
    phi_q, phi_k, v_H, (H, D, W) = _inputs(q, k, v, key_mask, feature_map, normalize, scale)
    log_gamma_11H = op.Reshape(op.CastLike(op.Log(decay), phi_q), i64([1, 1, H]))
    B_N_H = op.Concat(op.Shape(q, start=0, end=1), dim(q, 2), i64([H]), axis=0)
    out, _state = contrib_node(
        MS_DOMAIN, "LinearAttention",
        [pack_heads(phi_q), pack_heads(phi_k), pack_heads(v_H), None, op.Expand(log_gamma_11H, B_N_H)],
        {"q_num_heads": H, "kv_num_heads": H, "update_rule": "gated", "scale": 1.0}, num_outputs=2, like=q)
    out = unpack_heads(out, H)
    return ratio_of_ones_column(out, W, eps) if normalize else out


def _scan_prefix_states(U_BHcMW, gamma_C_1H11, like, M: int, W: int, initial=None):
    """The state entering each chunk, [B, H, nC, M, W], by a Scan over chunks (one state carried,
    from `initial` [B, H, M, W] or zeros). `like` is a graph input of the compute dtype
    (intermediate values carry no dtype while tracing)."""
    dtype = like.dtype
    s_in = ir.Value(name="state_in", type=ir.TensorType(dtype))
    u = ir.Value(name="chunk_state", type=ir.TensorType(dtype))
    decayed = ir.Node("", "Mul", [gamma_C_1H11, s_in], num_outputs=1)
    s_out = ir.Node("", "Add", [decayed.outputs[0], u], num_outputs=1)
    before = ir.Node("", "Identity", [s_in], num_outputs=1)
    s_out.outputs[0].name, before.outputs[0].name = "state_out", "state_before"
    for value in (decayed.outputs[0], s_out.outputs[0], before.outputs[0]):
        value.type = ir.TensorType(dtype)
    body = ir.Graph([s_in, u], [s_out.outputs[0], before.outputs[0]], nodes=[decayed, s_out, before],
                    name="decay_chunk_scan")
    zeros = initial if initial is not None else op.Expand(
        op.CastLike(f32(np.zeros((1, 1, 1, 1))), like), op.Concat(op.Shape(U_BHcMW, start=0, end=2), i64([M, W]), axis=0))
    # Chunks first: the scan runs over axis 0 (the reference evaluator implements no other axis).
    U_cBHMW = op.Transpose(U_BHcMW, perm=[2, 0, 1, 3, 4])
    _final, prefix_cBHMW = contrib_node("", "Scan", [zeros, U_cBHMW], {"body": body, "num_scan_inputs": 1},
                                        num_outputs=2, like=like)
    return op.Transpose(prefix_cBHMW, perm=[1, 2, 0, 3, 4])


def decay_std(q, k, v, decay, key_mask, feature_map, normalize, scale, eps, chunk_size):
    phi_q, phi_k, v_H, (H, M, W) = _inputs(q, k, v, key_mask, feature_map, normalize, scale)
    out = _chunked(phi_q, phi_k, v_H, decay, H, M, W, q)
    return ratio_of_ones_column(out, W, eps) if normalize else out


def _chunked(phi_q, phi_k, v_H, decay, H: int, M: int, W: int, q, initial=None):
    """Σ over keys j ≤ i of γ^(i−j) (φ(q_i)·φ(k_j)) v_j, plus γ^(i+1) φ(q_i)·initial when a state is
    carried in: [B, H, N, W]."""
    C = CHUNK
    N = dim(q, 2)
    log_g = op.Reshape(op.CastLike(op.Log(decay), phi_q), i64([1, H, 1, 1, 1]))  # [1, H, 1, 1, 1]
    r = np.arange(C, dtype=np.float32)
    lag_CC = np.maximum(r[:, None] - r[None, :], 0.0)
    tril = op.CastLike(f32(np.tril(np.ones((C, C)))), phi_q)
    decay_CC = op.Mul(op.Exp(op.Mul(log_g, op.CastLike(f32(lag_CC), phi_q))), tril)  # γ^(r−l), l ≤ r
    q_decay = op.Exp(op.Mul(log_g, op.CastLike(f32((r + 1)[:, None]), phi_q)))  # state reaches row r as γ^(r+1)
    k_decay = op.Exp(op.Mul(log_g, op.CastLike(f32((C - 1 - r)[:, None]), phi_q)))  # key l reaches the chunk end
    gamma_C = op.Reshape(op.Exp(op.Mul(log_g, op.CastLike(f32(float(C)), phi_q))), i64([1, H, 1, 1]))

    fq = op.Reshape(pad_axis(phi_q, 2, 4, C), i64([0, 0, -1, C, M]))
    fk = op.Reshape(pad_axis(phi_k, 2, 4, C), i64([0, 0, -1, C, M]))
    vc = op.Reshape(pad_axis(v_H, 2, 4, C), i64([0, 0, -1, C, W]))
    intra = op.MatMul(op.Mul(op.MatMul(fq, op.Transpose(fk, perm=[0, 1, 2, 4, 3])), decay_CC), vc)
    U = op.MatMul(op.Transpose(op.Mul(fk, k_decay), perm=[0, 1, 2, 4, 3]), vc)  # [B, H, nC, M, W]
    prefix = _scan_prefix_states(U, gamma_C, q, M, W, initial)
    out = op.Add(op.MatMul(op.Mul(fq, q_decay), prefix), intra)
    return slice_axis(op.Reshape(out, i64([0, 0, -1, W])), 2, i64([0]), N)


LOWERING = OpLowering("attnopt::decay_attention", {"ort": decay_ort, "onnx-std": decay_std})


def decay_step_ort(q, k, v, mask, state, count, decay, feature_map, normalize, scale, eps):
    keep = new_columns_keep(mask, q)
    phi_q, phi_k, v_H, (H, D, W) = _inputs(q, k, v, keep, feature_map, normalize, scale)
    log_gamma_11H = op.Reshape(op.CastLike(op.Log(decay), phi_q), i64([1, 1, H]))
    B_T_H = op.Concat(op.Shape(q, start=0, end=1), dim(q, 2), i64([H]), axis=0)
    out, present = linear_attention(phi_q, phi_k, v_H, state, H, H, "gated", like=q,
                                    log_decay=op.Expand(log_gamma_11H, B_T_H))
    out = ratio_of_ones_column(out, W, eps) if normalize else out
    return out, present, add_real_tokens(count, keep)


def decay_step_std(q, k, v, mask, state, count, decay, feature_map, normalize, scale, eps):
    keep = new_columns_keep(mask, q)
    phi_q, phi_k, v_H, (H, M, W) = _inputs(q, k, v, keep, feature_map, normalize, scale)
    out = _chunked(phi_q, phi_k, v_H, decay, H, M, W, q, initial=state)
    # The state after the call: γ^T S + Σ_j γ^(T−1−j) φ(k_j) v_jᵀ (a pad decays it too, as in torch).
    log_g = op.Reshape(op.CastLike(op.Log(decay), phi_q), i64([1, H, 1, 1]))
    T = dim(q, 2)
    T_f = op.CastLike(T, phi_q)
    lag = op.Sub(op.Sub(T_f, op.CastLike(f32(1.0), phi_q)), arange(T, ir.DataType.FLOAT))  # [T]
    weights = op.Exp(op.Mul(log_g, op.Reshape(lag, i64([1, 1, -1, 1]))))  # [1, H, T, 1]
    added = op.MatMul(op.Transpose(op.Mul(phi_k, weights), perm=[0, 1, 3, 2]), v_H)
    present = op.Add(op.Mul(op.Exp(op.Mul(log_g, T_f)), state), added)
    out = ratio_of_ones_column(out, W, eps) if normalize else out
    return out, present, add_real_tokens(count, keep)


DECODE_LOWERING = OpLowering("attnopt::decay_step", {"ort": decay_step_ort, "onnx-std": decay_step_std})
