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

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from attnopt.kernels.layout import check_sdpa_inputs
from attnopt.kernels.triton.band import LOG2E
from attnopt.kernels.triton.chunk_scan import dot
from attnopt.kernels.triton.runtime import (
    call_unsupported,
    interpreting,
    launcher,
    low_precision,
    pow2,
    require_runtime,
)


@triton.jit
def _block_sparse_fwd_kernel(
    Q, K, V, KEEP, BLOCKS, O,
    s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_on,
    H, N, D, Dv, G, M, NSLOT, scale2,
    CAUSAL: tl.constexpr, HAS_KEEP: tl.constexpr, LOWP: tl.constexpr,
    BQ: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    DT = Q.dtype.element_ty
    rq = pid_m * BQ + tl.arange(0, BQ)
    rk = tl.arange(0, BQ)
    rd = tl.arange(0, BD)
    rv = tl.arange(0, BV)
    q_ok = rq < N
    d_ok = rd < D
    v_ok = rv < Dv
    qx = tl.load(Q + b * s_qb + h * s_qh + rq[:, None] * s_qn + rd[None, :], mask=q_ok[:, None] & d_ok[None, :],
                 other=0.0)
    if not LOWP:
        qx = qx.to(tl.float32)
    k_base = K + b * s_kb + (h // G) * s_kh
    v_base = V + b * s_vb + (h // G) * s_vh
    m = tl.full([BQ], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BQ], dtype=tl.float32)
    acc = tl.zeros([BQ, BV], dtype=tl.float32)
    for slot in range(0, NSLOT):
        jb = tl.load(BLOCKS + (b * M + pid_m) * NSLOT + slot)
        j = jb * BQ + rk
        j_in = (j < N) & (j >= 0)  # an empty slot (−1) gives negative positions
        if HAS_KEEP:
            keep_j = j_in & (tl.load(KEEP + b * N + j, mask=j_in, other=0) != 0)
        else:
            keep_j = j_in
        kx = tl.load(k_base + j[:, None] * s_kn + rd[None, :], mask=j_in[:, None] & d_ok[None, :], other=0.0)
        vx = tl.load(v_base + j[:, None] * s_vn + rv[None, :], mask=j_in[:, None] & v_ok[None, :], other=0.0)
        s = dot(qx, tl.trans(kx), LOWP, DT) * scale2
        vis = keep_j[None, :] & q_ok[:, None]
        if CAUSAL:
            vis = vis & (j[None, :] <= rq[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        pr = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + dot(pr, vx, LOWP, DT)
        m = m_new
    out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    tl.store(O + b * s_ob + h * s_oh + rq[:, None] * s_on + rv[None, :], out.to(O.dtype.element_ty),
             mask=q_ok[:, None] & v_ok[None, :])


def _launch(q, k, v, key_mask, blocks, block, causal, scale, wrap: bool) -> Tensor:
    B, H, N, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    M, K = blocks.shape[1], blocks.shape[2]
    out = torch.empty(B, H, N, Dv, dtype=q.dtype, device=q.device)
    keep = key_mask.to(torch.int8).contiguous() if key_mask is not None else q.new_zeros(1, dtype=torch.int8)
    lists = blocks.to(torch.int32).contiguous()
    launcher(_block_sparse_fwd_kernel, wrap)[(B * H, M)](
        q, k, v, keep, lists, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, N, D, Dv, H // Hkv, M, K, scale * LOG2E,
        CAUSAL=bool(causal), HAS_KEEP=key_mask is not None, LOWP=low_precision(q.dtype),
        BQ=block, BD=pow2(D), BV=pow2(Dv),
    )
    return out


@triton_op("attnopt_triton::block_sparse", mutates_args={})
def _block_sparse_op(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], blocks: Tensor, block: int,
                     causal: bool, scale: float) -> Tensor:
    return _launch(q.contiguous(), k.contiguous(), v.contiguous(), key_mask, blocks, block, causal, scale, wrap=True)


def unsupported(q: Tensor, **kwargs) -> Optional[str]:
    """None if the kernel can run the reference op's call (its keywords, plus k=), else the reason."""
    reason = call_unsupported(q, kwargs.get("k"))
    if reason:
        return reason
    block, k = kwargs.get("block"), kwargs.get("k")
    if not isinstance(block, int) or block < 16 or block & (block - 1):
        return f"block_sparse_attention: the kernel's query tile is the block; {block} is not a power of two >= 16"
    if kwargs.get("offsets") is not None or (k is not None and k.shape[2] != q.shape[2]):
        return "block_sparse_attention: the kernel runs a prefill (Nq == Nk, no row offsets); decoding runs PyTorch"
    if max(q.shape[-1], 1) > 256:
        return f"block_sparse_attention: head dim {q.shape[-1]} > 256 does not fit the kernel's register tiles"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k) if t is not None):
        return "block_sparse_attention: the kernel is forward only; a call that needs gradients runs PyTorch"
    return None


def block_sparse_attention_triton(q: Tensor, k: Tensor, v: Tensor, blocks_BMK: Tensor, *, block: int, causal: bool,
                                  scale: Optional[float] = None, key_mask: Optional[Tensor] = None) -> Tensor:
    """The reference op's prefill (query block m reads the key blocks blocks_BMK[:, m]) on the kernel."""
    check_sdpa_inputs("block_sparse_attention", q, k, v, key_mask)
    require_runtime("block_sparse_attention", q)
    reason = unsupported(q, k=k, block=block)
    if reason:
        raise ValueError(reason)
    M = -(-q.shape[2] // block)
    if blocks_BMK.dim() != 3 or tuple(blocks_BMK.shape[:2]) != (q.shape[0], M):
        raise ValueError(f"block_sparse_attention: blocks must be [B, M, K] = [{q.shape[0]}, {M}, K], got "
                         f"{tuple(blocks_BMK.shape)}")
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if interpreting():
        return _launch(q.contiguous(), k.contiguous(), v.contiguous(), key_mask, blocks_BMK, block, causal, s,
                       wrap=False)
    return torch.ops.attnopt_triton.block_sparse(q, k, v, key_mask, blocks_BMK, block, bool(causal), s)
