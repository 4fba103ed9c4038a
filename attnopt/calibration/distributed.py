"""Calibration across processes: each rank trains on its share of the batches, and the trainable
tensors stay identical on every rank because every step applies the same averaged gradient.

The trainable tensors of a site are a few kilobytes (feature maps, β, residual factors, LoRA), so
one all-reduce per tensor per step is the whole protocol: no DDP wrapper (the site modules are
called outside any module DDP could own, and reuse residuals are buffers, not parameters) and no
FSDP (nothing to shard). The mean is taken explicitly (SUM, then divided by the world size), so
it holds on every backend alike; with gloo, FSDP2 sums gradients instead (pytorch issue 162338).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class World:
    """This process's rank and the number of processes (1, 0 without a process group)."""

    rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


def current_world() -> World:
    """The initialised default process group's rank and size (torchrun sets it up), else one process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def shard(items: Sequence, world: World) -> list:
    """Rank r's share: items r, r + size, r + 2·size, ... (every rank passes the same items)."""
    return list(items[world.rank :: world.size])


def broadcast_(tensors: Sequence[torch.Tensor], world: World) -> None:
    """Rank 0's values into every rank's tensors (in place): all ranks start from the same point."""
    if world.distributed:
        for t in tensors:
            torch.distributed.broadcast(t.data, src=0)


def average_gradients_(tensors: Sequence[torch.Tensor], world: World) -> None:
    """Replace each tensor's gradient by its mean over ranks (in place); a missing gradient counts as 0."""
    if not world.distributed:
        return
    for t in tensors:
        if t.grad is None:
            t.grad = torch.zeros_like(t)
        torch.distributed.all_reduce(t.grad, op=torch.distributed.ReduceOp.SUM)
        t.grad.div_(world.size)


def mean_over_ranks(value: float, world: World) -> float:
    """The mean of a float over ranks (a loss for the log, a score to decide on identically)."""
    if not world.distributed:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return float(t) / world.size


def barrier(world: World) -> None:
    if world.distributed:
        torch.distributed.barrier()
