"""What a rewrite mechanism must do, from capture to save/load: the `Target` protocol.

A Target wraps one model: at compile time a copy of the user's model (`for_compile`), afterwards
the compiled model itself (`target_of`). Everything that differs between mechanisms lives behind
these methods, and only dataclasses cross them.
"""

from __future__ import annotations

import abc
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch
from torch import nn

from attnopt import forms
from attnopt.forms.common.base import BuildContext, SiteModule
from attnopt.ir.calls import Recording
from attnopt.ir.detection import Detection
from attnopt.ir.digest import tensors_digest
from attnopt.ir.errors import SaveError
from attnopt.ir.outcomes import Status
from attnopt.ir.site import AttentionSite

Batch = tuple  # (args: tuple, kwargs: dict)


@dataclass(frozen=True)
class LongerBatch:
    """A verification input longer than the example (`batch`), or why none can be built (`reason`)."""

    batch: Optional[Batch] = None
    reason: str = ""


@dataclass
class Installed:
    """The model with the given site modules in place, and the install step's counts."""

    model: nn.Module
    counts: dict


class Target(abc.ABC):
    """One model under one mechanism. Subclasses: GraphTarget ("graph"), HfTarget ("hf")."""

    mechanism: ClassVar[str]

    def __init__(self, model: nn.Module, name: Optional[str] = None):
        self.model = model
        self.name = name or type(model).__name__

    # -- which models

    @classmethod
    def for_compile(cls, model: nn.Module, name: str) -> "Target":
        """A target around an eval-mode deep copy of `model` (the user's model is never touched)."""
        return cls(copy.deepcopy(model).eval(), name)

    @classmethod
    @abc.abstractmethod
    def compiled_by(cls, model: nn.Module) -> bool:
        """Whether `model` is a model this mechanism compiled."""

    # -- compile: capture, record, build, install

    @abc.abstractmethod
    def detect(self, batches: list) -> Detection:
        """Capture the model on `batches[0]` and find its attention sites."""

    @abc.abstractmethod
    def record(self, found: Detection, batches: list) -> Recording:
        """Run the exact model on every batch and keep each site's calls and the model's outputs."""

    def longer_batch(self, batch: Batch, length: int) -> LongerBatch:
        """A batch of about `length` tokens built from `batch`, for forms that act only on longer inputs."""
        return LongerBatch(reason="a graph-path model's inputs have no known sequence axis")

    def build_context(self, sites: list, recording: Recording) -> BuildContext:
        return BuildContext(sites=sites, calls=recording.calls)

    def adapt_site(self, site: AttentionSite) -> AttentionSite:
        """The site as this mechanism's site modules see it (e.g. the mask spelling they are handed)."""
        return site

    @abc.abstractmethod
    def install(self, sites: list, modules: dict) -> Installed:
        """The model with `modules` (site id -> SiteModule) in place of those sites, every other exact."""

    def installs(self, sites: list) -> dict:
        """How each site's module is put in place (site id -> a short word, for the report)."""
        return {s.id: self.mechanism for s in sites}

    def run(self, model: nn.Module, batches: list) -> list:
        """The outputs of `model` on every batch (no grad)."""
        with torch.no_grad():
            return [model(*args, **kwargs) for args, kwargs in batches]

    # -- the compiled model

    def site_modules(self) -> dict[str, SiteModule]:
        """Every installed site module by site id, in model order."""
        return {m.geometry.site_id: m for m in self.model.modules() if isinstance(m, SiteModule) and not m.nested}

    @abc.abstractmethod
    def record_exact(self, batches: list, report: Any) -> Recording:
        """Run the compiled model with every site exact on `batches`; keep each rewritten site's
        original inputs and exact output (what calibration trains towards) and the outputs."""

    @abc.abstractmethod
    def put_back_exact(self, site_ids: list, report: Any) -> None:
        """Make these sites of the compiled model exact again (in place)."""

    def lora_targets(self, report: Any) -> list[str]:
        """Module names of the q/k/v/o projections LoRA adapts; ValueError where it does not apply."""
        raise ValueError(f"LoRA needs a transformers model (its q/k/v/o nn.Linear projections); {self.name} is "
                         f"compiled by the {self.mechanism} mechanism")

    def default_example(self) -> Batch:
        """Inputs to export the compiled model with when the caller gives none; ValueError if unknown."""
        raise ValueError("export_onnx needs example_inputs= for this model (only transformers models with a vocab_size "
                         "get default input_ids)")

    # -- on disk

    @abc.abstractmethod
    def save(self, path: Path, report: Any) -> dict:
        """Write the compiled model's files into `path`; return the header entries to record."""

    @classmethod
    @abc.abstractmethod
    def load(cls, path: Path, header: dict, report: Any) -> nn.Module:
        """The compiled model saved in `path` (its header already checked; `report` read from it)."""

    def check_sites_match(self, report: Any, where: Path) -> None:
        """SaveError unless the loaded model runs exactly the forms and parameters its report names:
        every rewritten site has its module, and no other site has one."""
        modules = self.site_modules()
        for record in report.sites:
            site_id, outcome = record.site.id, record.outcome
            module = modules.pop(site_id, None)
            if outcome.status == Status.REWRITTEN:
                if module is None:
                    raise SaveError(f"attnopt.load: {where} has no site module for {site_id}, which the report says "
                                    f"runs {outcome.final_form}; the directory is damaged (save the model again)")
                if module.form != outcome.final_form or plain_params(module.params) != plain_params(outcome.params):
                    raise SaveError(f"attnopt.load: {where}: site {site_id} runs {module.form} {plain_params(module.params)}, "
                                    f"the report says {outcome.final_form} {plain_params(outcome.params)}; the directory is "
                                    "damaged (save the model again)")
            elif module is not None:
                raise SaveError(f"attnopt.load: {where}: site {site_id} has a {module.form} module but the report "
                                f"keeps it {outcome.final_form}; the directory is damaged (save the model again)")
        if modules:
            raise SaveError(f"attnopt.load: {where} has site modules the report does not list: {sorted(modules)}")


def site_entries(header_file: Path, entries: Any, fields: dict) -> list:
    """A saved header's site entries, each a dict with every field of `fields` ({name: type}) of its
    type and no site listed twice; SaveError naming the field otherwise."""
    if not isinstance(entries, list):
        raise SaveError(f"attnopt.load: {header_file} field 'sites' is missing or not a list")
    for i, entry in enumerate(entries):
        for name, kind in fields.items():
            if not isinstance(entry, dict) or not isinstance(entry.get(name), kind):
                raise SaveError(f"attnopt.load: {header_file} field 'sites[{i}].{name}' is missing or not a "
                                f"{kind.__name__}; the directory is damaged (save the model again)")
    if len({e["site_id"] for e in entries}) != len(entries):
        raise SaveError(f"attnopt.load: {header_file} field 'sites' lists a site twice")
    return entries


def read_site_state(file: Path) -> dict:
    """Every tensor of a saved site-state file (safetensors: data only), or SaveError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise SaveError(f"attnopt.load: {file} cannot be read ({exc}); the directory is damaged") from None


def restore_site(entry: dict, site: AttentionSite, state: dict, state_file: Path, header_file: Path,
                 build: Callable) -> SiteModule:
    """The site module a saved entry describes: its parameters valid and complete for its form, its
    tensors ("<site_id>/<name>" in `state`) of the declared shapes and digest, built by
    `build(form, site, params)` and given those tensors. SaveError naming the field otherwise."""
    sid = entry["site_id"]
    try:
        form = forms.get(entry["form"])
        params = form.validate(entry["params"])
    except ValueError as exc:
        raise SaveError(f"attnopt.load: {header_file} field 'sites.{sid}.params' is not valid for form "
                        f"{entry['form']!r}: {exc}") from None
    if plain_params(params) != plain_params(entry["params"]):
        raise SaveError(f"attnopt.load: {header_file} field 'sites.{sid}.params' is incomplete for form "
                        f"{entry['form']!r}")
    own = {k[len(sid) + 1:]: v for k, v in state.items() if k.startswith(sid + "/")}
    declared = {name: list(shape) for name, shape in entry["state"].items()}
    if {n: list(t.shape) for n, t in own.items()} != declared:
        raise SaveError(f"attnopt.load: {state_file}: the tensors of site {sid} "
                        f"({ {n: list(t.shape) for n, t in own.items()} }) are not the declared {declared}")
    if tensors_digest(own) != entry["sha256"]:
        raise SaveError(f"attnopt.load: {state_file}: the tensors of site {sid} changed after saving (sha256 differs)")
    try:
        module = build(form, site, params)
    except SaveError:
        raise
    except ValueError as exc:  # SiteUnsupported: the saved form cannot serve the saved site
        raise SaveError(f"attnopt.load: site {sid} cannot be rebuilt as {entry['form']} ({exc})") from None
    # assign: the saved tensors themselves (their dtype and device), not copies into fresh ones.
    missing, unexpected = module.load_state_dict(own, strict=False, assign=True)
    if missing or unexpected:
        raise SaveError(f"attnopt.load: site {sid} ({entry['form']}) state does not match its module: "
                        f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return module.eval()


def plain_params(params: Any) -> Any:
    """Parameters as JSON reads them back (tuples become lists), for comparing saved with loaded."""
    return json.loads(json.dumps(params, sort_keys=True, default=str))
