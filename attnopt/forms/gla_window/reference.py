"""Softmax in a sliding window plus gated linear attention over the keys that left it, one normaliser.

For the query at position pᵢ = Nk − Nq + i (bottom-right aligned) and query head h of kv head h':

    oᵢ = (Σ_{j∈W(i)} e^{s·qᵢ·kⱼ} vⱼ + β_h Σ_{j∈L(i)} aᵢⱼ vⱼ) / (Σ_{j∈W(i)} e^{s·qᵢ·kⱼ} + β_h Σ_{j∈L(i)} aᵢⱼ)
    aᵢⱼ = Σ_m φ(qᵢ)_m φ(kⱼ)_m exp(Σ_{j<t<=pᵢ} g_tm)

* W(i), causal as in window.py: pᵢ − W < j ≤ pᵢ, plus the S sinks (each row's first S kept keys,
  j ≤ pᵢ); L(i) every other kept key j ≤ pᵢ − W (sinks never). So a key leaves the softmax band
  into the gated state, decayed by every gate since it was written -- the state a GLA layer would
  hold, restricted to the keys the window no longer sees.
* One normaliser, as `linear+window` (LoLCATs): β_h trades window mass against the long-range mass
  per query, so a query that finds its key in the window barely reads the state. (The alternative,
  Liger's fixed mix ½·softmax-window + ½·GLA, lost on the tiny LM held out: see the README.)

Computation, O(N·(W + S)·(D + Dv) + N·M·Dv), no Nq × Nk tensor:
* the window part: queries in blocks of Bq against the Bq + W − 1 keys of their band (+ the sinks),
  giving each row's normalised window output and its log-sum-exp `lse`;
* the gated part: the GLA op (`attnopt.forms.gla.reference.gated_linear_attention`, unnormalised,
  on [v, 1] so the last column carries the denominator) over keys shifted W places to the right,
  each pre-decayed by the W gates it crosses while still inside the band, exp(Σ_{j<t<=j+W} g_t)
  (sums of at most W gates, from block-local cumsums: no long prefix differences). Query i then
  reads exactly Σ_{j <= pᵢ−W} exp(Σ_{j<t<=pᵢ} g_t) φ(kⱼ)[vⱼ, 1].
* combined in the log domain: with c = max(lse, log(β·den_L)), o = (e^{lse−c} o_W + β e^{−c} num_L) /
  (e^{lse−c} + β e^{−c} den_L), so nothing overflows however small the window logits; a row that
  sees no key at all is 0.

A dropped key (key_mask False) is in neither part and its gate is 0 (no decay), as in the GLA op.
The op takes φ(q) [B, H, Nq, M] and φ(k) [B, Hkv, Nk, M] already featurised, the log-gates g
([B, Hkv, Nk, M] or [B, Hkv, Nk]) and β [H]: the feature map and gates are the form's business.
Registered as `torch.ops.attnopt.gla_window_attention` (one node under torch.export; fake and
recompute autograd: differentiable in q, k, v, φ(q), φ(k), g and β). GQA: K, V, φ(k) and g per kv
head, never repeated. fp16/bf16 inputs compute in fp32.

Letters: B batch, H query heads, Hkv kv heads, G = H // Hkv, Nq/Nk lengths, D head dim, Dv value
dim, M feature count, Mg gate width (M or 1), W window, S sinks, Bq query block, L = Bq + W − 1.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.common.plain_autograd import wants_plain_autograd
from attnopt.forms.gla.reference import check_log_gate, gated_linear_attention
from attnopt.forms.window.reference import first_real_keys, sink_key_mask
from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.layout import check_sdpa_inputs, compute_dtype
from attnopt.kernels.registration import prefill_op

__all__ = ["gla_window_attention", "window_sums", "window_gate_sums", "combine", "gla_window_reference", "window_part",
           "with_gated_part"]

_WHO = "gla_window_attention"
BLOCK = 128  # queries per window block
CHUNK = 64  # the gated part's chunk length (gla.reference)


def window_sums(q: Tensor, k: Tensor, v: Tensor, keep_BN: Tensor, window: int, sinks: int, scale: float,
                block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Causal window (+ sinks) softmax of q [B, H, Nq, D] over k/v [B, Hkv, Nk, ·]: the normalised
    output [B, H, Nq, Dv] (0 where no key is visible) and the log-sum-exp [B, H, Nq] (−inf there)."""
    B, H, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G, off = H // Hkv, Nk - Nq
    W = max(1, min(window, Nk))  # a band of Nk keys already holds every key a query may see
    S = min(sinks, Nk)
    qg = q.reshape(B, Hkv, G, Nq, D) * scale
    kp, vp = F.pad(k, (0, 0, W - 1, 0)), F.pad(v, (0, 0, W - 1, 0))  # band keys of every block in range
    keep_p = F.pad(keep_BN, (W - 1, 0), value=False)
    if S:
        j_BS, ok_BS = first_real_keys(keep_BN, S, B, Nk, q.device)
        k_sink = torch.take_along_dim(k, j_BS[:, None, :, None], dim=2)  # [B, Hkv, S, D]
        v_sink = torch.take_along_dim(v, j_BS[:, None, :, None], dim=2)
    outs, lses = [], []
    for i0 in range(0, Nq, block):
        n = min(block, Nq - i0)
        p = off + i0 + torch.arange(n, device=q.device)  # key positions of the block's queries
        a = off + i0  # first band key (padded index a = position a − W + 1)
        kb, vb, keepb = kp[:, :, a:a + n + W - 1], vp[:, :, a:a + n + W - 1], keep_p[:, a:a + n + W - 1]
        j = a - (W - 1) + torch.arange(n + W - 1, device=q.device)
        lag = p[:, None] - j[None, :]
        vis = ((lag >= 0) & (lag < W))[None] & keepb[:, None, :]  # [B, n, L]
        s = qg[:, :, :, i0:i0 + n] @ kb[:, :, None].transpose(-1, -2)  # [B, Hkv, G, n, L]
        s = s.masked_fill(~vis[:, None, None], float("-inf"))
        vals = vb[:, :, None]
        if S:
            vis_s = ok_BS[:, None, :] & (j_BS[:, None, :] <= (p - W)[None, :, None])  # [B, n, S]: before the band
            ss = qg[:, :, :, i0:i0 + n] @ k_sink[:, :, None].transpose(-1, -2)
            s = torch.cat([s, ss.masked_fill(~vis_s[:, None, None], float("-inf"))], dim=-1)
            vals = torch.cat([vals, v_sink[:, :, None]], dim=-2)
        m = s.detach().amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        e = torch.exp(s - m)
        den = e.sum(-1, keepdim=True)
        outs.append((e @ vals) / torch.where(den > 0, den, torch.ones_like(den)))
        lses.append(torch.where(den > 0, m + torch.log(torch.where(den > 0, den, torch.ones_like(den))),
                                torch.full_like(den, float("-inf")))[..., 0])
    out = torch.cat(outs, dim=3).reshape(B, H, Nq, Dv)
    return out, torch.cat(lses, dim=3).reshape(B, H, Nq)


def window_gate_sums(g_BHkvNG: Tensor, window: int) -> Tensor:
    """Σ_{j<t<=j+W} g_t for every key j [B, Hkv, N, Mg] (gates past the end count 0): the decay a key
    collects while it is still inside the band. Sums of at most W terms, from cumsums within blocks
    of W (block b's suffix after j plus block b + 1's prefix up to j + W): no long prefix differences."""
    B, Hkv, N, Mg = g_BHkvNG.shape
    W = max(1, min(window, N))  # t <= N − 1 < j + N: a wider window adds no gate
    nb = -(-N // W) + 1
    gp = F.pad(g_BHkvNG, (0, 0, 0, nb * W - N)).reshape(B, Hkv, nb, W, Mg)
    cs = torch.cumsum(gp, dim=3)  # within each block
    suffix = cs[:, :, :, -1:] - cs  # Σ over block b after offset r (a difference of <= W terms)
    nxt = torch.cat([cs[:, :, 1:], torch.zeros_like(cs[:, :, :1])], dim=2)  # block b + 1 up to offset r
    return (suffix + nxt).reshape(B, Hkv, nb * W, Mg)[:, :, :N]


def combine(o_w: Tensor, lse: Tensor, lin: Tensor, beta_H: Tensor) -> Tensor:
    """(e^{lse} o_W + β num_L) / (e^{lse} + β den_L) in the log domain; lin [B, H, Nq, Dv + 1] holds
    [num_L, den_L]. A row with no window key and no state mass is 0."""
    beta = beta_H[None, :, None]
    den_l = lin[..., -1]
    log_l = torch.log(beta * den_l.clamp_min(0.0))  # −inf where the state holds nothing (or β = 0)
    c = torch.maximum(lse, log_l).detach()
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    w_w = torch.exp(lse - c)
    w_l = beta * torch.exp(-c)
    den = w_w + w_l * den_l
    num = w_w[..., None] * o_w + w_l[..., None] * lin[..., :-1]
    return num / torch.where(den > 0, den, torch.ones_like(den))[..., None]


def _gated_part(phi_q: Tensor, phi_k: Tensor, v: Tensor, g: Tensor, keep_BN: Tensor, lin_keep_BN: Tensor,
                window: int, chunk_size: int) -> Tensor:
    """[num_L, den_L] [B, H, Nq, Dv + 1]: the gated sums over the keys j <= pᵢ − W (see the docstring)."""
    g4 = (g if g.dim() == 4 else g[..., None]) * keep_BN[:, None, :, None].to(g.dtype)  # a dropped key: no decay
    pre = torch.exp(window_gate_sums(g4, window))  # [B, Hkv, Nk, Mg]
    fk = phi_k * lin_keep_BN[:, None, :, None].to(phi_k.dtype) * pre
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) * lin_keep_BN[:, None, :, None].to(v.dtype)
    Nk = phi_k.shape[2]
    shift = min(window, Nk)
    fk = F.pad(fk, (0, 0, shift, 0))[:, :, :Nk]  # key j sits at j + W: every query before it sees nothing
    v1 = F.pad(v1, (0, 0, shift, 0))[:, :, :Nk]
    gg = g4 if g.dim() == 4 else g4[..., 0]
    return gated_linear_attention(phi_q, fk, v1, gg, feature_map="identity", normalize=False, scale=1.0,
                                  chunk_size=chunk_size)


def _keep(key_mask: Optional[Tensor], B: int, Nk: int, device) -> Tensor:
    return torch.ones(B, Nk, dtype=torch.bool, device=device) if key_mask is None else key_mask


def window_part(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], window: int, sinks: int,
                scale: float) -> tuple[Tensor, Tensor]:
    """(o_W [B, H, Nq, Dv], lse [B, H, Nq]) in the compute dtype: the half of the op that reads no φ, gate
    or β, so a fit of those computes it once per recorded call (`with_gated_part` finishes the op)."""
    cdt = compute_dtype(q.dtype)
    keep = _keep(key_mask, q.shape[0], k.shape[2], q.device)
    return window_sums(q.to(cdt), k.to(cdt), v.to(cdt), keep, window, sinks, scale)


def with_gated_part(o_w: Tensor, lse: Tensor, v: Tensor, phi_q: Tensor, phi_k: Tensor, g: Tensor, beta: Tensor,
                    key_mask: Optional[Tensor], window: int, sinks: int, chunk_size: int) -> Tensor:
    """The op's output from its `window_part` (o_W, lse): the gated sums beyond the window, combined
    under one normaliser. In the compute dtype; differentiable in φ(q), φ(k), g and β."""
    B, Nk = v.shape[0], v.shape[2]
    cdt = o_w.dtype
    keep = _keep(key_mask, B, Nk, v.device)
    lin_keep = keep & ~sink_key_mask(key_mask, sinks, B, Nk, v.device)
    lin = _gated_part(phi_q.to(cdt), phi_k.to(cdt), v.to(cdt), g.to(cdt), keep, lin_keep, window, chunk_size)
    return combine(o_w, lse, lin, beta.to(device=v.device, dtype=cdt))


def _forward(q: Tensor, k: Tensor, v: Tensor, phi_q: Tensor, phi_k: Tensor, g: Tensor, beta: Tensor,
             key_mask: Optional[Tensor], window: int, sinks: int, scale: float, chunk_size: int) -> Tensor:
    """The op's differentiable plain-PyTorch body."""
    B, H, Nq, _ = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    if Nq == 0 or Nk == 0:
        return q.new_zeros(B, H, Nq, Dv)
    o_w, lse = window_part(q, k, v, key_mask, window, sinks, scale)
    return with_gated_part(o_w, lse, v, phi_q, phi_k, g, beta, key_mask, window, sinks, chunk_size).to(q.dtype)


# One opaque node in captured graphs; gradients reach q, k, v, φ(q), φ(k), the gates and β.
prefill_op("attnopt::gla_window_attention", _forward, differentiable=(0, 1, 2, 3, 4, 5, 6))


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{_WHO}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def check_inputs(q, k, v, phi_q, phi_k, g, key_mask, window, sinks, who: str = _WHO) -> None:
    """The layout of every argument, one line naming what to change."""
    check_sdpa_inputs(who, q, k, v, key_mask)
    check_sdpa_inputs(who, phi_q, phi_k, v, key_mask)
    if phi_q.shape[:3] != q.shape[:3]:
        raise ValueError(f"{who}: phi_q must be [B, H, Nq, M] for q {list(q.shape)}, got {list(phi_q.shape)}")
    B, Hkv, Nk, M = phi_k.shape
    if q.shape[2] > Nk:
        raise ValueError(f"{who}: {q.shape[2]} queries but only {Nk} keys; the op is causal and needs Nq <= Nk")
    check_log_gate(who, g, B, Hkv, Nk, M, per_channel_ok=True)
    _check_int("window", window, 1)
    _check_int("sinks", sinks, 0)


def beta_tensor(linear_weight, H: int, like: Tensor) -> Tensor:
    """β [H] (fp32 or like's compute dtype) from a float or a per-head tensor, all >= 0."""
    beta = linear_weight if isinstance(linear_weight, Tensor) else torch.tensor(float(linear_weight))
    beta = beta.to(device=like.device, dtype=compute_dtype(like.dtype)).reshape(-1)
    beta = beta.expand(H) if beta.numel() == 1 else beta
    if tuple(beta.shape) != (H,):
        raise ValueError(f"{_WHO}: linear_weight must be a float or one value per query head [H] = [{H}]")
    if not torch.compiler.is_compiling() and beta.numel() and not bool((beta.detach() >= 0).all()):
        raise ValueError(f"{_WHO}: linear_weight β must be >= 0, got {beta.detach().tolist()}")
    return beta


def gla_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    phi_q: Tensor,
    phi_k: Tensor,
    g: Tensor,
    *,
    window: int,
    sinks: int = 0,
    scale: Optional[float] = None,
    linear_weight: Union[float, Tensor] = 1.0,
    key_mask: Optional[Tensor] = None,
    chunk_size: int = CHUNK,
) -> Tensor:
    """Causal window softmax (+ sinks) plus gated linear attention beyond the window, one normaliser
    (see the module docstring). q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]; φ(q) [B, H,
    Nq, M], φ(k) [B, Hkv, Nk, M]; log-gates g <= 0 [B, Hkv, Nk, M] or [B, Hkv, Nk]; linear_weight β
    a float or [H]. Returns [B, H, Nq, Dv] in q's dtype."""
    check_inputs(q, k, v, phi_q, phi_k, g, key_mask, window, sinks)
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    beta = beta_tensor(linear_weight, q.shape[1], q)
    tk = cuda_kernels(q, __package__)
    if tk is not None and tk.unsupported(q, k=k, v=v, phi_q=phi_q, phi_k=phi_k, g=g, linear_weight=beta) is None:
        return tk.gla_window_attention(q, k, v, phi_q, phi_k, g, window=window, sinks=sinks, scale=s,
                                       linear_weight=beta, key_mask=key_mask)
    if wants_plain_autograd(q, k, v, phi_q, phi_k, g, beta):  # a compile-time fit: no recompute in the backward
        return _forward(q, k, v, phi_q, phi_k, g, beta, key_mask, window, sinks, s, chunk_size)
    return torch.ops.attnopt.gla_window_attention(q, k, v, phi_q, phi_k, g, beta, key_mask, window, sinks, s,
                                                  chunk_size)


def gla_window_reference(q, k, v, phi_q, phi_k, g, *, window: int, sinks: int = 0, scale: Optional[float] = None,
                         linear_weight: Union[float, Tensor] = 1.0, key_mask: Optional[Tensor] = None) -> Tensor:
    """The formula above with explicit Nq × Nk weights (tests only: O(N²) memory)."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    keep = torch.ones(B, Nk, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    p = (Nk - Nq) + torch.arange(Nq, device=q.device)
    lag = p[:, None] - torch.arange(Nk, device=q.device)[None, :]
    sink = sink_key_mask(key_mask, sinks, B, Nk, q.device)
    in_w = (((lag >= 0) & (lag < window))[None] | (sink[:, None, :] & (lag >= 0)[None])) & keep[:, None, :]
    in_l = ((lag >= window)[None] & keep[:, None, :] & ~sink[:, None, :])
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    logits = s * q @ kr.transpose(-1, -2)
    m = logits.masked_fill(~in_w[:, None], float("-inf")).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e_w = torch.where(in_w[:, None], torch.exp(logits - m), 0.0)
    g4 = (g if g.dim() == 4 else g[..., None]) * keep[:, None, :, None]
    cum = torch.cumsum(g4, dim=2).repeat_interleave(G, 1)
    dec = torch.exp((cum[:, :, p, None, :] - cum[:, :, None, :, :]).clamp_max(0.0))  # [B, H, Nq, Nk, Mg]
    a = (phi_q[:, :, :, None, :] * phi_k.repeat_interleave(G, 1)[:, :, None, :, :] * dec).sum(-1)
    beta = beta_tensor(linear_weight, H, q)[None, :, None, None]
    w = e_w + torch.where(in_l[:, None], beta * a * torch.exp(-m), 0.0)
    den = w.sum(-1, keepdim=True)
    return (w @ vr) / torch.where(den > 0, den, torch.ones_like(den))
