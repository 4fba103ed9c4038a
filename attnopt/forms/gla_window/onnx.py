"""ONNX lowerings of `attnopt::gla_window_attention`: window softmax + gated state beyond it, one normaliser.

The window part is window.onnx's banded decomposition (queries in blocks against a gathered band
of Bq + W − 1 keys, plus the sinks; sums shifted by each row's window max m), on both targets. The
gated part is the reference op's construction in standard ops -- gates zeroed where a key is
dropped, each key pre-decayed by the W gates it crosses inside the band (block-local cumsums, as
the torch op: sums of at most W gates), sinks and dropped keys zeroed, keys and [v, 1] shifted W
places to the right -- then, on `ort`, com.microsoft.LinearAttention(update_rule="gated", log-space
decay per channel or per head, scale 1; FINDINGS.md §1), on `onnx-std` gla.onnx's token Scan.
Combined as linear+window's lowering does: num_W + β e^{−m} num_L over den_W + β e^{−m} den_L (a
row with an empty window uses factor 1: it is common to both sums). O(N·(Bq + W + S)·D + N·M·Dv).

Decode step (`attnopt::gla_window_step`, forms/gla_window/step.py): the window form's step sums
(window/onnx.py) plus the gated sums, combined as above. Of the columns buffer ‖ new (L = W − 1 slots,
then the T new tokens) the first T leave the buffer during the call, query i after the i before it.
On that column sequence, with the buffer's gates 0 (its features arrive decayed to the last column
absorbed), each column's features are pre-decayed by the W gates after it (`window_gate_sums`: sums
of at most W gates); the leaving ones, shifted one step, run the gated recurrence from the carried
state with the new tokens' gates (ort: LinearAttention with past_state; onnx-std: gla.onnx's Scan),
and the last leaving column joins the present state. The remaining L columns, so decayed, are the
present buffer features (a sink or a pad: 0). O(T·(S + W)·D + (T + W)·M·Dv) per kv head.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.forms.gla.onnx import gated_scan, gates_4d, packed_decay
from attnopt.forms.window.onnx import arange, banded_sums, holds_sink, ones_keep, window_step_sums
from attnopt.forms.window.reference import default_window_block_size
from attnopt.kernels.onnx.functions import (
    MS_DOMAIN,
    causal_prefill_dims,
    contrib_node,
    dim,
    expand_heads,
    f32,
    i64,
    keep_BN1,
    pack_heads,
    pad_axis,
    slice_axis,
    static_dim,
    unpack_heads,
    with_ones_column,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import linear_attention, new_columns_keep


def window_gate_sums(g_BHkvNG, window: int, Mg: int):
    """Σ_{j<t<=j+W} g_t per key (gates past the end count 0), from cumsums inside blocks of W."""
    W = window
    N = dim(g_BHkvNG, 2)
    g = op.Pad(pad_axis(g_BHkvNG, 2, 4, W), i64([0, 0, 0, 0, 0, 0, W, 0]))  # one extra block of zeros
    blocks = op.Reshape(g, i64([0, 0, -1, W, Mg]))  # [B, Hkv, nb, W, Mg]
    cs = op.CumSum(blocks, op.Constant(value_int=3))
    last = slice_axis(cs, 3, i64([W - 1]), i64([W]))
    nxt = op.Pad(slice_axis(cs, 2, i64([1]), i64([2 ** 62])), i64([0, 0, 0, 0, 0, 0, 0, 1, 0, 0]))
    sums = op.Add(op.Sub(last, cs), nxt)
    return slice_axis(op.Reshape(sums, i64([0, 0, -1, Mg])), 2, i64([0]), N)


def shift_right(x_BHNX, n: int):
    """Keys moved n places later (zeros in front, the last n dropped)."""
    return slice_axis(op.Pad(x_BHNX, i64([0, 0, n, 0, 0, 0, 0, 0])), 2, i64([0]), dim(x_BHNX, 2))


def _gated_inputs(q, phi_k, v, g, keep, sinks: int, window: int, M: int):
    """φ(k) pre-decayed, zeroed at sinks and dropped keys, and [v, 1], both shifted W to the right;
    the gates (0 at dropped keys) [B, Hkv, N, Mg] and whether they are per channel."""
    g4, per_channel = gates_4d(g, q)
    keep1 = keep_BN1(keep, q)
    g4 = op.Mul(g4, keep1)
    lin_keep = keep
    if sinks:  # each row's first S kept keys are sinks: window keys, never gated ones
        kept_BN = op.CumSum(op.Cast(keep, to=ir.DataType.INT64), op.Constant(value_int=1))
        lin_keep = op.And(keep, op.Greater(kept_BN, i64([sinks])))
    lin1 = keep_BN1(lin_keep, q)
    pre = op.Exp(window_gate_sums(g4, window, M if per_channel else 1))
    fk = op.Mul(op.Mul(op.CastLike(phi_k, q), lin1), pre)
    v1 = op.Mul(with_ones_column(v), lin1)
    return shift_right(fk, window), shift_right(v1, window), g4, per_channel


def one_normaliser(num, den, log_factor, lin, beta, H: int, Dv: int, like):
    """(num_W + β e^{log_factor} num_L) / (den_W + β e^{log_factor} den_L), 0 where both are empty; the
    window sums are shifted by the row's max m (log_factor −m), lin [B, H, N, Dv + 1] is [num_L, den_L]."""
    factor = op.Mul(op.Reshape(op.CastLike(beta, like), i64([1, H, 1, 1])), op.Exp(log_factor))
    num = op.Add(num, op.Mul(factor, slice_axis(lin, 3, i64([0]), i64([Dv]))))
    den = op.Add(den, op.Mul(factor, slice_axis(lin, 3, i64([Dv]), i64([Dv + 1]))))
    positive = op.Greater(den, op.CastLike(f32(0.0), den))
    return op.Div(num, op.Where(positive, den, op.CastLike(f32(1.0), den)))


def _lowering(contrib: bool):
    def lower(q, k, v, phi_q, phi_k, g, beta, key_mask, window, sinks, scale, chunk_size):
        H, Hkv, D, Dv = causal_prefill_dims(q, k, v, "gla+window")
        M = static_dim(phi_k, 3, "feature count")
        keep = ones_keep(q) if key_mask is None else key_mask
        num, den, m, seen = banded_sums(q, expand_heads(k, Hkv, H, D), expand_heads(v, Hkv, H, Dv), keep, window,
                                        True, sinks, scale, default_window_block_size(window, True), D, Dv)
        fk, v1, g4, per_channel = _gated_inputs(q, phi_k, v, g, keep, sinks, window, M)
        phi_q = op.CastLike(phi_q, q)
        if contrib:
            lin, _state = contrib_node(
                MS_DOMAIN, "LinearAttention", [pack_heads(phi_q), pack_heads(fk), pack_heads(v1), None,
                                               packed_decay(g4, per_channel)],
                {"q_num_heads": H, "kv_num_heads": Hkv, "update_rule": "gated", "scale": 1.0}, num_outputs=2, like=q)
            lin = unpack_heads(lin, H)
        else:
            lin = gated_scan(phi_q, fk, v1, g4, H, Hkv, M, Dv + 1, q)
        log_factor = op.Where(seen, op.Neg(m), op.CastLike(f32(0.0), m))  # empty window: a common factor, use 1
        return one_normaliser(num, den, log_factor, lin, beta, H, Dv, q)

    return lower


gla_window_ort = _lowering(contrib=True)
gla_window_std = _lowering(contrib=False)

LOWERING = OpLowering("attnopt::gla_window_attention", {"ort": gla_window_ort, "onnx-std": gla_window_std})


# ---------------------------------------------------------------- decode step (forms/gla_window/step.py)


def _step_lowering(contrib: bool):
    def lower(q, k, v, phi_q, phi_k, g, mask, buffer, slots, gated, gated_keys, beta, window, sinks, scale):
        H, Hkv, Dv = static_dim(q, 1, "H"), static_dim(k, 1, "Hkv"), static_dim(v, 3, "Dv")
        M = static_dim(phi_k, 3, "feature count")
        L = window - 1
        s = window_step_sums(q, k, v, mask, buffer, slots, window, sinks, scale)
        T = dim(q, 2)
        keep = new_columns_keep(mask, q)
        g4, per_channel = gates_4d(g, q)
        g4 = op.Mul(g4, keep_BN1(keep, q))  # a dropped token neither adds nor decays
        Mg = M if per_channel else 1
        take = keep  # the new tokens that join the gated part later: kept, and not a sink
        if sinks:
            take = op.And(keep, op.Not(holds_sink(s.sink_pos1, op.Add(arange(T), op.Add(s.past, i64([1]))))))
        f_all = op.Concat(op.CastLike(gated_keys, q), op.Mul(op.CastLike(phi_k, q), keep_BN1(take, q)), axis=2)
        zeros_L = op.Expand(op.CastLike(f32(0.0), q), op.Concat(op.Shape(g4, start=0, end=2), i64([L, Mg]), axis=0))
        g_all = op.Concat(zeros_L, g4, axis=2)  # [B, Hkv, L + T, Mg]: the buffer's decay is already applied
        f_all = op.Mul(f_all, op.Exp(window_gate_sums(g_all, window, Mg)))
        v1_all = with_ones_column(op.CastLike(s.v_all, q))  # [B, Hkv, L + T, Dv + 1]
        f_out, v_out = slice_axis(f_all, 2, i64([0]), T), slice_axis(v1_all, 2, i64([0]), T)
        f_in, v_in = shift_right(f_out, 1), shift_right(v_out, 1)  # query i reads the columns leaving before it
        phi_q = op.CastLike(phi_q, q)
        past = op.CastLike(gated, q)
        if contrib:
            lin, final = linear_attention(phi_q, f_in, v_in, past, H, Hkv, "gated", like=q,
                                          log_decay=packed_decay(g4, per_channel))
        else:
            lin, final = gated_scan(phi_q, f_in, v_in, g4, H, Hkv, M, Dv + 1, q, initial=past)
        last = op.Sub(T, i64([1]))
        present = op.Add(final, op.MatMul(op.Transpose(slice_axis(f_out, 2, last, T), perm=[0, 1, 3, 2]),
                                          slice_axis(v_out, 2, last, T)))
        present_keys = slice_axis(f_all, 2, T, op.Add(T, i64([L])))
        out = one_normaliser(s.num, s.den, op.Neg(s.m), lin, beta, H, Dv, q)  # m is 0 where nothing is seen
        return out, s.buffer, s.slots, op.CastLike(present, gated), op.CastLike(present_keys, gated_keys)

    return lower


gla_window_step_ort = _step_lowering(contrib=True)
gla_window_step_std = _step_lowering(contrib=False)

DECODE_LOWERING = OpLowering("attnopt::gla_window_step", {"ort": gla_window_step_ort,
                                                          "onnx-std": gla_window_step_std})
