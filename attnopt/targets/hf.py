"""The transformers mechanism of `attnopt.compile`: the model keeps its class (generate(), caches,
any length) and its attention modules are pointed at attnopt's registered attention function.

Sites come from torch.export detection when the model exports, else from the attention-interface
calls themselves; verification inputs are recorded through the same interface.
"""

from __future__ import annotations

import inspect as pyinspect
from dataclasses import replace

import torch
from torch import nn

from attnopt.forms.common.base import BuildContext
from attnopt.hf.install import install
from attnopt.hf.interface import implementation_for, switch
from attnopt.hf.recording import call_model, qk_projections, record_calls
from attnopt.hf.sites import site_from_call
from attnopt.ir.calls import Recording
from attnopt.ir.detection import Detection


def forward_params(model: nn.Module) -> set:
    try:
        return set(pyinspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


class HfTarget:
    """detect → record → (plan, verify elsewhere) → install, on a transformers model copy."""

    def __init__(self, model: nn.Module, name: str):
        self.model = model
        self.name = name

    def detect(self, batches: list) -> Detection:
        from attnopt.inspection import inspect as _inspect

        args, kwargs = batches[0]
        if "use_cache" not in kwargs and "use_cache" in forward_params(self.model):
            kwargs = {**kwargs, "use_cache": False}  # a KV-cache object is not an exportable output
        try:
            insp = _inspect(self.model, *args, dynamic=False, **kwargs)
        except Exception as exc:  # the attention interface still shows every site; say why export failed
            return Detection(capture="hf", notes=[
                f"torch.export capture failed ({type(exc).__name__}: {str(exc)[:300]}); sites were described "
                "from the attention interface calls"])
        return Detection(list(insp.sites), list(insp.near_misses), "export+hf", [], dict(insp.counts))

    def record(self, found: Detection, batches: list) -> Recording:
        """Record every attention call on every batch; fills `found.sites` when export showed none."""
        switch(self.model, implementation_for(self.model))
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
                layer = getattr(modules[path], "layer_idx", None)
                found.sites.append(site_from_call(path, modules[path], call, info, layer if isinstance(layer, int) else i))
        rec = Recording(outputs=outputs)
        for j, site in enumerate(found.sites):
            calls = recorded.get(site.module_path, [])
            softcap = next((info[3] for _, info in calls if info[3] is not None), None)
            if softcap is not None:  # Gemma-2 caps logits inside the attention function: say so on the site
                found.sites[j] = site = replace(site, softcap=float(softcap))
            window = next((info[2] for _, info in calls if info[2] is not None), None)
            if window is not None and site.window is None and site.causal:
                # The model slides a window the example was too short to show in its mask.
                found.sites[j] = site = replace(site, window=int(window), mask=replace(site.mask, window=int(window)))
            per_module = sum(1 for s in found.sites if s.module_path == site.module_path)
            if per_module == 1 and len(calls) == len(batches):
                rec.calls[site.id] = [c for c, _ in calls]
            elif calls:
                rec.notes.append(f"site {site.id}: {len(calls)} attention-interface calls for {per_module} sites; not rewritten")
        rec.counts = {"batches": len(batches), "sites": len(found.sites), "calls": sum(len(c) for c in rec.calls.values())}
        return rec

    def build_context(self, sites: list, recording: Recording) -> BuildContext:
        modules = dict(self.model.named_modules())
        return BuildContext(sites=sites, calls=recording.calls,
                            projections=lambda s: qk_projections(modules[s.module_path]))

    @staticmethod
    def adapt_site(site):
        # HF hands masks in its own spelling (bool keep for sdpa, additive for eager): read them as such.
        return replace(site, mask=replace(site.mask, keep_when="zero"))

    def splice(self, sites: list, modules: dict) -> tuple[nn.Module, dict]:
        return self.model, install(self.model, sites, modules)

    def longer_batch(self, batch, length: int):
        """(a batch of `length` tokens built from the example, None) or (None, why it cannot be built).

        Row 0's real tokens repeated to the length, within the model's position limit: enough for
        a form to act, and text-like enough for the attention pattern to be the model's own.
        """
        args, kwargs = batch
        cfg = getattr(self.model, "config", None)
        limit = next((getattr(cfg, n) for n in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")
                      if isinstance(getattr(cfg, n, None), int)), None)
        if limit is not None:
            length = min(length, limit)
        ids = kwargs.get("input_ids")
        if args or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return None, "the example inputs are not keyword input_ids [B, N] to extend"
        B, N = ids.shape
        if length <= N:
            return None, f"the model's position limit ({limit}) is not beyond the example length {N}"
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
                return None, f"the example input {key!r} cannot be extended to {length} tokens"
            else:
                out[key] = value
        return ((), out), None

    def run(self, module: nn.Module, batches: list) -> list:
        with torch.no_grad():
            return [call_model(module, b) for b in batches]
