"""The graph mechanism: any module is captured with torch.export, its sites are replaced in the
captured graph, and the result (`CompiledModule`) is called like the original module.

Saved as one pickle (`attnopt_graph.pt`, read with `torch.load(weights_only=False)`): the rewritten
graph is code plus its site modules, and the pickle is the one format that keeps both.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from attnopt import forms
from attnopt.ir.calls import Recording, SiteCall
from attnopt.ir.detection import Detection
from attnopt.ir.errors import CalibrationError, SaveError, SpecializedInputError
from attnopt.passes.capture import capture_export
from attnopt.passes.input_guard import guard_of
from attnopt.passes.detect import detect
from attnopt.passes.record import record_graph
from attnopt.passes.splice import splice_graph
from attnopt.targets.base import Installed, Target


class CompiledModule(nn.Module):
    """A rewritten captured graph, called like the original module (same arguments, same outputs)."""

    def __init__(self, graph_module: nn.Module, original_name: str):
        super().__init__()
        self.graph_module = graph_module
        self.original_name = original_name
        # state_dict() keys are the original module's (plus each stateful site module's, as
        # "attnopt_site_<i>.<name>"), without "graph_module.": hooks rather than overrides of
        # state_dict/load_state_dict, so the names also hold inside a parent module.
        self.register_state_dict_post_hook(_drop_graph_module_prefix)
        self.register_load_state_dict_pre_hook(_add_graph_module_prefix)

    def forward(self, *args, **kwargs):
        try:
            return self.graph_module(*args, **kwargs)
        except SpecializedInputError:  # already one line naming the input
            raise
        except (TypeError, ValueError) as exc:
            if "kwarg" in str(exc) or "argument" in str(exc) or "pytree" in str(exc).lower():
                raise TypeError(
                    f"the compiled {self.original_name} takes its inputs in the same form as the "
                    f"example_inputs it was compiled with (same argument names/positions): {exc}"
                ) from exc
            raise

    # -- pickling (torch.save / torch.load(weights_only=False))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_modules"] = {**self._modules, "graph_module": picklable_graph_module(self.graph_module)}
        return state

    def __deepcopy__(self, memo) -> "CompiledModule":
        # A deep copy keeps the graph module as it is (guards included); only pickling rewrites it.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def train(self, mode: bool = True) -> "CompiledModule":
        # The captured graph is frozen with inference semantics (exported graphs refuse train()/eval());
        # the flag still reaches the site modules, which behave the same either way.
        self.training = mode
        for m in self.graph_module.children():
            m.train(mode)
        return self


GRAPH_MODULE_PREFIX = "graph_module."


def _drop_graph_module_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + GRAPH_MODULE_PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_graph_module_prefix(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                             error_msgs) -> None:
    inner = prefix + GRAPH_MODULE_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def picklable_graph_module(graph_module: nn.Module) -> nn.Module:
    """A copy of an exported graph module that pickles, computing the same outputs.

    GraphModule pickles as its generated code and re-traces it on load. Two things of torch.export's
    unlifted module stop that: its `_guards_fn` submodule runs a function made by exec (it cannot be
    pickled), and its tracer class needs a scope it is not given on load (the plain fx tracer
    re-traces the code the same way). attnopt's capture puts its own `InputGuard` there, which
    pickles with its checks (fixed dims, equal dims, ranges, constant inputs) and without the exec'd
    function it also runs; a raw export guard (a graph not captured by attnopt) is dropped.
    """
    gm = copy.deepcopy(graph_module)
    if not isinstance(gm, torch.fx.GraphModule):
        return gm
    if "_guards_fn" in gm._modules and guard_of(gm) is None:
        for node in list(gm.graph.nodes):
            if node.op == "call_module" and node.target == "_guards_fn":
                gm.graph.erase_node(node)
        del gm._modules["_guards_fn"]
    gm._tracer_cls = None
    gm._tracer_extras = {}
    gm.recompile()
    return gm


class GraphTarget(Target):
    """capture → detect → record → (plan, verify elsewhere) → splice, on a module copy."""

    mechanism = "graph"
    FILE = "attnopt_graph.pt"

    def __init__(self, model: nn.Module, name=None):
        super().__init__(model, name)
        self.captured = None

    @classmethod
    def compiled_by(cls, model: nn.Module) -> bool:
        return isinstance(model, CompiledModule)

    def detect(self, batches: list) -> Detection:
        args, kwargs = batches[0]
        self.captured = capture_export(self.model, args, kwargs, dynamic=True)
        return detect(self.captured)

    def record(self, found: Detection, batches: list) -> Recording:
        return record_graph(self.captured, found.sites, batches)

    def install(self, sites: list, modules: dict) -> Installed:
        # On a copy: the end-to-end budget may splice again with fewer sites.
        with warnings.catch_warnings():  # torch's own pytree deprecation, raised while copying an exported graph
            warnings.simplefilter("ignore", FutureWarning)
            pristine = copy.deepcopy(self.captured.graph_module)
        spliced = splice_graph(pristine, sites, modules)
        return Installed(CompiledModule(spliced.graph_module, self.name), spliced.counts)

    # -- the compiled model

    def record_exact(self, batches: list, report) -> Recording:
        modules = self.site_modules()
        if any(m.uses_anchor_qk for m in modules.values()):
            raise CalibrationError("calibrate: a graph-path model with reuse sites cannot be recorded (a reuse site "
                                   "is handed its anchor's q and k, not its own); compile a transformers model for reuse")
        recording = Recording(calls={sid: [] for sid in modules})
        with _exact_sites(modules, recording.calls), torch.no_grad():
            for args, kwargs in batches:
                recording.outputs.append(self.model(*args, **kwargs))
        return recording

    def put_back_exact(self, site_ids: list, report) -> None:
        by_id = {r.site.id: r.site for r in report.sites}
        exact = forms.get("exact")
        graph_module = self.model.graph_module
        for name, child in list(graph_module.named_children()):
            if getattr(child, "geometry", None) is not None and child.geometry.site_id in site_ids:
                setattr(graph_module, name, exact.build(by_id[child.geometry.site_id], {}, None))

    # -- on disk

    def save(self, path: Path, report) -> dict:
        torch.save(self.model, path / self.FILE)
        return {"file": self.FILE}

    @classmethod
    def load(cls, path: Path, header: dict, report) -> nn.Module:
        file = path / cls.FILE
        if not file.is_file():
            raise SaveError(f"attnopt.load: {path} has no {cls.FILE}; the directory is incomplete")
        try:
            model = torch.load(file, weights_only=False)
        except Exception as exc:  # a damaged pickle fails in many ways; the digest check makes this rare
            raise SaveError(f"attnopt.load: {file} cannot be unpickled ({type(exc).__name__}: {exc})") from None
        if not isinstance(model, CompiledModule):
            raise SaveError(f"attnopt.load: {file} holds a {type(model).__name__}, not a compiled graph module")
        cls(model).check_sites_match(report, file)
        return model


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
