"""`attnopt.calibrate`'s arguments, checked once: each bad value is one line naming the fix."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from attnopt.calibration.distributed import World, current_world
from attnopt.ir.batch import as_batch
from attnopt.ir.errors import CalibrationError

PARAMS = ("forms", "forms+lora")
DEFAULT_STEPS = 200  # per site; at 256 tokens about 0.1-0.2 s a step on one CPU core (MiniLM)
DEFAULT_LR = 5e-2  # on MiniLM 5e-2 beat 1e-2 by a wide margin at 120 steps (site rel RMS 0.14 vs 0.22)
HELD_OUT_EVERY = 4  # without held_out=, batches 3, 7, 11, ... are held out


@dataclass(frozen=True)
class CalibrateOptions:
    """Everything calibrate runs on besides the model, validated: batches split into train / held."""

    report: Any  # the model's attnopt_report (a CompileReport)
    params: str  # "forms" or "forms+lora"
    steps: int
    lr: float
    seed: int
    train: list  # [Batch]: every rank's training batches (each rank takes its shard)
    held: list  # [Batch]: held out for re-verification
    world: World
    progress: bool
    checkpoint: Optional[str]

    @classmethod
    def check(cls, model: nn.Module, batches: Sequence[Any], *, steps: Optional[int] = None,
              lr: Optional[float] = None, seed: int = 0, params: str = "forms",
              held_out: Optional[Sequence[Any]] = None, progress: bool = True,
              checkpoint: Optional[str] = None) -> "CalibrateOptions":
        report = getattr(model, "attnopt_report", None)
        if report is None or not isinstance(model, nn.Module):
            raise CalibrationError(f"attnopt.calibrate needs a model returned by attnopt.compile; this "
                                   f"{type(model).__name__} has no attnopt_report (compile it first)")
        if params not in PARAMS:
            raise CalibrationError(f"params must be one of {', '.join(repr(p) for p in PARAMS)}; got {params!r}")
        if (getattr(report, "calibration", None) or {}).get("lora"):
            # the exact run that gives calibration its targets is no longer the original model's
            raise CalibrationError("this model's q/k/v/o projections carry the LoRA an earlier calibrate(params="
                                   "'forms+lora') merged, so its exact attention is no longer the original's to "
                                   "train towards; calibrate a fresh attnopt.compile of the original model instead")
        steps = DEFAULT_STEPS if steps is None else steps
        lr = DEFAULT_LR if lr is None else lr
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise CalibrationError(f"steps must be a positive int (Adam steps per site); got {steps!r}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise CalibrationError(f"lr must be a finite number > 0; got {lr!r}")
        train, held = _split(batches, held_out)
        world = current_world()
        if len(train) < world.size:
            raise CalibrationError(f"{len(train)} training batches for {world.size} ranks: every rank needs at least "
                                   "one; pass more (smaller) batches")
        return cls(report, params, steps, float(lr), seed, train, held, world, progress, checkpoint)


def _split(batches, held_out) -> tuple[list, list]:
    """(training, held-out) batches, each converted by `as_batch`; without `held_out`, every
    HELD_OUT_EVERY-th batch (at least the last) is held out."""
    if isinstance(batches, (torch.Tensor, dict)) or not isinstance(batches, (list, tuple)):
        raise CalibrationError(f"batches must be a list of model inputs (each like compile's example_inputs: a dict of "
                               f"keyword arguments, a tuple of arguments or (args, kwargs)); got {type(batches).__name__}")
    converted = []
    for name, group in (("batches", batches), ("held_out", held_out or [])):
        out = []
        for i, b in enumerate(group):
            try:
                out.append(as_batch(b, f"{name}[{i}]"))
            except TypeError as exc:
                raise CalibrationError(f"calibrate: {exc}") from None
        converted.append(out)
    train, held = converted
    if held_out is None:
        if len(train) < 2:
            raise CalibrationError(f"calibrate needs at least 2 batches to hold one out (got {len(train)}); pass more "
                                   "batches or held_out=[...]")
        held = [b for i, b in enumerate(train) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1] or [train[-1]]
        train = [b for b in train if not any(b is h for h in held)]
    if not train:
        raise CalibrationError("calibrate got no training batch; pass a non-empty list of batches")
    return train, held
