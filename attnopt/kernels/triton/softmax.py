"""Online softmax in log2 units, shared by the softmax kernels (window, linear+window, reuse).

A block of BQ query rows keeps a running row max m, row sum l and weighted value sum acc and folds
in one key block at a time (FlashAttention's order), so no row of scores is ever held whole. Scores
are q·k·scale2 with scale2 = scale·log2(e), so exp2 stands for exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnopt.kernels.triton.tiles import dot, kept, load_tile


@triton.jit
def key_tile(K, V, KEEP, b, hk, j, j_in, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, Nk, D, Dv,
             HAS_KEEP: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr):
    """(k [BK, BD], v [BK, BV], keep [BK]) of the keys j of kv head hk in batch row b: keep is j_in and,
    with a key mask (KEEP [B, Nk] int8), the mask."""
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    kx = load_tile(K + b * s_kb + hk * s_kh, j, s_kn, rd, j_in, rd < D)
    vx = load_tile(V + b * s_vb + hk * s_vh, j, s_vn, rv, j_in, rv < Dv)
    return kx, vx, kept(KEEP + b * Nk, j, j_in, HAS_KEEP)


@triton.jit
def softmax_init(BQ: tl.constexpr, BV: tl.constexpr):
    """(m, l, acc) before the first key block. m starts at −1e30, not −inf: a block where a row sees
    nothing then gives exp2(−inf − m) = 0 and exp2(m − m_new) = 1, never inf − inf."""
    m = tl.full([BQ], -1.0e30, dtype=tl.float32)
    return m, tl.zeros([BQ], dtype=tl.float32), tl.zeros([BQ, BV], dtype=tl.float32)


@triton.jit
def attend(qx, kx, vx, vis, m, l, acc, scale2, LOWP: tl.constexpr, DT: tl.constexpr):
    """Fold one key block into (m, l, acc): scores q·k·scale2 where vis [BQ, BK], else −inf."""
    s = tl.where(vis, dot(qx, tl.trans(kx), LOWP, DT) * scale2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    pr = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    return m_new, l * alpha + tl.sum(pr, axis=1), acc * alpha[:, None] + dot(pr, vx, LOWP, DT)


@triton.jit
def softmax_out(m, l, acc):
    """(out [BQ, BV], log-sum-exp [BQ] in log2 units); a row that saw no key (l = 0) gets 0 and 0."""
    seen = l > 0.0
    l_safe = tl.where(seen, l, 1.0)
    return acc / l_safe[:, None], tl.where(seen, m + tl.log2(l_safe), 0.0)
