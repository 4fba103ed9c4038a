"""Oracles for the kernel tests: each op's formula written out per (batch, head, query) in fp64.

They import nothing from attnopt. Feature maps are spelled out from their formulas, the GQA head of
query head h is h // G by explicit index, visibility is decided key by key, and every sum is dense:
a bug in the op's feature maps, masking, alignment, head mapping or denominator cannot be shared
by the oracle that checks it. The op's weights (FAVOR+ ω, hedgehog W) are read as data only.

Letters: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Nq/Nk query/key length,
D head dim of q and k, Dv head dim of v, M feature count.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor

F64 = torch.float64


def phi_by_hand(name: str, x_ND: Tensor, scale: float, weight: Optional[Tensor] = None, h: int = 0) -> Tensor:
    """φ of rows x [N, D] for query head h, from the map's formula (not its code).

    weight: FAVOR+ ω [D, M] or hedgehog W [H, D, P]. The scale enters favor, hedgehog and taylor as
    x' = √s·x; elu, relu and identity ignore it.
    """
    x = x_ND.to(F64)
    if name == "identity":
        return x
    if name == "elu":
        return torch.where(x > 0, x + 1.0, torch.exp(x))
    if name == "relu":
        return torch.where(x > 0, x, torch.zeros_like(x))
    xs = x * math.sqrt(scale)
    if name == "favor":  # exp(ωᵀx' − |x'|²/2)/√M, no stabiliser: true units
        omega_DM = weight.to(F64)
        return torch.exp(xs @ omega_DM - 0.5 * (xs**2).sum(-1, keepdim=True)) / math.sqrt(omega_DM.shape[1])
    if name == "hedgehog":  # [softmax(x'W_h), softmax(−x'W_h)]
        proj = xs @ weight[h].to(F64)
        pos, neg = torch.exp(proj), torch.exp(-proj)
        return torch.cat([pos / pos.sum(-1, keepdim=True), neg / neg.sum(-1, keepdim=True)], dim=-1)
    if name == "taylor":  # [1, x', vec(x' x'ᵀ)/√2]
        outer = (xs[:, :, None] * xs[:, None, :]).reshape(xs.shape[0], -1)
        return torch.cat([torch.ones_like(xs[:, :1]), xs, outer / math.sqrt(2.0)], dim=-1)
    raise AssertionError(f"no oracle for feature map {name!r}")


def kernel_by_hand(name: str, q_ND: Tensor, k_ND: Tensor, scale: float, weight=None, h: int = 0) -> Tensor:
    """φ(q)φ(k)ᵀ [Nq, Nk]; taylor in its closed form 1 + t + t²/2 with t = s·qᵀk (no features at all)."""
    if name == "taylor":
        t = scale * (q_ND.to(F64) @ k_ND.to(F64).T)
        return 1.0 + t + t * t / 2.0
    return phi_by_hand(name, q_ND, scale, weight, h) @ phi_by_hand(name, k_ND, scale, weight, h).T


def _kept(key_mask: Optional[Tensor], b: int, Nk: int) -> list[int]:
    return [j for j in range(Nk) if key_mask is None or bool(key_mask[b, j])]


def linear_oracle(q, k, v, *, name, weight=None, causal, scale, eps, key_mask=None) -> Tensor:
    """oᵢ = Σⱼ κ(qᵢ, kⱼ) vⱼ / (Σⱼ κ(qᵢ, kⱼ) + ε) over kept keys j (causal: j ≤ Nk − Nq + i).

    A row with a zero denominator (no visible key and ε = 0) is 0, as the op documents.
    """
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=F64)
    for b in range(B):
        kept = _kept(key_mask, b, Nk)
        for h in range(H):
            kv = h // G
            kern = kernel_by_hand(name, q[b, h], k[b, kv], scale, weight, h)
            for i in range(Nq):
                js = [j for j in kept if not causal or j <= Nk - Nq + i]
                w = kern[i, js]
                den = w.sum() + eps
                if den != 0:
                    out[b, h, i] = (w @ v[b, kv, js].to(F64)) / den
    return out


def linear_state_oracle(k, v, *, name, weight=None, scale, H) -> tuple[Tensor, Tensor]:
    """(S [B, H, M, Dv], z [B, H, M]) = (Σⱼ φ(kⱼ)vⱼᵀ, Σⱼ φ(kⱼ)) in true feature units, per query head."""
    B, Hkv = k.shape[:2]
    G = H // Hkv
    S, z = [], []
    for b in range(B):
        S_b, z_b = [], []
        for h in range(H):
            phi = phi_by_hand(name, k[b, h // G], scale, weight, h)
            S_b.append(phi.T @ v[b, h // G].to(F64))
            z_b.append(phi.sum(0))
        S.append(torch.stack(S_b))
        z.append(torch.stack(z_b))
    return torch.stack(S), torch.stack(z)


def decay_oracle(
    q, k, v, *, gammas: Sequence[float], feature_map, normalize, scale, eps, key_mask=None
) -> Tensor:
    """o_t = Σ_{j ≤ t} γ_h^(t−j) (φ(q_t)·φ(k_j)) v_j, times s, or divided by the same sum without v plus ε.

    Query i sits at position t = Nk − Nq + i; masked keys add nothing but still count for decay.
    """
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=F64)
    for b in range(B):
        kept = _kept(key_mask, b, Nk)
        for h in range(H):
            kv = h // G
            kern = kernel_by_hand(feature_map, q[b, h], k[b, kv], 1.0)
            for i in range(Nq):
                t = Nk - Nq + i
                js = [j for j in kept if j <= t]
                w = torch.tensor([float(gammas[h]) ** (t - j) for j in js], dtype=F64) * kern[i, js]
                num = w @ v[b, kv, js].to(F64)
                out[b, h, i] = num / (w.sum() + eps) if normalize else scale * num
    return out


def decay_state_oracle(k, v, *, gammas, feature_map, H, key_mask=None) -> tuple[Tensor, Tensor]:
    """State after all Nk keys: S = Σⱼ γ^(Nk−1−j) φ(kⱼ)vⱼᵀ [B, H, D, Dv], z = Σⱼ γ^(Nk−1−j) φ(kⱼ) [B, H, D]."""
    B, Hkv, Nk, D = k.shape
    G = H // Hkv
    S = torch.zeros(B, H, D, v.shape[-1], dtype=F64)
    z = torch.zeros(B, H, D, dtype=F64)
    for b in range(B):
        for h in range(H):
            phi = phi_by_hand(feature_map, k[b, h // G], 1.0)
            for j in _kept(key_mask, b, Nk):
                g = float(gammas[h]) ** (Nk - 1 - j)
                S[b, h] += g * torch.outer(phi[j], v[b, h // G, j].to(F64))
                z[b, h] += g * phi[j]
    return S, z


def window_oracle(q, k, v, *, window, causal, sinks=0, scale, key_mask=None) -> Tensor:
    """Softmax of s·qᵢ·kⱼ over the keys query i sees: kept keys in the band (causal p − W < j ≤ p,
    else |p − j| < W, p = Nk − Nq + i) or among the row's first `sinks` kept keys (causal: j ≤ p).
    A query that sees nothing gets 0."""
    B, H, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=F64)
    for b in range(B):
        kept = _kept(key_mask, b, Nk)
        sink = set(kept[:sinks])
        for h in range(H):
            kv = h // G
            for i in range(Nq):
                p = Nk - Nq + i
                in_band = (lambda j: p - window < j <= p) if causal else (lambda j: abs(p - j) < window)
                js = [j for j in kept if in_band(j) or (j in sink and (j <= p or not causal))]
                if js:
                    w = torch.softmax(scale * (k[b, kv, js].to(F64) @ q[b, h, i].to(F64)), dim=0)
                    out[b, h, i] = w @ v[b, kv, js].to(F64)
    return out


def reuse_oracle(q_a, k_a, v, x=None, A=None, B_=None, *, scale, causal, key_mask=None) -> Tensor:
    """Softmax over kept (causal: j ≤ i) keys of s·(q_a,i·k_a,j + (x̂ᵢA_h)·(x̂ⱼB_h)), times v of kv head h // G.

    x̂ = [x, 1] when A has C + 1 rows (the last row is the bias)."""
    B, H, N, _ = q_a.shape
    Ga, Gv = H // k_a.shape[1], H // v.shape[1]
    rank = 0 if A is None else A.shape[-1]
    out = torch.zeros(B, H, N, v.shape[-1], dtype=F64)
    for b in range(B):
        kept = _kept(key_mask, b, N)
        if rank:
            x_hat = x[b].to(F64)
            if A.shape[1] == x.shape[-1] + 1:
                x_hat = torch.cat([x_hat, torch.ones(N, 1, dtype=F64)], dim=1)
        for h in range(H):
            logits = q_a[b, h].to(F64) @ k_a[b, h // Ga].to(F64).T
            if rank:
                logits = logits + (x_hat @ A[h].to(F64)) @ (x_hat @ B_[h].to(F64)).T
            for i in range(N):
                js = [j for j in kept if not causal or j <= i]
                w = torch.softmax(scale * logits[i, js], dim=0)
                out[b, h, i] = w @ v[b, h // Gv, js].to(F64)
    return out


def linear_window_oracle(q, k, v, *, window, causal, sinks=0, name="elu", fmap=None, beta=1.0, key_mask=None):
    """Softmax weights e^{s·q·k} on the window keys (band + the row's first `sinks` real keys) and
    β_h·φ(q)·φ(k) on every other allowed real key, in one normalisation; 0 where nothing is seen."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D)
    beta = [float(beta)] * H if not isinstance(beta, torch.Tensor) else beta.tolist()
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=F64)
    for b in range(B):
        real = [j for j in range(Nk) if key_mask is None or bool(key_mask[b, j])]
        sink = real[:sinks]  # the first S real tokens of this row
        for h in range(H):
            kv = h // (H // Hkv)
            kernel = kernel_by_hand(name, q[b, h], k[b, kv], scale, None if fmap is None else fmap.op_weight(), h)
            for i in range(Nq):
                p = Nk - Nq + i
                in_band = lambda j: (p - window < j <= p) if causal else abs(p - j) < window
                win = [j for j in real if in_band(j) or (j in sink and (j <= p or not causal))]
                lin = [j for j in real if (j <= p or not causal) and j not in win]
                w_win = torch.exp(scale * (k[b, kv, win] @ q[b, h, i]))
                w_lin = beta[h] * kernel[i, lin]
                den = w_win.sum() + w_lin.sum()
                if den > 0:
                    out[b, h, i] = (w_win @ v[b, kv, win] + w_lin @ v[b, kv, lin]) / den
    return out
