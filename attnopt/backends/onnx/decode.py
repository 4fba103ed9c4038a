"""`attnopt.export_onnx(model, folder, decode=True)`: a compiled causal LM to a folder any runtime
generates from.

    folder/model.onnx           one graph for prefill and decoding: T ≥ 1 new tokens after any past ≥ 0
                                (chunked prefill too); its I/O contract in metadata_props["attnopt.decode"]
    folder/genai_config.json    for onnxruntime-genai 0.18, where it runs the folder as torch does
                                (genai.py; packing.py lays the states out as genai needs them)
    folder/tokenizer.json, ...  the tokenizer's files, when the model came with one

    checks (torch and the graph) → compile (given an original model and a policy) → probe the
    attention calls and plan each site's state tensors (graph_model.py) → torch.export of the model
    with state inputs and outputs (batch, sequence, total and past lengths dynamic) → torch.onnx with
    every form's decode-step lowering for the target → names, dims, contract → checks
    (decode_checks.py: greedy steps against torch generate(), per-step logits) → write the folder.

Every site runs its form's step op (forms/<form>/step.py; exact sites too), whose lowering is the
form folder's onnx.py DECODE_LOWERING. Fixed-size forms keep states whose size never depends on
the context; exact (and reuse) K/V grow. A site's dispatch threshold (min_seq_len, measured or
given) is kept: below it the compiled model runs exact attention, and so does the graph, from a
fixed exact prefix of min_seq_len slots (forms/exact/step.py), so ORT generates what torch does.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from attnopt import forms
from attnopt.backends.export_inputs import compiled_for_export, example_args
from attnopt.backends.onnx import checks, decode_checks, genai
from attnopt.backends.onnx.common import (
    PARITY_TOLERANCE,
    OnnxExport,
    check_target,
    first_failing_site,
    histogram,
    quiet_export,
    require_packages,
    to_onnx,
    translation_table,
)
from attnopt.backends.onnx.graph_model import CannotGenerate, DecoderGraph, Layout, context_of, graph_copy, probe
from attnopt.forms.common.mixed_heads import step_forms
from attnopt.hf.routes import is_hf_model
from attnopt.onnx.contract import CONTRACT_KEY

MODEL_FILE = "model.onnx"
GENAI_FILE = "genai_config.json"
DECODE_TARGETS = ("ort", "onnx-std")
STATE_CONTEXTS = (1024, 32768)  # report.exports' state bytes per site, at these contexts
EXAMPLE = {"batch": 2, "sequence": 3, "past": 2}  # torch.export specialises sizes 0 and 1
PREFIX_OP = "attnopt::exact_prefix_step"  # forms/exact/onnx.py PREFIX_LOWERING's op


@dataclass
class DecodeExport(OnnxExport):
    """What export_onnx(decode=True) wrote: the folder, the contract, state bytes, the genai outcome."""

    folder: str = ""
    files: list = field(default_factory=list)
    contract: dict = field(default_factory=dict)
    state_bytes: dict = field(default_factory=dict)  # site -> {"form", "1024": bytes per row, "32768": ...}
    genai: dict = field(default_factory=dict)  # {"supported", "why", "status", ...}

    def to_dict(self) -> dict:
        return {**super().to_dict(), "decode": True, "folder": self.folder, "files": list(self.files),
                "contract": self.contract, "state_bytes": self.state_bytes, "genai": dict(self.genai)}


# ---------------------------------------------------------------- arguments


def cannot_generate(model: nn.Module) -> Optional[str]:
    """Why `model` cannot get a decode folder (None when it can)."""
    if not isinstance(model, nn.Module):
        return f"export_onnx takes an nn.Module, got {type(model).__name__}"
    if not is_hf_model(model):
        return (f"{type(model).__name__} is not a transformers causal LM, and a decode folder needs one (its "
                "generate(), caches and positions); export one prefill file instead: a .onnx path or decode=False")
    if not type(model).can_generate() or getattr(model.config, "is_encoder_decoder", False):
        return (f"{type(model).__name__} cannot generate (not a decoder-only *ForCausalLM); export one prefill file "
                "instead: a .onnx path or decode=False")
    return None


def wants_folder(model: nn.Module, path) -> bool:
    """decode=None: a causal LM given a folder path (an existing directory, or a name without .onnx)."""
    p = Path(os.fspath(path)).expanduser()
    return (p.is_dir() or p.suffix.lower() != ".onnx") and cannot_generate(model) is None


def writable_folder(path) -> Path:
    p = Path(os.fspath(path)).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"cannot write the decode folder {str(p)!r}: it is a file; give a folder path such as "
                         f"{str(p.with_suffix(''))!r}")
    parent = p if p.is_dir() else (p.parent if str(p.parent) else Path("."))
    if not parent.is_dir():
        raise ValueError(f"cannot write the decode folder {str(p)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write the decode folder {str(p)!r}: permission denied; choose a writable folder")
    return p


def _check_decode_target(target: str) -> None:
    if target not in DECODE_TARGETS:
        raise ValueError(f"decode=True exports for target {' or '.join(map(repr, DECODE_TARGETS))}, not {target!r}: "
                         "the custom target's attnopt-domain nodes have no decode step")


# ---------------------------------------------------------------- the export


def export_decoder(model: nn.Module, path, example_inputs: Any = None, *, target: str = "ort",
                   opset: Optional[int] = None, policy: Any = None, tokenizer: Any = None) -> DecodeExport:
    """Write the decode folder `path/` of a compiled causal LM (or an original one plus `policy=`).

    `example_inputs`: the prompt the checks generate after (its first row; default: 128 random
    tokens). `tokenizer`: saved into the folder (default `model.attnopt_tokenizer`, if any).
    """
    started = time.perf_counter()
    _check_decode_target(target)
    target, opset = check_target(target, opset)
    require_packages()
    folder = writable_folder(path)
    why = cannot_generate(model)
    if why:
        raise ValueError(f"export_onnx(decode=True): {why}")
    opt = compiled_for_export(model, policy, example_inputs)
    args, kwargs = example_args(opt, example_inputs)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("export_onnx(decode=True) needs example input_ids [batch, length] (the prompt its checks "
                         "generate after); pass example_inputs={'input_ids': ...}")
    prompt = decode_checks.prompt_of(opt, ids)
    if tokenizer is None:
        tokenizer = getattr(model, "attnopt_tokenizer", None) or getattr(opt, "attnopt_tokenizer", None)
    try:
        result = _build(opt, folder, prompt, target, opset, tokenizer)
    except CannotGenerate as exc:
        raise ValueError(f"export_onnx(decode=True): {exc}") from None
    result.seconds = time.perf_counter() - started
    opt.attnopt_report.exports.append(result.to_dict())
    return result


def _build(opt: nn.Module, folder: Path, prompt, target: str, opset, tokenizer) -> DecodeExport:
    with graph_copy(opt) as twin:
        layout = probe(twin, opt.attnopt_report, prompt.batch)
        genai.choose_layout(layout)  # packed states where that lets onnxruntime-genai drive the graph
        prompt = decode_checks.crossing(prompt, max(p.prefix_slots for p in layout.layers), context_of(opt))
        calls: list = []
        table = translation_table(target, calls, _decode_lowerings(layout))
        program = trace(twin, layout, table, opset)
        contract = contract_of(opt, layout)
        finish(program.model, layout, contract)
        checks.check_model(program.model_proto)
        staging = Path(tempfile.mkdtemp(prefix=".attnopt-", dir=str(folder if folder.is_dir() else folder.parent)))
        try:
            program.save(str(staging / MODEL_FILE))
            parity, tokens = decode_checks.greedy_parity(
                opt, staging / MODEL_FILE, prompt, PARITY_TOLERANCE,
                on_failure=lambda msg: localise(twin, layout, prompt, table, opset, msg))
            outcome = _write_extras(opt, layout, contract, staging, tokenizer, prompt, tokens)
            files = _move_into(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    steps = [c for c in calls if c["op"] != PREFIX_OP]  # one step call per layer, in graph order
    sites = [{"site": p.site_id, "form": p.form, "lowering": c["lowering"], "exact_below": p.prefix_slots}
             for p, c in zip(layout.layers, steps)]
    return DecodeExport(path=str(folder / MODEL_FILE), target=target, opset=program.model.opset_imports[""],
                        sites=sites, ops_after=histogram(program.model), parity=parity, folder=str(folder),
                        files=files, contract=contract, state_bytes=state_bytes(layout), genai=outcome)


def _decode_lowerings(layout: Layout) -> list:
    found = []
    for name in dict.fromkeys(f for p in layout.layers for f in step_forms(p.site.module, p.form)):
        lowering = forms.get(name).onnx_decode_lowering()
        if lowering is None:
            raise CannotGenerate(f"form {name!r} has no ONNX lowering of its decode step")
        found.append((name, lowering))
    if any(p.prefix_slots for p in layout.layers):
        from attnopt.forms.exact.onnx import PREFIX_LOWERING  # onnxscript: imported once exporting

        found.append(("exact", PREFIX_LOWERING))
    return found


def trace(twin: nn.Module, layout: Layout, table: dict, opset):
    """torch.export of the DecoderGraph (dynamic batch, T ≥ 1, total and past ≥ 0), then torch.onnx."""
    B, T, P = EXAMPLE["batch"], EXAMPLE["sequence"], EXAMPLE["past"]
    args = (torch.zeros(B, T, dtype=torch.long), torch.ones(B, P + T, dtype=torch.long),
            torch.arange(P, P + T).expand(B, T).contiguous(), *layout.example_pasts(B, P))
    Dim = torch.export.Dim
    batch, seq = Dim("batch"), Dim("sequence", min=1)
    total, past = Dim("total_sequence", min=1), Dim("past_sequence", min=0)
    state_dims = tuple({0: batch, 2: past} if spec.grows else {0: batch} for _, spec, _, _ in layout.states())
    shapes = ({0: batch, 1: seq}, {0: batch, 1: total}, {0: batch, 1: seq}, state_dims)
    with quiet_export():
        try:
            program = torch.export.export(DecoderGraph(twin, layout), args, dynamic_shapes=shapes, strict=False)
        except Exception as exc:  # one line: what torch.export said first
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(f"torch.export cannot trace the model's decode graph: {type(exc).__name__}: "
                               f"{first[:300]}") from exc
        return to_onnx(program, table, opset)


# ---------------------------------------------------------------- names, dims, contract


def contract_of(model: nn.Module, layout: Layout) -> dict:
    """The JSON stored under metadata_props["attnopt.decode"] (attnopt/onnx/contract.py reads it)."""
    cfg = model.config
    gen = getattr(model, "generation_config", None)

    def token(name):
        value = getattr(gen, name, None) if gen is not None else None
        return value if value is not None else getattr(cfg, name, None)

    states = []
    for plan, spec, past, present in layout.states():
        entry = {"past": past, "present": present, "dtype": str(spec.dtype).replace("torch.", ""),
                 "shape": list(spec.shape), "init": "zeros", "site": plan.site_id, "form": plan.form}
        if layout.packed(plan):  # which of the site's states it holds, where (informative: a runtime feeds it back)
            entry["packs"] = layout.packing.describe(plan)[spec.name]
        states.append(entry)
    return {"format": CONTRACT_KEY, "version": 1,
            "inputs": {"input_ids": "int64 [batch, T]", "attention_mask": "int64 [batch, past + T], 1 = real token",
                       "position_ids": "int64 [batch, T]: cumsum(attention_mask) - 1, 0 at pads"},
            "outputs": {"logits": "float32 [batch, T, vocab]"},
            "states": states, "vocab_size": int(getattr(cfg, "vocab_size", 0) or 0),
            "bos_token_id": token("bos_token_id"), "eos_token_id": token("eos_token_id"),
            "pad_token_id": token("pad_token_id")}


def finish(model, layout: Layout, contract: dict) -> None:
    """The contract's names on the graph's inputs and outputs, readable dims, the contract itself."""
    inputs, outputs = list(model.graph.inputs), list(model.graph.outputs)
    names_in = ["input_ids", "attention_mask", "position_ids"] + [past for _, _, past, _ in layout.states()]
    names_out = ["logits"] + [present for _, _, _, present in layout.states()]
    if len(inputs) != len(names_in) or len(outputs) != len(names_out):
        raise RuntimeError(f"the traced graph has {len(inputs)} inputs and {len(outputs)} outputs; the contract "
                           f"needs {len(names_in)} and {len(names_out)} (an input the graph ignores was dropped)")
    symbols = {}
    for value, name in zip(inputs[:3], names_in[:3]):
        dims = ["batch", "sequence"] if name != "attention_mask" else ["batch", "total_sequence"]
        symbols.update({str(d): n for d, n in zip(value.shape, dims) if not isinstance(d, int)})
    for value, (_, spec, _, _) in zip(inputs[3:], layout.states()):
        symbols.update({str(d): s for d, s in zip(value.shape, spec.shape) if not isinstance(d, int)})
    for value, name in zip(inputs + outputs, names_in + names_out):
        value.name = name
    _rename_dims(model, symbols)
    for value, (_, spec, _, _) in zip(outputs[1:], layout.states()):
        value.shape = _shape([("total_sequence" if d == "past_sequence" else d) for d in spec.shape])
    model.metadata_props[CONTRACT_KEY] = json.dumps(contract)


def _shape(dims: list):
    import onnx_ir as ir

    return ir.Shape([d if isinstance(d, int) else ir.SymbolicDim(d) for d in dims])


def _rename_dims(model, symbols: dict) -> None:
    import onnx_ir as ir

    def renamed(text: str) -> str:
        return re.sub(r"\b[a-z]\d+\b", lambda m: symbols.get(m.group(0), m.group(0)), text)

    values = list(model.graph.inputs) + list(model.graph.outputs)
    values += [o for node in ir.traversal.RecursiveGraphIterator(model.graph) for o in node.outputs]
    for value in values:
        if value.shape is not None and any(not isinstance(d, int) and d.value for d in value.shape):
            value.shape = _shape([d if isinstance(d, int) else (renamed(d.value) if d.value else None)
                                  for d in value.shape])


def state_bytes(layout: Layout) -> dict:
    """Bytes one batch row of each site holds at the STATE_CONTEXTS (packed: its pair, padding included)."""
    out = {}
    for plan in layout.layers:
        row = {"form": plan.form}
        row.update({str(c): sum(s.row_bytes(c) for s in layout.io_specs(plan)) for c in STATE_CONTEXTS})
        out[plan.site_id] = row
    return out


# ---------------------------------------------------------------- the folder


def _write_extras(opt, layout: Layout, contract: dict, staging: Path, tokenizer, prompt, tokens) -> dict:
    """genai_config.json (only where onnxruntime-genai runs the folder as torch does, when it is
    installed to check) and the tokenizer files into `staging`; a folder genai cannot run is said
    in one warning and gets no config."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(staging))
    reason = genai.unsupported(layout)
    outcome = {"supported": reason is None, "why": reason}
    if reason is None:
        (staging / GENAI_FILE).write_text(json.dumps(genai.config(opt, layout, contract), indent=2))
        outcome.update(genai.check(staging, prompt.real_tokens(0), tokens[0], contract.get("eos_token_id")))
        if outcome["status"] == "skipped":
            warnings.warn(f"export_onnx: {outcome['note']}", stacklevel=4)
        elif outcome["status"] != "same tokens":
            (staging / GENAI_FILE).unlink()
            outcome.update(supported=False, why=outcome["note"])
    if not outcome["supported"]:
        warnings.warn(f"export_onnx: onnxruntime-genai cannot run this folder ({outcome['why']}), so it gets no "
                      f"{GENAI_FILE}; generate with attnopt.onnx.Generator", stacklevel=4)
    return outcome


def _move_into(staging: Path, folder: Path) -> list:
    folder.mkdir(exist_ok=True)
    names = sorted(p.name for p in staging.iterdir())
    for name in names:
        target = folder / name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    return names


# ---------------------------------------------------------------- localising a failed check


class _StepAlone(nn.Module):
    """One site's step op on given tensors: (q, k, v, mask, *pasts[, anchor q, anchor keys, x]) -> (out, *presents)."""

    def __init__(self, plan, extra: dict):
        super().__init__()
        self.plan, self.n_pasts = plan, len(plan.states)
        self.has_x = extra.get("x") is not None
        self.site_module = plan.site.module  # its weights become the graph's

    def forward(self, q, k, v, mask, *rest):
        pasts, more = list(rest[:self.n_pasts]), rest[self.n_pasts:]
        extra = {"anchor": (more[0], more[1]), "x": more[2] if self.has_x else None} if more else {}
        out, presents = self.plan.call(q, k, v, mask, pasts, **extra)
        return (out, *presents)


def _flat(extra: dict) -> tuple:
    if not extra:
        return ()
    return tuple(extra["anchor"]) + ((extra["x"],) if extra.get("x") is not None else ())


def localise(twin: nn.Module, layout: Layout, prompt, table: dict, opset, message: str) -> str:
    """Which site's decode lowering broke parity: each step op exported alone on its recorded inputs
    (a prefill of the prompt, then one step), against its torch implementation."""
    graph = DecoderGraph(twin, layout)
    graph.record = []
    ids, mask, pos = prompt.batch
    with torch.no_grad():
        out = graph(ids, mask, pos, *layout.example_pasts(ids.shape[0], 0))
        step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        graph(ids[:, -1:], step_mask, step_mask.sum(1, keepdim=True) - 1, *out[1:])

    def step_alone(plan, ins: tuple, extra: dict, want) -> float:
        with quiet_export():
            program = to_onnx(torch.export.export(_StepAlone(plan, extra), ins, strict=False), table, opset)
        return _ort_rel_rms(program.model_proto, ins, want)

    trials = ((f"{plan.site_id} ({plan.form})", functools.partial(step_alone, plan, ins + _flat(extra), extra, want))
              for plan, ins, extra, want in graph.record)
    return first_failing_site(trials, "its ONNX decode step",
                              f"every site's step matches alone; the whole graph does not: {message}")


def _ort_rel_rms(proto, ins: tuple, want: tuple) -> float:
    """Worst relative RMS of the outputs; the output only at real tokens (a pad's row reaches nothing, and
    GroupQueryAttention spreads it over the hidden keys where torch gives 0)."""
    session = checks.session(proto)
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(ins):
        raise RuntimeError(f"the step exported alone takes {len(names)} inputs, not {len(ins)}")
    got = session.run(None, {n: t.detach().contiguous().numpy() for n, t in zip(names, ins)})
    q, mask = ins[0], ins[3]
    real = mask[:, mask.shape[1] - q.shape[2]:].bool().numpy()[:, None, :, None]
    got[0] = np.where(real, got[0], 0.0)
    want = (torch.where(torch.as_tensor(real), want[0], 0.0),) + tuple(want[1:])
    return max(checks.rel_rms(np.asarray(g), w.detach().double().numpy()) for g, w in zip(got, want))
