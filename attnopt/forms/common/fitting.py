"""The fit loop the learnable forms share: Adam on a site module's own parameters, best step kept.

Attention transfer (LoLCATs' first stage): the module is trained to reproduce its site's exact
output on the recorded (q, k, v); nothing outside the module moves.

A step whose loss or gradients are not finite is rejected: the parameters go back to the best step
so far and the learning rate halves, so a fit never hands a NaN to the op that checks its gates.
The loop stops early once the loss has stopped falling, and tells `fit_progress`'s callback each
step (compile's progress bar).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from attnopt.forms.common.base import FitResult

# Early stop: after PATIENCE steps in which the best loss fell by less than MIN_GAIN (relative), the
# fit has converged for compile's purposes (attnopt.calibrate trains further).
PATIENCE = 15
MIN_GAIN = 0.005
MAX_REJECTED = 8  # non-finite steps after which the fit gives up and keeps its best step
REPORT_EVERY = 5  # steps between two progress reports

_progress: contextvars.ContextVar[Optional[Callable[[int, int], None]]] = contextvars.ContextVar(
    "attnopt_fit_progress", default=None)


@contextlib.contextmanager
def fit_progress(callback: Callable[[int, int], None]) -> Iterator[None]:
    """While active, every `adam_fit` calls `callback(step, steps)` as it goes (every few steps)."""
    token = _progress.set(callback)
    try:
        yield
    finally:
        _progress.reset(token)


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


def finite_step(value: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> bool:
    """Whether a step may be taken: a finite loss and finite gradients (one reduction per tensor)."""
    if not math.isfinite(float(value.detach())):
        return False
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)


def adam_fit(what: str, params: Sequence[torch.nn.Parameter], loss: Callable[[bool], torch.Tensor], *,
             steps: int = 100, lr: float = 3e-2, seed: int = 0, patience: int = PATIENCE) -> FitResult:
    """Minimise `loss(sampled)` over `params`; keep the best step; report full-loss RMS before/after.

    `loss(True)` may evaluate a subsample (fast steps), `loss(False)` evaluates everything. A
    non-finite step is rejected (best parameters back, learning rate halved); the loop stops after
    `patience` steps without a MIN_GAIN relative improvement (0: never early). FitResult.steps is
    the number of steps taken.
    """
    torch.manual_seed(seed)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    with torch.no_grad():
        before = float(loss(False)) ** 0.5
    start = [p.detach().clone() for p in params]
    best = (before if math.isfinite(before) else math.inf, start)  # the start counts as a step
    report = _progress.get()
    mark, since, rejected, taken = best[0], 0, 0, 0
    for step in range(steps):
        taken = step + 1
        opt.zero_grad()
        value = loss(True)
        if value.requires_grad:
            value.backward()
        if not finite_step(value, params):
            rejected += 1
            with torch.no_grad():
                for p, kept in zip(params, best[1]):
                    p.copy_(kept)
            for group in opt.param_groups:
                group["lr"] *= 0.5
            opt.state.clear()  # the moments saw the non-finite step
            if rejected >= MAX_REJECTED:
                break
            continue
        opt.step()
        rms = float(value.detach()) ** 0.5
        if rms < best[0]:
            best = (rms, [p.detach().clone() for p in params])
        since += 1
        if best[0] < mark * (1 - MIN_GAIN):
            mark, since = best[0], 0
        if report is not None and (taken % REPORT_EVERY == 0 or taken == steps):
            report(taken, steps)
        if patience and since >= patience:
            break
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
    return FitResult(what, before, after, taken)
