"""A scope in which the gated ops differentiate their plain-PyTorch forward directly.

Their custom ops' autograd recomputes the whole forward inside the backward (kernels/registration):
right for a model being trained at length, where the op must stay one node, but a compile-time fit
at a few hundred tokens then pays two forwards and one backward per step. Inside `plain_autograd`
it pays one of each; the result is the same function.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

from attnopt.kernels.layout import is_fake_tensor

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("attnopt_plain_autograd", default=False)


@contextlib.contextmanager
def plain_autograd() -> Iterator[None]:
    """While active, `wants_plain_autograd` says yes to calls that need a gradient."""
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def wants_plain_autograd(*tensors) -> bool:
    """Whether an op called on `tensors` should run its differentiable forward directly: inside
    `plain_autograd`, with grad enabled and some input needing a gradient, and never while tracing
    (torch.export and torch.compile must see the custom op)."""
    if not _active.get() or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    return any(t.requires_grad for t in tensors) and not any(is_fake_tensor(t) for t in tensors)
