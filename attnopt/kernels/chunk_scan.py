"""Chunked causal linear attention in PyTorch: the scan every linear-state form builds on.

Letters: B batch, Hf heads the features were computed for, G query heads per such head, L length,
M feature dim, W value columns (Dv, plus one when a ones column carries the normaliser), C chunk.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def state_times(phi_q: Tensor, T: Tensor) -> Tensor:
    """φ(q) [B, Hf, G, Nq, M] @ T [B, Hf, G|1, M, W] -> [B, Hf, G, Nq, W].

    A state shared by the G query heads (T's G dim 1) is applied as one [G·Nq, M] @ [M, W] product
    per kv head instead of a broadcast matmul, which would first copy T G times.
    """
    B, Hf, G, Nq, M = phi_q.shape
    if T.shape[2] == 1:
        return (phi_q.reshape(B, Hf, G * Nq, M) @ T[:, :, 0]).reshape(B, Hf, G, Nq, T.shape[-1])
    return phi_q @ T


def causal_chunks(phi_q: Tensor, phi_k: Tensor, v1: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Causal linear attention over aligned queries and keys (query i sees keys 0..i), no incoming state.

    phi_q [B, Hf, G, L, M], phi_k [B, Hf, L, M], v1 [B, Hf, L, W] -> (out [B, Hf, G, L, W],
    total key state phi_kᵀv1 [B, Hf, 1, M, W]). All chunks at once, no Python loop: L is zero-padded
    to nC·C (a zero key adds nothing; padded query rows are dropped), each chunk's key state
    S_c = φ(K_c)ᵀV_c is formed by one batched product, a cumsum over chunks minus S_c gives the state
    entering each chunk, and the in-chunk part is the tril-masked C×C block. Many small ops cost more
    than their flops on a busy CPU (each one synchronises the thread pool), hence few large ones.
    Memory O(L·G·C + (L/C)·M·W) per kv head: never L×L, never a per-position [L, M, W] state.
    """
    B, Hf, G, L, M = phi_q.shape
    W = v1.shape[-1]
    C = min(chunk_size, L)
    nC = -(-L // C)
    pad = nC * C - L
    if pad:
        phi_q = torch.nn.functional.pad(phi_q, (0, 0, 0, pad))
        phi_k = torch.nn.functional.pad(phi_k, (0, 0, 0, pad))
        v1 = torch.nn.functional.pad(v1, (0, 0, 0, pad))
    # Chunk-major query layout [B·Hf·nC, G·C, M]: the G query heads of a kv head share one product
    # with that chunk's keys and state (a free view when G = 1).
    fq_XRM = phi_q.reshape(B, Hf, G, nC, C, M).transpose(2, 3).reshape(B * Hf * nC, G * C, M)
    fk_XCM = phi_k.reshape(B * Hf * nC, C, M)
    v_XCW = v1.reshape(B * Hf * nC, C, W)
    chunk_state = (fk_XCM.transpose(1, 2) @ v_XCW).reshape(B, Hf, nC, M, W)
    running = chunk_state.cumsum(2)  # state after chunk c
    # The state before chunk c is running − own; it is kept negated, in place of the chunk states,
    # and the sign folded into the GEMM's beta below. Large fresh tensors are what this path pays
    # for on CPU (first-touch page faults cost more than the arithmetic), so intermediates are
    # updated in place where autograd allows it: neither bmm nor cumsum reads its output or
    # input back in backward. The rounding error of running − own is that of the cumsum itself.
    neg_prefix = chunk_state.sub_(running)
    scores = (fq_XRM @ fk_XCM.transpose(1, 2)).reshape(B * Hf * nC, G, C, C).tril_()
    inter = fq_XRM @ neg_prefix.reshape(B * Hf * nC, M, W)
    out = inter.baddbmm_(scores.reshape(B * Hf * nC, G * C, C), v_XCW, beta=-1.0)
    out = out.reshape(B, Hf, nC, G, C, W).transpose(2, 3).reshape(B, Hf, G, nC * C, W)[:, :, :, :L]
    return out, running[:, :, -1:]





def grouped_heads(phi_q: Tensor, phi_k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
    """Reshape φ(q) to [B, Hf, G, Nq, M] and repeat v to Hf heads when keys were featurised per query head."""
    B, H, Nq, M = phi_q.shape
    Hf = phi_k.shape[1]
    if v.shape[1] != Hf:  # per-head φ: v is shared by the G query heads of its kv head
        v = v.repeat_interleave(Hf // v.shape[1], dim=1)
    return phi_q.reshape(B, Hf, H // Hf, Nq, M), v, H // Hf


def causal_linear_blocks(q_BHND: Tensor, k_BHND: Tensor, v_BHND: Tensor, featurize: Callable[[Tensor], Tensor],
                         *, per_head: bool, eps: float, chunk_size: int, block_size: int, cdt: torch.dtype,
                         keep_BN: Optional[Tensor] = None) -> Tensor:
    """Causal normalised linear attention of aligned q [B, H, N, D], k [B, Hkv, N, D], v [B, Hkv, N, Dv]
    from the raw inputs, one block of `block_size` rows at a time; returns out [B, H, N, Dv] in q's
    dtype, laid out in memory as [B, N, H, Dv] (HF's attention output: its transpose is free).

    `featurize` maps x [B, h, n, D] (compute dtype) to φ(x) [B, h, n, M] row by row; `per_head`:
    keys are featurised per query head (hedgehog). Inside a block the maths is `causal_chunks`'
    (chunk states, their cumsum, tril-masked C×C blocks, the G query heads of a kv head in one
    product); a carried key state [B·Hf, 1, M, W] joins the blocks. Why blocks: every intermediate
    then has block size and stays in cache and in the allocator's reused memory, where the
    whole-sequence version paid, per N-sized tensor, first-touch page faults and a pass over RAM --
    more than its arithmetic. Only q, k, v are read and the output written at full length.
    """
    B, H, N, _ = q_BHND.shape
    Hkv, Dv = k_BHND.shape[1], v_BHND.shape[-1]
    Hf = H if per_head else Hkv
    G, W = H // Hf, Dv + 1
    C = max(1, min(chunk_size, N))
    Nb = max(C, block_size // C * C)
    out_BHND = heads_inner_empty(B, H, N, Dv, q_BHND)
    out_BNHD = out_BHND.transpose(1, 2)
    carry = None  # [B·Hf, 1, M, W]: φ(k)ᵀ[v ‖ 1] of every earlier block
    for r0 in range(0, N, Nb):
        n = min(Nb, N - r0)
        nC = -(-n // C)
        pad = nC * C - n
        k_b, v_b = k_BHND[:, :, r0:r0 + n], v_BHND[:, :, r0:r0 + n]
        if per_head and Hkv != H:
            k_b = k_b.repeat_interleave(H // Hkv, dim=1)
        if Hf != Hkv:
            v_b = v_b.repeat_interleave(Hf // Hkv, dim=1)
        fq = featurize(q_BHND[:, :, r0:r0 + n].to(cdt))  # [B, H, n, M]
        fk = featurize(k_b.to(cdt))  # [B, Hf, n, M]
        if keep_BN is not None:
            fk = fk * keep_BN[:, None, r0:r0 + n, None].to(cdt)
        v1 = torch.cat([v_b.to(cdt), v_b.new_ones(B, Hf, n, 1, dtype=cdt)], dim=-1)
        if pad:  # zero keys add nothing; the padded query rows are dropped
            fq, fk, v1 = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v1))
        M = fk.shape[-1]
        X = B * Hf * nC
        fq_XRM = fq.reshape(B, Hf, G, nC, C, M).transpose(2, 3).reshape(X, G * C, M)
        fk_XCM = fk.reshape(X, C, M)
        v_XCW = v1.reshape(X, C, W)
        chunk_state = torch.bmm(fk_XCM.transpose(1, 2), v_XCW).view(B * Hf, nC, M, W)
        running = chunk_state.cumsum(1)  # state after each chunk of the block
        # State before chunk c, negated (the sign goes into the GEMM's beta): own − running − carry.
        # In place, as in `causal_chunks` (neither bmm nor cumsum reads these back in backward).
        neg_prefix = chunk_state.sub_(running)
        if carry is not None:
            neg_prefix = neg_prefix.sub_(carry)
            carry = carry + running[:, -1:]
        else:
            carry = running[:, -1:]
        scores = torch.bmm(fq_XRM, fk_XCM.transpose(1, 2)).view(X, G, C, C).tril_()
        o_XRW = torch.bmm(fq_XRM, neg_prefix.view(X, M, W)).baddbmm_(scores.view(X, G * C, C), v_XCW, beta=-1.0)
        o = o_XRW.view(B, Hf, nC, G, C, W)
        den = o[..., Dv:] + eps
        if eps < torch.finfo(den.dtype).tiny:  # no visible key and eps = 0: an all-zero row (see _safe_ratio)
            den = torch.where(den == 0, 1.0, den)
        if pad:
            tail = (o[..., :Dv] / den).transpose(2, 3).reshape(B, Hf, G, nC * C, Dv)[:, :, :, :n]
            out_BNHD[:, r0:r0 + n].copy_(tail.permute(0, 3, 1, 2, 4).reshape(B, n, H, Dv))
            continue
        # The output rows of this block as [B, Hf, nC, G, C, Dv], a view of the [B, N, H, Dv] buffer.
        target = out_BNHD[:, r0:r0 + n].view(B, nC, C, Hf, G, Dv).permute(0, 3, 1, 4, 2, 5)
        if o.requires_grad:  # (out= is not differentiable)
            target.copy_(o[..., :Dv] / den)
        else:
            torch.div(o[..., :Dv], den, out=target)
    return out_BHND


def heads_inner_empty(B: int, H: int, N: int, Dv: int, like: Tensor) -> Tensor:
    """An uninitialised [B, H, N, Dv] in `like`'s dtype and device whose memory is [B, N, H, Dv].

    Not a view (a custom op may not return one that its caller then writes into), and its transpose
    to [B, N, H, Dv], what attention functions hand back, is contiguous.
    """
    return torch.empty_strided((B, H, N, Dv), (N * H * Dv, Dv, H * Dv, 1), dtype=like.dtype, device=like.device)
