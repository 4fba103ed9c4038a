"""Block-sparse softmax attention on Triton: a reused layer's prefill over its anchor's block lists.

One program per (batch, query head, query block m): it walks the K entries of block m's list
(`blocks` [B, M, K], −1 = an empty slot), loads each listed key block of b keys and folds it into an
online softmax (log2 units), masking causality (key position ≤ query position), padding (key_mask)
and the keys past Nk. A query that sees no key returns 0. Work: O(N·K·b·D), never N × N.

Forward only: a call that needs gradients runs the PyTorch op, whose autograd recomputes its
gathered path. Prefill shape only (Nq == Nk, queries in position order, no row offsets), with the
block b a power of two ≥ 16 (the query tile is the selection block); other calls take the PyTorch
path (`unsupported` says which).

Letters: B batch, H query heads, Hkv kv heads, G = H // Hkv, N length, D / Dv head dims, b block,
M query blocks, K list slots.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.kernels.triton.band import LOG2E
from attnopt.kernels.triton.runtime import checked_call, dims, keep_arg, launch, launcher, low_precision, pow2
from attnopt.kernels.triton.runtime import row_strides, scale_or_default, shared_checks
from attnopt.kernels.triton.softmax import attend, key_tile, softmax_init, softmax_out
from attnopt.kernels.triton.tiles import load_tile, program_head, span, store_tile


@triton.jit
def _block_sparse_fwd_kernel(
    Q, K, V, KEEP, BLOCKS, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
    H, N, D, Dv, G, M, NSLOT, scale2,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    _, b, h = program_head(H)
    pid_m = tl.program_id(1)
    rq, q_ok = span(pid_m * BQ, N, BQ)
    rd, d_ok = span(0, D, BD)
    qx = load_tile(Q + b * s_qb + h * s_qh, rq, s_qn, rd, q_ok, d_ok)
    m, l, acc = softmax_init(BQ, BV)
    for slot in range(0, NSLOT):
        j = tl.load(BLOCKS + (b * M + pid_m) * NSLOT + slot) * BQ + tl.arange(0, BQ)
        kx, vx, keep_j = key_tile(K, V, KEEP, b, h // G, j, (j < N) & (j >= 0),  # an empty slot (−1): j < 0
                                  s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, N, D, Dv, HAS_KEEP, BD, BV)
        vis = keep_j[None, :] & q_ok[:, None]
        if CAUSAL:
            vis = vis & (j[None, :] <= rq[:, None])
        m, l, acc = attend(qx, kx, vx, vis, m, l, acc, scale2, LOWP, Q.dtype.element_ty)
    out, _lse = softmax_out(m, l, acc)
    rv, v_ok = span(0, Dv, BV)
    store_tile(O + b * s_ob + h * s_oh, rq, s_on, rv, q_ok, v_ok, out)


def _launch(q, k, v, key_mask, blocks, block, causal, scale, wrap: bool) -> Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, Hkv, N, _, D, Dv = dims(q, k, v)
    M, K = blocks.shape[1], blocks.shape[2]
    out = torch.empty(B, H, N, Dv, dtype=q.dtype, device=q.device)
    keep_t, has_keep = keep_arg(key_mask, q)
    launcher(_block_sparse_fwd_kernel, wrap)[(B * H, M)](
        q, k, v, keep_t, blocks.to(torch.int32).contiguous(), out, *row_strides(q, k, v, out),
        H, N, D, Dv, H // Hkv, M, K, scale * LOG2E,
        CAUSAL=bool(causal), HAS_KEEP=has_keep, LOWP=low_precision(q.dtype), BQ=block, BD=pow2(D), BV=pow2(Dv),
    )
    return out


@triton_op("attnopt_triton::block_sparse", mutates_args={})
def _block_sparse_op(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], blocks: Tensor, block: int,
                     causal: bool, scale: float) -> Tensor:
    return _launch(q, k, v, key_mask, blocks, block, causal, scale, wrap=True)


def block_sparse_unsupported(q: Tensor, block=None, k=None, offsets=None, **_) -> Optional[str]:
    """The kernel's own limits (after the checks every form's kernels share), one line, or None."""
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        return f"block_sparse_attention: the kernel's query tile is the block; {block} is not a power of two >= 16"
    if offsets is not None or (k is not None and k.shape[2] != q.shape[2]):
        return "block_sparse_attention: the kernel runs a prefill (Nq == Nk, no row offsets); decoding runs PyTorch"
    if max(q.shape[-1], 1) > 256:
        return f"block_sparse_attention: head dim {q.shape[-1]} > 256 does not fit the kernel's register tiles"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k) if t is not None):
        return "block_sparse_attention: the kernel is forward only; a call that needs gradients runs PyTorch"
    return None


unsupported = shared_checks(block_sparse_unsupported)


def block_sparse_attention_triton(q: Tensor, k: Tensor, v: Tensor, blocks_BMK: Tensor, *, block: int, causal: bool,
                                  scale: Optional[float] = None, key_mask: Optional[Tensor] = None) -> Tensor:
    """The reference op's prefill (query block m reads the key blocks blocks_BMK[:, m]) on the kernel."""
    who = "block_sparse_attention"
    checked_call(who, q, k, v, key_mask, lambda: unsupported(q, k=k, block=block))
    M = -(-q.shape[2] // block)
    if blocks_BMK.dim() != 3 or tuple(blocks_BMK.shape[:2]) != (q.shape[0], M):
        raise ValueError(f"{who}: blocks must be [B, M, K] = [{q.shape[0]}, {M}, K], got {tuple(blocks_BMK.shape)}")
    return launch("block_sparse", _launch, q, k, v, key_mask, blocks_BMK, block, bool(causal),
                  scale_or_default(q, scale))
