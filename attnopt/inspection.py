"""`attnopt.inspect(model, *args, **kwargs)`: capture, detect, and report attention sites.

The result is plain data: `sites` (AttentionSite), `near_misses` (NearMiss with reasons), `counts`
and the captured graph(s) the sites' node names refer to. `str()` is a readable table;
`to_dict()` is JSON-able.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from attnopt.ir.errors import CaptureError
from attnopt.ir.site import AttentionSite, NearMiss
from attnopt.passes.capture import (
    CapturedGraph,
    capture_dynamo,
    capture_export,
    without_cache,
)
from attnopt.passes.detect import detect_all


__all__ = ["inspect", "Inspection", "CaptureError", "format_table"]


@dataclass
class Inspection:
    """Everything `inspect` found. `captures` holds one graph (export) or one per Dynamo graph."""

    sites: list[AttentionSite]
    near_misses: list[NearMiss]
    counts: dict[str, Any] = field(default_factory=dict)
    captures: list[CapturedGraph] = field(default_factory=list)

    @property
    def captured(self) -> Optional[CapturedGraph]:
        """The captured graph the sites refer to (the first one when Dynamo split the model)."""
        return self.captures[0] if self.captures else None

    def symbol_ranges(self) -> dict[str, tuple]:
        """{symbol: (min, max or None)} of every size torch.export kept dynamic (e.g. "s53" for the
        sequence length), from the captures' range constraints; {} for static or Dynamo captures."""
        ranges: dict = {}
        for captured in self.captures:
            program = getattr(captured, "exported_program", None)
            for sym, vr in (getattr(program, "range_constraints", None) or {}).items():
                ranges[str(sym)] = (_bound(vr.lower), _bound(vr.upper))
        return ranges

    def to_dict(self) -> dict[str, Any]:
        # Sizes stay torch.export's symbols here (equal symbols are equal sizes); "symbols" says
        # what each may be, as the table says "dynamic".
        return {
            "sites": [_jsonable(s.to_dict()) for s in self.sites],
            "near_misses": [_jsonable(m.to_dict()) for m in self.near_misses],
            "counts": _jsonable(self.counts),
            "symbols": {sym: {"dynamic": True, "min": lo, "max": hi} for sym, (lo, hi) in self.symbol_ranges().items()},
        }

    def __str__(self) -> str:
        return format_table(self)


def _bound(x: Any) -> Optional[int]:
    try:
        value = float(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return int(value) if math.isfinite(value) else None


def dim_text(dim: Any, ranges: dict) -> str:
    """A size as people read it: the number, or "dynamic" where the capture kept a symbol (torch.export
    prints "s53"), with the largest size it allows when that is bounded."""
    if isinstance(dim, int):
        return str(dim)
    high = ranges.get(str(dim), (None, None))[1]
    return "dynamic" if high is None else f"dynamic (max {high})"


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)  # SymInts, dtypes, anything else printable


_COLUMNS = ("id", "layer", "source", "B", "H", "Hkv", "Nq", "Nk", "D", "scale", "mask", "causal", "window")


def _row(s: AttentionSite, ranges: dict) -> list[str]:
    return [s.id, str(s.layer), s.source, dim_text(s.batch, ranges), str(s.heads), str(s.kv_heads),
            dim_text(s.q_len, ranges), dim_text(s.kv_len, ranges), str(s.head_dim), f"{s.scale:.6g}", s.mask.kind,
            "yes" if s.causal else "no", "-" if s.window is None else str(s.window)]


def format_table(ins: Inspection) -> str:
    ranges = ins.symbol_ranges()
    rows = [list(_COLUMNS)] + [_row(s, ranges) for s in ins.sites]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    lines = [f"{len(ins.sites)} attention site(s), {len(ins.near_misses)} near miss(es)"
             f" [capture: {ins.counts.get('method', '?')}, dynamic={ins.counts.get('dynamic', '?')}]"]
    if ins.sites:
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
    runtime = [s for s in ins.sites if s.runtime_inputs]
    if runtime:
        lines.append("")
        lines.append("read at run time (kept exact):")
        for s in runtime:
            lines.append(f"  {s.id} [{', '.join(s.runtime_inputs)}]: {s.runtime_reason}")
    if ins.near_misses:
        lines.append("")
        lines.append("near misses:")
        for m in ins.near_misses:
            where = m.module_path or "graph"
            lines.append(f"  {where} ({m.node}) [{m.code}]: {m.reason}")
    return "\n".join(lines)


def inspect(model: torch.nn.Module, *args, method: str = "export", dynamic: bool = True, **kwargs) -> Inspection:
    """Capture `model(*args, **kwargs)` and report its attention sites and near misses.
    method: "export" (torch.export, one graph) or "dynamo" (torch.compile's graphs, split where the
    model breaks the graph); dynamic: keep batch and length symbolic where the model allows."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"inspect() needs a torch.nn.Module, got {type(model).__name__}; "
                        "pass the model first, then its example inputs")
    if method not in ("export", "dynamo"):
        raise ValueError(f"method must be 'export' or 'dynamo', got {method!r}")
    t0 = time.perf_counter()
    kwargs = without_cache(model, kwargs)
    if method == "export":
        captures = [capture_export(model, args, kwargs, dynamic=dynamic,
                                   retry_hint="or try inspect(..., method='dynamo'), which splits the graph there")]
    else:
        captures = capture_dynamo(model, args, kwargs)
    found = detect_all(captures, method, seconds_capture=time.perf_counter() - t0)
    return Inspection(found.sites, found.near_misses, found.counts, captures)
