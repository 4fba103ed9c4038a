"""The tile arithmetic every Triton kernel of attnopt shares, as `@triton.jit` helpers (Triton inlines
them into the kernels that call them, so they cost nothing at run time).

A program's place in the grid (`program_head`), an index range with its mask (`span`), masked
[rows, cols] tiles of a row-major slice with unit column stride (`load_tile`, `load_phi`,
`store_tile`), the key mask (`kept`), the feature maps fused into the loads (`phi`, `dphi`) and the
precision rule of every product (`dot`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_head(H):
    """(pid, b, h): axis 0 of the grid runs over batch × H heads."""
    pid = tl.program_id(0)
    return pid, pid // H, pid % H


@triton.jit
def span(start, n, BLOCK: tl.constexpr):
    """(start + [0, BLOCK), its mask `< n`)."""
    r = start + tl.arange(0, BLOCK)
    return r, r < n


@triton.jit
def load_tile(base, rows, s_row, cols, row_ok, col_ok):
    """The [rows, cols] tile of a row-major slice (row stride s_row, unit column stride), 0 outside the masks."""
    return tl.load(base + rows[:, None] * s_row + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def store_tile(base, rows, s_row, cols, row_ok, col_ok, x):
    """Write x into the [rows, cols] tile of a row-major slice, in the slice's dtype."""
    tl.store(base + rows[:, None] * s_row + cols[None, :], x.to(base.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def phi(x, FMAP: tl.constexpr):
    """The feature map fused into the loads (runtime.FMAP_CODES): 0 identity, 1 ELU+1, 2 ReLU."""
    if FMAP == 1:
        return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.maximum(x, 0.0)
    else:
        return x


@triton.jit
def dphi(x, FMAP: tl.constexpr):
    """dφ/dx at x (1 for identity)."""
    if FMAP == 1:
        return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.where(x > 0, 1.0, 0.0)
    else:
        return tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def load_phi(base, rows, s_row, cols, row_ok, col_ok, FMAP: tl.constexpr):
    """φ of a tile in fp32, 0 outside the masks (φ(0) is 1 for ELU+1, so the load's 0 is not enough)."""
    x = load_tile(base, rows, s_row, cols, row_ok, col_ok)
    return tl.where(row_ok[:, None] & col_ok[None, :], phi(x.to(tl.float32), FMAP), 0.0)


@triton.jit
def kept(KEEP_ROW, j, j_in, HAS_KEEP: tl.constexpr):
    """Bool: key j exists (j_in) and, with a key mask, is kept (KEEP_ROW: the batch row of KEEP [B, Nk]
    int8, 0 = dropped)."""
    if HAS_KEEP:
        return j_in & (tl.load(KEEP_ROW + j, mask=j_in, other=0) != 0)
    else:
        return j_in


@triton.jit
def dot(a, b, LOWP: tl.constexpr, DT: tl.constexpr):
    # LOWP (runtime.low_precision): bf16/fp16 inputs: operands in the input dtype (tensor cores), fp32 accumulation;
    # fp32 inputs: IEEE fp32 (tf32 would cost ~3 decimal digits the fp32 oracle tests check).
    if LOWP == 1:
        return tl.dot(a.to(DT), b.to(DT))
    elif LOWP == 2:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")
