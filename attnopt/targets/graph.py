"""The graph mechanism: any module is captured with torch.export, its sites are replaced in the
captured graph, and the result (`CompiledModule`) is called like the original module.

Saved as data, never as a pickle (format 3):

    attnopt_program.pt2         the captured program before any site was replaced (torch.export.save:
                                JSON graph + raw tensors, the compiled model's current weights), read
                                back only after `program_archive.check_archive` refused everything
                                torch.export.load could unpickle or exec
    attnopt_sites.safetensors   each site module's tensors, keyed "<site_id>/<name>"
    attnopt.json                (saving.py) the header: the input contract and one entry per site
                                module (site id, form, params, tensor shapes, digest), in splice order

`load` rebuilds what compile built: the program's graph module, attnopt's InputGuard from the
contract, each site module from its form and parameters with its saved tensors, spliced by the
same `splice_graph` call, so the loaded model computes exactly what the saved one did, with the
same dynamic dims. torch.export's own guard function (Python source) is not kept: InputGuard's
checks (fixed dims, equal dims, ranges, constant inputs) stand in for it.
"""

from __future__ import annotations

import copy
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from attnopt import forms
from attnopt.forms.common.base import BuildContext, SiteModule
from attnopt.forms.common.mixed_heads import build_site
from attnopt.ir.calls import Recording, SiteCall
from attnopt.ir.detection import Detection
from attnopt.ir.digest import tensors_digest
from attnopt.ir.errors import CalibrationError, SaveError, SpecializedInputError
from attnopt.passes.capture import capture_export
from attnopt.passes.detect import detect
from attnopt.passes.input_guard import contract_from_dict, contract_to_dict, guard_of, install_guard
from attnopt.passes.record import record_graph
from attnopt.passes.splice import splice_graph
from attnopt.targets.base import Installed, Target, read_site_state, restore_site, site_entries
from attnopt.targets.program_archive import read_program, write_program


class CompiledModule(nn.Module):
    """A rewritten captured graph, called like the original module (same arguments, same outputs)."""

    def __init__(self, graph_module: nn.Module, original_name: str, program=None):
        super().__init__()
        self.graph_module = graph_module
        self.original_name = original_name
        # The captured ExportedProgram the graph was spliced from, its tensors shared with
        # graph_module's (attnopt.save writes it; None when unpickled, which drops it).
        self.program = program
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

    # -- pickling: a user's own torch.save of the module (attnopt.save never pickles, attnopt.load never unpickles)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_modules"] = {**self._modules, "graph_module": picklable_graph_module(self.graph_module)}
        state["program"] = None  # only attnopt.save needs it; an unpickled copy says so when saved
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
    PROGRAM_FILE = "attnopt_program.pt2"
    SITE_STATE_FILE = "attnopt_sites.safetensors"

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
        program = program_sharing_tensors(self.captured.exported_program, spliced.graph_module)
        return Installed(CompiledModule(spliced.graph_module, self.name, program), spliced.counts)

    # -- the compiled model

    def record_exact(self, batches: list, report) -> Recording:
        modules = self.site_modules()
        if any(m.uses_anchor_qk for m in modules.values()):
            raise CalibrationError("calibrate: a graph-path model with reuse sites cannot be recorded (their anchors "
                                   "run inside the captured graph, which records no call); compile a transformers "
                                   "model for reuse")
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
        from safetensors.torch import save_file

        model = self.model
        if getattr(model, "program", None) is None:
            raise SaveError(f"attnopt.save: this compiled {model.original_name} holds no captured program (it was "
                            "unpickled, which drops it); compile the model again and save the result")
        guard = guard_of(model.graph_module)
        if guard is None:
            raise SaveError(f"attnopt.save: this compiled {model.original_name} has no input guard; compile the "
                            "model again and save the result")
        try:
            inputs = contract_to_dict(guard.contract)
        except ValueError as exc:
            raise SaveError(f"attnopt.save: {exc}") from None
        entries, state = [], {}
        for name, module in spliced_sites(model.graph_module):
            site_id = module.geometry.site_id
            own = {k: t.detach().contiguous().clone() for k, t in module.state_dict().items()}
            state.update({f"{site_id}/{k}": t for k, t in own.items()})
            entries.append({"site_id": site_id, "name": name, "form": module.form, "params": dict(module.params),
                            "state": {k: list(t.shape) for k, t in own.items()}, "sha256": tensors_digest(own)})
        write_program(program_sharing_tensors(model.program, model.graph_module), path / self.PROGRAM_FILE)
        save_file(state, str(path / self.SITE_STATE_FILE))
        return {"program": self.PROGRAM_FILE, "inputs": inputs, "sites": entries}

    @classmethod
    def load(cls, path: Path, header: dict, report) -> nn.Module:
        where = path / HEADER
        check_listed_files(path, header, {cls.PROGRAM_FILE, cls.SITE_STATE_FILE})
        entries = site_entries(where, header.get("sites"), ENTRY_FIELDS)
        try:
            contract = contract_from_dict(header.get("inputs"))
        except ValueError as exc:
            raise SaveError(f"attnopt.load: {where} field 'inputs' is damaged ({exc}); save the model again") from None
        state = read_site_state(path / cls.SITE_STATE_FILE)
        program = read_program(path / cls.PROGRAM_FILE)
        try:
            graph_module = _unlifted(program)
        except Exception as exc:
            raise SaveError(f"attnopt.load: {path / cls.PROGRAM_FILE} holds a program torch.export cannot rebuild "
                            f"({type(exc).__name__}: {str(exc)[:200]})") from None
        install_guard(graph_module, contract)
        sites = [r.site for r in report.sites]
        modules = {e["site_id"]: _restore_site(e, sites, state, path) for e in entries}
        try:
            spliced = splice_graph(graph_module, sites, modules)
        except (KeyError, AttributeError, RuntimeError) as exc:  # a report naming nodes the program lacks
            raise SaveError(f"attnopt.load: {where}: the report's sites do not fit the saved program "
                            f"({type(exc).__name__}: {exc}); the directory is damaged (save the model again)") from None
        if [n for n, _ in spliced_sites(spliced.graph_module)] != [e["name"] for e in entries]:
            raise SaveError(f"attnopt.load: {where} field 'sites' names its modules out of splice order")
        model = CompiledModule(spliced.graph_module, report.model_name,
                               program_sharing_tensors(program, spliced.graph_module))
        cls(model).check_sites_match(report, where)
        return model


def _unlifted(program) -> torch.fx.GraphModule:
    """The program as a module called like the model. Without export's guard function where torch can
    leave it out: that function is Python that `.module()` generates and execs, and attnopt's
    InputGuard checks the inputs instead (the archive check keeps what it is generated from plain)."""
    try:
        return program.module(check_guards=False)
    except TypeError:  # a torch whose .module() has no check_guards
        return program.module()


HEADER = "attnopt.json"
ENTRY_FIELDS = {"site_id": str, "name": str, "form": str, "params": dict, "state": dict, "sha256": str}


def spliced_sites(graph_module: nn.Module) -> list[tuple[str, SiteModule]]:
    """(graph name, site module) of every site spliced into `graph_module`, in splice order (the
    splice names them attnopt_site_<i>)."""
    found = [(name, m) for name, m in graph_module.named_children() if isinstance(m, SiteModule)]

    def order(item):
        index = re.fullmatch(r"attnopt_site_(\d+)", item[0])
        return (0, int(index.group(1))) if index else (1, 0)

    return sorted(found, key=order)


def program_sharing_tensors(program, graph_module: nn.Module):
    """`program` with its parameters, buffers and constants taken from `graph_module` (same tensors,
    no copy): the compiled model's current weights, and no second copy of them kept in memory."""
    shared = copy.copy(program)
    live = {**dict(graph_module.named_parameters(remove_duplicate=False)),
            **dict(graph_module.named_buffers(remove_duplicate=False))}

    def take(name: str, old: torch.Tensor) -> torch.Tensor:
        new = live.get(name)
        if new is None:  # a lifted constant: a plain attribute of the unlifted module
            owner, _, attr = name.rpartition(".")
            try:
                new = getattr(graph_module.get_submodule(owner), attr, None)
            except AttributeError:
                return old
        if not isinstance(new, torch.Tensor):
            return old
        if new.shape != old.shape or new.dtype != old.dtype:
            raise SaveError(f"attnopt.save: {name} is {tuple(new.shape)} {new.dtype} in the compiled model but "
                            f"{tuple(old.shape)} {old.dtype} in its captured program; load weights of the captured "
                            "shapes, or compile again")
        return new

    shared._state_dict = {k: take(k, t) for k, t in program.state_dict.items()}
    shared._constants = {k: take(k, t) if isinstance(t, torch.Tensor) else t for k, t in program.constants.items()}
    return shared


def check_listed_files(path: Path, header: dict, allowed: set) -> None:
    """SaveError for a file the header lists that this mechanism does not write (it is never read)."""
    extra = sorted(set(header["files"]) - allowed)
    if extra:
        raise SaveError(f"attnopt.load: {path / HEADER} lists {extra[0]!r}, which a graph-path directory does not "
                        f"hold (only {', '.join(sorted(allowed))}); the directory is damaged (save the model again)")


def _restore_site(entry: dict, sites: list, state: dict, path: Path) -> SiteModule:
    site = next((s for s in sites if s.id == entry["site_id"]), None)
    if site is None:
        raise SaveError(f"attnopt.load: {path / HEADER} lists site {entry['site_id']!r}, which its report does "
                        "not have")
    return restore_site(entry, site, state, path / GraphTarget.SITE_STATE_FILE, path / HEADER,
                        lambda form, site, params: build_site(form, site, params, BuildContext(sites=sites)))


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
