"""The transformers mechanism: the model keeps its class (generate(), caches, any length) and its
attention modules are pointed at attnopt's registered attention function.

Sites come from torch.export detection when the model exports, else from the attention-interface
calls themselves; verification inputs are recorded through the same interface. Saved as the model's
own `save_pretrained` directory plus attnopt's files:

    config.json, model.safetensors, ...   the model's own files, without any site module weights;
                                          config.json carries "attn_implementation": "use_attnopt_load"
    attnopt.json                          (saving.py) the header, with one entry per installed site
                                          module (site id, module path, form, params)
    attnopt_sites.safetensors             each site module's state_dict, keyed "<site_id>/<name>"

Plain `from_pretrained(path)` raises ValueError ('Specified `attn_implementation="use_attnopt_load"`
is not supported'); called with an explicit attn_implementation= it loads the original model
without the rewrite, since the site modules live only in attnopt's own files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.forms.common.mixed_heads import build_site
from attnopt.hf.interface import IMPL_EAGER, IMPL_SDPA, layer_index
from attnopt.hf.recording import call_model, record_calls
from attnopt.hf.routes import INTERFACE, MODULE, is_hf_model, position_limit, reached, route, route_kind
from attnopt.hf.sites import model_keeps_exact, site_from_call
from attnopt.ir.calls import Recording
from attnopt.ir.detection import Detection
from attnopt.ir.digest import tensors_digest
from attnopt.ir.errors import SaveError
from attnopt.ir.outcomes import Status
from attnopt.passes.capture import capture_export, without_cache
from attnopt.passes.detect import detect_all
from attnopt.targets.base import Installed, LongerBatch, Target, read_site_state, restore_site, site_entries
from attnopt.targets.detection_memo import detected

__all__ = ["HfTarget", "is_hf_model"]

SITE_ATTR = "attnopt_site"  # the submodule name install() attaches a site module under
SITE_STATE_FILE = "attnopt_sites.safetensors"
# Written into the saved config.json: transformers refuses an unregistered implementation with a
# ValueError naming it, so plain `from_pretrained` fails loudly instead of silently returning the
# original (exact) model, whose weights are all that config.json's directory holds. Not "attnopt"
# itself: a process that imported attnopt has registered that name, and would load the exact model.
CONFIG_IMPLEMENTATION = "use_attnopt_load"
CONFIG_NOTE_KEY = "attnopt"
CONFIG_NOTE = "compiled by attnopt: load this directory with attnopt.load(path), not from_pretrained"
# Names transformers attention modules give q, k, v and the output projection; BERT-style models
# keep the output projection one level up, as `<attention>.output.dense`.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "query", "key", "value", "out_proj")


class HfTarget(Target):
    """detect → record → (plan, verify elsewhere) → install, on a transformers model copy."""

    mechanism = "hf"

    @classmethod
    def compiled_by(cls, model: nn.Module) -> bool:
        return is_hf_model(model) and getattr(model, "attnopt_report", None) is not None

    def detect(self, batches: list) -> Detection:
        if route_kind(self.model) == MODULE:
            # Routed per module, the calls show each site as the module computes it (its causal band
            # folded into one mask, its own heads); a graph of the inline math proves less.
            return Detection(capture="hf", notes=[])
        args, kwargs = batches[0]
        kwargs = without_cache(self.model, kwargs)

        def capture_and_detect() -> Detection:
            found = detect_all([capture_export(self.model, args, kwargs, dynamic=False)], "export")
            found.capture, found.notes = "export+hf", []
            return found

        try:
            return detected(self.model, args, kwargs, capture_and_detect)  # a second compile reuses the first's
        except Exception as exc:  # the attention interface still shows every site; say why export failed
            return Detection(capture="hf", notes=[
                f"torch.export capture failed ({type(exc).__name__}: {str(exc)[:300]}); sites were described "
                "from the attention interface calls"])

    def record(self, found: Detection, batches: list) -> Recording:
        """Record every attention call on every batch; fills `found.sites` when export showed none."""
        routed = route(self.model)
        try:
            recorded, outputs = record_calls(self.model, batches)
        except Exception as exc:
            raise ValueError(
                f"the model failed when called with the example inputs ({type(exc).__name__}: {exc}); "
                "pass example_inputs the way you call the model: a dict of keyword arguments such as the "
                "tokenizer's output, a tuple of positional arguments, or (args, kwargs)"
            ) from exc
        modules = dict(self.model.named_modules())
        if not found.sites and recorded:
            if found.capture != "hf":
                found.notes.append("torch.export showed no attention site, but the attention interface was called: "
                                   "sites are described from those calls")
            for i, path in enumerate(recorded):
                call, info = recorded[path][0]
                layer = layer_index(modules[path])
                found.sites.append(site_from_call(path, modules[path], call, info, i if layer is None else layer))
        rec = Recording(outputs=outputs, notes=_route_notes(routed, found.sites, recorded))
        for j, site in enumerate(found.sites):
            calls = recorded.get(site.module_path, [])
            found.sites[j] = site = _with_layer(_with_call_info(site, [info for _, info in calls]),
                                                modules[site.module_path])
            per_module = sum(1 for s in found.sites if s.module_path == site.module_path)
            if per_module == 1 and len(calls) == len(batches):
                rec.calls[site.id] = [c for c, _ in calls]
            elif calls:
                rec.notes.append(f"site {site.id}: {len(calls)} attention-interface calls for {per_module} sites; not rewritten")
        rec.notes += _window_notes(found.sites)
        rec.counts = {"batches": len(batches), "sites": len(found.sites), "calls": sum(len(c) for c in rec.calls.values())}
        return rec

    def build_context(self, sites: list, recording: Recording) -> BuildContext:
        return BuildContext(sites=sites, calls=recording.calls)

    def adapt_site(self, site):
        # HF hands masks in its own spelling (bool keep for sdpa, additive for eager): read them as such.
        return replace(site, mask=replace(site.mask, keep_when="zero"))

    def install(self, sites: list, modules: dict) -> Installed:
        from attnopt.hf.install import install  # needs transformers' cache classes

        return Installed(self.model, install(self.model, sites, modules))

    def installs(self, sites: list) -> dict:
        """How each site's module reaches attnopt: "attention-interface", or the module route taken."""
        routed = reached(self.model)
        return {s.id: routed.install_of(s.module_path) if routed is not None else INTERFACE for s in sites}

    def longer_batch(self, batch, length: int) -> LongerBatch:
        """A batch of `length` tokens built from the example, or why it cannot be built.

        Row 0's real tokens repeated to the length, within the model's position limit: enough for
        a form to act, and text-like enough for the attention pattern to be the model's own.
        """
        args, kwargs = batch
        limit = position_limit(self.model)
        if limit is not None:
            length = min(length, limit)
        ids = kwargs.get("input_ids")
        if args or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return LongerBatch(reason="the example inputs are not keyword input_ids [B, N] to extend")
        B, N = ids.shape
        if length <= N:
            return LongerBatch(reason=f"the model's position limit ({limit}) is not beyond the example length {N}")
        am = kwargs.get("attention_mask")
        real = ids[0][am[0].bool()] if isinstance(am, torch.Tensor) and am.shape == ids.shape else ids[0]
        reps = -(-length // max(1, real.numel()))
        out = {}
        for key, value in kwargs.items():
            if key == "input_ids":
                out[key] = real.repeat(reps)[:length][None]
            elif key == "attention_mask":
                out[key] = torch.ones(1, length, dtype=value.dtype)
            elif key == "token_type_ids":
                out[key] = torch.zeros(1, length, dtype=value.dtype)
            elif key == "position_ids":
                out[key] = torch.arange(length, dtype=value.dtype)[None]
            elif isinstance(value, torch.Tensor):
                return LongerBatch(reason=f"the example input {key!r} cannot be extended to {length} tokens")
            else:
                out[key] = value
        return LongerBatch(batch=((), out))

    def run(self, model: nn.Module, batches: list) -> list:
        with torch.no_grad():
            return [call_model(model, b) for b in batches]

    # -- the compiled model

    def record_exact(self, batches: list, report) -> Recording:
        recorded, outputs = record_calls(self.model, batches)
        recording = Recording(outputs=outputs)
        for rec in report.sites:
            calls = recorded.get(rec.site.module_path, [])
            if len(calls) == len(batches):  # one call per batch: a module that is one site
                recording.calls[rec.site.id] = [c.detached() for c, _ in calls]
        return recording

    def put_back_exact(self, site_ids: list, report) -> None:
        by_id = {r.site.id: r.site for r in report.sites}
        for sid in site_ids:
            self.model.get_submodule(by_id[sid].module_path)._modules.pop(SITE_ATTR, None)

    def lora_targets(self, report) -> list[str]:
        """Full module names of every rewritten site's q/k/v/o nn.Linear projections."""
        names = []
        for rec in report.sites:
            if rec.outcome.final_form == "exact":
                continue
            path = rec.site.module_path
            attn = self.model.get_submodule(path)
            names += [f"{path}.{n}" for n in PROJECTIONS if isinstance(getattr(attn, n, None), nn.Linear)]
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            out = f"{parent}.output.dense" if parent else "output.dense"
            try:
                if isinstance(self.model.get_submodule(out), nn.Linear):
                    names.append(out)
            except AttributeError:
                pass
        return sorted(set(names))

    def default_example(self):
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is None:
            return super().default_example()
        gen = torch.Generator().manual_seed(0)
        return (), {"input_ids": torch.randint(0, vocab, (1, 128), generator=gen)}

    def installed(self) -> list[tuple[str, nn.Module]]:
        """(attention module path, site module) for every site module install() attached, in model order."""
        return [(name, m._modules[SITE_ATTR]) for name, m in self.model.named_modules() if SITE_ATTR in m._modules]

    # -- on disk

    def save(self, path: Path, report) -> dict:
        from safetensors.torch import save_file

        installed = self.installed()
        accepted = {r.site.id for r in report.sites if r.outcome.status == Status.REWRITTEN}
        entries, state = [], {}
        for module_path, module in installed:
            site_id = module.geometry.site_id
            own = {name: t.detach().contiguous().clone() for name, t in module.state_dict().items()}
            state.update({f"{site_id}/{name}": t for name, t in own.items()})
            entries.append({"site_id": site_id, "module_path": module_path, "form": module.form,
                            "params": dict(module.params), "accepted": site_id in accepted,
                            "state": {name: list(t.shape) for name, t in own.items()},
                            "sha256": tensors_digest(own)})
        self._save_pretrained_without_sites(path, installed)
        save_file(state, str(path / SITE_STATE_FILE))
        return {"model_class": type(self.model).__name__,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None), "sites": entries,
                "buffer_dtypes": unsaved_buffer_dtypes(self.model)}

    def _save_pretrained_without_sites(self, path: Path, installed: list) -> None:
        # The model's own weights only: the site modules are detached while save_pretrained runs, so a
        # plain transformers reader sees the original architecture's keys (and the config refuses it).
        detached = [(self.model.get_submodule(p), m) for p, m in installed]
        for owner, _ in detached:
            del owner._modules[SITE_ATTR]
        try:
            self.model.save_pretrained(path)
        finally:
            for owner, module in detached:
                owner._modules[SITE_ATTR] = module
        config_file = path / "config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["attn_implementation"] = CONFIG_IMPLEMENTATION
        config[CONFIG_NOTE_KEY] = CONFIG_NOTE
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path, header: dict, report) -> nn.Module:
        from attnopt.hf.install import install  # needs transformers' cache classes

        entries = site_entries(path / HEADER, header.get("sites"), ENTRY_FIELDS)
        state = read_site_state(path / SITE_STATE_FILE) if (path / SITE_STATE_FILE).is_file() else {}
        with _checked_files_only(path, header["files"]) as staged:
            model = _load_pretrained(staged, header, path)
        target = cls(model)
        # Sites as the transformers mechanism builds them (HF's mask spelling), as compile did.
        sites = [target.adapt_site(r.site) for r in report.sites]
        modules = {e["site_id"]: _restore_site(e, sites, state, path) for e in entries}
        install(model, sites, modules)
        cast_unsaved_buffers(model, header.get("buffer_dtypes", {}), path / HEADER)
        target.check_sites_match(report, path / HEADER)
        return model


HEADER = "attnopt.json"
# The dtypes a buffer may be recorded in (the header is untrusted: no other name reaches getattr(torch)).
BUFFER_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def unsaved_buffer_dtypes(model: nn.Module) -> dict:
    """{buffer name: dtype} of the floating buffers save_pretrained leaves out (non-persistent, such
    as RoPE's inv_freq). from_pretrained rebuilds them in its own dtype; a model cast with .to() had
    them in another, and a load must compute what was saved."""
    out = {}
    for prefix, module in model.named_modules():  # site modules too (ssm's decay: rebuilt in float64)
        for name in module._non_persistent_buffers_set:
            t = module._buffers.get(name)
            if t is not None and t.is_floating_point():
                out[f"{prefix}.{name}" if prefix else name] = str(t.dtype)
    return out


def cast_unsaved_buffers(model: nn.Module, dtypes, header: Path) -> int:
    """Cast the buffers `dtypes` names (unsaved_buffer_dtypes at save) to their saved dtype; the count cast."""
    if not isinstance(dtypes, dict):
        raise SaveError(f"attnopt.load: {header} field 'buffer_dtypes' is not an object; the directory is damaged")
    cast = 0
    for name, dtype in dtypes.items():
        owner, _, leaf = str(name).rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            module = None
        t = None if module is None else module._buffers.get(leaf)
        if t is None or not t.is_floating_point() or dtype not in BUFFER_DTYPES:
            raise SaveError(f"attnopt.load: {header} field 'buffer_dtypes' names {name!r} as {dtype!r}: no such "
                            "floating buffer or dtype in the loaded model; the directory is damaged (save it again)")
        if t.dtype != BUFFER_DTYPES[dtype]:
            module._buffers[leaf] = t.to(BUFFER_DTYPES[dtype])
            cast += 1
    return cast


ENTRY_FIELDS = {"site_id": str, "module_path": str, "form": str, "params": dict, "accepted": bool, "state": dict,
                "sha256": str}


def _restore_site(entry: dict, sites: list, state: dict, path: Path) -> nn.Module:
    """The site module an entry describes, checked against the report's site and its saved tensors."""
    sid = entry["site_id"]
    site = next((s for s in sites if s.id == sid), None)
    if site is None or site.module_path != entry["module_path"]:
        raise SaveError(f"attnopt.load: {path / HEADER} lists site {sid!r} at {entry['module_path']!r}, which its "
                        "report does not have")
    return restore_site(entry, site, state, path / SITE_STATE_FILE, path / HEADER,
                        lambda form, site, params: _build_site(site, {**entry, "params": params}, sites))


# The files save_pretrained writes for a model (no tokenizer), and attnopt's own: nothing transformers
# would unpickle (*.bin, *.pt), import (*.py remote code) or pick up beside them (adapters).
SAVED_FILES = re.compile(r"^(config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                         r"model-\d{5}-of-\d{5}\.safetensors|" + re.escape(SITE_STATE_FILE) + r")$")


@contextlib.contextmanager
def _checked_files_only(path: Path, files: dict) -> Iterator[Path]:
    """A temporary directory holding links to exactly the files the header lists (digests already
    checked), so transformers sees no other file of `path`: no pickle, remote code or adapter."""
    odd = sorted(name for name in files if not SAVED_FILES.match(str(name)))
    if odd:
        raise SaveError(f"attnopt.load: {path / HEADER} lists {odd[0]!r}, which attnopt.save never writes for a "
                        "transformers model (only config.json, generation_config.json, model*.safetensors and "
                        f"{SITE_STATE_FILE}); the directory is damaged (save the model again)")
    for name in files:
        _check_readable(path / name)
    with tempfile.TemporaryDirectory(prefix="attnopt-load-", ignore_cleanup_errors=True) as staged:
        for name in files:
            try:
                os.symlink((path / name).resolve(), Path(staged) / name)
            except OSError:  # no symlinks here (e.g. Windows without the privilege): copy
                shutil.copy2(path / name, Path(staged) / name)
        yield Path(staged)


def _check_readable(file: Path) -> None:
    """SaveError unless `file` is what its name says: a JSON object, or a safetensors file (its header
    read). transformers skips a generation config it cannot parse; a damaged one is refused here."""
    from safetensors import SafetensorError, safe_open

    try:
        if file.suffix == ".json":
            if not isinstance(json.loads(file.read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        else:
            with safe_open(str(file), framework="pt"):
                pass
    except (OSError, UnicodeDecodeError, ValueError, SafetensorError) as exc:
        kind = "JSON" if file.suffix == ".json" else "safetensors"
        raise SaveError(f"attnopt.load: {file} cannot be read as {kind} ({str(exc)[:200]}); the directory is "
                        "damaged (save the model again)") from None


def _load_pretrained(staged: Path, header: dict, path: Path) -> nn.Module:
    """The saved transformers model, with the mask flavour it was compiled under, pointed at attnopt:
    read from `staged` (the checked files of `path`), safetensors only, no remote code."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(staged, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        text = str(exc).replace(str(staged), str(path))
        raise SaveError(f"attnopt.load: {path / 'config.json'} cannot be read ({text})") from None
    model_class = next((getattr(transformers, n) for n in getattr(config, "architectures", None) or ()
                        if getattr(transformers, n, None) is not None), transformers.AutoModel)
    # The mask flavour the model was compiled under: attnopt's names stand for eager / sdpa; a model
    # routed per module (Falcon, BLOOM, GPT-Neo) kept its own implementation name.
    saved = header.get("attn_implementation")
    base = {IMPL_EAGER: "eager", IMPL_SDPA: "sdpa"}.get(saved, saved if isinstance(saved, str) else "sdpa")
    try:
        model = model_class.from_pretrained(staged, attn_implementation=base, use_safetensors=True,
                                            trust_remote_code=False).eval()
    except Exception as exc:  # transformers' loaders raise many kinds (SafetensorError, OSError, ...) on damage
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first = first.replace(str(staged), str(path))
        raise SaveError(f"attnopt.load: the transformers model in {path} cannot be loaded ({first[:300]})") from None
    if hasattr(model.config, CONFIG_NOTE_KEY):
        delattr(model.config, CONFIG_NOTE_KEY)
    route(model)
    return model


def _with_call_info(site, infos: list):
    """The site as its recorded calls show it: a softcap, the model's own window, a position bias."""
    softcap = next((i.softcap for i in infos if i.softcap is not None), None)
    if softcap is not None:  # Gemma-2 caps logits inside the attention function: say so on the site
        site = replace(site, softcap=float(softcap))
    window = next((i.sliding_window for i in infos if i.sliding_window is not None), None)
    if window is not None and site.window is None and site.causal:
        # The model slides a window the example was too short to show in its mask.
        site = replace(site, window=int(window), mask=replace(site.mask, window=int(window)))
    if any(i.position_bias == "nonzero" for i in infos) and "position_bias" not in site.runtime_inputs:
        # T5's relative position bias, ALiBi: added to the scores on every call; only exact attention
        # honours it. (T5's cross-attention passes an all-zero one, which changes nothing.)
        site = replace(site, runtime_inputs=site.runtime_inputs + ("position_bias",),
                       runtime_reason="a position bias the model adds to the scores: a relative position bias or ALiBi")
    return site


def _with_layer(site, module: nn.Module):
    """The site kept exact, with the reason, where the model's own layer requires it (hf.sites)."""
    kept = model_keeps_exact(module)
    if kept is None or site.runtime_inputs:
        return site
    inputs, reason = kept
    return replace(site, runtime_inputs=inputs, runtime_reason=reason)


def _window_notes(sites: list) -> list:
    """Say where the model slides its own window: what exact and rewritten sites do with it."""
    windowed = sorted({s.window for s in sites if s.window is not None})
    if not windowed:
        return []
    n = sum(s.window is not None for s in sites)
    return [f"{n} of {len(sites)} sites sit on layers that slide their own window "
            f"({', '.join(map(str, windowed))} keys): exact sites keep the model's window, mask and cache as they are; "
            "a rewritten site replaces it (a window form keeps the narrower band) and decodes from its own state"]


def _route_notes(routed, sites: list, recorded: dict) -> list:
    """What the route did, and every attention module the record run did not see call attnopt."""
    notes = []
    if routed.kind != INTERFACE:
        kinds = sorted(set(routed.modules.values()))
        notes.append(f"the model computes attention inside its modules, not through the attention interface: attnopt "
                     f"reached {len(routed.modules)} of them per module ({', '.join(kinds)}), leaving the model's "
                     "attention implementation as it was")
    if routed.positions:
        notes.append("calls with an attention_mask and no position_ids get position_ids derived from the mask as "
                     "generate() derives them, so a left-padded row gives what the row alone gives for every form")
    silent = sorted({s.module_path for s in sites if s.module_path not in recorded}
                    | {p for p in routed.modules if p not in recorded})
    if silent:
        notes.append(f"{len(silent)} attention modules never called attnopt's attention function on the example inputs "
                     f"({', '.join(silent[:3])}{', ...' if len(silent) > 3 else ''}): their sites stay exact")
    return notes


def _build_site(site, entry: dict, sites: list) -> nn.Module:
    params = entry["params"]
    try:
        return build_site(forms.get(entry["form"]), site, params, BuildContext(sites=sites))
    except ValueError as exc:  # SiteUnsupported: the saved form cannot serve the saved site
        raise SaveError(f"attnopt.load: site {site.id} cannot be rebuilt as {entry['form']} ({exc})") from None
