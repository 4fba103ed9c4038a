"""Test helpers shared by the kernel tests: fp64 SDPA-layout inputs, and a probe for the largest
tensor any aten op produces (memory-shape assertions)."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def sdpa_inputs(B, H, Hkv, Nq, Nk, D, Dv, seed):
    """Seeded fp64 q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Nq, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, Hkv, Nk, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, Hkv, Nk, Dv, dtype=torch.float64, generator=g)
    return q, k, v


def assert_exports_as_one_node(fn, op, inputs):
    """torch.export of `fn(q, k, v)` keeps exactly one `op` node and computes the same output."""

    class Mod(torch.nn.Module):
        def forward(self, q, k, v):
            return fn(q, k, v)

    ep = torch.export.export(Mod(), tuple(inputs))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(op) == 1, targets
    assert torch.allclose(ep.module()(*inputs), Mod()(*inputs))
