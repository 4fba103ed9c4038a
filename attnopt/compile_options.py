"""`attnopt.compile`'s arguments, checked once: each bad value is one line naming the fix."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from torch import nn

from attnopt.ir.batch import Batch, as_batch
from attnopt.passes.crossover import dispatch_mode
from attnopt.policy import Policy
from attnopt.targets import check_method


def _quiet(text, done=None, total=None) -> None:
    """The progress callback when none is given."""


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


@dataclass(frozen=True)
class CompileOptions:
    """Everything compile runs on besides the model, validated: batches[0] is the example."""

    policy: Policy
    batches: list  # [Batch]: the example, then calibration, then verify_inputs
    name: str
    tolerance: Optional[float]
    e2e_tolerance: Optional[float]
    method: str  # "auto", "hf" or "graph"
    dispatch: str  # "auto" or "off"
    progress: Callable = _quiet

    @classmethod
    def check(cls, model: nn.Module, policy: Any, example_inputs: Any, *, tolerance=None, e2e_tolerance=None,
              calibration: Optional[Sequence[Any]] = None, verify_inputs: Optional[Sequence[Any]] = None,
              method: str = "auto", name: Optional[str] = None, dispatch: Optional[str] = None,
              progress: Optional[Callable] = None) -> "CompileOptions":
        if not isinstance(model, nn.Module):
            raise TypeError(f"attnopt.compile expects a torch.nn.Module; got {type(model).__name__}")
        if example_inputs is None:
            raise ValueError(
                "attnopt.compile needs example_inputs (how the model is called), e.g. "
                "example_inputs=tokenizer(text, return_tensors='pt') or example_inputs=(x,)"
            )
        method = check_method(method)
        if tolerance is not None and not (_number(tolerance) and 0 <= tolerance < math.inf):
            raise ValueError(f"tolerance must be a finite number >= 0 (relative RMS drift of a site); got {tolerance!r}")
        if e2e_tolerance is not None and not (_number(e2e_tolerance) and 0 < e2e_tolerance < math.inf):
            raise ValueError(f"e2e_tolerance must be a finite number > 0 (relative RMS drift of the outputs) or None; "
                             f"got {e2e_tolerance!r}")
        mode = dispatch_mode(dispatch)
        batches: list[Batch] = [as_batch(example_inputs, "example_inputs")]
        batches += [as_batch(b, f"calibration[{i}]") for i, b in enumerate(calibration or [])]
        batches += [as_batch(b, f"verify_inputs[{i}]") for i, b in enumerate(verify_inputs or [])]
        return cls(Policy.parse(policy), batches, name or type(model).__name__, tolerance, e2e_tolerance, method, mode,
                   progress or _quiet)
