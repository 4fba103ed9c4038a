"""ONNX lowerings of `attnopt::linear_attention`: o = φ(q)ᵀS / (φ(q)ᵀz + ε).

ort, causal: com.microsoft.LinearAttention with update_rule="linear" (always set: the op's
default is gated_delta) and scale 1, fed φ(q), φ(k) and [v, 1]; the ones column makes the op's one
output carry the normaliser φ(q)ᵀz, so the division is one standard op after it. φ is standard ops
before it (the contrib op has no feature-map input). Non-causal (both targets): two MatMuls through
the [M, Dv + 1] state. onnx-std, causal: the chunked decomposition of functions.causal_linear_chunks.

Decode step (`attnopt::linear_step`, forms/linear/step.py): the same with the carried state
[B, Hf, M, Dv + 1] (S ‖ z): ort feeds it to LinearAttention as past_state (present_state comes
back); onnx-std adds φ(q)·state to the chunked in-call sums and φ(k)ᵀ[v, 1] to the state. A pad's
φ(k) is 0, so it adds nothing.
"""

from __future__ import annotations

import numpy as np
from onnxscript import opset18 as op

from attnopt.kernels.onnx.functions import (
    CHUNK,
    MS_DOMAIN,
    causal_linear_chunks,
    check_self_attention,
    contrib_node,
    expand_heads,
    f32,
    feature_count,
    head_dims,
    i64,
    pack_heads,
    query_key_features,
    ratio_of_ones_column,
    slice_axis,
    unpack_heads,
    with_ones_column,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import add_real_tokens, linear_attention, new_columns_keep


def _featurised(q, k, v, feature_map, weight, scale, key_mask):
    """φ(q) [B, H, N, M], φ(k) [B, Hf, N, M], v [B, Hf, N, Dv] and the sizes (H, Hf, M, Dv)."""
    H, Hkv, D, Dv = head_dims(q, k, v)
    phi_q, phi_k, _ = query_key_features(feature_map, q, k, scale, weight, key_mask, H, Hkv, D)
    Hf = H if feature_map == "hedgehog" else Hkv  # per-head maps featurise keys per query head
    return phi_q, phi_k, expand_heads(v, Hkv, Hf, Dv), (H, Hf, feature_count(feature_map, D, weight), Dv)


def non_causal(phi_q, phi_k, v_f, H: int, Hf: int, M: int, Dv: int, eps: float):
    """φ(q)·[S, z] with S = φ(k)ᵀv, z = Σ φ(k): one state per kv head, expanded to the query heads."""
    S = op.MatMul(op.Transpose(phi_k, perm=[0, 1, 3, 2]), v_f)  # [B, Hf, M, Dv]
    z = op.Transpose(op.ReduceSum(phi_k, i64([2]), keepdims=1), perm=[0, 1, 3, 2])  # [B, Hf, M, 1]
    T = expand_heads(op.Concat(S, z, axis=-1), Hf, H, Dv + 1)
    return ratio_of_ones_column(op.MatMul(phi_q, T), Dv + 1, eps)


def linear_std(q, k, v, feature_map, weight, causal, scale, eps, key_mask, chunk_size):
    phi_q, phi_k, v_f, (H, Hf, M, Dv) = _featurised(q, k, v, feature_map, weight, scale, key_mask)
    if not causal:
        return non_causal(phi_q, phi_k, v_f, H, Hf, M, Dv, eps)
    check_self_attention(q, k, "linear")
    v1 = with_ones_column(expand_heads(v_f, Hf, H, Dv))
    out = causal_linear_chunks(phi_q, expand_heads(phi_k, Hf, H, M), v1, M, Dv + 1, CHUNK)
    return ratio_of_ones_column(out, Dv + 1, eps)


def linear_ort(q, k, v, feature_map, weight, causal, scale, eps, key_mask, chunk_size):
    phi_q, phi_k, v_f, (H, Hf, M, Dv) = _featurised(q, k, v, feature_map, weight, scale, key_mask)
    if not causal:
        return non_causal(phi_q, phi_k, v_f, H, Hf, M, Dv, eps)
    check_self_attention(q, k, "linear")
    out, _state = contrib_node(
        MS_DOMAIN, "LinearAttention", [pack_heads(phi_q), pack_heads(phi_k), pack_heads(with_ones_column(v_f))],
        {"q_num_heads": H, "kv_num_heads": Hf, "update_rule": "linear", "scale": 1.0}, num_outputs=2, like=q)
    return ratio_of_ones_column(unpack_heads(out, H), Dv + 1, eps)


LOWERING = OpLowering("attnopt::linear_attention", {"ort": linear_ort, "onnx-std": linear_std})


def _step_features(q, k, v, mask, state, feature_map, weight, scale):
    """keep [B, T], φ(q), φ(k) (pads 0), v per state head, sizes, the state to read and, for FAVOR+, the
    shared log-stabiliser the present must be scaled back by (else None).

    FAVOR+ keeps its state in true feature units (as linear_attention does): the new keys' stabiliser
    c_k and the state's own scale log max z meet at one shared constant that cancels in the ratio."""
    keep = new_columns_keep(mask, q)
    H, Hkv, D, Dv = head_dims(q, k, v)
    phi_q, phi_k, log_scale_k = query_key_features(feature_map, q, k, scale, weight, keep, H, Hkv, D)
    Hf = H if feature_map == "hedgehog" else Hkv
    shared = None
    if log_scale_k is not None:
        z = slice_axis(state, 3, i64([Dv]), i64([Dv + 1]))
        tiny = op.CastLike(f32(np.finfo(np.float32).tiny), z)
        shared = op.Max(log_scale_k, op.Log(op.Max(op.ReduceMax(z, i64([2, 3]), keepdims=1), tiny)))
        phi_k = op.Mul(phi_k, op.Exp(op.Sub(log_scale_k, shared)))
        state = op.Mul(state, op.Exp(op.Neg(shared)))
    sizes = (H, Hf, feature_count(feature_map, D, weight), Dv)
    return keep, phi_q, phi_k, expand_heads(v, Hkv, Hf, Dv), sizes, state, shared


def _true_units(present, shared):
    return present if shared is None else op.Mul(present, op.Exp(shared))


def linear_step_ort(q, k, v, mask, state, count, feature_map, weight, scale, eps):
    keep, phi_q, phi_k, v_f, (H, Hf, M, Dv), state_in, shared = _step_features(q, k, v, mask, state, feature_map,
                                                                              weight, scale)
    out, present = linear_attention(phi_q, phi_k, with_ones_column(v_f), state_in, H, Hf, "linear", like=q)
    return ratio_of_ones_column(out, Dv + 1, eps), _true_units(present, shared), add_real_tokens(count, keep)


def linear_step_std(q, k, v, mask, state, count, feature_map, weight, scale, eps):
    keep, phi_q, phi_k, v_f, (H, Hf, M, Dv), state_in, shared = _step_features(q, k, v, mask, state, feature_map,
                                                                              weight, scale)
    W = Dv + 1
    v1 = with_ones_column(v_f)
    carried = op.MatMul(phi_q, expand_heads(state_in, Hf, H, W))  # the earlier tokens' part
    within = causal_linear_chunks(phi_q, expand_heads(phi_k, Hf, H, M), expand_heads(v1, Hf, H, W), M, W, CHUNK)
    present = op.Add(state_in, op.MatMul(op.Transpose(phi_k, perm=[0, 1, 3, 2]), v1))
    out = ratio_of_ones_column(op.Add(carried, within), W, eps)
    return out, _true_units(present, shared), add_real_tokens(count, keep)


DECODE_LOWERING = OpLowering("attnopt::linear_step", {"ort": linear_step_ort, "onnx-std": linear_step_std})
