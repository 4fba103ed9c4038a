"""What calibration trains towards: each rewritten site's ORIGINAL inputs and exact outputs.

The compiled model runs with every site exact (so everything upstream of a site is the original
model's), and each site's q, k, v, mask, layer input x and exact output are kept, batch by batch;
how is the mechanism's business (`Target.record_exact`).
"""

from __future__ import annotations

from torch import nn

from attnopt.forms.common.base import SiteModule
from attnopt.ir.calls import Recording
from attnopt.targets import target_of


def site_modules(model: nn.Module) -> dict[str, SiteModule]:
    """Every installed site module of a compiled model by site id, in model order."""
    return target_of(model).site_modules()


def record_targets(model: nn.Module, batches: list, report) -> Recording:
    """Run the compiled model exactly on `batches` and keep every site's inputs and exact output."""
    if not batches:
        return Recording()
    return target_of(model).record_exact(batches, report)
