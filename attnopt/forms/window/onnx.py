"""ONNX lowerings of `attnopt::window_attention`: softmax over a band of W keys plus S sink tokens.

ort: com.microsoft.GroupQueryAttention with local_window_size = W (ORT counts the W keys
including self, as attnopt does; measured on ORT 1.32), but only where it computes exactly what
the op does: causal, no sinks (its `head_sink`/`smooth_softmax` is a learned logit in the
denominator, not StreamingLLM's sink tokens), head dim a multiple of 8, v's head dim equal to q's,
and no key dropped: its attention_bias would have to be a full [B, H, N, N] tensor (O(N²)), so a
site with a run-time key mask gets an If on "every key kept" that runs GQA then and the banded form
otherwise. Every other case, and onnx-std, is the banded decomposition below.

Banded decomposition (standard ops, O(N·(Bq + W + S)) time and memory, never N×N): queries in
blocks of Bq; block b reads the L = Bq + W − 1 keys (causal; Bq + 2W − 2 bidirectional) its band
can reach, gathered from the keys padded by W − 1 zeros in front; a constant [Bq, L] pattern says
which of those a query sees, and the padded/dropped keys are masked from a gathered keep mask. The
S sinks (each row's first S kept keys, found from a running count of kept keys) are scored
separately and join the same softmax, counted only where they lie outside the band.

Decode step (`attnopt::window_step`, forms/window/step.py; both targets standard ops: GQA has no
StreamingLLM sinks): the bottom of this file.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    pad_axis,
    slice_axis,
    static_dim,
    traced_graph,
    unpack_heads,
)
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import add_real_tokens, branch, new_columns_keep, one_token, past_columns, split_last


def sink_positions(keep_BN, N, S: int):
    """Positions [B, S] (int64) of each row's first S kept keys and which of them exist [B, S] (bool)."""
    kept_BN = op.CumSum(op.Cast(keep_BN, to=ir.DataType.INT64), op.Constant(value_int=1))  # kept keys up to j
    rank_11S = op.Reshape(i64(range(1, S + 1)), i64([1, S, 1]))
    before = op.Cast(op.Less(op.Unsqueeze(kept_BN, i64([1])), rank_11S), to=ir.DataType.INT64)  # [B, S, N]
    j_BS = op.ReduceSum(before, i64([2]), keepdims=0)  # first j whose running count reaches s + 1
    valid_BS = op.Less(j_BS, N)
    return op.Where(valid_BS, j_BS, i64([0])), valid_BS


def ones_keep(q):
    """A keep mask [B, N] of True (no key dropped)."""
    shape = op.Concat(op.Shape(q, start=0, end=1), dim(q, 2), axis=0)
    return op.Cast(op.Expand(i64([1]), shape), to=ir.DataType.BOOL)


def arange(n_1):
    """0 .. n − 1 (int64) for a 1-D [1] length."""
    return op.Range(op.Constant(value_int=0), op.Squeeze(n_1, i64([0])), op.Constant(value_int=1))


def banded_sums(q_BHND, k_BHND, v_BHND, keep_BN, window: int, causal: bool, sinks: int, scale: float,
                block: int, D: int, Dv: int, front=None):
    """Window softmax sums shifted by each row's window max m: (num [B, H, N, Dv], den [B, H, N, 1],
    m [B, H, N, 1], seen [B, H, N, 1] bool: the row saw a key). All heads aligned (H).

    `front` (causal only): the W − 1 columns before these, (k [B, H, W−1, D], v, keep [B, W−1] bool),
    which the first queries' bands reach into (a decode step's buffer); default: nothing before."""
    W, Bq = window, block
    left = W - 1
    L = Bq + W - 1 if causal else Bq + 2 * W - 2
    N = dim(q_BHND, 2)
    if keep_BN is None:
        keep_BN = ones_keep(q_BHND)
    qb = op.Reshape(pad_axis(q_BHND, 2, 4, Bq), i64([0, 0, -1, Bq, D]))  # [B, H, nb, Bq, D]
    nb = dim(qb, 2)
    pad_end = op.Add(op.Sub(op.Mul(nb, i64([Bq])), N), i64([L - Bq - left]))
    front_len = i64([left])
    k_front, v_front, keep_front = front if front is not None else (None, None, None)

    def padded(x, axis, rank, before=None):
        zeros = [0] * rank
        start = front_len if before is None else i64([0])
        pads = op.Concat(i64(zeros[:axis]), start, i64(zeros[axis + 1:]), i64(zeros[:axis]), pad_end,
                         i64(zeros[axis + 1:]), axis=0)
        return op.Pad(x if before is None else op.Concat(before, x, axis=axis), pads)

    block_starts = op.Mul(arange(nb), op.Constant(value_int=Bq))  # [nb]
    idx_bL = op.Add(op.Unsqueeze(block_starts, i64([1])), i64(range(L)))  # [nb, L] into the padded keys
    kb = op.Gather(padded(k_BHND, 2, 4, k_front), idx_bL, axis=2)  # [B, H, nb, L, D]
    vb = op.Gather(padded(v_BHND, 2, 4, v_front), idx_bL, axis=2)  # [B, H, nb, L, Dv]
    keep_front = None if keep_front is None else op.CastLike(keep_front, q_BHND)
    keep_b = op.Gather(padded(op.CastLike(keep_BN, q_BHND), 1, 2, keep_front), idx_bL, axis=1)  # [B, nb, L]
    r = np.arange(Bq)[:, None]
    lag = r - np.arange(L)[None, :] + left  # query position − key position
    band = (lag >= 0) & (lag < W) if causal else np.abs(lag) < W
    vis = op.And(op.Cast(op.Unsqueeze(keep_b, i64([1, 3])), to=ir.DataType.BOOL), op.Constant(value=_ir_bool(band)))

    scores = op.MatMul(op.Mul(qb, op.CastLike(f32(scale), qb)), op.Transpose(kb, perm=[0, 1, 2, 4, 3]))
    neg_inf = op.CastLike(f32(-np.inf), qb)
    masked = op.Where(vis, scores, neg_inf)  # [B, H, nb, Bq, L]
    m = op.ReduceMax(masked, i64([-1]), keepdims=1)
    if sinks:
        j_BS, valid_BS = sink_positions(keep_BN, N, sinks)
        onehot_BSN = op.CastLike(op.Equal(op.Unsqueeze(j_BS, i64([2])), arange(N)), q_BHND)
        onehot_BSN = op.Mul(onehot_BSN, op.CastLike(op.Unsqueeze(valid_BS, i64([2])), q_BHND))
        ks = op.MatMul(op.Unsqueeze(onehot_BSN, i64([1])), k_BHND)  # [B, H, S, D]
        vs = op.MatMul(op.Unsqueeze(onehot_BSN, i64([1])), v_BHND)  # [B, H, S, Dv]
        p = op.Reshape(op.Add(op.Unsqueeze(block_starts, i64([1])), i64(range(Bq))), i64([1, 1, -1, Bq, 1]))
        lag_s = op.Sub(p, op.Reshape(j_BS, i64([0, 1, 1, 1, sinks])))  # [B, 1, nb, Bq, S]
        outside = op.GreaterOrEqual(lag_s, i64([W])) if causal else op.GreaterOrEqual(op.Abs(lag_s), i64([W]))
        vis_s = op.And(outside, op.Reshape(valid_BS, i64([0, 1, 1, 1, sinks])))
        scores_s = op.MatMul(op.Mul(qb, op.CastLike(f32(scale), qb)),
                             op.Unsqueeze(op.Transpose(ks, perm=[0, 1, 3, 2]), i64([2])))  # [B, H, nb, Bq, S]
        masked_s = op.Where(vis_s, scores_s, neg_inf)
        m = op.Max(m, op.ReduceMax(masked_s, i64([-1]), keepdims=1))
    seen = op.Not(op.IsInf(m))
    m = op.Where(seen, m, op.CastLike(f32(0.0), m))
    e = op.Exp(op.Sub(masked, m))
    num = op.MatMul(e, vb)
    den = op.ReduceSum(e, i64([-1]), keepdims=1)
    if sinks:
        e_s = op.Exp(op.Sub(masked_s, m))
        num = op.Add(num, op.MatMul(e_s, op.Unsqueeze(vs, i64([2]))))
        den = op.Add(den, op.ReduceSum(e_s, i64([-1]), keepdims=1))

    def rows(x, width):
        return slice_axis(op.Reshape(x, i64([0, 0, -1, width])), 2, i64([0]), N)

    return rows(num, Dv), rows(den, 1), rows(m, 1), rows(op.Cast(seen, to=ir.DataType.BOOL), 1)


def _ir_bool(array):
    return ir.tensor(np.asarray(array, dtype=np.bool_))


def window_std(q, k, v, key_mask, window, causal, sinks, scale, block_size):
    H, Hkv, D, Dv = head_dims(q, k, v)
    num, den, _m, _seen = banded_sums(q, expand_heads(k, Hkv, H, D), expand_heads(v, Hkv, H, Dv), key_mask,
                                      window, causal, sinks, scale, block_size, D, Dv)
    # A row that sees a key has den >= 1 (its max term is e^0); one that sees none gets 0.
    return op.Div(num, op.Max(den, op.CastLike(f32(1.0), den)))


def gqa_exact(q, k, v, causal: bool, sinks: int) -> bool:
    """Whether ORT's GroupQueryAttention computes exactly this window on unpadded keys (module docstring)."""
    D, Dv = static_dim(q, 3, "D"), static_dim(v, 3, "Dv")
    same_len = q.shape is not None and k.shape is not None and q.shape[2] == k.shape[2]
    return causal and sinks == 0 and D % 8 == 0 and D == Dv and same_len


def _gqa(q, k, v, window, scale):
    H, Hkv = static_dim(q, 1, "H"), static_dim(k, 1, "Hkv")
    N32 = op.Cast(dim(q, 2), to=ir.DataType.INT32)
    B = op.Shape(q, start=0, end=1)
    seqlens_k = op.Expand(op.Sub(N32, op.Constant(value=_ir_int32(1))), B)  # total length − 1 per row
    total = op.Squeeze(N32, i64([0]))
    out, _pk, _pv = contrib_node(
        MS_DOMAIN, "GroupQueryAttention",
        [pack_heads(q), pack_heads(k), pack_heads(v), None, None, seqlens_k, total],
        {"num_heads": H, "kv_num_heads": Hkv, "local_window_size": int(window), "scale": float(scale)},
        num_outputs=3, like=q)
    return unpack_heads(out, H)


def window_ort(q, k, v, key_mask, window, causal, sinks, scale, block_size):
    if not gqa_exact(q, k, v, causal, sinks):
        return window_std(q, k, v, key_mask, window, causal, sinks, scale, block_size)
    if key_mask is None:
        return _gqa(q, k, v, window, scale)
    # Transformers models always pass a key mask, mostly all True: GQA when no key is dropped in
    # this call, the banded form when one is (GQA's attention_bias would have to be [B, H, N, N]).
    none_dropped = op.Cast(op.ReduceMin(op.Cast(key_mask, to=ir.DataType.INT32), keepdims=0), to=ir.DataType.BOOL)
    fast = traced_graph("window_gqa", lambda: _gqa(q, k, v, window, scale))
    banded = traced_graph("window_banded", lambda: window_std(q, k, v, key_mask, window, causal, sinks, scale,
                                                              block_size))
    [out] = contrib_node("", "If", [none_dropped], {"then_branch": fast, "else_branch": banded}, like=q)
    return out


def _ir_int32(x: int):
    return ir.tensor(np.asarray([x], dtype=np.int32))


LOWERING = OpLowering("attnopt::window_attention", {"ort": window_ort, "onnx-std": window_std})


# ---------------------------------------------------------------- decode step (forms/window/step.py)
#
# The state is S sink slots then the last L = W − 1 columns (oldest first), keys ‖ values in one
# buffer [B, Hkv, S + L, D + Dv], and slots [B, 1, 1 + S + L] int64: count, sink column + 1 (0 empty),
# buffer keep flags. A call's keys are the sinks (seen at columns ≤ c − W), the buffer and the new
# tokens (the band, c − W < j ≤ c): one softmax over them for one token, the banded blocks above (the
# buffer as their front) for more, so a long prefill builds nothing T × T.

STEP_BLOCK = 64


@dataclass
class WindowStep:
    """A window step's softmax sums (shifted by the row max m, 0 where nothing is seen), its present
    states, and what linear+window needs besides: the columns buffer ‖ new (k, v [B, Hkv, L + T, ·],
    keep [B, L + T]), the sinks' column + 1 after the call [B, S], and P."""

    num: object
    den: object
    m: object
    buffer: object
    slots: object
    k_all: object
    v_all: object
    keep_all: object
    sink_pos1: object
    past: object


def _state_parts(buffer, slots, S: int, L: int, D: int, Dv: int):
    sink_k, sink_v = split_last(slice_axis(buffer, 2, i64([0]), i64([S])), D, D + Dv)
    ring_k, ring_v = split_last(slice_axis(buffer, 2, i64([S]), i64([S + L])), D, D + Dv)
    row = op.Squeeze(slots, i64([1]))  # [B, 1 + S + L]
    pos1 = slice_axis(row, 1, i64([1]), i64([1 + S]))
    ring_keep = op.Greater(slice_axis(row, 1, i64([1 + S]), i64([1 + S + L])), i64([0]))
    return sink_k, sink_v, pos1, ring_k, ring_v, ring_keep, slice_axis(slots, 2, i64([0]), i64([1]))


def _new_sinks(sink_k, sink_v, pos1, k, v, keep, P, S: int):
    """The sink slots after this call: its first real tokens fill the empty ones, in order."""
    rank = op.Add(op.ReduceSum(op.Cast(op.Greater(pos1, i64([0])), to=ir.DataType.INT64), i64([1]), keepdims=1),
                  op.CumSum(op.Cast(keep, to=ir.DataType.INT64), op.Constant(value_int=1)))  # [B, T]
    is_new = op.And(keep, op.LessOrEqual(rank, i64([S])))
    onehot = op.And(op.Equal(op.Unsqueeze(op.Sub(rank, i64([1])), i64([1])), op.Reshape(i64(range(S)), i64([1, S, 1]))),
                    op.Unsqueeze(is_new, i64([1])))  # [B, S, T]: slot s takes token j
    hot = op.CastLike(onehot, k)
    filled = op.Greater(op.ReduceSum(hot, i64([2]), keepdims=0), op.CastLike(f32(0.0), k))  # [B, S]
    cols1 = op.Add(arange(dim(k, 2)), op.Add(P, i64([1])))  # column + 1 of each new token
    new_pos1 = op.ReduceSum(op.Mul(op.Cast(onehot, to=ir.DataType.INT64), op.Reshape(cols1, i64([1, 1, -1]))),
                            i64([2]), keepdims=0)
    f4 = op.Unsqueeze(filled, i64([1, 3]))
    hot4 = op.Unsqueeze(hot, i64([1]))
    return (op.Where(f4, op.MatMul(hot4, k), sink_k), op.Where(f4, op.MatMul(hot4, v), sink_v),
            op.Where(filled, new_pos1, pos1))


def _sink_scores(q_scaled, sink_k_H, pos1, col_q, W: int):
    """Scores [B, H, T, S] of the sinks, −inf where hidden (empty, or inside the query's band)."""
    p = op.Unsqueeze(pos1, i64([1, 2]))  # [B, 1, 1, S]
    reach = op.Reshape(op.Add(col_q, i64([1 - W])), i64([1, 1, -1, 1]))  # column + 1 of c − W
    visible = op.And(op.Greater(p, i64([0])), op.LessOrEqual(p, reach))
    scores = op.MatMul(q_scaled, op.Transpose(sink_k_H, perm=[0, 1, 3, 2]))
    return op.Where(visible, scores, op.CastLike(f32(-np.inf), scores))


def _one_token_sums(q_scaled, keys_H, values_H, keep_all, sink_scores, sink_v_H):
    """One query: sinks, buffer and self in one softmax (the whole buffer is in its band)."""
    scores = op.MatMul(q_scaled, op.Transpose(keys_H, perm=[0, 1, 3, 2]))  # [B, H, 1, L + 1]
    scores = op.Where(op.Unsqueeze(keep_all, i64([1, 2])), scores, op.CastLike(f32(-np.inf), scores))
    if sink_scores is not None:
        scores = op.Concat(sink_scores, scores, axis=-1)
        values_H = op.Concat(sink_v_H, values_H, axis=2)
    m = op.ReduceMax(scores, i64([-1]), keepdims=1)
    m = op.Where(op.IsInf(m), op.CastLike(f32(0.0), m), m)
    e = op.Exp(op.Sub(scores, m))
    return op.MatMul(e, values_H), op.ReduceSum(e, i64([-1]), keepdims=1), m


def _banded_step_sums(q, k_H, v_H, keep, front, sink_scores, sink_v_H, window, scale, D, Dv):
    """Several queries: the banded blocks with the buffer in front, then the sinks merged in."""
    num, den, m, seen = banded_sums(q, k_H, v_H, keep, window, True, 0, scale, STEP_BLOCK, D, Dv, front=front)
    if sink_scores is None:
        return num, den, m
    neg_inf = op.CastLike(f32(-np.inf), m)
    m_band = op.Where(seen, m, neg_inf)
    m_all = op.Max(m_band, op.ReduceMax(sink_scores, i64([-1]), keepdims=1))
    m_all = op.Where(op.IsInf(m_all), op.CastLike(f32(0.0), m_all), m_all)
    band_factor = op.Exp(op.Sub(m_band, m_all))
    e = op.Exp(op.Sub(sink_scores, m_all))
    return (op.Add(op.Mul(num, band_factor), op.MatMul(e, sink_v_H)),
            op.Add(op.Mul(den, band_factor), op.ReduceSum(e, i64([-1]), keepdims=1)), m_all)


def window_step_sums(q, k, v, mask, buffer, slots, window: int, sinks: int, scale: float) -> WindowStep:
    H, Hkv, D, Dv = head_dims(q, k, v)
    S, L = sinks, window - 1
    keep, P, T = new_columns_keep(mask, q), past_columns(mask, q), dim(q, 2)
    sink_k, sink_v, pos1, ring_k, ring_v, ring_keep, count = _state_parts(buffer, slots, S, L, D, Dv)
    k_all, v_all = op.Concat(ring_k, k, axis=2), op.Concat(ring_v, v, axis=2)
    keep_all = op.Concat(ring_keep, keep, axis=1)
    q_scaled = op.Mul(q, op.CastLike(f32(scale), q))
    sink_scores = sink_v_H = None
    if S:
        sink_k, sink_v, pos1 = _new_sinks(sink_k, sink_v, pos1, k, v, keep, P, S)
        sink_scores = _sink_scores(q_scaled, expand_heads(sink_k, Hkv, H, D), pos1, op.Add(arange(T), P), window)
        sink_v_H = expand_heads(sink_v, Hkv, H, Dv)
    k_H, v_H = expand_heads(k, Hkv, H, D), expand_heads(v, Hkv, H, Dv)
    front = (expand_heads(ring_k, Hkv, H, D), expand_heads(ring_v, Hkv, H, Dv), ring_keep)
    num, den, m = branch(
        one_token(q),
        lambda: _one_token_sums(q_scaled, expand_heads(k_all, Hkv, H, D), expand_heads(v_all, Hkv, H, Dv), keep_all,
                                sink_scores, sink_v_H),
        lambda: _banded_step_sums(q, k_H, v_H, keep, front, sink_scores, sink_v_H, window, scale, D, Dv),
        num_outputs=3, like=q, name="window_step")
    ring_k2, ring_v2 = slice_axis(k_all, 2, T, op.Add(T, i64([L]))), slice_axis(v_all, 2, T, op.Add(T, i64([L])))
    ring_keep2 = op.Cast(slice_axis(keep_all, 1, T, op.Add(T, i64([L]))), to=ir.DataType.INT64)
    parts = [op.Concat(sink_k, sink_v, axis=-1)] if S else []
    present = op.Concat(*parts, op.Concat(ring_k2, ring_v2, axis=-1), axis=2) if parts else \
        op.Concat(ring_k2, ring_v2, axis=-1)
    slot_parts = [add_real_tokens(count, keep)] + ([op.Unsqueeze(pos1, i64([1]))] if S else []) + \
        [op.Unsqueeze(ring_keep2, i64([1]))]
    return WindowStep(num, den, m, present, op.Concat(*slot_parts, axis=2), k_all, v_all, keep_all,
                      pos1 if S else None, P)


def holds_sink(sink_pos1_BS, cols1_T):
    """Bool [B, T]: column cols1 − 1 is one of the row's sinks (sink_pos1: each sink's column + 1 after
    the call, 0 empty; cols1 [T] int64 the columns + 1 asked about)."""
    hit = op.Equal(op.Reshape(cols1_T, i64([1, -1, 1])), op.Unsqueeze(sink_pos1_BS, i64([1])))  # [B, T, S]
    return op.Greater(op.ReduceSum(op.Cast(hit, to=ir.DataType.INT64), i64([2]), keepdims=0), i64([0]))


def window_step(q, k, v, mask, buffer, slots, window, sinks, scale):
    s = window_step_sums(q, k, v, mask, buffer, slots, window, sinks, scale)
    return op.Div(s.num, op.Max(s.den, op.CastLike(f32(1.0), s.den))), s.buffer, s.slots


DECODE_LOWERING = OpLowering("attnopt::window_step", {"ort": window_step, "onnx-std": window_step})
