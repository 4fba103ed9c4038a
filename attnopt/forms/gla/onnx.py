"""ONNX lowerings of `attnopt::gated_linear_attention`: S_t = diag(exp g_t) S_{t−1} + φ(k_t) v_tᵀ.

ort: com.microsoft.LinearAttention with update_rule="gated" (always set: the op's default is
gated_delta) and scale 1, fed φ(q) (times s when not normalising), φ(k) and v, or [v, 1] so the
one output carries the normaliser φ(q)ᵀz; the log-gates go in as the op's log-space decay, [B, N,
Hkv·M] per channel (row m of the state scaled by exp g_m) or [B, N, Hkv] per head, verified on ORT
1.32 (/work/research/onnx/FINDINGS.md §1). The contrib op has no mask input: a dropped key gets
φ(k) = 0 and log-gate 0, which leaves the state exactly unchanged, as the torch op does. GQA
without repeating K/V (q_num_heads = H, kv_num_heads = Hkv).

onnx-std: a Scan over the tokens carrying the [B, Hkv, M, W] state (S_t = a_t ⊙ S_{t−1} + φ(k_t)
v_tᵀ, o_t = φ(q_t)ᵀS_t, the G query heads of a kv head read it together): O(N·M·W) work and one
state of memory, never N×N; a chunked form would be faster in ORT, the Scan is the one that is
exact for any gates in standard ops. `token_scan` builds the Scan for the delta form too.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.kernels.onnx.functions import (
    MS_DOMAIN,
    causal_prefill_dims,
    contrib_node,
    f32,
    features,
    i64,
    keep_BN1,
    pack_heads,
    ratio_of_ones_column,
    unpack_heads,
    with_ones_column,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import (
    add_real_tokens,
    linear_attention,
    new_columns_keep,
)


class ScanBody:
    """Records the nodes of a Scan body (standard ops, one output each, all in one dtype)."""

    def __init__(self, dtype):
        self.dtype, self.nodes = dtype, []

    def value(self, name: str):
        return ir.Value(name=name, type=ir.TensorType(self.dtype))

    def __call__(self, op_type: str, *inputs):
        node = ir.Node("", op_type, list(inputs), num_outputs=1)
        node.outputs[0].type = ir.TensorType(self.dtype)
        self.nodes.append(node)
        return node.outputs[0]


def token_scan(name: str, state0, scanned: list, step, like, with_final: bool = False):
    """Scan over axis 0 of every value in `scanned` ([N, ...], the reference evaluator's only axis),
    carrying one state from `state0`; `step(body, state, *x_t)` returns (new state, output of step t).
    Returns the outputs stacked, [N, ...] (and first the final state, with_final: a decode step's
    present). `like` is a graph input of the compute dtype."""
    body = ScanBody(like.dtype)
    s_in = body.value(f"{name}_state_in")
    xs = [body.value(f"{name}_x{i}") for i in range(len(scanned))]
    s_out, y = step(body, s_in, *xs)
    s_out = body("Identity", s_out)
    y = body("Identity", y)
    s_out.name, y.name = f"{name}_state_out", f"{name}_out"
    graph = ir.Graph([s_in, *xs], [s_out, y], nodes=body.nodes, name=name)
    final, ys = contrib_node("", "Scan", [state0, *scanned], {"body": graph, "num_scan_inputs": len(scanned)},
                             num_outputs=2, like=like)
    return (final, ys) if with_final else ys


def zero_state(k_BHkvNX, rows: int, cols: int, like):
    """Zeros [B, Hkv, rows, cols] in like's dtype."""
    shape = op.Concat(op.Shape(k_BHkvNX, start=0, end=2), i64([rows, cols]), axis=0)
    return op.Expand(op.CastLike(f32(np.zeros((1, 1, 1, 1))), like), shape)


def gated_scan(phi_q_BHNM, phi_k_BHkvNM, v_BHkvNW, g_BHkvNG, H: int, Hkv: int, M: int, W: int, like, initial=None):
    """o_t = φ(q_t)ᵀ S_t with S_t = diag(exp g_t) S_{t−1} + φ(k_t) v_tᵀ, [B, H, N, W] (heads h = hk·G + i),
    from S_0 = 0, or from `initial` [B, Hkv, M, W] (a decode step: then (out, final state));
    `like` a graph input of the compute dtype."""
    G = H // Hkv
    q_t = op.Transpose(op.Reshape(phi_q_BHNM, i64([0, Hkv, G, -1, M])), perm=[3, 0, 1, 2, 4])  # [N, B, Hkv, G, M]
    k_t = op.Transpose(op.Unsqueeze(phi_k_BHkvNM, i64([4])), perm=[2, 0, 1, 3, 4])  # [N, B, Hkv, M, 1]
    v_t = op.Transpose(op.Unsqueeze(v_BHkvNW, i64([3])), perm=[2, 0, 1, 3, 4])  # [N, B, Hkv, 1, W]
    a_t = op.Transpose(op.Unsqueeze(op.Exp(g_BHkvNG), i64([4])), perm=[2, 0, 1, 3, 4])  # [N, B, Hkv, Mg, 1]

    def step(body, S, q, k, v, a):
        S = body("Add", body("Mul", a, S), body("MatMul", k, v))
        return S, body("MatMul", q, S)

    state0 = zero_state(phi_k_BHkvNM, M, W, like) if initial is None else initial
    final, ys = token_scan("gated_scan", state0, [q_t, k_t, v_t, a_t], step, like, with_final=True)
    out = op.Reshape(op.Transpose(ys, perm=[1, 2, 3, 0, 4]), i64([0, H, -1, W]))  # [B, H, N, W]
    return out if initial is None else (out, final)


def gates_4d(g, like):
    """[B, Hkv, N, M] or [B, Hkv, N] (a graph input: its rank is known) -> [B, Hkv, N, Mg] in like's
    dtype, and whether it is per channel."""
    per_channel = g.shape is not None and len(g.shape) == 4
    g = op.CastLike(g, like)
    return (g if per_channel else op.Unsqueeze(g, i64([3]))), per_channel


def packed_decay(g4, per_channel: bool):
    """The log-gates as LinearAttention's decay: [B, N, Hkv·M] per channel, [B, N, Hkv] per head."""
    if per_channel:
        return op.Reshape(op.Transpose(g4, perm=[0, 2, 1, 3]), i64([0, 0, -1]))
    return op.Transpose(op.Squeeze(g4, i64([3])), perm=[0, 2, 1])


def _inputs(q, k, v, g, key_mask, feature_map, normalize, scale):
    """φ(q) (scaled unless normalised), φ(k) and the gates (0 where a key is dropped), v or [v, 1]."""
    H, Hkv, D, Dv = causal_prefill_dims(q, k, v, "gla")
    phi_q = features(feature_map, q, scale, None, D)
    if not normalize:
        phi_q = op.Mul(phi_q, op.CastLike(f32(scale), phi_q))
    phi_k = features(feature_map, k, scale, None, D)
    g4, per_channel = gates_4d(g, phi_q)
    if key_mask is not None:  # a dropped key neither adds nor decays
        keep = keep_BN1(key_mask, phi_k)
        phi_k, g4 = op.Mul(phi_k, keep), op.Mul(g4, keep)
    v_in = with_ones_column(v) if normalize else v
    return phi_q, phi_k, v_in, g4, per_channel, (H, Hkv, D, Dv + 1 if normalize else Dv)


def gla_ort(q, k, v, g, key_mask, feature_map, normalize, scale, eps, chunk_size):
    phi_q, phi_k, v_in, g4, per_channel, (H, Hkv, M, W) = _inputs(q, k, v, g, key_mask, feature_map, normalize, scale)
    out, _state = contrib_node(
        MS_DOMAIN, "LinearAttention",
        [pack_heads(phi_q), pack_heads(phi_k), pack_heads(v_in), None, packed_decay(g4, per_channel)],
        {"q_num_heads": H, "kv_num_heads": Hkv, "update_rule": "gated", "scale": 1.0}, num_outputs=2, like=q)
    out = unpack_heads(out, H)
    return ratio_of_ones_column(out, W, eps) if normalize else out


def gla_std(q, k, v, g, key_mask, feature_map, normalize, scale, eps, chunk_size):
    phi_q, phi_k, v_in, g4, _per_channel, (H, Hkv, M, W) = _inputs(q, k, v, g, key_mask, feature_map, normalize, scale)
    out = gated_scan(phi_q, phi_k, v_in, g4, H, Hkv, M, W, q)
    return ratio_of_ones_column(out, W, eps) if normalize else out


LOWERING = OpLowering("attnopt::gated_linear_attention", {"ort": gla_ort, "onnx-std": gla_std})


# Decode step (`attnopt::gla_step`, forms/gla/step.py): φ and the gates arrive computed; the carried
# state [B, Hkv, M, W] is LinearAttention's past_state (ort) or the Scan's initial state (onnx-std),
# and the present is the op's / the Scan's final state. A pad has φ(k) = 0 and g = 0: a no-op.


def _step_inputs(phi_q, phi_k, v, g, mask, state, normalize):
    keep = new_columns_keep(mask, phi_q)
    phi_q, phi_k, v_in, g4, per_channel, sizes = _inputs(phi_q, phi_k, v, g, keep, "identity", normalize, 1.0)
    return keep, phi_q, phi_k, v_in, g4, per_channel, sizes, op.CastLike(state, phi_q)


def gla_step_ort(phi_q, phi_k, v, g, mask, state, count, normalize, eps):
    keep, phi_q, phi_k, v_in, g4, per_channel, (H, Hkv, M, W), past = _step_inputs(phi_q, phi_k, v, g, mask, state,
                                                                                  normalize)
    out, present = linear_attention(phi_q, phi_k, v_in, past, H, Hkv, "gated", like=phi_q,
                                    log_decay=packed_decay(g4, per_channel))
    out = ratio_of_ones_column(out, W, eps) if normalize else out
    return out, op.CastLike(present, state), add_real_tokens(count, keep)


def gla_step_std(phi_q, phi_k, v, g, mask, state, count, normalize, eps):
    keep, phi_q, phi_k, v_in, g4, _per_channel, (H, Hkv, M, W), past = _step_inputs(phi_q, phi_k, v, g, mask, state,
                                                                                   normalize)
    out, present = gated_scan(phi_q, phi_k, v_in, g4, H, Hkv, M, W, phi_q, initial=past)
    out = ratio_of_ones_column(out, W, eps) if normalize else out
    return out, op.CastLike(present, state), add_real_tokens(count, keep)


DECODE_LOWERING = OpLowering("attnopt::gla_step", {"ort": gla_step_ort, "onnx-std": gla_step_std})
