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
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.layout import check_sdpa_inputs, compute_dtype
from attnopt.kernels.registration import register_recompute_autograd

__all__ = [
    "window_attention",
    "window_attention_reference",
    "window_visibility_mask",
    "default_window_block_size",
    "first_real_keys",
    "sink_key_mask",
]


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor]) -> None:
    check_sdpa_inputs("window_attention", q, k, v, key_mask)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"window_attention: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"window_attention: {name} must be >= {minimum}, got {value}")
    return value


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


def _window_forward(
    q_BHND: Tensor,
    k_BHkvND: Tensor,
    v_BHkvND: Tensor,
    key_mask_BN: Optional[Tensor],
    window: int,
    causal: bool,
    sinks: int,
    scale: float,
    block_size: int,
    scores_per_step: Optional[int] = None,
) -> Tensor:
    """Blockwise banded softmax; differentiable plain PyTorch (the custom op wraps it).

    k and v are padded once so every block's band is in range; a step takes n blocks, views their
    bands with `unfold` ([B, Hkv, n, D, L]) and runs one masked softmax over [B, Hkv, n, Bq, G, L].
    """
    B, H, Nq, D = q_BHND.shape
    Hkv, Nk, Dv = k_BHkvND.shape[1], k_BHkvND.shape[2], v_BHkvND.shape[3]
    G = H // Hkv
    out_dtype = q_BHND.dtype
    cdt = compute_dtype(out_dtype)
    device = q_BHND.device
    if Nq == 0 or Nk == 0:
        return q_BHND.new_zeros(B, H, Nq, Dv)
    off = Nk - Nq  # bottom-right alignment: query i is at position off + i
    W = min(window, Nk + abs(off) + Nq + 1)  # a wider window sees nothing more
    S = min(sinks, Nk)
    lo = W - 1  # keys left of self in the band
    hi = 0 if causal else W - 1  # keys right of self
    Bq = max(1, min(block_size, Nq))
    nb = (Nq + Bq - 1) // Bq
    L = Bq + lo + hi
    per_step = SCORES_PER_STEP if scores_per_step is None else scores_per_step
    n_step = max(1, min(nb, per_step // max(1, B * H * Bq * L)))  # query blocks per step

    # Queries as [B, Hkv, N, G, D]: a block of rows (position, g) is one matrix, so the G query
    # heads sharing a kv head share one matmul against its key band.
    q = (q_BHND.to(cdt) * scale).reshape(B, Hkv, G, Nq, D).transpose(2, 3).contiguous()
    if nb * Bq > Nq:  # (a zero-width pad keeps the input's strides eagerly but not when traced)
        q = F.pad(q, (0, 0, 0, 0, 0, nb * Bq - Nq))  # [B, Hkv, nb*Bq, G, D]
    # Band of block b starts at key off + b*Bq - lo; pad k/v (masked out below) so all are in range.
    pad_left = max(0, lo - off)
    start = off - lo + pad_left
    need = start + (nb - 1) * Bq + L
    pad_right = max(0, need - (Nk + pad_left))
    k = F.pad(k_BHkvND.to(cdt), (0, 0, pad_left, pad_right))
    v = F.pad(v_BHkvND.to(cdt), (0, 0, pad_left, pad_right))
    km = None if key_mask_BN is None else F.pad(key_mask_BN, (pad_left, pad_right), value=False)

    r = torch.arange(Bq, device=device)
    c = torch.arange(L, device=device)
    rel = c[None, :] - r[:, None]
    band_Bq_L = (rel >= 0) & (rel <= lo + hi)  # row r of a block sees band columns r .. r+lo+hi
    hidden_static = ~band_Bq_L[:, None, :]  # [Bq, 1, L]: interior steps without key_mask
    if S > 0:
        # Sinks are the first S kept keys of each row: under left padding keys 0..S-1 are pads.
        j_BS, sink_ok_BS = first_real_keys(key_mask_BN, S, B, Nk, device)
        if key_mask_BN is None:
            k_sink, v_sink = k_BHkvND[:, :, :S], v_BHkvND[:, :, :S]
        else:
            k_sink = torch.take_along_dim(k_BHkvND, j_BS[:, None, :, None], dim=2)  # [B, Hkv, S, D]
            v_sink = torch.take_along_dim(v_BHkvND, j_BS[:, None, :, None], dim=2)
        k_sink = k_sink.to(cdt).transpose(-1, -2)[:, :, None]  # [B, Hkv, 1, D, S]
        v_sink = v_sink.to(cdt)[:, :, None]
    # Without sinks, padding or queries before key 0, every row sees at least itself: the fused
    # softmax is exact there. Otherwise rows may see nothing and the explicit path gives them 0
    # (softmax would give NaN, and NaN gradients into every key).
    fast = S == 0 and key_mask_BN is None and off >= 0
    outs = []
    for b0 in range(0, nb, n_step):
        n = min(nb, b0 + n_step) - b0
        a = start + b0 * Bq
        e = a + (n - 1) * Bq + L
        # Overlapping bands gathered into contiguous copies (the matmul would copy them anyway,
        # and traced backward graphs mis-handle views with overlapping strides).
        k_band = k[:, :, a:e].unfold(2, L, Bq).contiguous()  # [B, Hkv, n, D, L]
        v_band = v[:, :, a:e].unfold(2, L, Bq).transpose(-1, -2).contiguous()  # [B, Hkv, n, L, Dv]
        q_blk = q[:, :, b0 * Bq : (b0 + n) * Bq].reshape(B, Hkv, n, Bq * G, D)
        s = torch.matmul(q_blk, k_band).reshape(B, Hkv, n, Bq, G, L)
        j_first = off - lo + b0 * Bq  # key index of band column 0 of the group's first block
        interior = j_first >= 0 and j_first + (n - 1) * Bq + L <= Nk
        if interior and km is None:
            hidden = hidden_static
        else:
            j_n_L = j_first + torch.arange(n, device=device)[:, None] * Bq + c[None, :]
            keep = ((j_n_L >= 0) & (j_n_L < Nk))[None]
            if km is not None:
                keep = keep & km[:, a:e].unfold(1, L, Bq)
            hidden = ~(band_Bq_L[None, None] & keep[:, :, None, :])[:, None, :, :, None, :]
            # Padding rows past Nq are discarded, but a row with every score -inf would put NaN
            # into the softmax backward (and from there into dk): let them see their band.
            real_n_Bq = (b0 + torch.arange(n, device=device))[:, None] * Bq + r[None, :] < Nq
            hidden = hidden & real_n_Bq[None, None, :, :, None, None]
        s.masked_fill_(hidden, float("-inf"))
        if fast:
            p = torch.softmax(s, dim=-1)
            outs.append(torch.matmul(p.reshape(B, Hkv, n, Bq * G, L), v_band).reshape(B, Hkv, n, Bq, G, Dv))
            continue
        with torch.no_grad():
            row_max = s.amax(dim=-1)
        if S > 0:
            # Sink j adds a column for position p only where the band does not already hold it.
            p_n_Bq = off + (b0 + torch.arange(n, device=device))[:, None] * Bq + r[None, :]
            d = p_n_Bq[None, :, :, None] - j_BS[:, None, None, :]  # [B, n, Bq, S]
            ok = ~((d >= 0) & (d < W) if causal else (d.abs() < W))
            if causal:
                ok = ok & (d >= 0)
            ok = ok & sink_ok_BS[:, None, None, :]
            ss = torch.matmul(q_blk, k_sink).reshape(B, Hkv, n, Bq, G, S)
            ss.masked_fill_(~ok[:, None, :, :, None, :], float("-inf"))
            with torch.no_grad():
                row_max = torch.maximum(row_max, ss.amax(dim=-1))
        # A row that sees nothing has max -inf; a finite shift keeps all its exps 0, its output 0.
        row_max.clamp_(min=torch.finfo(cdt).min)
        p = s.sub_(row_max[..., None]).exp_()
        denom = p.sum(dim=-1)
        num = torch.matmul(p.reshape(B, Hkv, n, Bq * G, L), v_band)
        if S > 0:
            ps = ss.sub_(row_max[..., None]).exp_()
            denom = denom + ps.sum(dim=-1)
            num = num + torch.matmul(ps.reshape(B, Hkv, n, Bq * G, S), v_sink)
        # A row that sees a key has denom >= 1 (its max term is exp(0)); one that sees none has
        # num = denom = 0, so clamping to 1 leaves seen rows exact and gives 0 for the rest.
        outs.append(num.reshape(B, Hkv, n, Bq, G, Dv) / denom.clamp(min=1.0)[..., None])
    out = torch.cat(outs, dim=2).reshape(B, Hkv, nb * Bq, G, Dv)[:, :, :Nq]
    return out.permute(0, 1, 3, 2, 4).reshape(B, H, Nq, Dv).to(out_dtype)


# ---- custom op: one opaque node in captured graphs, fake + autograd registered ----


@torch.library.custom_op("attnopt::window_attention", mutates_args=())
def _window_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Optional[Tensor],
    window: int,
    causal: bool,
    sinks: int,
    scale: float,
    block_size: int,
) -> Tensor:
    return _window_forward(q, k, v, key_mask, window, causal, sinks, scale, block_size)


@_window_attention_op.register_fake
def _(q, k, v, key_mask, window, causal, sinks, scale, block_size):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


register_recompute_autograd(_window_attention_op, _window_forward, differentiable=(0, 1, 2))


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
    window = _check_int("window", window, 1)
    sinks = _check_int("sinks", sinks, 0)
    if block_size is None:
        block_size = default_window_block_size(window, causal)
    block_size = _check_int("block_size", block_size, 1)
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
