"""Recorded calls: what each site computed on the exact model, the data verification and fitting read."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch


@dataclass
class SiteCall:
    """One recorded call of a site: its inputs in the site's layout and the exact output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    out: torch.Tensor  # [B, H, Nq, Dv] (or the site's rank-3 layout)
    x: Optional[torch.Tensor] = None  # the layer's input to its q projection [B, N, C], when recorded

    def detached(self) -> "SiteCall":
        return replace(self, q=self.q.detach(), k=self.k.detach(), v=self.v.detach(), out=self.out.detach())


@dataclass
class Recording:
    """Per site id, one SiteCall per batch that reached it; the exact model's outputs per batch."""

    calls: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
