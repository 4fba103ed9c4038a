"""ONNX lowerings of `attnopt::gated_delta_attention`: S_t = exp(g_t)(I − β_t k_t k_tᵀ)S_{t−1} + β_t k_t v_tᵀ.

ort: com.microsoft.LinearAttention with update_rule="gated_delta": the op decays first and reads the
delta from the decayed state, S ← e^g S;  S ← S + β k (v − Sᵀk)ᵀ, which is this recurrence; the decay
goes in as log-space g [B, N, Hkv], β raw [B, N, Hkv] (the kernel applies no sigmoid), the scale
folded into q (attribute scale = 1, never 0, which would mean 1/√D). The op has no mask input: a
dropped key gets k = 0, g = 0 and β = 0, an exact no-op (/work/research/onnx/FINDINGS.md §1, ORT 1.32).
GQA without repeating K/V.

onnx-std: a Scan over the tokens carrying S [B, Hkv, D, Dv] (`gla.onnx.token_scan`): per token
S ← a S, S ← S + k (β (v − kᵀS)), o = s qᵀS. O(N·D·Dv) work and one state, never N×N; the chunked
WY form needs a triangular solve that standard ONNX has no op for.
"""

from __future__ import annotations

from onnxscript import opset18 as op

from attnopt.forms.gla.onnx import token_scan, zero_state
from attnopt.kernels.onnx.functions import (
    MS_DOMAIN,
    causal_prefill_dims,
    contrib_node,
    f32,
    i64,
    keep_BN1,
    pack_heads,
    unpack_heads,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import new_columns_keep


def _inputs(q, k, v, g, beta, key_mask, scale):
    """s·q, and k, g, β zeroed where a key is dropped."""
    H, Hkv, D, Dv = causal_prefill_dims(q, k, v, "delta")
    qs = op.Mul(q, op.CastLike(f32(scale), q))
    g, beta = op.CastLike(g, q), op.CastLike(beta, q)
    if key_mask is not None:
        keep = keep_BN1(key_mask, k)  # [B, 1, N, 1]
        k = op.Mul(k, keep)
        keep_BHN = op.Squeeze(keep, i64([3]))
        g, beta = op.Mul(g, keep_BHN), op.Mul(beta, keep_BHN)
    return qs, k, g, beta, (H, Hkv, D, Dv)


def delta_ort(q, k, v, g, beta, key_mask, scale, chunk_size):
    qs, k, g, beta, (H, Hkv, D, Dv) = _inputs(q, k, v, g, beta, key_mask, scale)
    out, _state = contrib_node(
        MS_DOMAIN, "LinearAttention",
        [pack_heads(qs), pack_heads(k), pack_heads(v), None, op.Transpose(g, perm=[0, 2, 1]),
         op.Transpose(beta, perm=[0, 2, 1])],
        {"q_num_heads": H, "kv_num_heads": Hkv, "update_rule": "gated_delta", "scale": 1.0}, num_outputs=2, like=q)
    return unpack_heads(out, H)


def delta_std(q, k, v, g, beta, key_mask, scale, chunk_size):
    qs, k, g, beta, (H, Hkv, D, Dv) = _inputs(q, k, v, g, beta, key_mask, scale)
    return _delta_scan(qs, k, v, g, beta, H, Hkv, D, Dv, q)


def _delta_scan(qs, k, v, g, beta, H: int, Hkv: int, D: int, Dv: int, like, initial=None):
    """The delta rule over the tokens by a Scan, from zeros or from `initial` [B, Hkv, D, Dv] (then
    (out, final state))."""
    q = like
    G = H // Hkv
    q_t = op.Transpose(op.Reshape(qs, i64([0, Hkv, G, -1, D])), perm=[3, 0, 1, 2, 4])  # [N, B, Hkv, G, D]
    k_row = op.Transpose(op.Unsqueeze(k, i64([3])), perm=[2, 0, 1, 3, 4])  # [N, B, Hkv, 1, D]
    k_col = op.Transpose(op.Unsqueeze(k, i64([4])), perm=[2, 0, 1, 3, 4])  # [N, B, Hkv, D, 1]
    v_t = op.Transpose(op.Unsqueeze(v, i64([3])), perm=[2, 0, 1, 3, 4])  # [N, B, Hkv, 1, Dv]
    a_t = op.Transpose(op.Unsqueeze(op.Exp(g), i64([3, 4])), perm=[2, 0, 1, 3, 4])  # [N, B, Hkv, 1, 1]
    b_t = op.Transpose(op.Unsqueeze(beta, i64([3, 4])), perm=[2, 0, 1, 3, 4])

    def step(body, S, qt, kr, kc, vt, at, bt):
        S = body("Mul", at, S)
        written = body("Mul", bt, body("Sub", vt, body("MatMul", kr, S)))  # β (v − kᵀS)  [B, Hkv, 1, Dv]
        S = body("Add", S, body("MatMul", kc, written))
        return S, body("MatMul", qt, S)

    state0 = zero_state(k, D, Dv, q) if initial is None else initial
    final, ys = token_scan("delta_scan", state0, [q_t, k_row, k_col, v_t, a_t, b_t], step, q, with_final=True)
    out = op.Reshape(op.Transpose(ys, perm=[1, 2, 3, 0, 4]), i64([0, H, -1, Dv]))
    return out if initial is None else (out, final)


LOWERING = OpLowering("attnopt::gated_delta_attention", {"ort": delta_ort, "onnx-std": delta_std})


# Decode step (`attnopt::delta_step`, forms/delta/step.py): q̂ (scale on it), k̂, g and β arrive
# computed, the short convolution and its conv_state having run before in plain ops; the carried
# S [B, Hkv, M, Dv] is LinearAttention's past_state (ort) or the Scan's initial state (onnx-std).
# A pad has k̂ = 0, g = 0, β = 0: an exact no-op.


def delta_step_ort(q, k, v, g, beta, mask, state):
    keep = new_columns_keep(mask, q)
    qs, k, g, beta, (H, Hkv, D, Dv) = _inputs(q, k, v, g, beta, keep, 1.0)
    out, present = contrib_node(
        MS_DOMAIN, "LinearAttention",
        [pack_heads(qs), pack_heads(k), pack_heads(v), op.CastLike(state, q), op.Transpose(g, perm=[0, 2, 1]),
         op.Transpose(beta, perm=[0, 2, 1])],
        {"q_num_heads": H, "kv_num_heads": Hkv, "update_rule": "gated_delta", "scale": 1.0}, num_outputs=2, like=q)
    return unpack_heads(out, H), op.CastLike(present, state)


def delta_step_std(q, k, v, g, beta, mask, state):
    keep = new_columns_keep(mask, q)
    qs, k, g, beta, (H, Hkv, D, Dv) = _inputs(q, k, v, g, beta, keep, 1.0)
    out, present = _delta_scan(qs, k, v, g, beta, H, Hkv, D, Dv, q, initial=op.CastLike(state, q))
    return out, op.CastLike(present, state)


DECODE_LOWERING = OpLowering("attnopt::delta_step", {"ort": delta_step_ort, "onnx-std": delta_step_std})
