"""Chunked causal linear attention in PyTorch: the scan every linear-state form builds on.

Letters: B batch, Hf heads the features were computed for, G query heads per such head, L length,
M feature dim, W value columns (Dv, plus one when a ones column carries the normaliser), C chunk.
"""

from __future__ import annotations

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
