"""Registering attnopt's custom ops: their schema, their fake (shapes without values) and their autograd.

Every prefill op has a plain-PyTorch forward that autograd can trace through, so the backward needs
no hand-written formulas: it recomputes that forward under autograd and differentiates it, exact by
construction, at the cost of one extra forward (the same O(N) memory, since nothing quadratic is
ever built). `prefill_op` registers such an op from its forward alone; `step_op` registers a decode
graph's step op, whose outputs have the shapes of its inputs.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from attnopt.kernels.chunk_scan import heads_inner_empty


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


def _attention_out(forward_result) -> Tensor:
    """out [B, H, Nq, Dv] of a forward that returns it alone or first of a tuple (out, states...)."""
    return forward_result if isinstance(forward_result, Tensor) else forward_result[0]


def fresh(t: Tensor) -> Tensor:
    """A custom op's output must be a fresh dense tensor (its fake twin has offset 0), not a slice."""
    t = t.contiguous()
    return t if t.storage_offset() == 0 else t.clone()


def prefill_op(name: str, forward: Callable, *, differentiable: Sequence[int],
               check: Optional[Callable[..., None]] = None, heads_inner: bool = False):
    """Register `forward`'s stateless call as the custom op `name` (one node under torch.export) and
    return it.

    Its schema is the forward's parameters that have no default, names and annotations as written
    (the trailing carried-state and tuning parameters stay plain PyTorch). Its fake is an empty
    out [B, H, Nq, Dv] (q's first three sizes, v's last, q's dtype); its backward recomputes the
    forward and reaches the inputs at `differentiable`. `forward` returns out or (out, states...).
    `check(**inputs)` (by parameter name) runs first in the op and in its fake: a check that needs
    values must skip a fake tensor (kernels.layout.values_known). `heads_inner`: out's memory is [B, Nq, H, Dv], the
    layout attention functions hand back, so their transpose costs no copy.
    """
    signature = inspect.signature(forward)
    required = [p for p in signature.parameters.values() if p.default is inspect.Parameter.empty]
    names = [p.name for p in required]

    def empty_out(q: Tensor, v: Tensor) -> Tensor:
        B, H, Nq, Dv = q.shape[0], q.shape[1], q.shape[2], v.shape[-1]
        return heads_inner_empty(B, H, Nq, Dv, q) if heads_inner else q.new_empty(B, H, Nq, Dv)

    def run(*inputs) -> Tensor:
        if check is not None:
            check(**dict(zip(names, inputs)))
        out = _attention_out(forward(*inputs))
        if not heads_inner:
            return fresh(out)
        fits = out.transpose(1, 2).is_contiguous() and out.storage_offset() == 0
        return out if fits else empty_out(inputs[0], inputs[2]).copy_(out)

    def fake(*inputs) -> Tensor:
        if check is not None:
            check(**dict(zip(names, inputs)))
        return empty_out(inputs[0], inputs[2])

    run.__signature__ = signature.replace(parameters=required, return_annotation=Tensor)
    run.__doc__ = forward.__doc__
    op = torch.library.custom_op(name, run, mutates_args=())
    op.register_fake(fake)
    register_recompute_autograd(op, lambda *inputs: _attention_out(forward(*inputs)), differentiable)
    return op


def step_op(name: str, *, out: tuple[str, str] = ("q", "v"), presents: Sequence[str]):
    """Decorator: the decode graph's step function becomes the custom op `name`, with its fake.

    The step returns (out, present states...): out [B, H, T, Dv] is shaped as the first three sizes
    of input `out[0]` and the last of input `out[1]`; each present state is shaped as the input
    named in `presents`, in order (a fixed-size state comes back the size it went in).
    """

    def register(step: Callable):
        op = torch.library.custom_op(name, step, mutates_args=())
        signature = inspect.signature(step)

        def fake(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            rows, columns = bound[out[0]], bound[out[1]]
            out_BHTDv = rows.new_empty(rows.shape[0], rows.shape[1], rows.shape[2], columns.shape[-1])
            return (out_BHTDv, *(bound[p].new_empty(bound[p].shape) for p in presents))

        op.register_fake(fake)
        return op

    return register
