"""The autograd of attnopt's differentiable Triton ops (window, causal linear, decay), on both launch paths.

A form registers two `torch.library.triton_op`s, its forward (returning (out, *aux)) and its
backward, so that torch.export and Inductor see one node each way on CUDA. Under TRITON_INTERPRET=1
a triton_op cannot run (export and opcheck hand it fake tensors, which the interpreter cannot read),
so the same host functions run inside a `torch.autograd.Function`. `differentiable` wires both from
one description: how many leading inputs the backward reads, and which options.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from attnopt.kernels.triton.runtime import interpreting


def differentiable(op, backward_op, forward: Callable, backward: Callable, *, saved: int,
                   opts: Sequence[int]) -> Callable[..., Tensor]:
    """Register `op`'s autograd and return the function an entry point calls with the op's inputs: the
    op's first output, through the triton_ops on CUDA, through `forward` / `backward` (launching the
    raw kernels) under the interpreter.

    op(*inputs) and forward(*inputs, wrap) return (out, *aux); backward_op(g, *inputs[:saved],
    *outputs, *options) and backward(..., wrap) return the gradients of q, k, v (the first three
    inputs), where options are the inputs at the indices `opts`. The other inputs get none."""
    opts = tuple(opts)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:saved], *output)
        ctx.options = tuple(inputs[i] for i in opts)
        ctx.n_inputs = len(inputs)

    def grads(ctx, dq_dk_dv) -> tuple:
        return (*dq_dk_dv, *([None] * (ctx.n_inputs - 3)))

    def op_backward(ctx, g, *_g_aux):
        return grads(ctx, backward_op(g.contiguous(), *ctx.saved_tensors, *ctx.options))

    op.register_autograd(op_backward, setup_context=setup)

    class Interpreted(torch.autograd.Function):
        """The same forward and backward, launching the raw kernels (TRITON_INTERPRET=1)."""

        @staticmethod
        def forward(ctx, *inputs):
            output = forward(*inputs, wrap=False)
            setup(ctx, inputs, output)
            return output[0]

        @staticmethod
        def backward(ctx, g, *_g_aux):
            return grads(ctx, backward(g.contiguous(), *ctx.saved_tensors, *ctx.options, wrap=False))

    def call(*inputs) -> Tensor:
        return Interpreted.apply(*inputs) if interpreting() else op(*inputs)[0]

    return call
