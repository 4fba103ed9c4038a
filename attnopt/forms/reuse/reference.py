"""Block-sparse softmax attention: each query reads only the key blocks its list names.

    o_i = Σ_{j ∈ V(i)} softmax(s · q_i k_jᵀ) v_j,
    V(i) = { key j : ⌊pos(j) / b⌋ ∈ blocks[i],  pos(j) ≤ pos(i) when causal,  key_mask[j] }

The queries are the last Nq of the Nk columns (bottom-right, as with a KV cache). Positions count
each row's columns from its offset (pos = column − offset): columns before it are padding, as
queries (zero rows) and as keys.
`blocks` [B, Nq, K] lists each query's key blocks (−1: an empty slot; an id at most once per row).
A query that sees no key gets a zero row. Cost: O(Nq · K · b) scores, never Nq × Nk.

Two CPU paths, one result: FlexAttention with a BlockMask (torch.compile'd once per process; a
prefill, where each query block shares one list) and gathered blocks + batched matmul (any call:
decoding, chunks after a cache, per-row offsets). The prefill takes Flex: measured 0.22 s against
the gathered path's 0.49 s and SDPA causal's 0.82 s at 8k, 8/2 heads, D 64, 16 blocks of 64 (2
cores, loaded machine). CUDA tensors take the Triton kernel (triton.py).

Letters: B batch, H query heads, Hkv key/value heads, G = H / Hkv, Nq/Nk query/key length, D, Dv
head dims, b block, K list slots, M query blocks, C tiles in one step, T queries per tile.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.layout import check_sdpa_inputs, compute_dtype, is_fake_tensor
from attnopt.kernels.registration import register_recompute_autograd

__all__ = ["block_sparse_attention", "gathered_attention", "flex_attention_cpu", "uniform_per_block"]

# Scores held at once by the gathered path (per step over tiles): 32 MB in fp32.
SCORES_PER_STEP = 1 << 23
# Below this many scores a call is too small for Flex's launch to pay: the gathered path runs.
FLEX_MIN_SCORES = 1 << 22


def _check(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, block: int, key_mask: Optional[Tensor],
           offsets: Optional[Tensor]) -> None:
    check_sdpa_inputs("block_sparse_attention", q, k, v, key_mask)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block_sparse_attention: block must be a positive int, got {block!r}")
    B, Nq = q.shape[0], q.shape[2]
    if not isinstance(blocks, Tensor) or blocks.dtype not in (torch.int32, torch.int64) or blocks.dim() != 3 \
            or tuple(blocks.shape[:2]) != (B, Nq):
        raise ValueError(f"block_sparse_attention: blocks must be an int tensor [B, Nq, K] = [{B}, {Nq}, K], got "
                         f"{getattr(blocks, 'dtype', type(blocks).__name__)} {tuple(getattr(blocks, 'shape', ()))}")
    if q.shape[2] > k.shape[2]:
        raise ValueError(f"block_sparse_attention: {q.shape[2]} queries but only {k.shape[2]} keys; the queries are "
                         "the last Nq of the keys' positions")
    if offsets is not None and (offsets.dtype != torch.int64 or tuple(offsets.shape) != (B,)):
        raise ValueError(f"block_sparse_attention: offsets must be int64 [B] = [{B}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")


# ---------------------------------------------------------------------------------------------
# gathered blocks + batched matmul
# ---------------------------------------------------------------------------------------------


def gathered_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, *, block: int, causal: bool, scale: float,
                       key_mask: Optional[Tensor] = None, offsets: Optional[Tensor] = None) -> Tensor:
    """The op on any call: tiles of queries that share a list gather their blocks' keys and values
    and run one masked softmax each; tiles batch into steps of at most SCORES_PER_STEP scores."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G, K = H // Hkv, blocks.shape[-1]
    dtype = compute_dtype(q.dtype)
    if Nq == 1 and offsets is None and key_mask is None and not q.requires_grad:
        return _one_query(q, k, v, blocks, block, causal, scale, dtype)
    off = torch.zeros(B, dtype=torch.long, device=q.device) if offsets is None else offsets
    qpos_BQ = (Nk - Nq) + torch.arange(Nq, device=q.device)[None, :] - off[:, None]
    same_offset = offsets is None or bool((offsets == offsets[0]).all())
    # Tiles: runs of queries inside one query block for every row (one offset: aligned runs of b);
    # rows with different offsets, and calls of fewer queries than a block (decoding), tile per query.
    T = block if same_offset and Nq >= block else 1
    lead = int(qpos_BQ[0, 0]) % block if T > 1 else 0
    if T > 1 and not _tiles_share_lists(blocks, T, lead):  # a caller's lists may differ inside a block
        T, lead = 1, 0
    n_tiles = -(-(lead + Nq) // T)
    pad_tail = n_tiles * T - lead - Nq
    q_t = torch.nn.functional.pad(q.to(dtype), (0, 0, lead, pad_tail)).view(B, Hkv, G, n_tiles, T, D)
    row_of_tile = (torch.arange(n_tiles, device=q.device) * T - lead).clamp(0, Nq - 1)  # a real query of each tile
    empty_BQ = (blocks < 0).all(-1) if T > 1 else None
    if empty_BQ is not None and bool(empty_BQ.any()):
        # A query with an empty list (a padded row beside real ones in its block) reads nothing: it
        # counts as padding, and its tile's list is that of its first query with one.
        listed_t = torch.nn.functional.pad(~empty_BQ, (lead, pad_tail), value=False).view(B, n_tiles, T)
        starts = torch.arange(n_tiles, device=q.device) * T - lead
        rows_BC = (starts + listed_t.long().argmax(-1)).clamp(0, Nq - 1)
        lists = blocks.long().gather(1, rows_BC[..., None].expand(B, n_tiles, K))
        qpos_BQ = torch.where(empty_BQ, -(1 << 40), qpos_BQ)
    else:
        lists = blocks.long()[:, row_of_tile]  # [B, n_tiles, K]
    qpos_t = torch.nn.functional.pad(qpos_BQ, (lead, pad_tail), value=-(1 << 40)).view(B, n_tiles, T)
    out = q.new_zeros(B, Hkv, G, n_tiles, T, Dv, dtype=dtype)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    step = max(1, SCORES_PER_STEP // max(1, Hkv * G * T * K * block))
    slot = torch.arange(block, device=q.device)
    for c0 in range(0, n_tiles, step):
        c1 = min(n_tiles, c0 + step)
        ids = lists[:, c0:c1]  # [B, C, K]
        kpos = (ids.clamp_min(0) * block)[..., None] + slot  # [B, C, K, b]
        cols = kpos + off[:, None, None, None]
        ok = (ids >= 0)[..., None] & (cols < Nk) & (kpos >= 0)
        cols = torch.where(ok, cols, 0).flatten(2)  # [B, C, K·b]
        kpos = kpos.flatten(2)
        visible = ok.flatten(2)[:, :, None, :]  # [B, C, 1, K·b]
        if key_mask is not None:
            visible = visible & key_mask.gather(1, cols.flatten(1)).view(cols.shape)[:, :, None, :]
        visible = visible & (qpos_t[:, c0:c1, :, None] >= 0)  # queries before a row's offset are padding
        if causal:
            visible = visible & (kpos[:, :, None, :] <= qpos_t[:, c0:c1, :, None])
        hidden = ~visible
        if grad:  # a query that sees no key gets finite scores, then 0: softmax's backward of a NaN row is NaN
            seen = visible.any(-1, keepdim=True)
            hidden &= seen
        bias = torch.zeros(visible.shape, dtype=dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        for r in range(B):
            idx = cols[r].flatten()
            C = c1 - c0
            k_g = k[r].index_select(1, idx).to(dtype).view(Hkv, C, K * block, D)
            v_g = v[r].index_select(1, idx).to(dtype).view(Hkv, C, K * block, Dv)
            q_r = q_t[r, :, :, c0:c1].transpose(1, 2).reshape(Hkv, C, G * T, D)
            s = torch.matmul(q_r, k_g.transpose(-1, -2)).mul_(scale).view(Hkv, C, G, T, K * block)
            s.add_(bias[r][None, :, None])
            p = torch.softmax(s, dim=-1)
            p = (p * seen[r][None, :, None] if grad else p.nan_to_num_(0.0)).view(Hkv, C, G * T, K * block)
            out[r, :, :, c0:c1] = torch.matmul(p, v_g).view(Hkv, C, G, T, Dv).transpose(1, 2)
    out = out.view(B, Hkv, G, n_tiles * T, Dv)[:, :, :, lead:lead + Nq]
    return out.reshape(B, H, Nq, Dv).to(q.dtype)


def _one_query(q, k, v, blocks, block: int, causal: bool, scale: float, dtype) -> Tensor:
    """A decoding step without padding: per row, the listed whole blocks taken as slabs of a
    [J, b] view of the cache (index_select copies K·b rows; an element-wise gather cost 6× more
    at 8k), the partial last block sliced on, then one SDPA call. The query is the last column, so
    it sees every listed key, causal or not; ids outside the cache add nothing."""
    B, H = q.shape[:2]
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    whole_blocks = Nk // block
    rows = []
    for r in range(B):
        ids = blocks[r, 0].long()
        whole = ids[(ids >= 0) & (ids < whole_blocks)]
        # (4-D, selecting along dim 2: measured 4× faster than the same index_select on a 3-D view)
        k_r = k[r:r + 1, :, : whole_blocks * block].unflatten(2, (whole_blocks, block)).index_select(2, whole)
        v_r = v[r:r + 1, :, : whole_blocks * block].unflatten(2, (whole_blocks, block)).index_select(2, whole)
        k_r, v_r = k_r.flatten(2, 3), v_r.flatten(2, 3)
        if Nk % block and bool((ids == whole_blocks).any()):  # the partial last block
            k_r = torch.cat([k_r, k[r:r + 1, :, whole_blocks * block:]], dim=2)
            v_r = torch.cat([v_r, v[r:r + 1, :, whole_blocks * block:]], dim=2)
        if k_r.shape[2] == 0:
            rows.append(q.new_zeros(1, H, 1, Dv, dtype=dtype))
            continue
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            q[r:r + 1].to(dtype), k_r.to(dtype), v_r.to(dtype), scale=scale, enable_gqa=H != Hkv))
    out = rows[0] if B == 1 else torch.cat(rows, dim=0)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# FlexAttention with a BlockMask (prefill)
# ---------------------------------------------------------------------------------------------


def _tiles_share_lists(blocks: Tensor, T: int, lead: int) -> bool:
    """Whether the queries of every tile of T (the first one starting `lead` queries early) list the
    same blocks, queries with an empty list (padding) aside."""
    B, Nq, K = blocks.shape
    n_tiles = -(-(lead + Nq) // T)
    pad_tail = n_tiles * T - lead - Nq
    b_BCTK = torch.nn.functional.pad(blocks.long(), (0, 0, lead, pad_tail), value=-1).view(B, n_tiles, T, K)
    listed_BCT = (b_BCTK >= 0).any(-1)
    first_BC = listed_BCT.long().argmax(-1)
    ref_BC1K = b_BCTK.gather(2, first_BC[..., None, None].expand(B, n_tiles, 1, K))
    return bool(((b_BCTK == ref_BC1K) | ~listed_BCT[..., None]).all())


def uniform_per_block(blocks: Tensor, block: int) -> bool:
    """Whether every query block's queries share one list (what a BlockMask can say)."""
    N = blocks.shape[1]
    firsts = blocks[:, ::block].repeat_interleave(block, dim=1)[:, :N]
    return bool((firsts == blocks).all())


@functools.cache
def _compiled_flex():
    """FlexAttention compiled once (dynamic shapes: one compile serves every length); None with a
    warning where Inductor cannot build it (no C compiler), or ATTNOPT_FLEX=0."""
    if os.environ.get("ATTNOPT_FLEX", "1") == "0":
        return None
    try:
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention, dynamic=True)
    except Exception as exc:  # an old torch without flex_attention
        warnings.warn(f"block_sparse_attention: FlexAttention is not available ({exc}); the gathered path runs",
                      RuntimeWarning, stacklevel=3)
        return None


def flex_attention_cpu(q: Tensor, k: Tensor, v: Tensor, blocks_BMK: Tensor, *, block: int, causal: bool, scale: float,
                       key_mask: Optional[Tensor] = None) -> Tensor:
    """The op for a prefill (Nq == Nk, positions = columns) whose query block m reads blocks_BMK[:, m]:
    one FlexAttention call. Blocks before the diagonal are full; the diagonal (and, with padding,
    every listed block) applies the causal / padding mask per element."""
    from torch.nn.attention.flex_attention import BlockMask

    fn = _compiled_flex()
    if fn is None:
        raise RuntimeError("FlexAttention is off (ATTNOPT_FLEX=0) or unavailable here")
    B, H, N, D = q.shape
    M, J = blocks_BMK.shape[1], -(-k.shape[2] // block)
    ids = blocks_BMK.long()
    m = torch.arange(M, device=q.device)[None, :, None]
    listed = ids >= 0
    partial = listed & (torch.ones_like(listed) if key_mask is not None else (ids >= m) if causal else
                        torch.zeros_like(listed))
    full = listed & ~partial

    def packed(which):  # BlockMask wants [B, 1, M] counts and [B, 1, M, J] indices, the listed ones first
        order = torch.sort((~which).to(torch.int8), dim=-1, stable=True).indices
        idx = torch.gather(ids.clamp_min(0), -1, order)
        idx = torch.nn.functional.pad(idx, (0, max(0, J - idx.shape[-1])))[..., :J]
        return which.sum(-1).to(torch.int32)[:, None], idx.to(torch.int32)[:, None].contiguous()

    kv_num, kv_idx = packed(partial)
    full_num, full_idx = packed(full)
    keep = key_mask

    def mask_mod(b, h, q_idx, kv_idx_):
        ok = (kv_idx_ <= q_idx) if causal else (kv_idx_ >= 0)
        return ok & keep[b, kv_idx_] if keep is not None else ok

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(N, N))
    dtype = compute_dtype(q.dtype)
    out = fn(q.to(dtype), k.to(dtype), v.to(dtype), block_mask=mask, scale=scale, enable_gqa=k.shape[1] != H)
    return out.to(q.dtype)


def _flex_fits(q: Tensor, k: Tensor, blocks: Tensor, block: int, offsets: Optional[Tensor]) -> bool:
    if q.device.type != "cpu" or q.shape[2] != k.shape[2] or offsets is not None or q.dtype == torch.float64:
        return False
    scores = q.shape[0] * q.shape[1] * q.shape[2] * blocks.shape[-1] * block
    return scores >= FLEX_MIN_SCORES and _compiled_flex() is not None and uniform_per_block(blocks, block)


# ---------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("attnopt::block_sparse_attention", mutates_args=())
def _block_sparse_op(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, block: int, causal: bool, scale: float,
                     key_mask: Optional[Tensor], offsets: Optional[Tensor]) -> Tensor:
    if _flex_fits(q, k, blocks, block, offsets):
        out = flex_attention_cpu(q, k, v, blocks[:, ::block], block=block, causal=causal, scale=scale,
                                 key_mask=key_mask)
        return out.clone() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out
    return gathered_attention(q, k, v, blocks, block=block, causal=causal, scale=scale, key_mask=key_mask,
                              offsets=offsets)


@_block_sparse_op.register_fake
def _(q, k, v, blocks, block, causal, scale, key_mask, offsets):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _differentiable(q, k, v, blocks, block, causal, scale, key_mask, offsets):
    return gathered_attention(q, k, v, blocks, block=block, causal=causal, scale=scale, key_mask=key_mask,
                              offsets=offsets)


register_recompute_autograd(_block_sparse_op, _differentiable, differentiable=(0, 1, 2))


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, *, block: int, causal: bool,
                           scale: Optional[float] = None, key_mask: Optional[Tensor] = None,
                           offsets: Optional[Tensor] = None) -> Tensor:
    """Softmax attention of q [B, H, Nq, D] over the key blocks `blocks` [B, Nq, K] names per query
    (k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]; see the module docstring); returns [B, H, Nq, Dv]."""
    _check(q, k, v, blocks, block, key_mask, offsets)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kernels = cuda_kernels(q, "attnopt.forms.reuse")
    if kernels is not None and not is_fake_tensor(q) and kernels.unsupported(q, k=k, block=block, offsets=offsets) \
            is None and uniform_per_block(blocks, block) and q.shape[2] == k.shape[2]:
        return kernels.block_sparse_attention_triton(q, k, v, blocks[:, ::block], block=block, causal=causal,
                                                     scale=scale, key_mask=key_mask)
    return _block_sparse_op(q, k, v, blocks, block, causal, scale, key_mask, offsets)
