"""`attnopt.calibrate`: attention transfer on a compiled model, then held-out re-verification.

    check the arguments                                           (options.py: CalibrateOptions)
      → the trainable sites, every rank starting from rank 0's tensors
      → record (exact run: each site's original inputs and softmax output; held-out drift before)
      → train each site's own tensors, layer by layer            (train.py; ranks share batches)
      → re-verify each site on held-out batches (keep the compiled values where it got worse)
      → [LoRA on q/k/v/o against the original outputs]           (lora.py, params="forms+lora")
      → end-to-end guard on the held-out batches                  → report.calibration

Each step is one function returning a dataclass (or plain data); `calibrate` lists them in order.
The model is changed in place (it is already attnopt's copy of the user's model) and returned.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from attnopt.calibration.distributed import World, barrier, broadcast_, shard
from attnopt.calibration.lora import train_lora
from attnopt.calibration.options import CalibrateOptions
from attnopt.calibration.targets import record_targets, site_modules
from attnopt.calibration.train import SiteTraining, train_site, trainable_tensors
from attnopt.forms.reuse.plan import overlap_in_use
from attnopt.ir.calls import Recording
from attnopt.ir.errors import CalibrationError
from attnopt.ir.outcomes import Status
from attnopt.passes.verify import output_drift, site_drift
from attnopt.targets import target_of

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
    reuse: Optional[dict] = None  # reuse's top-block overlap matrix and the anchors in use, when reuse sites exist
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
    (feature maps, β) or "forms+lora" (then LoRA on q/k/v/o, transformers models).
    checkpoint: a directory; finished sites are saved there (safetensors) and skipped on a rerun.
    steps, lr: Adam steps per site and its learning rate (defaults DEFAULT_STEPS and DEFAULT_LR in
    attnopt.calibration.options); seed: the initial tensors and batch order (the same seed, the same
    result); progress: a progress bar on stderr.
    """
    start = time.perf_counter()
    opts = CalibrateOptions.check(model, batches, steps=steps, lr=lr, seed=seed, params=params, held_out=held_out,
                                  progress=progress, checkpoint=checkpoint)
    sites = trainable_sites(model, opts)
    recorded = record_calibration_targets(model, opts, sites)
    trained = train_sites(model, opts, sites, recorded)
    result = Calibration(opts.params, opts.steps, opts.lr, opts.seed, opts.world.size, len(opts.train),
                         len(opts.held))
    if any(m.uses_anchor_qk for m in sites.modules.values()):
        result.reuse = overlap_in_use(opts.report.sites, recorded.targets.calls, sites.modules)
    result.sites = reverify_held_out(sites, recorded, trained)
    if opts.params == "forms+lora":
        result.lora = train_lora(model, opts.report, recorded.mine, recorded.targets.outputs, steps=opts.steps,
                                 lr=opts.lr, seed=opts.seed, world=opts.world, progress=opts.progress)
    guard = end_to_end_guard(model, opts, sites, recorded, trained, result.sites)
    result.notes += guard.notes
    result.end_to_end_before, result.end_to_end_after = recorded.e2e_before.to_dict(), guard.e2e_after.to_dict()
    if not opts.held:
        result.notes.append("no held-out batch: the before/after drift was not measured")
    result.seconds = time.perf_counter() - start
    write_report(opts, sites, trained, result)
    return model


# ------------------------------------------------------------------ steps


@dataclass
class SitesToTrain:
    """The compiled model's site modules by id, and those among them with tensors to train."""

    modules: dict  # {site id: SiteModule}
    trainable: dict  # {site id: SiteModule}, in the model's site order


def trainable_sites(model: nn.Module, opts: CalibrateOptions) -> SitesToTrain:
    """The sites calibrate trains, starting on every rank from rank 0's tensors (after seeding)."""
    modules = site_modules(model)
    recorded_ids = {r.site.id for r in opts.report.sites}
    trainable = {sid: m for sid, m in modules.items() if trainable_tensors(m) and sid in recorded_ids}
    if not trainable and opts.params == "forms":
        forms_in_use = sorted({m.form for m in modules.values()}) or ["none (every site exact)"]
        raise CalibrationError(f"nothing to calibrate: the rewritten sites' forms ({', '.join(forms_in_use)}) have no "
                               "trainable tensors; use linear:hedgehog or linear+window, or "
                               "params='forms+lora' on a transformers model")
    torch.manual_seed(opts.seed)
    for m in trainable.values():  # every rank starts from rank 0's tensors
        broadcast_(list(trainable_tensors(m).values()), opts.world)
    return SitesToTrain(modules, trainable)


@dataclass
class CalibrationTargets:
    """The exact runs calibration trains and re-verifies against, and the drift before training."""

    mine: list  # this rank's share of the training batches
    targets: Recording  # on `mine`
    held_targets: Recording  # on the held-out batches
    masks: list  # the held-out batches' attention masks (or None)
    e2e_before: Any  # OutputDrift on the held-out batches
    drift_before: dict  # {site id: held-out site drift dict, or None}


def record_calibration_targets(model: nn.Module, opts: CalibrateOptions, sites: SitesToTrain) -> CalibrationTargets:
    """Record each site's original inputs and outputs on this rank's batches and the held-out ones,
    and measure the held-out drift, per site and end to end, before any training."""
    mine = shard(opts.train, opts.world)
    targets = _record(model, mine, opts.report, "batches")
    held_targets = _record(model, opts.held, opts.report, "held_out")
    masks = [_attention_mask(b) for b in opts.held]
    e2e_before = output_drift(_run(model, opts.held), held_targets.outputs, masks)
    drift_before = {sid: _held_out_drift(m, held_targets, sid) for sid, m in sites.trainable.items()}
    return CalibrationTargets(mine, targets, held_targets, masks, e2e_before, drift_before)


@dataclass
class TrainedSites:
    """Each site's training record, its tensors as compile (or the checkpoint) left them, and the
    sites whose training diverged (put back to exact attention)."""

    trainings: dict  # {site id: SiteTraining}
    compiled_values: dict  # {site id: [Tensor]} in trainable_tensors order
    dropped: list  # site ids


def train_sites(model: nn.Module, opts: CalibrateOptions, sites: SitesToTrain,
                recorded: CalibrationTargets) -> TrainedSites:
    """Train each site on its own recorded calls, layer by layer (resumed sites are skipped and each
    finished one is checkpointed); sites that diverge are taken out of the model."""
    done = _resume(opts.checkpoint, sites.trainable)
    compiled_values = {sid: [t.detach().clone() for t in trainable_tensors(m).values()]
                       for sid, m in sites.trainable.items()}
    trainings: dict[str, SiteTraining] = {}
    for index, (sid, m) in enumerate(sites.trainable.items()):
        if sid in done:
            trainings[sid] = SiteTraining(sid, m.form, sorted(trainable_tensors(m)), 0, "resumed",
                                          f"loaded from checkpoint {opts.checkpoint}",
                                          curve=done[sid].get("curve", []))
            continue
        anchors = _anchor_calls(m, recorded.targets)
        trainings[sid] = train_site(m, recorded.targets.calls.get(sid, []), anchors, steps=opts.steps, lr=opts.lr,
                                    seed=opts.seed * 1009 + index, world=opts.world, progress=opts.progress)
        if opts.checkpoint is not None:
            _save_checkpoint(opts.checkpoint, sites.trainable, trainings, opts.world)
    dropped = [sid for sid, t in trainings.items() if t.status == "non_finite"]
    if dropped:
        _keep_exact(model, opts.report, dropped, {sid: trainings[sid].reason for sid in dropped})
    return TrainedSites(trainings, compiled_values, dropped)


def reverify_held_out(sites: SitesToTrain, recorded: CalibrationTargets, trained: TrainedSites) -> list:
    """One report entry per trained site: its training and held-out drift before / after. A site
    better on its training calls but worse held out learnt the batches, not the attention: it gets
    its compiled values back."""
    entries = []
    for sid, t in trained.trainings.items():
        before = recorded.drift_before[sid]
        after = _held_out_drift(sites.modules[sid], recorded.held_targets, sid) if sid not in trained.dropped else None
        if after is not None and before is not None and t.status == "trained" \
                and not after["rel_rms"] < before["rel_rms"]:
            _restore(sites.modules[sid], trained.compiled_values[sid])
            t.status = "unchanged"
            t.reason = (f"held-out drift rose ({before['rel_rms']:.4g} -> {after['rel_rms']:.4g}) although "
                        f"training lowered its own ({t.rms_before:.4g} -> {t.rms_after:.4g}); "
                        "the compiled values are kept")
            after = before
        entries.append({**t.to_dict(), "held_out_before": before, "held_out_after": after})
    return entries


@dataclass
class EndToEnd:
    """The end-to-end held-out drift after calibration, and the note when the guard undid it."""

    e2e_after: Any  # OutputDrift
    notes: list


def end_to_end_guard(model: nn.Module, opts: CalibrateOptions, sites: SitesToTrain, recorded: CalibrationTargets,
                     trained: TrainedSites, entries: list) -> EndToEnd:
    """Measure the model end to end on the held-out batches; with params="forms", when it got worse
    although each site improved (errors compound from layer to layer), every site goes
    back to what compile built and its entry says so."""
    e2e_before = recorded.e2e_before
    e2e_after = output_drift(_run(model, opts.held), recorded.held_targets.outputs, recorded.masks)
    if not (opts.params == "forms" and opts.held and _worse(e2e_after, e2e_before)):
        return EndToEnd(e2e_after, [])
    for sid, m in sites.trainable.items():
        _restore(m, trained.compiled_values[sid])
    for entry in entries:
        if entry["status"] == "trained":
            entry["status"], entry["held_out_after"] = "unchanged", entry["held_out_before"]
            trained.trainings[entry["site_id"]].status = "unchanged"
    note = (f"end to end the held-out drift rose ({_describe(e2e_before)} -> {_describe(e2e_after)}) "
            "although the sites improved; every site keeps its compiled values")
    return EndToEnd(e2e_before, [note])


def write_report(opts: CalibrateOptions, sites: SitesToTrain, trained: TrainedSites, result: Calibration) -> None:
    """Put `result` into the compile report (and, on the leader, the checkpoint directory); then
    wait for every rank."""
    report = opts.report
    report.calibration = result.to_dict()
    report.notes.append(_summary(result))
    if opts.checkpoint is not None and opts.world.leader:
        _save_checkpoint(opts.checkpoint, sites.trainable, trained.trainings, opts.world)
        report.to_json(Path(opts.checkpoint) / "report.json")
        report.to_html(Path(opts.checkpoint) / "report.html")
    barrier(opts.world)


# ------------------------------------------------------------------ inputs


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


def _restore(module, values: list) -> None:
    """Copy `values` (as `TrainedSites.compiled_values` keeps them) back into the module's trainable tensors."""
    with torch.no_grad():
        for tensor, value in zip(trainable_tensors(module).values(), values):
            tensor.copy_(value)


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
