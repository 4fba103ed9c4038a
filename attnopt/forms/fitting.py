"""The fit loop the learnable forms share: Adam on a site module's own parameters, best step kept.

Attention transfer (LoLCATs' first stage): the module is trained to reproduce its site's exact
output on the recorded (q, k, v); nothing outside the module moves.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from attnopt.forms.base import FitResult


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
