"""How a model is called: one batch is (args, kwargs), whatever form the user gave it in."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

Batch = tuple  # (args: tuple, kwargs: dict)


def as_batch(inputs: Any, what: str) -> Batch:
    """Example inputs as (args, kwargs): a tuple/list of args, a mapping of kwargs, or one tensor."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        if len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], Mapping):
            return tuple(inputs[0]), dict(inputs[1])
        return tuple(inputs), {}
    raise TypeError(
        f"{what} must be a tensor, a tuple of positional arguments, a dict of keyword arguments, or "
        f"(args, kwargs); got {type(inputs).__name__}"
    )


def attention_mask_of(batch: Batch) -> Optional[torch.Tensor]:
    """The batch's `attention_mask` keyword, when it is a tensor."""
    am = batch[1].get("attention_mask")
    return am if isinstance(am, torch.Tensor) else None
