"""`attnopt.calibrate`: attention transfer on a compiled model, then held-out re-verification.

    record (exact run: each site's original inputs and softmax output)
      → train each site's own tensors, layer by layer            (train.py; ranks share batches)
      → [LoRA on q/k/v/o against the original outputs]           (lora.py, params="forms+lora")
      → re-verify on held-out batches, per site and end to end    → report.calibration

The model is changed in place (it is already attnopt's copy of the user's model) and returned.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from attnopt.calibration.distributed import (
    World,
    barrier,
    broadcast_,
    current_world,
    shard,
)
from attnopt.calibration.lora import train_lora
from attnopt.calibration.reuse_plan import reuse_matrix_in_use
from attnopt.calibration.targets import record_targets, site_modules
from attnopt.calibration.train import SiteTraining, train_site, trainable_tensors
from attnopt.ir.batch import as_batch
from attnopt.ir.calls import Recording
from attnopt.ir.errors import CalibrationError
from attnopt.ir.outcomes import Status
from attnopt.passes.verify import output_drift, site_drift
from attnopt.targets import target_of

PARAMS = ("forms", "forms+lora")
DEFAULT_STEPS = 200  # per site; at 256 tokens about 0.1-0.2 s a step on one CPU core (MiniLM)
DEFAULT_LR = 5e-2  # on MiniLM 5e-2 beat 1e-2 by a wide margin at 120 steps (site rel RMS 0.14 vs 0.22)
HELD_OUT_EVERY = 4  # without held_out=, batches 3, 7, 11, ... are held out
CHECKPOINT_TENSORS = "calibration.safetensors"
CHECKPOINT_STATE = "calibration.json"


@dataclass
class Calibration:
    """What `calibrate` did, for the report: per-site training and drift, end to end, before/after."""

    params: str
    steps: int
    lr: float
    seed: int
    world_size: int
    train_batches: int
    held_out_batches: int
    sites: list = field(default_factory=list)  # one dict per site: training + held-out drift before/after
    end_to_end_before: Optional[dict] = None  # OutputDrift.to_dict() on the held-out batches
    end_to_end_after: Optional[dict] = None
    lora: Optional[dict] = None
    reuse: Optional[dict] = None  # similarity matrix and the plan in use, when reuse sites exist
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def calibrate(model: nn.Module, batches: Sequence[Any], *, steps: Optional[int] = None, lr: Optional[float] = None,
              seed: int = 0, params: str = "forms", held_out: Optional[Sequence[Any]] = None, progress: bool = True,
              checkpoint: Optional[str] = None) -> nn.Module:
    """Train a compiled model's rewritten sites to reproduce its original attention; return the model.

    batches: inputs the model is called with (as compile's example_inputs); without `held_out`,
    every 4th is held out for re-verification. Under torchrun (a process group initialised) each
    rank trains on its share and the trained tensors stay identical on all ranks. params: "forms"
    (feature maps, β, reuse residuals) or "forms+lora" (then LoRA on q/k/v/o, transformers models).
    checkpoint: a directory; finished sites are saved there (safetensors) and skipped on a rerun.
    """

    start = time.perf_counter()
    report = getattr(model, "attnopt_report", None)
    if report is None or not isinstance(model, nn.Module):
        raise CalibrationError(f"attnopt.calibrate needs a model returned by attnopt.compile; this "
                               f"{type(model).__name__} has no attnopt_report (compile it first)")
    if params not in PARAMS:
        raise CalibrationError(f"params must be one of {', '.join(repr(p) for p in PARAMS)}; got {params!r}")
    steps = DEFAULT_STEPS if steps is None else steps
    lr = DEFAULT_LR if lr is None else lr
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise CalibrationError(f"steps must be a positive int (Adam steps per site); got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
        raise CalibrationError(f"lr must be a finite number > 0; got {lr!r}")
    train, held = _split(batches, held_out, as_batch)
    world = current_world()
    if len(train) < world.size:
        raise CalibrationError(f"{len(train)} training batches for {world.size} ranks: every rank needs at least one; "
                               "pass more (smaller) batches")
    modules = site_modules(model)
    sites = {r.site.id: r for r in report.sites}
    trainable = {sid: m for sid, m in modules.items() if trainable_tensors(m) and sid in sites}
    if not trainable and params == "forms":
        forms_in_use = sorted({m.form for m in modules.values()}) or ["none (every site exact)"]
        raise CalibrationError(f"nothing to calibrate: the rewritten sites' forms ({', '.join(forms_in_use)}) have no "
                               "trainable tensors; use linear:hedgehog, linear+window or reuse with rank > 0, or "
                               "params='forms+lora' on a transformers model")
    torch.manual_seed(seed)
    for m in trainable.values():  # every rank starts from rank 0's tensors
        broadcast_(list(trainable_tensors(m).values()), world)

    mine = shard(train, world)
    targets = _record(model, mine, report, "batches")
    held_targets = _record(model, held, report, "held_out")
    masks = [_attention_mask(b) for b in held]
    e2e_before = output_drift(_run(model, held), held_targets.outputs, masks)
    drift_before = {sid: _held_out_drift(m, held_targets, sid) for sid, m in trainable.items()}

    done = _resume(checkpoint, trainable)
    compiled_values = {sid: [t.detach().clone() for t in trainable_tensors(m).values()] for sid, m in trainable.items()}
    trainings: dict[str, SiteTraining] = {}
    for index, (sid, m) in enumerate(trainable.items()):
        if sid in done:
            trainings[sid] = SiteTraining(sid, m.form, sorted(trainable_tensors(m)), 0, "resumed",
                                          f"loaded from checkpoint {checkpoint}", curve=done[sid].get("curve", []))
            continue
        anchors = _anchor_calls(m, targets)
        trainings[sid] = train_site(m, targets.calls.get(sid, []), anchors, steps=steps, lr=float(lr),
                                    seed=seed * 1009 + index, world=world, progress=progress)
        if checkpoint is not None:
            _save_checkpoint(checkpoint, trainable, trainings, world)
    dropped = [sid for sid, t in trainings.items() if t.status == "non_finite"]
    if dropped:
        _keep_exact(model, report, dropped, {sid: trainings[sid].reason for sid in dropped})

    result = Calibration(params, steps, float(lr), seed, world.size, len(train), len(held))
    if any(m.uses_anchor_qk for m in modules.values()):
        result.reuse = reuse_matrix_in_use(report.sites, targets.calls, modules)
    for sid, t in trainings.items():
        after = _held_out_drift(modules[sid], held_targets, sid) if sid not in dropped else None
        if after is not None and drift_before[sid] is not None and t.status == "trained" \
                and not after["rel_rms"] < drift_before[sid]["rel_rms"]:
            # Better on its training calls, worse held out: it learnt the batches, not the attention.
            with torch.no_grad():
                for tensor, value in zip(trainable_tensors(modules[sid]).values(), compiled_values[sid]):
                    tensor.copy_(value)
            t.status = "unchanged"
            t.reason = (f"held-out drift rose ({drift_before[sid]['rel_rms']:.4g} -> {after['rel_rms']:.4g}) although "
                        f"training lowered its own ({t.rms_before:.4g} -> {t.rms_after:.4g}); the compiled values are kept")
            after = drift_before[sid]
        result.sites.append({**t.to_dict(), "held_out_before": drift_before[sid], "held_out_after": after})
    if params == "forms+lora":
        result.lora = train_lora(model, report, mine, targets.outputs, steps=steps, lr=float(lr), seed=seed,
                                 world=world, progress=progress)
    e2e_after = output_drift(_run(model, held), held_targets.outputs, masks)
    if params == "forms" and held and _worse(e2e_after, e2e_before):
        # Each site better on its own, the model worse: errors compound (reuse sites read drifted
        # anchors). The model goes back to what compile built rather than get worse.
        with torch.no_grad():
            for sid, m in trainable.items():
                for tensor, value in zip(trainable_tensors(m).values(), compiled_values[sid]):
                    tensor.copy_(value)
        for entry in result.sites:
            if entry["status"] == "trained":
                entry["status"], entry["held_out_after"] = "unchanged", entry["held_out_before"]
                trainings[entry["site_id"]].status = "unchanged"
        result.notes.append(f"end to end the held-out drift rose ({_describe(e2e_before)} -> {_describe(e2e_after)}) "
                            "although the sites improved; every site keeps its compiled values")
        e2e_after = e2e_before
    result.end_to_end_before, result.end_to_end_after = e2e_before.to_dict(), e2e_after.to_dict()
    if not held:
        result.notes.append("no held-out batch: the before/after drift was not measured")
    result.seconds = time.perf_counter() - start
    report.calibration = result.to_dict()
    report.notes.append(_summary(result))
    if checkpoint is not None and world.leader:
        _save_checkpoint(checkpoint, trainable, trainings, world)
        report.to_json(Path(checkpoint) / "report.json")
        report.to_html(Path(checkpoint) / "report.html")
    barrier(world)
    return model


# ------------------------------------------------------------------ inputs


def _split(batches, held_out, as_batch) -> tuple[list, list]:
    if isinstance(batches, (torch.Tensor, dict)) or not isinstance(batches, (list, tuple)):
        raise CalibrationError(f"batches must be a list of model inputs (each like compile's example_inputs: a dict of "
                               f"keyword arguments, a tuple of arguments or (args, kwargs)); got {type(batches).__name__}")
    converted = []
    for name, group in (("batches", batches), ("held_out", held_out or [])):
        out = []
        for i, b in enumerate(group):
            try:
                out.append(as_batch(b, f"{name}[{i}]"))
            except TypeError as exc:
                raise CalibrationError(f"calibrate: {exc}") from None
        converted.append(out)
    train, held = converted
    if held_out is None:
        if len(train) < 2:
            raise CalibrationError(f"calibrate needs at least 2 batches to hold one out (got {len(train)}); pass more "
                                   "batches or held_out=[...]")
        held = [b for i, b in enumerate(train) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1] or [train[-1]]
        train = [b for b in train if not any(b is h for h in held)]
    if not train:
        raise CalibrationError("calibrate got no training batch; pass a non-empty list of batches")
    return train, held


def _record(model, batches, report, what) -> Recording:
    try:
        return record_targets(model, batches, report)
    except CalibrationError:
        raise
    except Exception as exc:
        raise CalibrationError(f"calibrate: the model failed on the {what} ({type(exc).__name__}: {str(exc)[:200]}); "
                               "pass batches the way the model was compiled: same keys, shapes and dtypes") from exc


def _attention_mask(batch) -> Optional[torch.Tensor]:
    am = batch[1].get("attention_mask")
    return am if isinstance(am, torch.Tensor) else None


def _run(model, batches) -> list:
    with torch.no_grad():
        return [model(*a, **k) for a, k in batches]


def _anchor_calls(module, targets: Recording) -> list:
    calls = targets.calls.get(module.geometry.site_id, [])
    if module.uses_anchor_qk:
        return list(targets.calls.get(module.anchor_id, [None] * len(calls)))
    return [None] * len(calls)


def _held_out_drift(module, targets: Recording, sid: str) -> Optional[dict]:
    calls = targets.calls.get(sid)
    if not calls:
        return None
    anchors = targets.calls.get(module.anchor_id) if module.uses_anchor_qk else None
    return site_drift(module, calls, anchors).to_dict()


# ------------------------------------------------------------------ sites kept exact


def _keep_exact(model, report, site_ids: list, reasons: dict) -> None:
    """Take sites whose training diverged out of the model (exact again) and say so in the report."""
    target_of(model).put_back_exact(site_ids, report)
    by_id = {r.site.id: r for r in report.sites}
    for sid in site_ids:
        rec = by_id[sid]
        rec.outcome = replace(rec.outcome, final_form="exact", status=Status.REVERTED,
                              reason=f"calibration: {reasons[sid]}")


# ------------------------------------------------------------------ checkpoints


def _save_checkpoint(directory, trainable: dict, trainings: dict, world: World) -> None:
    """Finished sites' tensors (safetensors, "<site id>/<name>") and their training records (JSON)."""
    if not world.leader:
        return
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    finished = {sid: t for sid, t in trainings.items() if t.status != "non_finite"}
    tensors = {f"{sid}/{name}": t.detach().contiguous().clone()
               for sid in finished for name, t in trainable_tensors(trainable[sid]).items()}
    save_file(tensors, str(path / CHECKPOINT_TENSORS))
    state = {"format": 1, "sites": {sid: t.to_dict() for sid, t in finished.items()}}
    (path / CHECKPOINT_STATE).write_text(json.dumps(state, indent=1, default=str))


def _resume(directory, trainable: dict) -> dict:
    """Load the finished sites of an earlier run into `trainable`; {site id: its record}."""
    if directory is None or not (Path(directory) / CHECKPOINT_STATE).is_file():
        return {}
    from safetensors.torch import load_file

    path = Path(directory)
    state = json.loads((path / CHECKPOINT_STATE).read_text())
    tensors = load_file(str(path / CHECKPOINT_TENSORS))
    done = {}
    for sid, rec in state.get("sites", {}).items():
        if sid not in trainable:
            raise CalibrationError(f"checkpoint {directory}: site {sid!r} is not a trainable site of this model "
                                   "(another model or policy?); use a new checkpoint directory")
        with torch.no_grad():
            for name, t in trainable_tensors(trainable[sid]).items():
                saved = tensors.get(f"{sid}/{name}")
                if saved is None or saved.shape != t.shape:
                    raise CalibrationError(f"checkpoint {directory}: tensor {sid}/{name} is missing or has another "
                                           "shape (another model or policy?); use a new checkpoint directory")
                t.copy_(saved)
        done[sid] = rec
    return done


def _worse(after, before) -> bool:
    """Whether the end-to-end drift `after` is worse than `before` (embedding cosine when there is one)."""
    if after.embedding_cosine is not None and before.embedding_cosine is not None:
        return after.embedding_cosine < before.embedding_cosine
    if after.worst is None or before.worst is None:
        return False
    return after.worst.rel_rms > before.worst.rel_rms


def _describe(e2e) -> str:
    if e2e.embedding_cosine is not None:
        return f"embedding cosine {e2e.embedding_cosine:.4f}"
    return f"worst output rel RMS {e2e.worst.rel_rms:.4g}"


def _summary(result: Calibration) -> str:
    def cos(d):
        return None if d is None else d.get("embedding_cosine")

    def worst(d):
        return None if d is None or d.get("worst") is None else d["worst"]["rel_rms"]

    before, after = result.end_to_end_before, result.end_to_end_after
    text = (f"calibrated ({result.params}, {result.steps} steps per site, {result.train_batches} batches on "
            f"{result.world_size} rank(s), {result.seconds:.0f} s); held out on {result.held_out_batches} batches: "
            f"worst output rel RMS {worst(before):.4g} -> {worst(after):.4g}"
            if worst(before) is not None and worst(after) is not None
            else f"calibrated ({result.params}, {result.steps} steps per site); nothing held out")
    if cos(before) is not None and cos(after) is not None:
        text += f", embedding cosine {cos(before):.4f} -> {cos(after):.4f}"
    return text
