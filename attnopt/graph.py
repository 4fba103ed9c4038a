"""The graph mechanism of `attnopt.compile`: any module is captured with torch.export, its sites
are replaced in the captured graph, and the result is called like the original module."""

from __future__ import annotations

import copy

import torch
from torch import nn

from attnopt.forms.base import BuildContext
from attnopt.passes.capture import capture_export
from attnopt.passes.detect import detect
from attnopt.passes.record import Recording, record_graph
from attnopt.passes.records import Detection
from attnopt.passes.splice import splice_graph


class CompiledModule(nn.Module):
    """A rewritten captured graph, called like the original module (same arguments, same outputs)."""

    def __init__(self, graph_module: nn.Module, original_name: str):
        super().__init__()
        self.graph_module = graph_module
        self.original_name = original_name

    def forward(self, *args, **kwargs):
        try:
            return self.graph_module(*args, **kwargs)
        except (TypeError, ValueError) as exc:
            if "kwarg" in str(exc) or "argument" in str(exc) or "pytree" in str(exc).lower():
                raise TypeError(
                    f"the compiled {self.original_name} takes its inputs in the same form as the "
                    f"example_inputs it was compiled with (same argument names/positions): {exc}"
                ) from exc
            raise

    def train(self, mode: bool = True) -> "CompiledModule":
        # The captured graph is frozen with inference semantics (exported graphs refuse train()/eval());
        # the flag still reaches the site modules, which behave the same either way.
        self.training = mode
        for m in self.graph_module.children():
            m.train(mode)
        return self


class GraphTarget:
    """capture → detect → record → (plan, verify elsewhere) → splice, on a module copy."""

    def __init__(self, model: nn.Module, name: str):
        self.model = model
        self.name = name
        self.captured = None

    def detect(self, batches: list) -> Detection:
        args, kwargs = batches[0]
        self.captured = capture_export(self.model, args, kwargs, dynamic=True)
        det = detect(self.captured)
        return Detection(list(det.sites), list(det.near_misses), self.captured.method, list(self.captured.notes),
                         dict(getattr(det, "counts", {}) or {}))

    def record(self, found: Detection, batches: list) -> Recording:
        return record_graph(self.captured, found.sites, batches)

    def build_context(self, sites: list, recording: Recording) -> BuildContext:
        return BuildContext(sites=sites, calls=recording.calls)

    @staticmethod
    def adapt_site(site):
        return site

    def splice(self, sites: list, modules: dict) -> tuple[nn.Module, dict]:
        # On a copy: the end-to-end budget may splice again with fewer sites.
        spliced = splice_graph(copy.deepcopy(self.captured.graph_module), sites, modules)
        return CompiledModule(spliced.graph_module, self.name), spliced.counts

    def longer_batch(self, batch, length: int):
        return None, "a graph-path model's inputs have no known sequence axis"

    def run(self, module: nn.Module, batches: list) -> list:
        with torch.no_grad():
            return [module(*a, **k) for a, k in batches]
