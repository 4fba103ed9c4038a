"""Calibrate pass: fit a site's learnable feature map to its own softmax outputs (attention transfer).

A hedgehog map φ(x) = [softmax(x W), softmax(−x W)] starts near the identity; trained to reproduce
the exact attention output of its site on the recorded (q, k, v) -- as LoLCATs does before any
fine-tuning -- it closes much of the gap fixed maps leave. Only the map's weights move. The compile
pass fits on the example batch and verifies on it and on every calibration batch (held out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnopt.passes.masks import key_keep
from attnopt.passes.verify import SiteCall


@dataclass(frozen=True)
class FitResult:
    """Relative RMS of the site output before and after fitting, and the steps taken."""

    rel_rms_before: float
    rel_rms_after: float
    steps: int


def _quadratic_linear(module, c: SiteCall, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The site's linear attention in its explicit N×N form: o = (A v) / (A 1 + ε), A = φ(q)φ(k)ᵀ.

    Mathematically the op's output; at calibration lengths the quadratic form is the fastest to
    differentiate (the op's backward recomputes a chunked scan). With `rows`, only that many evenly
    spaced query rows are evaluated (rows are independent). Returns (output, matching target).
    """
    g = module.geometry
    q, k, v = c.q, c.k, c.v
    if q.dim() == 3:
        q, k, v = module._unfold_heads(q), module._unfold_heads(k), module._unfold_heads(v)
    ref = c.out if c.out.dim() == 4 else c.out.reshape(q.shape[0], q.shape[1], q.shape[2], -1)
    nq, nk = q.shape[-2], k.shape[-2]
    idx = torch.arange(nq, device=q.device)
    if rows and nq > rows:
        idx = torch.linspace(0, nq - 1, rows, device=q.device).round().long()
        q, ref = q[:, :, idx], ref[:, :, idx]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    fq, fk = module.feature_map(q, g.scale), module.feature_map(k, g.scale)
    a = fq @ fk.transpose(-2, -1)  # [B, H, Nq, Nk]
    if c.mask is not None:
        keep = key_keep(c.mask, g.keep_when, a.shape[0], a.shape[-1])
        a = a * keep[:, None, None, :]
    if g.causal:
        i = idx[:, None] + (nk - nq)
        a = a * (torch.arange(nk, device=a.device)[None, :] <= i)
    out = (a @ v) / (a.sum(-1, keepdim=True) + module.params["eps"])
    return out, ref


def _rel_mse(module, calls: list[SiteCall], rows: int = 0) -> torch.Tensor:
    total = 0.0
    for c in calls:
        out, ref = _quadratic_linear(module, c, rows)
        total = total + ((out - ref) ** 2).sum() / (ref**2).sum().clamp_min(1e-30)
    return total / len(calls)


def fit_feature_map(module: torch.nn.Module, calls: list[SiteCall], *, steps: int = 100, lr: float = 3e-2,
                    rows: int = 64, seed: int = 0) -> FitResult | None:
    """Adam on the feature map's parameters over `rows` query rows per call; None when nothing to learn.

    The fit is judged afterwards by the verifier on every row of every recorded call.
    """
    fmap = getattr(module, "feature_map", None)
    if fmap is None or module.form != "linear":
        return None
    params = [p for p in fmap.parameters()] if fmap is not None else []
    if not params:
        return None
    torch.manual_seed(seed)
    calls = [SiteCall(c.q.detach(), c.k.detach(), c.v.detach(), c.mask, c.out.detach()) for c in calls]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    with torch.no_grad():
        before = float(_rel_mse(module, calls)) ** 0.5
    best = (before, [p.detach().clone() for p in params])
    for _ in range(steps):
        opt.zero_grad()
        loss = _rel_mse(module, calls, rows)
        loss.backward()
        opt.step()
        value = float(loss.detach()) ** 0.5
        if value < best[0]:
            best = (value, [p.detach().clone() for p in params])
    with torch.no_grad():
        for p, keep in zip(params, best[1]):
            p.copy_(keep)
        after = float(_rel_mse(module, calls)) ** 0.5
    for p in params:
        p.requires_grad_(False)
    return FitResult(before, after, steps)
