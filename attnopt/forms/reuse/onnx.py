"""The reuse form in standard ONNX ops (both targets): the anchor's block choice and the
block-sparse softmax, by gathers.

A prefill (`attnopt::reuse_attention`, prefill.py; the form's LOWERING, one node per site):
selection._prefill in standard ops (each row's positions from its first real token, the anchor's
key bounds per block, the probes' mass, TopK for the choice), then `tiled_softmax`: each query
block gathers its K listed key blocks once and its b queries score them, O(N·K·b) work and memory,
as the torch op's tiles.

Decoding (`attnopt::reuse_step`, step.py): selection.select_span in the same ops, inside an If that
only a call starting a block takes, then, in a second If, one of two softmaxes over the site's own
K/V cache. A call of at least a block of tokens (a prompt, a chunk of one) takes `tiled_softmax`
over every position. A shorter one (a step) takes `gathered_softmax`: each query's K·b key columns
(offset + block·b + slot) gathered per row (GatherND, batch_dims 1), scored against the query alone
and masked (empty slot, column past the keys, padding, causality, a query before its row's offset),
O(T·K·b·D) memory, which a long prompt could not afford (4k tokens: 12.5 s and 4.9 GB in ORT against
0.5 s and 1.2 GB tiled). `attnopt::block_sparse_attention` lowers to it too (BLOCK_SPARSE_LOWERING).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.forms.reuse.selection import BlockRule
from attnopt.kernels.onnx.functions import dim, f32, i64, pad_axis, static_dim
from attnopt.kernels.onnx.lowering import OpLowering
from attnopt.kernels.onnx.steps import arange, branch


def gathered_softmax(q, k, v, blocks, block: int, causal: bool, scale: float, key_mask, offsets, static=None,
                     K=None):
    """The op's definition in standard ops: q [B, H, Nq, D] over each query's listed blocks of
    k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]; blocks [B, Nq, K] int64; key_mask [B, Nk] bool or None;
    offsets [B] int64 or None. Returns [B, H, Nq, Dv]. static: (Hkv, D, Dv) where k and v are values
    made in the graph (their shapes unknown to the exporter); K likewise for blocks."""
    H = static_dim(q, 1, "H")
    Hkv, D, Dv = static or (static_dim(k, 1, "Hkv"), static_dim(q, 3, "D"), static_dim(v, 3, "Dv"))
    K = K or static_dim(blocks, 2, "list slots")
    G = H // Hkv
    Nq, Nk = dim(q, 2), dim(k, 2)
    off = i64([0]) if offsets is None else op.Unsqueeze(offsets, i64([1, 2]))  # [B, 1, 1]
    slot = op.Unsqueeze(arange(i64([block])), i64([0, 1, 2]))  # [1, 1, 1, b]
    ids = op.Unsqueeze(op.Cast(blocks, to=ir.DataType.INT64), i64([3]))  # [B, Nq, K, 1]
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


BLOCK_SPARSE_LOWERING = OpLowering("attnopt::block_sparse_attention", {"ort": block_sparse_std,
                                                                        "onnx-std": block_sparse_std})


# ---------------------------------------------------------------- the decode step (forms/reuse/step.py)


def _bool(x):
    return op.Cast(x, to=ir.DataType.BOOL)


def _i64(x):
    return op.Cast(x, to=ir.DataType.INT64)


def _gather_columns(x_BHND, cols_BN, H: int, D: int):
    """x[b, :, cols[b, n], :]: [B, H, N, D] rows taken per batch row."""
    c4 = op.Reshape(cols_BN, i64([0, 1, -1, 1]))
    return op.GatherElements(x_BHND, op.Expand(c4, op.Concat(op.Shape(c4, start=0, end=1), i64([H]),
                                                             op.Shape(c4, start=2, end=3), i64([D]), axis=0)), axis=2)


def position_columns(offset_B, keep_BN, N):
    """Each row's positions (from its first real token, offset_B columns in) as columns: (the column of
    each position [B, N]; the same clipped to the last column; whether the position holds a real
    token, false past the row's end)."""
    cols = op.Add(op.Unsqueeze(offset_B, i64([1])), op.Unsqueeze(arange(N), i64([0])))
    colc = op.Min(cols, op.Sub(N, i64([1])))
    return cols, colc, op.And(op.GatherElements(keep_BN, colc, axis=1), op.Less(cols, N))


def key_bounds(k_BHND, keep_BN, block: int, Hk: int, Dk: int):
    """selection.key_bounds in standard ops: (min, max [B, Hk, J, Dk], has_key [B, J] bool)."""
    k = pad_axis(k_BHND, 2, 4, block)
    real = _bool(pad_axis(op.Cast(keep_BN, to=ir.DataType.INT64), 1, 2, block))
    k5 = op.Reshape(k, op.Concat(i64([0, Hk, -1, block, Dk]), axis=0))
    real5 = op.Reshape(real, i64([0, 1, -1, block, 1]))
    lo = op.ReduceMin(op.Where(real5, k5, op.CastLike(f32(np.inf), k5)), i64([3]), keepdims=0)
    hi = op.ReduceMax(op.Where(real5, k5, op.CastLike(f32(-np.inf), k5)), i64([3]), keepdims=0)
    has_key = _bool(op.ReduceMax(_i64(op.Reshape(real, i64([0, -1, block]))), i64([2]), keepdims=0))
    ok = op.Unsqueeze(has_key, i64([1, 3]))
    zero = op.CastLike(f32(0.0), lo)
    return op.Where(ok, lo, zero), op.Where(ok, hi, zero), has_key


def bound_mass(q_BHCPD, present_BCP, lo, hi, visible_BCJ, scale: float, H: int, Hk: int, Dk: int):
    """selection.bound_mass in standard ops: [B, C, J] double."""
    G = H // Hk
    q = op.Reshape(op.Mul(q_BHCPD, op.CastLike(f32(scale), q_BHCPD)), op.Concat(i64([0, Hk, -1, Dk]), axis=0))
    zero = op.CastLike(f32(0.0), q)
    u = op.Add(op.MatMul(op.Max(q, zero), op.Transpose(hi, perm=[0, 1, 3, 2])),
               op.MatMul(op.Min(q, zero), op.Transpose(lo, perm=[0, 1, 3, 2])))
    shape = op.Concat(i64([0, Hk, G]), op.Shape(present_BCP, start=1, end=3), op.Shape(lo, start=2, end=3), axis=0)
    u = op.Reshape(u, shape)  # [B, Hk, G, C, P, J]
    visible = op.Unsqueeze(visible_BCJ, i64([1, 2, 4]))
    w = op.Softmax(op.Where(visible, u, op.CastLike(f32(-np.inf), u)), axis=-1)
    w = op.Where(op.IsNaN(w), op.CastLike(f32(0.0), w), w)  # a probe that sees no block adds nothing
    w = op.Mul(w, op.CastLike(op.Unsqueeze(present_BCP, i64([1, 2, 5])), w))
    return op.Cast(op.ReduceSum(w, i64([1, 2, 4]), keepdims=0), to=ir.DataType.DOUBLE)


def choose_blocks(mass_BCJ, m_BC, block_rule: dict, K: int, causal: bool = True, n_blocks_B=None):
    """selection.choose_blocks in standard ops: [B, C, K] int64 sorted, −1 padded. n_blocks_B [B]: the
    blocks up to each row's last real position (None: every block of a causal call's past)."""
    J = dim(mass_BCJ, 2)
    j = op.Reshape(arange(J), i64([1, 1, -1]))
    m = op.Unsqueeze(m_BC, i64([2]))
    if causal:
        valid = op.LessOrEqual(j, m)
        in_window = op.And(op.GreaterOrEqual(j, op.Sub(m, i64([block_rule["window"]]))), op.LessOrEqual(j, m))
    else:
        valid = op.Less(j, J)
        in_window = op.LessOrEqual(op.Abs(op.Sub(j, m)), i64([block_rule["window"]]))
    if n_blocks_B is not None:
        valid = op.And(valid, op.Less(j, op.Unsqueeze(n_blocks_B, i64([1, 2]))))
    forced = op.And(valid, op.Or(op.Less(j, i64([block_rule["sinks"]])), in_window))
    candidate = op.And(valid, op.Not(forced))
    zero = op.CastLike(f32(0.0), mass_BCJ)
    quantum = op.Max(op.Mul(op.ReduceSum(op.Where(valid, mass_BCJ, zero), i64([-1]), keepdims=1),
                            op.CastLike(f32(2.0 ** -16), mass_BCJ)), op.CastLike(f32(1e-30), mass_BCJ))
    score = op.Where(candidate, op.Round(op.Div(mass_BCJ, quantum)), op.CastLike(f32(-1.0), mass_BCJ))
    _, order = op.TopK(score, J, axis=-1, largest=1, sorted=1)  # best first; ties keep the earlier block
    zeros = op.Mul(order, i64([0]))
    rank = op.ScatterElements(zeros, order, op.Add(zeros, j), axis=-1)
    chosen = op.And(candidate, op.Less(rank, i64([block_rule["top_k"]])))
    if block_rule["mass"] is not None:
        total = op.ReduceSum(op.Where(valid, mass_BCJ, op.CastLike(f32(0.0), mass_BCJ)), i64([-1]), keepdims=1)
        have = op.ReduceSum(op.Where(forced, mass_BCJ, op.CastLike(f32(0.0), mass_BCJ)), i64([-1]), keepdims=1)
        ranked = op.GatherElements(op.Where(candidate, mass_BCJ, op.CastLike(f32(0.0), mass_BCJ)), order, axis=-1)
        before = op.Sub(op.CumSum(ranked, op.Constant(value_int=-1)), ranked)  # axis: a 0-D tensor
        need = op.Less(op.Add(have, before), op.Mul(op.CastLike(f32(block_rule["mass"]), total), total))
        needed = op.ScatterElements(zeros, order, _i64(need), axis=-1)
        chosen = op.And(chosen, _bool(needed))
    read = op.Or(forced, chosen)
    ids = op.Where(read, op.Add(zeros, j), op.Add(op.Add(zeros, j), J))
    width = op.Min(J, i64([K]))
    lowest, _ = op.TopK(ids, width, axis=-1, largest=0, sorted=1)
    lowest = op.Pad(lowest, op.Concat(i64([0, 0, 0, 0, 0]), op.Sub(i64([K]), width), axis=0),
                    op.Squeeze(op.Mul(J, i64([2])), i64([0])))
    return op.Where(op.Less(lowest, J), lowest, i64([-1]))


def reuse_step_lowering(q, k, v, mask, past_key, past_value, anchor_q, anchor_keys, past_probes, past_blocks, block,
                        top_k, window, sinks, mass, scale, anchor_scale):
    """attnopt::reuse_step in standard ops: selection.select_span, then gathered_softmax. The
    selection of new blocks runs in an If that only a call starting a block takes (a decoding step
    mostly does not; it then reads only its K·b keys)."""
    block = int(block)
    rule = {"window": int(window), "sinks": int(sinks), "top_k": int(top_k), "mass": None if mass is None else float(mass)}
    Ha, Da, Hk = static_dim(anchor_q, 1, "anchor heads"), static_dim(anchor_q, 3, "anchor head dim"), \
        static_dim(anchor_keys, 1, "anchor kv heads")
    P, K = static_dim(past_probes, 2, "probes"), static_dim(past_blocks, 2, "list slots")
    K_all, V_all = op.Concat(past_key, k, axis=2), op.Concat(past_value, v, axis=2)
    keep = _bool(mask)
    N, T = dim(mask, 1), dim(q, 2)
    any_real = _bool(op.ReduceMax(_i64(keep), i64([1]), keepdims=0))
    offset = op.Where(any_real, op.ArgMax(_i64(keep), axis=1, keepdims=0), op.Squeeze(N, i64([0])))  # [B]
    first = op.Sub(op.Squeeze(op.Sub(N, T), i64([0])), offset)
    seen = op.Max(first, i64([0]))
    pos = op.Add(op.Unsqueeze(first, i64([1])), op.Unsqueeze(arange(T), i64([0])))  # [B, T]
    history = op.Concat(op.CastLike(past_probes, anchor_q), anchor_q, axis=2)  # positions seen − P ..

    def slot(x, rank: int):
        axes = i64(list(range(1, rank)))
        s, f = op.Unsqueeze(seen, axes), op.Unsqueeze(first, axes)
        return op.Where(op.Less(x, s), op.Add(op.Sub(x, s), i64([P])), op.Add(op.Sub(x, f), i64([P])))

    C = op.Add(op.Div(T, i64([block])), i64([1]))
    first_block = op.Div(op.Add(seen, i64([block - 1])), i64([block]))
    m_BC = op.Add(op.Unsqueeze(first_block, i64([1])), op.Unsqueeze(arange(C), i64([0])))
    last = op.Squeeze(op.Slice(pos, i64([-1]), i64([2 ** 62]), i64([1])), i64([1]))
    end = op.Max(op.Add(last, i64([1])), seen)
    starts = op.Less(op.Mul(m_BC, i64([block])), op.Unsqueeze(end, i64([1])))  # [B, C]
    some_start = _bool(op.ReduceMax(_i64(starts), keepdims=0))
    current = op.Squeeze(past_blocks, i64([1]))  # [B, K]

    def fresh_lists():
        probe_pos = op.Add(op.Unsqueeze(op.Sub(op.Mul(m_BC, i64([block])), i64([P])), i64([2])),
                           op.Reshape(arange(i64([P])), i64([1, 1, -1])))  # [B, C, P]
        idx = slot(probe_pos, 3)
        present = op.And(op.And(op.Unsqueeze(starts, i64([2])), op.GreaterOrEqual(probe_pos, i64([0]))),
                         op.And(op.GreaterOrEqual(idx, i64([0])), op.Less(idx, op.Add(T, i64([P])))))
        idx = op.Clip(idx, op.Constant(value_int=0), op.Squeeze(op.Add(T, i64([P - 1])), i64([0])))
        flat = op.Reshape(idx, i64([0, 1, -1, 1]))
        q_probe = op.GatherElements(history, op.Expand(flat, op.Concat(op.Shape(flat, start=0, end=1), i64([Ha]),
                                                                       op.Shape(flat, start=2, end=3), i64([Da]),
                                                                       axis=0)), axis=2)
        _, colc, keep_pos = position_columns(offset, keep, N)
        k_pos = _gather_columns(anchor_keys, colc, Hk, Da)
        lo, hi, has_key = key_bounds(k_pos, keep_pos, block, Hk, Da)
        J = dim(lo, 2)
        visible = op.And(op.Less(op.Reshape(arange(J), i64([1, 1, -1])), op.Unsqueeze(m_BC, i64([2]))),
                         op.Unsqueeze(has_key, i64([1])))
        q5 = op.Reshape(q_probe, op.Concat(i64([0, Ha]), op.Shape(present, start=1, end=3), i64([Da]), axis=0))
        mass_BCJ = bound_mass(q5, present, lo, hi, visible, float(anchor_scale), Ha, Hk, Da)
        return choose_blocks(mass_BCJ, m_BC, rule, K)

    def no_lists():  # nothing starts: the lists are never read
        return op.Expand(i64([-1]), op.Concat(op.Shape(m_BC), i64([K]), axis=0))

    [lists] = branch(some_start, fresh_lists, no_lists, 1, like=past_blocks, name="reuse_select")
    m_BT = op.Div(op.Max(pos, i64([0])), i64([block]))
    c = op.Clip(op.Sub(m_BT, op.Unsqueeze(first_block, i64([1]))), op.Constant(value_int=0),
                op.Squeeze(op.Sub(C, i64([1])), i64([0])))
    c3 = op.Expand(op.Unsqueeze(c, i64([2])), op.Concat(op.Shape(c), i64([K]), axis=0))
    fresh = op.GatherElements(lists, c3, axis=1)
    before = op.Unsqueeze(op.Less(op.Mul(m_BT, i64([block])), op.Unsqueeze(seen, i64([1]))), i64([2]))
    blocks = op.Where(before, op.Unsqueeze(current, i64([1])), fresh)
    blocks = op.Where(op.Unsqueeze(op.GreaterOrEqual(pos, i64([0])), i64([2])), blocks, i64([-1]))
    stash_pos = op.Add(op.Unsqueeze(op.Add(last, i64([1])), i64([1])), op.Unsqueeze(op.Sub(arange(i64([P])), i64([P])),
                                                                                      i64([0])))  # [B, P]
    sidx = op.Clip(slot(stash_pos, 2), op.Constant(value_int=0), op.Squeeze(op.Add(T, i64([P - 1])), i64([0])))
    s4 = op.Reshape(sidx, i64([0, 1, -1, 1]))
    stash = op.GatherElements(history, op.Expand(s4, op.Concat(op.Shape(s4, start=0, end=1), i64([Ha]), i64([P, Da]),
                                                                axis=0)), axis=2)
    stash = op.Where(op.Reshape(op.GreaterOrEqual(stash_pos, i64([0])), i64([0, 1, -1, 1])), stash,
                     op.CastLike(f32(0.0), stash))
    H, (Hkv, D, Dv) = static_dim(q, 1, "H"), (static_dim(k, 1, "Hkv"), static_dim(k, 3, "D"), static_dim(v, 3, "Dv"))

    def per_query():  # a step, or a few tokens: each query gathers its own K·b keys
        return gathered_softmax(q, K_all, V_all, blocks, block, True, float(scale), keep, offset,
                                static=(Hkv, D, Dv), K=K)

    def per_block():  # a prompt, or a chunk of one: every position's block scored once, as a prefill does
        cols, colc, keep_pos = position_columns(offset, keep, N)
        new_col = op.Sub(cols, op.Sub(N, T))  # which of this call's queries sits at the position
        asks = op.And(keep_pos, op.GreaterOrEqual(new_col, i64([0])))
        q_pos = _gather_columns(q, op.Max(op.Min(new_col, op.Sub(T, i64([1]))), i64([0])), H, D)
        M = op.Div(op.Add(N, i64([block - 1])), i64([block]))
        last_of_block = op.Sub(op.Mul(op.Add(arange(M), i64([1])), i64([block])), i64([1]))  # [M]
        t_BM = op.Sub(op.Unsqueeze(last_of_block, i64([0])), op.Unsqueeze(first, i64([1])))
        t_BM = op.Max(op.Min(t_BM, op.Sub(T, i64([1]))), i64([0]))  # the block's last query of this call
        lists = op.GatherElements(blocks, op.Expand(op.Unsqueeze(t_BM, i64([2])), op.Concat(
            op.Shape(t_BM), i64([K]), axis=0)), axis=1)  # [B, M, K]
        out = tiled_softmax(q_pos, _gather_columns(K_all, colc, Hkv, D), _gather_columns(V_all, colc, Hkv, Dv), lists,
                            keep_pos, block, True, float(scale), K, (H, Hkv, D, Dv), asks_pos=asks)
        got = _gather_columns(out, op.Max(pos, i64([0])), H, Dv)  # [B, H, T, Dv]
        return op.Where(op.Unsqueeze(op.GreaterOrEqual(pos, i64([0])), i64([1, 3])), got, op.CastLike(f32(0.0), got))

    [out] = branch(op.Squeeze(op.GreaterOrEqual(T, i64([block])), i64([0])), per_block, per_query, 1, like=q,
                   name="reuse_tiles")
    present_blocks = op.Slice(blocks, i64([-1]), i64([2 ** 62]), i64([1]))  # [B, 1, K]
    return out, K_all, V_all, op.CastLike(stash, past_probes), present_blocks


DECODE_LOWERING = OpLowering("attnopt::reuse_step", {"ort": reuse_step_lowering, "onnx-std": reuse_step_lowering})


# ---------------------------------------------------------------- a prefill (`attnopt::reuse_attention`, prefill.py)


def select_prefill(anchor_q, anchor_k, keep, rule: dict, block: int, P: int, causal: bool, anchor_scale: float, K: int):
    """selection._prefill in standard ops, in position space (each row from its first real token):
    (blocks [B, M, K] int64 per query block, sorted, −1 padded; keep_pos [B, N]; the rows' leading
    pads [B]; colc [B, N], the column of each position)."""
    Ha, Da, Hk = static_dim(anchor_q, 1, "anchor heads"), static_dim(anchor_q, 3, "anchor head dim"), \
        static_dim(anchor_k, 1, "anchor kv heads")
    N = dim(anchor_q, 2)
    any_real = _bool(op.ReduceMax(_i64(keep), i64([1]), keepdims=0))
    offset = op.Where(any_real, op.ArgMax(_i64(keep), axis=1, keepdims=0), i64([0]))  # [B]
    n_ar = arange(N)
    _, colc, keep_pos = position_columns(offset, keep, N)
    q_pos, k_pos = _gather_columns(anchor_q, colc, Ha, Da), _gather_columns(anchor_k, colc, Hk, Da)
    lo, hi, has_key = key_bounds(k_pos, keep_pos, block, Hk, Da)
    J = dim(lo, 2)
    m_M = arange(J)  # query blocks: as many as key blocks
    pa = op.Unsqueeze(i64(list(range(P))), i64([0]))  # [1, P]
    if causal:  # the P positions before the block; the blocks complete before it
        pos = op.Add(op.Unsqueeze(op.Sub(op.Mul(m_M, i64([block])), i64([P])), i64([1])), pa)  # [M, P]
        visible = op.Less(op.Unsqueeze(m_M, i64([0])), op.Unsqueeze(m_M, i64([1])))  # [M, J]
    else:  # the block's last P positions; every block
        end = op.Min(op.Mul(op.Add(m_M, i64([1])), i64([block])), N)
        pos = op.Add(op.Unsqueeze(op.Sub(end, i64([P])), i64([1])), pa)
        pos = op.Where(op.GreaterOrEqual(pos, op.Unsqueeze(op.Mul(m_M, i64([block])), i64([1]))), pos, i64([-1]))
        visible = op.Expand(_bool(i64([1])), op.Concat(J, J, axis=0))
    safe = op.Max(pos, i64([0]))
    present = op.And(op.Unsqueeze(op.GreaterOrEqual(pos, i64([0])), i64([0])), op.Gather(keep_pos, safe, axis=1))
    q_probe = op.Gather(q_pos, safe, axis=2)  # [B, Ha, M, P, Da]
    visible_BMJ = op.And(op.Unsqueeze(visible, i64([0])), op.Unsqueeze(has_key, i64([1])))
    mass_BMJ = bound_mass(q_probe, present, lo, hi, visible_BMJ, anchor_scale, Ha, Hk, Da)
    n_pos = op.ReduceMax(op.Where(keep_pos, op.Add(n_ar, i64([1])), i64([0])), i64([1]), keepdims=0)  # [B]
    n_blocks = op.Div(op.Add(n_pos, i64([block - 1])), i64([block]))
    m_BM = op.Expand(op.Unsqueeze(m_M, i64([0])), op.Concat(op.Shape(keep, start=0, end=1), J, axis=0))
    return choose_blocks(mass_BMJ, m_BM, rule, K, causal, n_blocks), keep_pos, offset, colc


def tiled_softmax(q_pos, k_pos, v_pos, blocks_BMK, keep_pos, block: int, causal: bool, scale: float, K: int,
                  dims: tuple, asks_pos=None):
    """The block-sparse softmax of a prefill, in position space: each query block gathers its K listed
    key blocks once ([B, Hkv, M, K·b, D]: O(N·K·b·D) memory, as the torch op's tiles) and its b
    queries score them. A query that is padding (keep_pos false), or not asked (asks_pos [B, N] false,
    when given), gets a zero row. Returns [B, H, N, Dv]."""
    H, Hkv, D, Dv = dims
    G = H // Hkv
    N = dim(q_pos, 2)
    q = op.Reshape(pad_axis(q_pos, 2, 4, block), i64([0, Hkv, G, -1, block, D]))  # [B, Hkv, G, M, b, D]
    M = op.Shape(q, start=3, end=4)
    # A query block's G·b queries (its heads of one KV head) as the rows of one product with its keys:
    # [B, Hkv, M, G·b, D] (no broadcast batch dimension, which ORT's MatMul runs as a slow loop).
    q = op.Reshape(op.Transpose(q, perm=[0, 1, 3, 2, 4, 5]), op.Concat(i64([0, Hkv]), M, i64([G * block, D]), axis=0))
    ids = op.Max(blocks_BMK, i64([0]))
    slot = op.Reshape(arange(i64([block])), i64([1, 1, 1, -1]))
    kpos = op.Reshape(op.Add(op.Mul(op.Unsqueeze(ids, i64([3])), i64([block])), slot),
                      op.Concat(i64([0]), M, i64([K * block]), axis=0))  # [B, M, K·b]
    keep_p = pad_axis(_i64(keep_pos), 1, 2, block)  # [B, M·b]: every block's keys inside
    real_key = _bool(op.GatherElements(keep_p, op.Reshape(kpos, i64([0, -1])), axis=1))
    listed = op.Reshape(op.Expand(op.Unsqueeze(op.GreaterOrEqual(blocks_BMK, i64([0])), i64([3])),
                                  op.Concat(i64([1, 1, 1]), i64([block]), axis=0)), op.Shape(kpos))
    ok = op.And(op.Reshape(real_key, op.Shape(kpos)), listed)  # [B, M, K·b]
    asks = keep_p if asks_pos is None else pad_axis(_i64(asks_pos), 1, 2, block)
    real_q = op.Reshape(_bool(asks), op.Concat(i64([0]), M, i64([block, 1]), axis=0))  # [B, M, b, 1]
    visible = op.And(op.Unsqueeze(ok, i64([2])), real_q)  # [B, M, b, K·b]
    if causal:
        qpos = op.Reshape(arange(op.Mul(M, i64([block]))), op.Concat(i64([1]), M, i64([block, 1]), axis=0))
        visible = op.And(visible, op.LessOrEqual(op.Unsqueeze(kpos, i64([2])), qpos))

    def gathered(x, width):  # [B, Hkv, N, w] -> [B, Hkv, M, K·b, w]
        xb = op.Reshape(pad_axis(x, 2, 4, block), i64([0, Hkv, -1, block, width]))  # [B, Hkv, J, b, w]
        rows = op.GatherND(op.Transpose(xb, perm=[0, 2, 1, 3, 4]), op.Unsqueeze(ids, i64([3])), batch_dims=1)
        rows = op.Transpose(rows, perm=[0, 3, 1, 2, 4, 5])  # [B, Hkv, M, K, b, w]
        return op.Reshape(rows, op.Concat(i64([0, Hkv]), M, i64([K * block, width]), axis=0))

    k_g, v_g = gathered(k_pos, D), gathered(v_pos, Dv)
    scores = op.MatMul(op.Mul(q, op.CastLike(f32(scale), q)), op.Transpose(k_g, perm=[0, 1, 2, 4, 3]))
    view = op.Concat(i64([0, Hkv]), M, i64([G, block, K * block]), axis=0)  # [B, Hkv, M, G, b, K·b]
    out = visible_softmax(scores, op.Unsqueeze(visible, i64([1, 3])), v_g, view)  # [B, Hkv, M, G·b, Dv]
    out = op.Reshape(out, op.Concat(i64([0, Hkv]), M, i64([G, block, Dv]), axis=0))
    out = op.Reshape(op.Transpose(out, perm=[0, 1, 3, 2, 4, 5]), i64([0, H, -1, Dv]))
    return op.Slice(out, i64([0]), N, i64([2]))


def visible_softmax(scores, visible, v, view=None):
    """softmax(scores over the visible keys) @ v; a row that sees no key gets zeros. ONNX's Softmax
    (one fused pass) gives such a row NaN, replaced on the output, which is K·b / Dv times smaller.
    `view`: the shape in which `visible` broadcasts against the scores (the scores' own otherwise)."""
    bias = op.Where(visible, op.CastLike(f32(0.0), scores), op.CastLike(f32(-np.inf), scores))  # without heads
    shaped = scores if view is None else op.Reshape(scores, view)
    p = op.Softmax(op.Add(shaped, bias), axis=-1)  # (ORT's broadcasting Add: 4x its Where here)
    out = op.MatMul(p if view is None else op.Reshape(p, op.Shape(scores)), v)
    return op.Where(op.IsNaN(out), op.CastLike(f32(0.0), out), out)


def dense_softmax(q, k, v, keep, causal: bool, scale: float, dims: tuple):
    """Exact attention over the columns, keys masked by keep [B, N] (and causality); a query that sees
    no key gets a zero row. Returns [B, H, N, Dv]."""
    H, Hkv, D, Dv = dims
    q5 = op.Reshape(q, i64([0, Hkv, H // Hkv, -1, D]))  # [B, Hkv, G, N, D]
    scores = op.MatMul(op.Mul(q5, op.CastLike(f32(scale), q5)), op.Unsqueeze(op.Transpose(k, perm=[0, 1, 3, 2]),
                                                                          i64([2])))
    visible = op.Unsqueeze(keep, i64([1, 2, 3]))  # [B, 1, 1, 1, N]
    if causal:
        n = arange(dim(q, 2))
        visible = op.And(visible, op.LessOrEqual(op.Unsqueeze(n, i64([0])), op.Unsqueeze(n, i64([1]))))
    return op.Reshape(visible_softmax(scores, visible, op.Unsqueeze(v, i64([2]))), i64([0, H, -1, Dv]))


def blocks_read_whole(rule: BlockRule) -> int:
    """The most blocks at which every query block reads every block it sees (the torch op then runs
    exact attention): BlockRule.reads_everything holds up to it, and not after (candidates only grow
    with the blocks)."""
    M = 0
    while rule._reads_everything(M + 1):
        M += 1
    return M


def reuse_attention_std(q, k, v, key_mask, anchor_q, anchor_k, block, top_k, window, sinks, probes, causal, mass, scale,
                        anchor_scale):
    """attnopt::reuse_attention in standard ops: the anchor's selection (select_prefill), then the
    tiled block-sparse softmax, in position space and back to columns. A call short enough that every
    block is read takes exact attention instead (an If), as the torch op does: the two differ only on
    padded query rows, which exact attention lets see the real keys."""
    block, P, causal = int(block), int(probes), bool(causal)
    rule = {"window": int(window), "sinks": int(sinks), "top_k": int(top_k), "mass": None if mass is None else float(mass)}
    block_rule = BlockRule(block=block, top_k=rule["top_k"], window=rule["window"], sinks=rule["sinks"], probes=P,
                           causal=causal, mass=rule["mass"])
    whole, K = blocks_read_whole(block_rule), block_rule.slots
    dims = H, Hkv, D, Dv = static_dim(q, 1, "H"), static_dim(k, 1, "Hkv"), static_dim(q, 3, "D"), static_dim(v, 3, "Dv")
    N = dim(q, 2)
    keep = _bool(key_mask) if key_mask is not None else op.Expand(_bool(i64([1])), op.Concat(
        op.Shape(q, start=0, end=1), N, axis=0))

    def sparse():
        blocks, keep_pos, offset, colc = select_prefill(anchor_q, anchor_k, keep, rule, block, P, causal,
                                                        float(anchor_scale), K)
        out = tiled_softmax(_gather_columns(q, colc, H, D), _gather_columns(k, colc, Hkv, D),
                            _gather_columns(v, colc, Hkv, Dv), blocks, keep_pos, block, causal, float(scale), K, dims)
        back = op.Mod(op.Add(op.Sub(op.Unsqueeze(arange(N), i64([0])), op.Unsqueeze(offset, i64([1]))), N), N)
        return _gather_columns(out, back, H, Dv)  # column c holds position c − offset (padding: a zero row)

    if whole == 0:
        return sparse()
    short = op.Squeeze(op.LessOrEqual(N, i64([whole * block])), i64([0]))  # ceil(N / b) <= whole
    [out] = branch(short, lambda: dense_softmax(q, k, v, keep, causal, float(scale), dims), sparse, 1, like=q,
                   name="reuse_reads_everything")
    return out


LOWERING = OpLowering("attnopt::reuse_attention", {"ort": reuse_attention_std, "onnx-std": reuse_attention_std})
