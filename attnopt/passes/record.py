"""Record pass: run the exact model on every batch and keep what verification needs of each site.

One recorder for graphs: `ValueRecorder` runs a captured FX graph and keeps the values of the named
nodes (detection replays candidates with it; compile records every site's q, k, v, mask and output).
Transformers models record through the attention interface instead (`attnopt.hf.recording`), into the
same `Recording`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from attnopt.ir.calls import Recording, SiteCall


class ValueRecorder(fx.Interpreter):
    """Runs a graph and keeps the values of the wanted nodes; with `stop_early`, stops once all are kept."""

    def __init__(self, gm: fx.GraphModule, wanted: Iterable[str], stop_early: bool = False):
        super().__init__(gm, garbage_collect_values=True)
        self.wanted = set(wanted)
        self.stop_early = stop_early
        self.kept: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if n.name in self.wanted:
            self.kept[n.name] = value
            if self.stop_early and len(self.kept) == len(self.wanted):
                raise AllRecorded()  # nothing after this node is needed
        return value

    def record(self, *flat_inputs) -> dict[str, Any]:
        """Run on flat graph inputs (no grad); {node name: value} for the wanted nodes reached."""
        with torch.no_grad():
            try:
                self.output = self.run(*flat_inputs)
            except AllRecorded:
                self.output = None
        return self.kept


class AllRecorded(Exception):
    """Raised by `ValueRecorder` with stop_early once every wanted node has been kept."""


def record_graph(captured, sites: list, batches: list) -> Recording:
    """Run the captured graph on each (args, kwargs) batch and keep every site's inputs and output."""
    from torch.export._tree_utils import reorder_kwargs

    gm = captured.graph_module
    names = set()
    for s in sites:
        names.update(n for n in (s.nodes.query, s.nodes.key, s.nodes.value, s.nodes.output, s.nodes.mask) if n)
    rec = Recording(calls={s.id: [] for s in sites})
    for args, kwargs in batches:
        if kwargs and captured.in_spec is not None:
            kwargs = reorder_kwargs(kwargs, captured.in_spec)
        recorder = ValueRecorder(gm, names)
        values = recorder.record(*gm.graph._codegen.process_inputs(tuple(args), kwargs))
        out = recorder.output
        rec.outputs.append(gm.graph._codegen.process_outputs(out) if isinstance(out, list) else out)
        for s in sites:
            k = values[s.nodes.key]
            if s.nodes.key_is_transposed:
                k = k.transpose(-2, -1)
            rec.calls[s.id].append(SiteCall(values[s.nodes.query], k, values[s.nodes.value],
                                            values[s.nodes.mask] if s.nodes.mask else None, values[s.nodes.output]))
    rec.counts = {"batches": len(batches), "sites": len(sites), "calls": sum(len(c) for c in rec.calls.values())}
    return rec
