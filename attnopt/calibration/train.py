"""Attention transfer for one site: Adam on the site module's own tensors, so that on the site's
original inputs it reproduces the exact attention output (relative MSE, LoLCATs' first stage).

Sites are trained one after another (layer by layer); each sees only its own recorded calls, so a
site's training never depends on how well an earlier one went.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from attnopt.calibration.distributed import World, average_gradients_, mean_over_ranks
from attnopt.forms.common.base import SiteModule
from attnopt.forms.common.fitting import relative_mse
from attnopt.forms.common.plain_autograd import plain_autograd
from attnopt.ir.calls import SiteCall

# Loss curves are kept at no more than this many points per site in the report (evenly spaced).
CURVE_POINTS = 100


@dataclass
class SiteTraining:
    """How one site's calibration went: the loss curve (relative RMS per step, mean over ranks),
    the loss over all its training calls before and after, and what was kept."""

    site_id: str
    form: str
    tensors: list  # names of the trained tensors
    steps: int
    status: str  # "trained", "unchanged" (no step lowered the loss), "non_finite" (kept exact), "resumed"
    reason: str
    rms_before: float = float("nan")
    rms_after: float = float("nan")
    curve: list = field(default_factory=list)  # [(step, relative RMS)]
    seconds: float = 0.0
    skipped_steps: int = 0  # steps whose gradients were not finite: not taken

    def to_dict(self) -> dict:
        return asdict(self)


def trainable_tensors(module: SiteModule) -> dict[str, torch.Tensor]:
    """The tensors calibration may change: the module's parameters (feature maps, β) plus the
    buffers its form declares calibrated (the reuse residual factors)."""
    found = {name: p for name, p in module.named_parameters()}
    for name in getattr(module, "calibrated_buffers", ()):
        t = getattr(module, name, None)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            found[name] = t
    return found


def call_loss(module: SiteModule, call: SiteCall, anchor: Optional[SiteCall]) -> torch.Tensor:
    """Relative MSE of the module's output against the exact output, on the site's original inputs
    (a reuse site is handed its anchor's q and k, as at run time)."""
    q, k = (anchor.q, anchor.k) if anchor is not None else (call.q, call.k)
    return relative_mse(module(q, k, call.v, call.mask, x=call.x), call.out)


def full_rms(module, calls, anchors, world: World) -> float:
    """Relative RMS over every call (mean of the per-call losses, then over ranks)."""
    with torch.no_grad():
        losses = [float(call_loss(module, c, a)) for c, a in zip(calls, anchors)]
    return math.sqrt(max(mean_over_ranks(sum(losses) / max(len(losses), 1), world), 0.0))


def train_site(module: SiteModule, calls: list, anchors: list, *, steps: int, lr: float, seed: int, world: World,
               progress: bool = True) -> SiteTraining:
    """Train `module`'s tensors on its recorded `calls` (anchor calls for reuse, else None per call)."""
    sid, form = module.geometry.site_id, module.form
    tensors = trainable_tensors(module)
    start = time.perf_counter()
    record = SiteTraining(sid, form, sorted(tensors), steps, "trained", "")
    if not calls:
        record.status, record.reason = "unchanged", "no recorded call of this site"
        return record
    params = list(tensors.values())
    start_values = [t.detach().clone() for t in params]
    record.rms_before = full_rms(module, calls, anchors, world)
    for t in params:
        t.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    order: list = []
    bar = progress_bar(steps, f"{sid} ({form})", progress and world.leader)
    every = max(1, steps // CURVE_POINTS)
    try:
        # The gated ops differentiate their forward directly here: no recomputed forward per step.
        with plain_autograd():
            for step in range(steps):
                if not order:
                    order = torch.randperm(len(calls), generator=gen).tolist()
                i = order.pop()
                # Cosine decay to a tenth: large early steps, small late ones, no schedule to tune.
                for group in opt.param_groups:
                    group["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / max(steps, 1))))
                opt.zero_grad(set_to_none=True)
                loss = call_loss(module, calls[i], anchors[i])
                value = mean_over_ranks(float(loss.detach()), world)  # every rank decides the same way
                if not math.isfinite(value):
                    _restore(params, start_values)
                    record.status = "non_finite"
                    record.reason = f"the loss was not finite at step {step} (lr {lr:g}); the site is kept exact"
                    break
                if loss.requires_grad:
                    loss.backward()
                average_gradients_(params, world)
                # A finite loss can still have non-finite gradients; such a step would leave NaN tensors
                # that the gated ops refuse on the next call. It is skipped (every rank alike).
                if mean_over_ranks(float(grads_finite(params)), world) < 1.0:
                    record.skipped_steps += 1
                    opt.zero_grad(set_to_none=True)
                    continue
                opt.step()
                if step % every == 0 or step == steps - 1:
                    record.curve.append((step, math.sqrt(max(value, 0.0))))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(rel_rms=f"{math.sqrt(max(value, 0.0)):.4f}")
    finally:
        if bar is not None:
            bar.close()
        for t in params:
            t.requires_grad_(False)
            t.grad = None
    if record.status == "trained":
        record.rms_after = full_rms(module, calls, anchors, world)
        if not record.rms_after < record.rms_before:  # never hand back a worse site than compile did
            _restore(params, start_values)
            record.status = "unchanged"
            record.reason = (f"training did not lower the loss ({record.rms_before:.4g} -> {record.rms_after:.4g}); "
                             "the compiled values are kept")
            record.rms_after = record.rms_before
        else:
            record.reason = f"relative RMS on its training calls {record.rms_before:.4g} -> {record.rms_after:.4g}"
    if record.skipped_steps:
        record.reason += f"; {record.skipped_steps} steps with non-finite gradients were skipped"
    record.seconds = time.perf_counter() - start
    return record


def grads_finite(params) -> bool:
    """Whether every gradient of `params` is finite (None counts as finite)."""
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)


def _restore(params, values) -> None:
    with torch.no_grad():
        for t, v in zip(params, values):
            t.copy_(v)


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
