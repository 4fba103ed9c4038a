"""Autograd for attnopt's custom ops: recompute the op's own differentiable forward and differentiate it.

Every op here has a plain-PyTorch forward that autograd can trace through, so the backward needs
no hand-written formulas: it is exact by construction and costs one extra forward (the same O(N)
memory as the forward, since nothing quadratic is ever built).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


def register_recompute_autograd(op, forward: Callable[..., Tensor], differentiable: Sequence[int]) -> None:
    """Give `op` an autograd formula: `forward(*op_inputs)` is recomputed under autograd.

    `differentiable` lists the positions of the op's inputs that get gradients; every other
    input (masks, decays, options) is a constant.
    """
    positions = tuple(differentiable)

    def setup_context(ctx, inputs, output):
        ctx.tensor_at = tuple(i for i, x in enumerate(inputs) if isinstance(x, Tensor))
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_at))
        ctx.constants = tuple(None if isinstance(x, Tensor) else x for x in inputs)

    def backward(ctx, grad_out):
        inputs = list(ctx.constants)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            inputs[i] = t
        wanted = [i for i in positions if inputs[i] is not None and ctx.needs_input_grad[i]]
        grads = [None] * len(inputs)
        if not wanted:
            return tuple(grads)
        with torch.enable_grad():
            for i in positions:
                if inputs[i] is not None:
                    inputs[i] = inputs[i].detach().requires_grad_(i in wanted)
            out = forward(*inputs)
            got = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out, allow_unused=True)
        for i, g in zip(wanted, got):
            grads[i] = torch.zeros_like(inputs[i]) if g is None else g
        return tuple(grads)

    op.register_autograd(backward, setup_context=setup_context)
