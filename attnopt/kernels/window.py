"""Sliding-window softmax attention with StreamingLLM attention sinks, computed blockwise.

Window convention -- `window` = W is the number of keys a query sees on the causal side,
INCLUDING ITSELF:

* causal:      query i sees keys j with  i - W < j <= i       (W keys: i-W+1 .. i)
* non-causal:  query i sees keys j with  |i - j| < W          (2W - 1 keys: i-W+1 .. i+W-1)

plus the first `sinks` keys (j < sinks), which obey causality (a sink j is hidden from query i when
causal and j > i). A sink that already lies inside the band is counted once.

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
lie outside it (sinks inside the band are read once, through the band).

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

__all__ = [
    "window_attention",
    "window_attention_reference",
    "window_visibility_mask",
    "default_window_block_size",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 accumulate in fp32; fp32 and fp64 keep their own precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor]) -> None:
    """SDPA layout checks with messages that say what to change."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"window_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"window_attention: {name} must be 4-D [B, heads, N, dim] (SDPA layout), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"window_attention: {name} must be floating point, got {t.dtype}")
    B, H, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"window_attention: batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"window_attention: k has {k.shape[1]} heads but v has {v.shape[1]}; they must match")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"window_attention: k has {k.shape[2]} keys but v has {v.shape[2]} values; they must match")
    if k.shape[3] != D:
        raise ValueError(f"window_attention: q head dim {D} != k head dim {k.shape[3]}")
    Hkv = k.shape[1]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"window_attention: query heads H={H} must be a multiple of key/value heads Hkv={Hkv} (GQA)"
        )
    if key_mask is not None:
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            raise TypeError("window_attention: key_mask must be a bool tensor [B, Nk] with True = keep")
        if tuple(key_mask.shape) != (B, k.shape[2]):
            raise ValueError(
                f"window_attention: key_mask must have shape [B, Nk] = {(B, k.shape[2])}, got {tuple(key_mask.shape)}"
            )


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"window_attention: {name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"window_attention: {name} must be >= {minimum}, got {value}")
    return value


def default_window_block_size(window: int, causal: bool) -> int:
    """Query block size ~W/4 (clamped to 32..128): the band Bq + W - 1 stays close to W, so few
    scores are wasted, while blocks stay large enough for efficient matmuls and few loop steps.
    Measured at N=16k, W=256, 2 CPU threads: Bq=64 beat 32, 128 and 256."""
    width = window if causal else 2 * window - 1
    return int(max(32, min(128, width // 4)))


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
) -> Tensor:
    """Blockwise banded softmax; differentiable plain PyTorch (the custom op wraps it).

    A Python loop over query blocks keeps each block's scores ([B, Hkv, Bq, G, L]) cache-sized and
    lets the band be a plain slice of k (no gathered copy); the loop is nb = Nq / Bq steps.
    """
    B, H, Nq, D = q_BHND.shape
    Hkv, Nk, Dv = k_BHkvND.shape[1], k_BHkvND.shape[2], v_BHkvND.shape[3]
    G = H // Hkv
    out_dtype = q_BHND.dtype
    cdt = _compute_dtype(out_dtype)
    device = q_BHND.device
    if Nq == 0 or Nk == 0:
        return q_BHND.new_zeros(B, H, Nq, Dv)

    off = Nk - Nq  # bottom-right alignment: query i is at position off + i
    W = min(window, Nk + abs(off) + Nq + 1)  # a wider window sees nothing more
    S = min(sinks, Nk)
    lo = W - 1  # keys left of self in the band
    hi = 0 if causal else W - 1  # keys right of self
    Bq = max(1, min(block_size, Nq))
    L = Bq + lo + hi

    # Queries as [B, Hkv, Nq, G, D]: a block of rows (position, g) is one contiguous matrix, so
    # the G query heads sharing a kv head share one matmul against its key band.
    q_BHkvNGD = (q_BHND.to(cdt) * scale).view(B, Hkv, G, Nq, D).transpose(2, 3).contiguous()
    k = k_BHkvND.to(cdt)
    v = v_BHkvND.to(cdt)
    r = torch.arange(Bq, device=device)
    rel = torch.arange(L, device=device)[None, :] - r[:, None]
    band_Bq_L = (rel >= 0) & (rel <= lo + hi)  # row r of a block sees band columns r .. r+lo+hi
    hidden_Bq_1_L = ~band_Bq_L[:, None, :]  # interior blocks without key_mask reuse this as is

    outs = []
    for i0 in range(0, Nq, Bq):
        rows = min(Bq, Nq - i0)
        p0 = off + i0  # absolute position of the block's first query
        j0 = p0 - lo  # band column 0 is key j0
        jlo, jhi = max(0, j0), min(Nk, j0 + rows + lo + hi)
        q_blk = q_BHkvNGD[:, :, i0 : i0 + rows].reshape(B, Hkv, rows * G, D)
        parts = []  # (scores [B, Hkv, rows, G, Li], values [B, Hkv, Li, Dv])
        if jhi > jlo:
            s = torch.matmul(q_blk, k[:, :, jlo:jhi].transpose(-1, -2)).view(B, Hkv, rows, G, jhi - jlo)
            if S <= jlo and key_mask_BN is None:
                hidden = hidden_Bq_1_L[:rows, :, jlo - j0 : jhi - j0]
            else:
                vis = band_Bq_L[:rows, jlo - j0 : jhi - j0]
                if S > jlo:  # sinks inside the band: visible by the band rule OR the sink rule
                    jj = torch.arange(jlo, jhi, device=device)
                    sink_vis = (jj < S)[None, :]
                    if causal:
                        sink_vis = sink_vis & (jj[None, :] <= (p0 + r[:rows])[:, None])
                    vis = vis | sink_vis
                vis = vis[:, None, :]  # [rows, 1, Li]
                if key_mask_BN is not None:
                    vis = vis & key_mask_BN[:, None, None, None, jlo:jhi]
                hidden = ~vis
            s.masked_fill_(hidden, float("-inf"))
            parts.append((s, v[:, :, jlo:jhi]))
        # Sinks left of the band are causally visible to every row of the block (j < jlo <= p);
        # sinks right of it exist only without causality and are then visible to every row too.
        sink_ranges = [(0, min(S, jlo))]
        if not causal:
            sink_ranges.append((max(jhi, 0), S))
        for a, e in sink_ranges:
            if e <= a:
                continue
            s = torch.matmul(q_blk, k[:, :, a:e].transpose(-1, -2)).view(B, Hkv, rows, G, e - a)
            if key_mask_BN is not None:
                s.masked_fill_(~key_mask_BN[:, None, None, None, a:e], float("-inf"))
            parts.append((s, v[:, :, a:e]))
        if not parts:  # every row of this block sees nothing
            outs.append(q_blk.new_zeros(B, Hkv, rows, G, Dv))
            continue

        with torch.no_grad():
            row_max = parts[0][0].amax(dim=-1)
            for s, _ in parts[1:]:
                row_max = torch.maximum(row_max, s.amax(dim=-1))
            # A row that sees nothing has max -inf; a finite shift keeps all its exps 0, its output 0.
            row_max.clamp_(min=torch.finfo(cdt).min)
        denom = None
        num = None
        for s, vs in parts:
            pr = s.sub_(row_max[..., None]).exp_()
            ps = pr.sum(dim=-1)
            pv = torch.matmul(pr.view(B, Hkv, rows * G, pr.shape[-1]), vs)
            denom = ps if denom is None else denom + ps
            num = pv if num is None else num + pv
        # A row that sees a key has denom >= 1 (its max term is exp(0)); one that sees none has
        # num = denom = 0, so clamping to 1 leaves seen rows exact and gives 0 for the rest.
        denom = denom.clamp(min=1.0)
        outs.append(num.view(B, Hkv, rows, G, Dv) / denom[..., None])

    out = torch.cat(outs, dim=2)  # [B, Hkv, Nq, G, Dv]
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


def _setup_context(ctx, inputs, output):
    q, k, v, key_mask, window, causal, sinks, scale, block_size = inputs
    ctx.save_for_backward(q, k, v, key_mask)
    ctx.params = (window, causal, sinks, scale, block_size)


def _backward(ctx, grad_out):
    # Recompute the differentiable blockwise forward and let autograd derive the gradients:
    # O(N * W) memory like the forward, and correct by construction.
    q, k, v, key_mask = ctx.saved_tensors
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = _window_forward(qg, kg, vg, key_mask, *ctx.params)
        dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), grad_out, allow_unused=True)
    return dq, dk, dv, None, None, None, None, None, None


_window_attention_op.register_autograd(_backward, setup_context=_setup_context)


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
    """Exact softmax attention restricted to a window of keys (+ `sinks` first keys), O(N·W).

    q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] -> [B, H, Nq, Dv] in q's dtype.
    `window` counts visible keys INCLUDING self: causal i-W < j <= i, non-causal |i-j| < W
    (ORT GQA local_window_size = window; ONNX Attention left_window_size = window - 1).
    Queries are bottom-right aligned (query i at position Nk - Nq + i). `key_mask` [B, Nk] bool,
    True = keep. A query with no visible key returns zeros. `scale` defaults to 1/sqrt(D).
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
    """Boolean [B|1, 1, Nq, Nk] mask (True = visible) of the window + sinks rule, N×N: for oracles."""
    p = (Nk - Nq) + torch.arange(Nq, device=device)[:, None]
    j = torch.arange(Nk, device=device)[None, :]
    d = p - j
    band = ((d >= 0) & (d < window)) if causal else (d.abs() < window)
    sink = j < sinks
    if causal:
        sink = sink & (d >= 0)
    vis = (band | sink)[None, None]
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
    cdt = _compute_dtype(q.dtype)
    out = F.scaled_dot_product_attention(
        q.to(cdt), k.to(cdt), v.to(cdt), attn_mask=vis, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    out = torch.where(vis.any(dim=-1, keepdim=True), out, torch.zeros_like(out))
    return out.to(q.dtype)
