"""Sliding-window softmax attention with StreamingLLM attention sinks, computed blockwise.

Window convention -- `window` = W is the number of keys a query sees on the causal side,
INCLUDING ITSELF:

* causal:      query i sees keys j with  i - W < j <= i       (W keys: i-W+1 .. i)
* non-causal:  query i sees keys j with  |i - j| < W          (2W - 1 keys: i-W+1 .. i+W-1)

plus `sinks` = S attention sinks: per batch row, the first S keys that `key_mask` keeps (the first S
real tokens; keys 0..S-1 when there is no mask). Counting real tokens rather than positions is what
makes a left-padded row equal the same row run alone: with positions, the sinks of a left-padded
row would be pad tokens (batched Llama generate diverged that way). A row with fewer than S real
keys has that many sinks. Sinks obey causality (a sink j is hidden from query i when causal and
j > i). A sink that already lies inside the band is counted once.

Mapping to runtimes that name the window differently:

* ONNX Runtime GroupQueryAttention `local_window_size` counts the keys including self (ORT 1.32),
  so `local_window_size = window`.
* ONNX opset-25 Attention `left_window_size` counts the keys to the LEFT of self (W there means
  W + 1 visible keys), so `left_window_size = window - 1` (and `right_window_size = window - 1`
  for the non-causal band, 0 for causal).

Alignment: when Nq != Nk the queries are the LAST Nq positions (bottom-right, as with a KV cache):
query i sits at absolute position Nk - Nq + i, in both causal and non-causal mode.

A query that sees no key at all (only possible through `key_mask`, or queries placed before key 0)
gets an all-zero output row instead of SDPA's NaN / undefined row.

Cost: O(N * (W + sinks)) time and memory, never Nq x Nk. Queries are split into blocks of Bq; each
block takes the band of keys its queries can see (a slice of length L = Bq + W - 1 causal,
Bq + 2W - 2 otherwise) and runs a masked softmax within the band, jointly with the sink keys that
lie outside it (sinks inside the band are read once, through the band). The S sink keys of each row
are gathered once ([B, Hkv, S, D]); their positions come from a search in the running count of kept
keys, O(B·(Nk + S·log Nk)). Many blocks run per step
(up to SCORES_PER_STEP scores), so the op count stays small.

Registered as the custom op `torch.ops.attnopt.window_attention` (fake + autograd; the backward
recomputes the blockwise forward under autograd, so it is O(N * W) too).

Letters: B batch, H query heads, Hkv key/value heads, G = H // Hkv query heads per kv head, Nq/Nk
query/key length, D head dim of q and k, Dv head dim of v, W window, S sinks, nb query blocks,
Bq query block size, L band length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.layout import check_int, check_sdpa_inputs, compute_dtype
from attnopt.kernels.registration import prefill_op

__all__ = [
    "window_attention",
    "window_attention_reference",
    "window_visibility_mask",
    "default_window_block_size",
    "first_real_keys",
    "sink_key_mask",
    "BandBlocks",
    "BandStep",
    "band_blocks",
    "sinks_outside_band",
]


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor]) -> None:
    check_sdpa_inputs("window_attention", q, k, v, key_mask)


def first_real_keys(key_mask_BN: Optional[Tensor], sinks: int, B: int, Nk: int, device=None) -> tuple[Tensor, Tensor]:
    """Positions [B, S] of each row's sinks -- its first S kept keys -- and which of them exist [B, S].

    S = min(sinks, Nk). Without a mask the sinks are keys 0..S-1 in every row. A row with r < S kept
    keys has its first r slots valid; the others point at key 0 (a harmless index) and are invalid.
    """
    S = min(sinks, Nk)
    if key_mask_BN is None:
        j_BS = torch.arange(S, device=device).expand(B, S)
        return j_BS, torch.ones(B, S, dtype=torch.bool, device=device)
    kept_BN = key_mask_BN.cumsum(dim=1)  # kept keys up to and including j (non-decreasing)
    rank_BS = torch.arange(1, S + 1, device=key_mask_BN.device).expand(B, S).contiguous()
    j_BS = torch.searchsorted(kept_BN, rank_BS)  # first j whose running count reaches rank s + 1
    valid_BS = j_BS < Nk
    return torch.where(valid_BS, j_BS, 0), valid_BS


def sink_key_mask(key_mask_BN: Optional[Tensor], sinks: int, B: int, Nk: int, device=None) -> Tensor:
    """Bool [B, Nk]: True where key j is one of its row's sinks (see `first_real_keys`). N-sized, not N x N."""
    if key_mask_BN is None:
        return (torch.arange(Nk, device=device) < sinks).expand(B, Nk)
    return key_mask_BN & (key_mask_BN.cumsum(dim=1) <= sinks)


def default_window_block_size(window: int, causal: bool) -> int:
    """Query block size ~W/4 (clamped to 32..128): the band Bq + W - 1 stays close to W, so few
    scores are wasted, while blocks stay large enough for efficient matmuls.
    Measured at N=16k, W=256, 2 CPU threads: Bq=64 beat 32, 128 and 256."""
    width = window if causal else 2 * window - 1
    return int(max(32, min(128, width // 4)))


# Scores computed per step (elements): a step is a few large ops over many query blocks. On a
# busy 2-core CPU every op pays a thread-synchronisation cost, so small steps (one per block, or
# 2^21 scores) ran 2-5x slower than 2^23; on an idle machine 2^21 was ~1.4x faster than 2^23.
# 2^23 (32 MB fp32) is the robust choice; peak memory stays bounded for any N.
SCORES_PER_STEP = 1 << 23


# ---- blocking shared with linear_window: query blocks, their key bands, the steps over them ----


@dataclass(frozen=True)
class BandStep:
    """One step: query blocks b0 .. b0+n-1, whose bands are padded key columns a .. e."""

    b0: int
    n: int
    a: int
    e: int


@dataclass(frozen=True)
class BandBlocks:
    """How one call is blocked: nb query blocks of Bq, block b against a band of L keys that starts
    lo keys left of its first query; k/v are padded by pad_left / pad_right so every band is in range.
    """

    Nq: int
    Nk: int
    off: int  # Nk - Nq, bottom-right alignment: query i is at key position off + i
    W: int  # the window, capped where a wider one sees nothing more
    S: int  # sinks, at most Nk
    lo: int  # band keys left of self
    hi: int  # band keys right of self (0 causal)
    Bq: int
    nb: int
    L: int
    pad_left: int
    pad_right: int
    start: int  # padded index of block 0's first band key

    def blocks_per_step(self, BH: int, columns: int, scores_per_step: int) -> int:
        """Query blocks per step so that a step scores about `scores_per_step` elements (at least one)."""
        return max(1, min(self.nb, scores_per_step // max(1, BH * self.Bq * columns)))

    def steps(self, n_step: int) -> list[BandStep]:
        """The steps in order, n_step blocks each (the last one may have fewer)."""
        steps = []
        for b0 in range(0, self.nb, n_step):
            n = min(self.nb, b0 + n_step) - b0
            a = self.start + b0 * self.Bq
            steps.append(BandStep(b0, n, a, a + (n - 1) * self.Bq + self.L))
        return steps

    def pad_keys(self, x_BHkvND: Tensor) -> Tensor:
        """k or v padded along N so that every band is in range (the pads are masked by the caller)."""
        return F.pad(x_BHkvND, (0, 0, self.pad_left, self.pad_right))

    def pad_key_mask(self, key_mask_BN: Tensor) -> Tensor:
        """The key mask padded as `pad_keys` pads k: pads are never kept."""
        return F.pad(key_mask_BN, (self.pad_left, self.pad_right), value=False)

    def band_mask(self, device) -> Tensor:
        """Bool [Bq, L]: row r of a block sees band columns r .. r + lo + hi."""
        rel_Bq_L = torch.arange(self.L, device=device)[None, :] - torch.arange(self.Bq, device=device)[:, None]
        return (rel_Bq_L >= 0) & (rel_Bq_L <= self.lo + self.hi)

    def bands(self, k_pad: Tensor, v_pad: Tensor, step: BandStep) -> tuple[Tensor, Tensor]:
        """The step's key bands [B, Hkv, n, D, L] and value bands [B, Hkv, n, L, Dv] of padded k, v.

        Overlapping bands gathered into contiguous copies (the matmul would copy them anyway, and
        traced backward graphs mis-handle views with overlapping strides)."""
        k_B_Hkv_n_D_L = k_pad[:, :, step.a : step.e].unfold(2, self.L, self.Bq).contiguous()
        v_B_Hkv_n_L_Dv = v_pad[:, :, step.a : step.e].unfold(2, self.L, self.Bq).transpose(-1, -2).contiguous()
        return k_B_Hkv_n_D_L, v_B_Hkv_n_L_Dv

    def band_key_mask(self, mask_pad_BN: Tensor, step: BandStep) -> Tensor:
        """Bool [B, n, L]: the padded key mask over the step's bands."""
        return mask_pad_BN[:, step.a : step.e].unfold(1, self.L, self.Bq)

    def block_queries(self, q_BHkvNGD: Tensor, step: BandStep) -> Tensor:
        """The step's queries [B, Hkv, n, Bq·G, D] of block-padded grouped queries [B, Hkv, nb·Bq, G, D]."""
        B, Hkv, _, G, D = q_BHkvNGD.shape
        return q_BHkvNGD[:, :, step.b0 * self.Bq : (step.b0 + step.n) * self.Bq].reshape(B, Hkv, step.n, self.Bq * G, D)

    def block_positions(self, step: BandStep, device) -> Tensor:
        """Long [n, Bq]: the key position of each query of the step's blocks (past Nq for padding rows)."""
        blocks_n = step.b0 + torch.arange(step.n, device=device)
        return blocks_n[:, None] * self.Bq + torch.arange(self.Bq, device=device)[None, :]


def band_blocks(Nq: int, Nk: int, window: int, causal: bool, sinks: int, block_size: int) -> BandBlocks:
    """The blocking of a call with Nq, Nk >= 1: band widths, block count and the padding of k / v."""
    off = Nk - Nq
    W = min(window, Nk + abs(off) + Nq + 1)  # a wider window sees nothing more
    lo, hi = W - 1, (0 if causal else W - 1)
    Bq = max(1, min(block_size, Nq))
    nb = (Nq + Bq - 1) // Bq
    L = Bq + lo + hi
    # Band of block b starts at key off + b*Bq - lo; pad k/v (masked out) so all are in range.
    pad_left = max(0, lo - off)
    start = off - lo + pad_left
    pad_right = max(0, start + (nb - 1) * Bq + L - (Nk + pad_left))
    return BandBlocks(Nq, Nk, off, W, min(sinks, Nk), lo, hi, Bq, nb, L, pad_left, pad_right, start)


def sinks_outside_band(
    blocks: BandBlocks, step: BandStep, j_BS: Tensor, sink_ok_BS: Tensor, causal: bool, device
) -> Tensor:
    """Bool [B, n, Bq, S]: sink s adds a column for a query only where it exists, the band does not
    already hold it (a sink is counted once) and, causal, it is not after the query."""
    p_n_Bq = blocks.off + blocks.block_positions(step, device)
    d_B_n_Bq_S = p_n_Bq[None, :, :, None] - j_BS[:, None, None, :]
    in_band = ((d_B_n_Bq_S >= 0) & (d_B_n_Bq_S < blocks.W)) if causal else (d_B_n_Bq_S.abs() < blocks.W)
    ok = ~in_band & sink_ok_BS[:, None, None, :]
    if causal:
        ok = ok & (d_B_n_Bq_S >= 0)
    return ok


# ---- window_attention's body: one masked softmax per step over the bands (+ the sinks) ----


@dataclass
class _Sinks:
    """Each row's sink keys, gathered once: positions [B, S], which exist [B, S], and k / v as
    [B, Hkv, 1, D, S] / [B, Hkv, 1, S, Dv] in the compute dtype (the 1 broadcasts over blocks)."""

    j_BS: Tensor
    ok_BS: Tensor
    k_BHkv1DS: Tensor
    v_BHkv1SDv: Tensor


def _gather_sinks(k_BHkvND: Tensor, v_BHkvND: Tensor, key_mask_BN: Optional[Tensor], S: int, cdt, device) -> _Sinks:
    """The first S kept keys of each row (under left padding keys 0..S-1 are pads)."""
    B, _, Nk, _ = k_BHkvND.shape
    j_BS, sink_ok_BS = first_real_keys(key_mask_BN, S, B, Nk, device)
    if key_mask_BN is None:
        k_BHkvSD, v_BHkvSDv = k_BHkvND[:, :, :S], v_BHkvND[:, :, :S]
    else:
        k_BHkvSD = torch.take_along_dim(k_BHkvND, j_BS[:, None, :, None], dim=2)
        v_BHkvSDv = torch.take_along_dim(v_BHkvND, j_BS[:, None, :, None], dim=2)
    return _Sinks(j_BS, sink_ok_BS, k_BHkvSD.to(cdt).transpose(-1, -2)[:, :, None], v_BHkvSDv.to(cdt)[:, :, None])


def _grouped_queries(q_BHND: Tensor, Hkv: int, scale: float, cdt, blocks: BandBlocks) -> Tensor:
    """Scaled queries as [B, Hkv, nb·Bq, G, D], zero-padded to whole blocks: a block of rows
    (position, g) is one matrix, so the G query heads sharing a kv head share one matmul."""
    B, H, Nq, D = q_BHND.shape
    q_BHkvNGD = (q_BHND.to(cdt) * scale).reshape(B, Hkv, H // Hkv, Nq, D).transpose(2, 3).contiguous()
    if blocks.nb * blocks.Bq > Nq:  # (a zero-width pad keeps the input's strides eagerly but not when traced)
        q_BHkvNGD = F.pad(q_BHkvNGD, (0, 0, 0, 0, 0, blocks.nb * blocks.Bq - Nq))
    return q_BHkvNGD


def _hidden_band_scores(
    blocks: BandBlocks, step: BandStep, band_Bq_L: Tensor, km_pad_BN: Optional[Tensor], device
) -> Tensor:
    """Bool, broadcastable to the scores [B, Hkv, n, Bq, G, L]: True where a band column is hidden.

    Interior steps without a key mask share one [Bq, 1, L] mask; others also hide keys outside
    0..Nk-1 and masked keys, but never a whole padding row (past Nq): its outputs are dropped, yet a
    row of -inf scores would put NaN into the softmax backward (and from there into dk)."""
    j_first = blocks.off - blocks.lo + step.b0 * blocks.Bq  # key index of band column 0 of the step's first block
    if j_first >= 0 and j_first + (step.n - 1) * blocks.Bq + blocks.L <= blocks.Nk and km_pad_BN is None:
        return ~band_Bq_L[:, None, :]
    c_L = torch.arange(blocks.L, device=device)
    j_n_L = j_first + torch.arange(step.n, device=device)[:, None] * blocks.Bq + c_L[None, :]
    keep = ((j_n_L >= 0) & (j_n_L < blocks.Nk))[None]
    if km_pad_BN is not None:
        keep = keep & blocks.band_key_mask(km_pad_BN, step)
    hidden = ~(band_Bq_L[None, None] & keep[:, :, None, :])[:, None, :, :, None, :]
    real_n_Bq = blocks.block_positions(step, device) < blocks.Nq
    return hidden & real_n_Bq[None, None, :, :, None, None]


def _sink_scores(
    blocks: BandBlocks, step: BandStep, q_blk: Tensor, sinks: _Sinks, causal: bool, G: int
) -> Tensor:
    """Sink scores [B, Hkv, n, Bq, G, S], -inf where the sink adds no column for that query."""
    B, Hkv = q_blk.shape[:2]
    ok_B_n_Bq_S = sinks_outside_band(blocks, step, sinks.j_BS, sinks.ok_BS, causal, q_blk.device)
    ss = torch.matmul(q_blk, sinks.k_BHkv1DS).reshape(B, Hkv, step.n, blocks.Bq, G, blocks.S)
    ss.masked_fill_(~ok_B_n_Bq_S[:, None, :, :, None, :], float("-inf"))
    return ss


def _softmax_block(s_B_Hkv_n_Bq_G_L: Tensor, v_band: Tensor, Dv: int) -> Tensor:
    """Fused softmax of the scores times the value bands, [B, Hkv, n, Bq, G, Dv]: exact where every
    row sees at least itself (no sinks, no key mask, no query before key 0)."""
    B, Hkv, n, Bq, G, L = s_B_Hkv_n_Bq_G_L.shape
    p = torch.softmax(s_B_Hkv_n_Bq_G_L, dim=-1)
    return torch.matmul(p.reshape(B, Hkv, n, Bq * G, L), v_band).reshape(B, Hkv, n, Bq, G, Dv)


def _shifted_block(
    s_B_Hkv_n_Bq_G_L: Tensor,
    ss_B_Hkv_n_Bq_G_S: Optional[Tensor],
    v_band: Tensor,
    v_sink: Optional[Tensor],
    Dv: int,
    cdt,
) -> Tensor:
    """Softmax over band (+ sink) columns with an explicit max shift, [B, Hkv, n, Bq, G, Dv]; a row
    that sees nothing gets 0 (softmax would give NaN, and NaN gradients into every key)."""
    B, Hkv, n, Bq, G, L = s_B_Hkv_n_Bq_G_L.shape
    with torch.no_grad():
        row_max = s_B_Hkv_n_Bq_G_L.amax(dim=-1)
        if ss_B_Hkv_n_Bq_G_S is not None:
            row_max = torch.maximum(row_max, ss_B_Hkv_n_Bq_G_S.amax(dim=-1))
    # A row that sees nothing has max -inf; a finite shift keeps all its exps 0, its output 0.
    row_max.clamp_(min=torch.finfo(cdt).min)
    p = s_B_Hkv_n_Bq_G_L.sub_(row_max[..., None]).exp_()
    denom = p.sum(dim=-1)
    num = torch.matmul(p.reshape(B, Hkv, n, Bq * G, L), v_band)
    if ss_B_Hkv_n_Bq_G_S is not None:
        ps = ss_B_Hkv_n_Bq_G_S.sub_(row_max[..., None]).exp_()
        denom = denom + ps.sum(dim=-1)
        num = num + torch.matmul(ps.reshape(B, Hkv, n, Bq * G, ps.shape[-1]), v_sink)
    # A row that sees a key has denom >= 1 (its max term is exp(0)); one that sees none has
    # num = denom = 0, so clamping to 1 leaves seen rows exact and gives 0 for the rest.
    return num.reshape(B, Hkv, n, Bq, G, Dv) / denom.clamp(min=1.0)[..., None]


def _window_forward(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], window: int, causal: bool,
                    sinks: int, scale: float, block_size: int, scores_per_step: Optional[int] = None) -> Tensor:
    """Blockwise banded softmax; differentiable plain PyTorch (the custom op wraps it).

    k and v are padded once so every block's band is in range; a step takes n blocks, views their
    bands with `unfold` ([B, Hkv, n, D, L]) and runs one masked softmax over [B, Hkv, n, Bq, G, L].
    """
    B, H, Nq, _ = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if Nq == 0 or Nk == 0:
        return q.new_zeros(B, H, Nq, Dv)
    G, cdt, device = H // Hkv, compute_dtype(q.dtype), q.device
    blocks = band_blocks(Nq, Nk, window, causal, sinks, block_size)
    per_step = SCORES_PER_STEP if scores_per_step is None else scores_per_step
    q_BHkvNGD = _grouped_queries(q, Hkv, scale, cdt, blocks)
    k_pad, v_pad = blocks.pad_keys(k.to(cdt)), blocks.pad_keys(v.to(cdt))
    km_pad_BN = None if key_mask is None else blocks.pad_key_mask(key_mask)
    band_Bq_L = blocks.band_mask(device)
    sink_keys = _gather_sinks(k, v, key_mask, blocks.S, cdt, device) if blocks.S > 0 else None
    # Without sinks, padding or queries before key 0, every row sees at least itself: the fused
    # softmax is exact there. Otherwise rows may see nothing and the explicit path gives them 0.
    fast = blocks.S == 0 and key_mask is None and blocks.off >= 0
    outs = []
    for step in blocks.steps(blocks.blocks_per_step(B * H, blocks.L, per_step)):
        k_band, v_band = blocks.bands(k_pad, v_pad, step)
        q_blk = blocks.block_queries(q_BHkvNGD, step)
        s_B_Hkv_n_Bq_G_L = torch.matmul(q_blk, k_band).reshape(B, Hkv, step.n, blocks.Bq, G, blocks.L)
        s_B_Hkv_n_Bq_G_L.masked_fill_(_hidden_band_scores(blocks, step, band_Bq_L, km_pad_BN, device), float("-inf"))
        if fast:
            outs.append(_softmax_block(s_B_Hkv_n_Bq_G_L, v_band, Dv))
            continue
        ss = None if sink_keys is None else _sink_scores(blocks, step, q_blk, sink_keys, causal, G)
        v_sink = None if sink_keys is None else sink_keys.v_BHkv1SDv
        outs.append(_shifted_block(s_B_Hkv_n_Bq_G_L, ss, v_band, v_sink, Dv, cdt))
    out_BHkvNGDv = torch.cat(outs, dim=2).reshape(B, Hkv, blocks.nb * blocks.Bq, G, Dv)[:, :, :Nq]
    return out_BHkvNGDv.permute(0, 1, 3, 2, 4).reshape(B, H, Nq, Dv).to(q.dtype)


# One opaque node in captured graphs; the backward recomputes the blockwise forward (O(N·W) too).
prefill_op("attnopt::window_attention", _window_forward, differentiable=(0, 1, 2))


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    causal: bool,
    sinks: int = 0,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
    block_size: Optional[int] = None,
) -> Tensor:
    """Exact softmax attention restricted to a window of keys (+ `sinks` sinks), O(N·W).

    q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] -> [B, H, Nq, Dv] in q's dtype.
    `window` counts visible keys INCLUDING self: causal i-W < j <= i, non-causal |i-j| < W
    (ORT GQA local_window_size = window; ONNX Attention left_window_size = window - 1).
    Queries are bottom-right aligned (query i at position Nk - Nq + i). `key_mask` [B, Nk] bool,
    True = keep; the sinks are each row's first `sinks` kept keys (its first real tokens, also under
    left padding), visible to every query (causal: to queries at or after them). A query with no
    visible key returns zeros. `scale` defaults to 1/sqrt(D).
    `block_size` is the query block (default `default_window_block_size`); it does not change
    the result. Runs as the custom op `torch.ops.attnopt.window_attention`.
    """
    _check_inputs(q, k, v, key_mask)
    if not isinstance(causal, bool):
        raise TypeError(f"window_attention: causal must be a bool, got {causal!r}")
    window = check_int("window_attention", "window", window, 1)
    sinks = check_int("window_attention", "sinks", sinks, 0)
    if block_size is None:
        block_size = default_window_block_size(window, causal)
    block_size = check_int("window_attention", "block_size", block_size, 1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)
    tk = cuda_kernels(q, __package__)
    if tk is not None and tk.unsupported(q, window=window, sinks=sinks, k=k) is None:
        return tk.window_attention(q, k, v, window=window, causal=causal, sinks=sinks, scale=scale, key_mask=key_mask)
    return torch.ops.attnopt.window_attention(q, k, v, key_mask, window, causal, sinks, scale, block_size)


# ---- oracle ----


def window_visibility_mask(
    Nq: int,
    Nk: int,
    *,
    window: int,
    causal: bool,
    sinks: int = 0,
    key_mask: Optional[Tensor] = None,
    device=None,
) -> Tensor:
    """Boolean [B|1, 1, Nq, Nk] mask (True = visible) of the window + sinks rule, N×N: for oracles.

    Sinks are each row's first `sinks` kept keys, so with a key_mask the result has B rows."""
    p = (Nk - Nq) + torch.arange(Nq, device=device)[:, None]
    j = torch.arange(Nk, device=device)[None, :]
    d = p - j
    band = ((d >= 0) & (d < window)) if causal else (d.abs() < window)
    B = 1 if key_mask is None else key_mask.shape[0]
    sink = sink_key_mask(key_mask, sinks, B, Nk, device)[:, None, :]  # [B|1, 1, Nk]
    if causal:
        sink = sink & (d >= 0)
    vis = (band | sink)[:, None]
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :]
    return vis


def window_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    causal: bool,
    sinks: int = 0,
    scale: Optional[float] = None,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """SDPA with the explicit N×N window + sinks mask (GQA via enable_gqa); rows with no visible
    key are set to 0 to match `window_attention`. O(N²): tests and verification only."""
    _check_inputs(q, k, v, key_mask)
    vis = window_visibility_mask(
        q.shape[2], k.shape[2], window=window, causal=causal, sinks=sinks, key_mask=key_mask, device=q.device
    )
    cdt = compute_dtype(q.dtype)
    out = F.scaled_dot_product_attention(
        q.to(cdt), k.to(cdt), v.to(cdt), attn_mask=vis, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    out = torch.where(vis.any(dim=-1, keepdim=True), out, torch.zeros_like(out))
    return out.to(q.dtype)
