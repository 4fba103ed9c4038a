"""`attnopt.save` / `attnopt.load`: a compiled model on disk, and back in another process.

Transformers models (the model keeps its class) are saved as a `save_pretrained` directory plus
two files of attnopt's own:

    config.json, model.safetensors, ...   the model's own files, without any site module weights;
                                          config.json carries "attn_implementation": "use_attnopt_load"
    attnopt.json                          format version, versions, policy, report, one entry per
                                          installed site module (site id, module path, form, params)
    attnopt_sites.safetensors             each site module's state_dict, keyed "<site_id>/<name>"

`load` reads the model back with its saved class, rebuilds every site module from its form and
params (`forms.get(form).build`), loads its state, and installs them as `attnopt.compile` did.
Plain `from_pretrained(path)` raises ValueError ('Specified `attn_implementation="use_attnopt_load"`
is not supported'); called with an explicit attn_implementation= it does load, as the original
model without the rewrite, since the site modules live only in attnopt's own files.

Graph-path models (`CompiledModule`) are pickled whole (`attnopt_graph.pt`, read with
`torch.load(weights_only=False)`): the rewritten graph is code plus its site modules, and the
pickle is the one format that keeps both. Load only directories you trust, as with any pickle.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from attnopt.ir.errors import SaveError

FORMAT_VERSION = 1
HEADER_FILE = "attnopt.json"
SITE_STATE_FILE = "attnopt_sites.safetensors"
GRAPH_FILE = "attnopt_graph.pt"
SITE_ATTR = "attnopt_site"  # the submodule name install() attaches a site module under

# Written into the saved config.json: transformers refuses an unregistered implementation with a
# ValueError naming it, so plain `from_pretrained` fails loudly instead of silently returning the
# original (exact) model, whose weights are all that config.json's directory holds. Not "attnopt"
# itself: a process that imported attnopt has registered that name, and would load the exact model.
CONFIG_IMPLEMENTATION = "use_attnopt_load"
CONFIG_NOTE_KEY = "attnopt"
CONFIG_NOTE = "compiled by attnopt: load this directory with attnopt.load(path), not from_pretrained"




def save(model: nn.Module, path: Union[str, os.PathLike]) -> Path:
    """Write the compiled `model` (from `attnopt.compile`) into the directory `path`; return it."""
    from attnopt.targets.graph import CompiledModule
    from attnopt.hf.interface import is_hf_model

    report = getattr(model, "attnopt_report", None)
    if report is None:
        raise SaveError(f"attnopt.save: this {type(model).__name__} was not compiled by attnopt.compile "
                        "(it has no .attnopt_report); save the model attnopt.compile returned")
    path = _writable_directory(Path(path))
    if isinstance(model, CompiledModule):
        return _save_graph(model, path)
    if is_hf_model(model):
        return _save_hf(model, report, path)
    raise SaveError(f"attnopt.save: a compiled {type(model).__name__} is neither a transformers model nor a "
                    "CompiledModule; attnopt.save knows only those two")


def load(path: Union[str, os.PathLike]) -> nn.Module:
    """The compiled model saved in `path` by `attnopt.save`, with its `.attnopt_report`."""
    path = Path(path)
    header = read_header(path)
    if header["mechanism"] == "graph":
        return _load_graph(path)
    return _load_hf(path, header)


def read_header(path: Path) -> dict:
    """attnopt.json of a saved directory, its format version checked."""
    if not path.is_dir():
        raise SaveError(f"attnopt.load: {path} is not a directory saved by attnopt.save")
    file = path / HEADER_FILE
    if not file.is_file():
        raise SaveError(f"attnopt.load: {path} has no {HEADER_FILE}, so it was not saved by attnopt.save "
                        "(a plain transformers directory loads with from_pretrained)")
    try:
        header = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SaveError(f"attnopt.load: {file} cannot be read as JSON ({exc})") from exc
    version = header.get("format_version") if isinstance(header, dict) else None
    if isinstance(version, bool) or not isinstance(version, int):
        raise SaveError(f"attnopt.load: {file} has no integer format_version; it was not written by attnopt.save")
    if version > FORMAT_VERSION:
        raise SaveError(f"attnopt.load: {path} was saved in attnopt format {version}, newer than this attnopt "
                        f"reads (up to {FORMAT_VERSION}); upgrade attnopt (saved by attnopt "
                        f"{header.get('versions', {}).get('attnopt', 'unknown')})")
    if header.get("mechanism") not in ("hf", "graph"):
        raise SaveError(f"attnopt.load: {file} names mechanism {header.get('mechanism')!r}; expected 'hf' or 'graph'")
    return header


def _writable_directory(path: Path) -> Path:
    if path.exists() and not path.is_dir():
        raise SaveError(f"attnopt.save: {path} exists and is not a directory; give a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SaveError(f"attnopt.save: cannot create the directory {path} ({exc.strerror or exc})") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise SaveError(f"attnopt.save: the directory {path} is not writable")
    return path


def _versions() -> dict:
    # The package root is imported before any of its modules; reading it from sys.modules keeps the
    # root's lazy `save`/`load` names from being an import cycle.
    return {"attnopt": sys.modules["attnopt"].__version__, "torch": torch.__version__}


def _write_header(path: Path, header: dict) -> None:
    from attnopt.report import _finite

    text = json.dumps(_finite(header), indent=2, default=str, allow_nan=False)
    (path / HEADER_FILE).write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- transformers path


def installed_site_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(attention module path, site module) for every site module install() attached, in model order."""
    return [(name, m._modules[SITE_ATTR]) for name, m in model.named_modules() if SITE_ATTR in m._modules]


def _save_hf(model: nn.Module, report, path: Path) -> Path:
    from safetensors.torch import save_file

    from attnopt.ir.outcomes import Status

    installed = installed_site_modules(model)
    accepted = {r.site.id for r in report.sites if r.outcome.status == Status.REWRITTEN}
    entries, state = [], {}
    for module_path, module in installed:
        site_id = module.geometry.site_id
        own = {name: t.detach().contiguous().clone() for name, t in module.state_dict().items()}
        state.update({f"{site_id}/{name}": t for name, t in own.items()})
        # Sites not accepted in the report are exact sites install() runs as the model's own window band
        # (take_over_model_windows); they are saved too so the loaded model is the same module for module.
        entries.append({"site_id": site_id, "module_path": module_path, "form": module.form,
                        "params": dict(module.params), "accepted": site_id in accepted,
                        "state": {name: list(t.shape) for name, t in own.items()}})
    # The model's own weights only: the site modules are detached while save_pretrained runs, so a
    # plain transformers reader sees the original architecture's keys (and the config refuses it).
    detached = [(model.get_submodule(p), m) for p, m in installed]
    for owner, _ in detached:
        del owner._modules[SITE_ATTR]
    try:
        model.save_pretrained(path)
    finally:
        for owner, module in detached:
            owner._modules[SITE_ATTR] = module
    config_file = path / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["attn_implementation"] = CONFIG_IMPLEMENTATION
    config[CONFIG_NOTE_KEY] = CONFIG_NOTE
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file(state, str(path / SITE_STATE_FILE))
    _write_header(path, {
        "format": "attnopt", "format_version": FORMAT_VERSION, "mechanism": "hf", "versions": _versions(),
        "model_class": type(model).__name__,
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "policy": report.policy_dict(), "report": report.to_dict(), "sites": entries,
    })
    return path


def _model_class(config) -> Any:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def _load_hf(path: Path, header: dict) -> nn.Module:
    import transformers
    from safetensors.torch import load_file

    from attnopt.hf.install import install
    from attnopt.hf.interface import IMPL_EAGER, implementation_for, switch
    from attnopt.targets.hf import HfTarget
    from attnopt.report import CompileReport

    config = transformers.AutoConfig.from_pretrained(path)
    # The mask flavour the model was compiled under: "attnopt_eager" came from an eager model.
    base = "eager" if header.get("attn_implementation") == IMPL_EAGER else "sdpa"
    model = _model_class(config).from_pretrained(path, attn_implementation=base).eval()
    if hasattr(model.config, CONFIG_NOTE_KEY):
        delattr(model.config, CONFIG_NOTE_KEY)
    switch(model, implementation_for(model))
    report = CompileReport.from_dict(header["report"])
    report.policy = _policy(header["policy"])
    # Sites as the transformers mechanism builds them (HF's mask spelling), as compile did.
    sites = [HfTarget.adapt_site(r.site) for r in report.sites]
    by_id = {s.id: s for s in sites}
    state_file = path / SITE_STATE_FILE
    state = load_file(str(state_file)) if state_file.is_file() else {}
    modules = {}
    for entry in header["sites"]:
        site = by_id.get(entry["site_id"])
        if site is None:
            raise SaveError(f"attnopt.load: {HEADER_FILE} lists site {entry['site_id']!r}, which its report does not have")
        prefix = entry["site_id"] + "/"
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        module = _build_site(site, entry, sites)
        # assign: the saved tensors themselves (their dtype and device), not copies into fresh ones.
        missing, unexpected = module.load_state_dict(own, strict=False, assign=True)
        if missing or unexpected:
            raise SaveError(f"attnopt.load: site {site.id} ({entry['form']}) state does not match its module: "
                            f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        modules[site.id] = module.eval()
    install(model, sites, modules)
    model.attnopt_report = report
    return model


def _build_site(site, entry: dict, sites: list) -> nn.Module:
    from attnopt import forms
    from attnopt.forms.common.base import BuildContext
    from attnopt.forms.reuse.form import ReuseSite, find_anchor

    params = entry["params"]
    if entry["form"] == "reuse" and params.get("rank", 0) > 0:
        # The residual is fitted from the compile-time projections and inputs; its saved values
        # replace these zeros right after.
        anchor = find_anchor(site, sites, params["anchor"])
        if anchor is None:
            raise SaveError(f"attnopt.load: reuse site {site.id} finds no anchor at {params['anchor']} among the saved sites")
        shapes = entry["state"]
        residual = (torch.zeros(shapes["residual_A"]), torch.zeros(shapes["residual_B"]))
        return ReuseSite(site, params, anchor, residual)
    return forms.get(entry["form"]).build(site, params, BuildContext(sites=sites))


def _policy(d: Any) -> Any:
    """The saved policy as a Policy again (the report keeps it either way)."""
    from attnopt.policy import Policy

    try:
        return Policy.from_dict(d)
    except (ValueError, TypeError):  # PolicyError is a ValueError: keep the dict the report holds
        return d


# ---------------------------------------------------------------- graph path


def _save_graph(model: nn.Module, path: Path) -> Path:
    torch.save(model, path / GRAPH_FILE)
    _write_header(path, {
        "format": "attnopt", "format_version": FORMAT_VERSION, "mechanism": "graph", "versions": _versions(),
        "model_class": type(model).__name__, "policy": model.attnopt_report.policy_dict(),
        "report": model.attnopt_report.to_dict(), "file": GRAPH_FILE,
    })
    return path


def _load_graph(path: Path) -> nn.Module:
    file = path / GRAPH_FILE
    if not file.is_file():
        raise SaveError(f"attnopt.load: {path} has no {GRAPH_FILE}; the directory is incomplete")
    return torch.load(file, weights_only=False)
