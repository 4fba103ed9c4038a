"""Dense fp64 formulas the Triton kernels are checked against, written from the definitions
(not from the reference ops' code). Every oracle builds the full [B, H, Nq, Nk] weight matrix.

Letters: B batch, H query heads, Hkv kv heads, Nq/Nk lengths (query i at position Nk − Nq + i),
D head dim, Dv value dim, W window, S sinks.
"""

import math

import torch


def repeat_kv(x, H):
    return x.repeat_interleave(H // x.shape[1], dim=1)


def positions(Nq, Nk, device=None):
    """(p [Nq, 1], j [1, Nk]): bottom-right query positions and key indices."""
    return (Nk - Nq) + torch.arange(Nq, device=device)[:, None], torch.arange(Nk, device=device)[None, :]


def phi(x, name, scale=None, weight=None):
    if name == "elu":
        return torch.where(x > 0, x + 1.0, torch.exp(x))
    if name == "relu":
        return x.clamp(min=0)
    if name == "identity":
        return x
    if name == "favor":  # unstabilised: the kernels' stabilisers cancel in the ratio
        xs = x * math.sqrt(scale)
        return torch.exp(xs @ weight - 0.5 * (xs * xs).sum(-1, keepdim=True)) / math.sqrt(weight.shape[1])
    if name == "hedgehog":
        proj = (x * math.sqrt(scale)) @ weight
        return torch.cat([proj.softmax(-1), (-proj).softmax(-1)], -1)
    raise ValueError(name)


def linear(q, k, v, *, fmap, causal, key_mask=None, eps=1e-6, scale=None, weight=None):
    """o_i = Σ_j a_ij v_j / (Σ_j a_ij + eps), a_ij = φ(q_i)·φ(k_j) over allowed, kept keys."""
    H, Nq, Nk = q.shape[1], q.shape[2], k.shape[2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    fq, fk = features(q, k, fmap, scale, weight)
    a = fq @ fk.transpose(-1, -2)
    p, j = positions(Nq, Nk, q.device)
    if causal:
        a = a * (j <= p)
    if key_mask is not None:
        a = a * key_mask[:, None, None, :]
    return (a @ repeat_kv(v, H)) / (a.sum(-1, keepdim=True) + eps)


def decay(q, k, v, *, gamma, fmap, normalize, scale, key_mask=None, eps=1e-6):
    """o_i = Σ_{j<=p_i} γ_h^(p_i − j) (φ(q_i)·φ(k_j)) v_j, times scale or over its own weight sum + eps."""
    H, Nq, Nk = q.shape[1], q.shape[2], k.shape[2]
    p, j = positions(Nq, Nk, q.device)
    d = p - j
    w = torch.where(d >= 0, gamma.to(q.device).view(H, 1, 1) ** d.clamp(min=0), 0.0)
    a = (phi(q, fmap) @ repeat_kv(phi(k, fmap), H).transpose(-1, -2)) * w
    if key_mask is not None:
        a = a * key_mask[:, None, None, :]
    if normalize:
        return (a @ repeat_kv(v, H)) / (a.sum(-1, keepdim=True) + eps)
    return scale * (a @ repeat_kv(v, H))


def window_visible(B, Nq, Nk, *, window, causal, sinks, key_mask, device=None):
    """[B, 1, Nq, Nk] bool: band (W keys incl. self) | the first `sinks` kept keys, & kept."""
    keep = torch.ones(B, Nk, dtype=torch.bool, device=device) if key_mask is None else key_mask
    p, j = positions(Nq, Nk, device)
    d = p - j
    band = ((d >= 0) & (d < window)) if causal else (d.abs() < window)
    sink = (keep & (keep.long().cumsum(1) <= sinks))[:, None, None, :]
    if causal:
        sink = sink & (d >= 0)
    return (band[None, None] | sink) & keep[:, None, None, :]


def window(q, k, v, *, window, causal, sinks=0, key_mask=None, scale=None):
    B, H, Nq, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    vis = window_visible(B, Nq, k.shape[2], window=window, causal=causal, sinks=sinks, key_mask=key_mask, device=q.device)
    s = ((q @ repeat_kv(k, H).transpose(-1, -2)) * scale).masked_fill(~vis, float("-inf"))
    return s.softmax(-1).nan_to_num(0.0) @ repeat_kv(v, H)


def features(q, k, fmap, scale, weight):
    """(φ(q) [B, H, Nq, M], φ(k) [B, H, Nk, M]); hedgehog uses one W per query head."""
    H = q.shape[1]
    kr = repeat_kv(k, H)
    if fmap == "hedgehog":
        fq = torch.stack([phi(q[:, h], fmap, scale, weight[h]) for h in range(H)], 1)
        fk = torch.stack([phi(kr[:, h], fmap, scale, weight[h]) for h in range(H)], 1)
        return fq, fk
    return phi(q, fmap, scale, weight), phi(kr, fmap, scale, weight)


def linear_window(q, k, v, *, window, sinks, causal, fmap, beta, key_mask=None, scale=None, weight=None):
    """(Σ_W e^{s q·k} v + β Σ_L φ(q)·φ(k) v) / (Σ_W e^{s q·k} + β Σ_L φ(q)·φ(k)); L = allowed, kept, not W."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    vis = window_visible(B, Nq, Nk, window=window, causal=causal, sinks=sinks, key_mask=key_mask, device=q.device)
    keep = torch.ones(B, Nk, dtype=torch.bool, device=q.device) if key_mask is None else key_mask
    p, j = positions(Nq, Nk, q.device)
    allowed = ((j <= p) if causal else torch.ones(Nq, Nk, dtype=torch.bool, device=q.device))[None, None] & keep[:, None, None, :]
    lin = allowed & ~vis
    s = (q @ repeat_kv(k, H).transpose(-1, -2)) * scale
    m = s.masked_fill(~vis, float("-inf")).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    ew = torch.exp(s - m) * vis
    fq, fk = features(q, k, fmap, scale, weight)
    el = (fq @ fk.transpose(-1, -2)) * lin * beta.to(q.device).view(1, H, 1, 1) * torch.exp(-m)
    a = ew + el
    den = a.sum(-1, keepdim=True)
    return torch.where(den > 0, (a @ repeat_kv(v, H)) / torch.where(den > 0, den, 1.0), 0.0)
