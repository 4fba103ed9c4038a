"""What calibration trains towards: each rewritten site's ORIGINAL inputs and exact outputs.

The compiled model runs with every site exact (so everything upstream of a site is the original
model's), and each site's q, k, v, mask, layer input x and exact output are kept, batch by batch.
Transformers models record through attnopt's attention interface (`attnopt.hf.recording`); graph-path
models record by running each site module as exact attention for the duration of the run.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from attnopt.forms.common.base import SiteModule
from attnopt.ir.calls import SiteCall
from attnopt.ir.errors import CalibrationError




@dataclass
class SiteTargets:
    """Per site id, one recorded call per batch; the exact model's outputs per batch."""

    calls: dict = field(default_factory=dict)  # site id -> [SiteCall]
    outputs: list = field(default_factory=list)


def mechanism(model: nn.Module) -> str:
    """"hf" (site modules attached to transformers attention modules) or "graph" (a CompiledModule)."""
    from attnopt.targets.graph import CompiledModule

    return "graph" if isinstance(model, CompiledModule) else "hf"


def site_modules(model: nn.Module) -> dict[str, SiteModule]:
    """Every installed site module by site id, in model order."""
    return {m.geometry.site_id: m for m in model.modules() if isinstance(m, SiteModule)}


def record_targets(model: nn.Module, batches: list, report) -> SiteTargets:
    """Run the compiled model exactly on `batches` and keep every site's inputs and exact output."""
    if not batches:
        return SiteTargets()
    if mechanism(model) == "hf":
        return _record_hf(model, batches, report)
    return _record_graph(model, batches)


def _record_hf(model, batches, report) -> SiteTargets:
    from attnopt.hf.recording import record_calls

    recorded, outputs = record_calls(model, batches)
    targets = SiteTargets(outputs=outputs)
    for rec in report.sites:
        calls = recorded.get(rec.site.module_path, [])
        if len(calls) == len(batches):  # one call per batch: a module that is one site
            targets.calls[rec.site.id] = [c.detached() for c, _ in calls]
    return targets


def _record_graph(model, batches) -> SiteTargets:
    modules = site_modules(model)
    if any(m.uses_anchor_qk for m in modules.values()):
        raise CalibrationError("calibrate: a graph-path model with reuse sites cannot be recorded (a reuse site "
                               "is handed its anchor's q and k, not its own); compile a transformers model for reuse")
    targets = SiteTargets(calls={sid: [] for sid in modules})
    with _exact_sites(modules, targets.calls), torch.no_grad():
        for args, kwargs in batches:
            targets.outputs.append(model(*args, **kwargs))
    return targets


@contextmanager
def _exact_sites(modules: dict, calls: dict) -> Iterator[None]:
    """Every site module computes exact attention and records its call, until the block ends."""

    def recorder(sid, module):
        def forward(q, k, v, mask=None, x=None):
            out = module.exact(q, k, v, mask)
            calls[sid].append(SiteCall(q.detach(), k.detach(), v.detach(), mask, out.detach(), x=x))
            return out

        return forward

    for sid, m in modules.items():
        m.forward = recorder(sid, m)  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for m in modules.values():
            del m.forward
