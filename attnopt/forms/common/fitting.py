"""The fit loop the learnable forms share: Adam on a site module's own parameters, best step kept.

Attention transfer (LoLCATs' first stage): the module is trained to reproduce its site's exact
output on the recorded (q, k, v); nothing outside the module moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from attnopt.forms.common.base import FitResult


@dataclass
class SampledRows:
    """A recorded call as 4-D tensors on a subset of query rows, k and v repeated to the query heads."""

    q: torch.Tensor  # [B, H, R, D]
    k: torch.Tensor  # [B, H, Nk, D]
    v: torch.Tensor  # [B, H, Nk, Dv]
    ref: torch.Tensor  # [B, H, R, Dv] the exact output on those rows
    positions: torch.Tensor  # [R] key position of each row (bottom-right aligned)


def sample_rows(module, call, rows: int = 0) -> SampledRows:
    """`rows` evenly spaced query rows of `call` (0: all), in the layout the fit formulas use."""
    q, k, v = call.q, call.k, call.v
    if q.dim() == 3:  # bmm spelling [B*H, N, D]
        q, k, v = module.unfold_heads(q), module.unfold_heads(k), module.unfold_heads(v)
    ref = call.out if call.out.dim() == 4 else call.out.reshape(q.shape[0], q.shape[1], q.shape[2], -1)
    nq, nk = q.shape[-2], k.shape[-2]
    idx = torch.arange(nq, device=q.device)
    if rows and nq > rows:
        idx = torch.linspace(0, nq - 1, rows, device=q.device).round().long()
        q, ref = q[:, :, idx], ref[:, :, idx]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return SampledRows(q, k, v, ref, idx + (nk - nq))


def relative_mse(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """‖out − ref‖² / ‖ref‖², the loss whose square root is the verifier's relative RMS."""
    return ((out - ref) ** 2).sum() / (ref**2).sum().clamp_min(1e-30)


def adam_fit(what: str, params: Sequence[torch.nn.Parameter], loss: Callable[[bool], torch.Tensor], *,
             steps: int = 100, lr: float = 3e-2, seed: int = 0) -> FitResult:
    """Minimise `loss(sampled)` over `params`; keep the best step; report full-loss RMS before/after.

    `loss(True)` may evaluate a subsample (fast steps), `loss(False)` evaluates everything.
    """
    torch.manual_seed(seed)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    with torch.no_grad():
        before = float(loss(False)) ** 0.5
    start = [p.detach().clone() for p in params]
    best = (before, start)  # the start counts as a step
    for _ in range(steps):
        opt.zero_grad()
        value = loss(True)
        value.backward()
        opt.step()
        rms = float(value.detach()) ** 0.5
        if rms < best[0]:
            best = (rms, [p.detach().clone() for p in params])
    with torch.no_grad():
        for p, kept in zip(params, best[1]):
            p.copy_(kept)
        after = float(loss(False)) ** 0.5
        if not after <= before:  # a subsample misled the steps: never hand back a worse module
            for p, kept in zip(params, start):
                p.copy_(kept)
            after = before
    for p in params:
        p.requires_grad_(False)
    return FitResult(what, before, after, steps)
