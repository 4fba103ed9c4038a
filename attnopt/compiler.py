"""`attnopt.compile`: capture → detect → record → plan → verify → select heads (keep:recall) → budget →
install → dispatch → report, on a copy of the model.

Two mechanisms share every step (`attnopt.targets`): "hf" keeps a transformers model's class and
points its attention modules at attnopt's attention function; "graph" captures any other module with
torch.export and replaces each site in the graph. Each step returns a dataclass with its counts.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch
from torch import nn

from attnopt.analysis.cost import cost_curve
from attnopt.analysis.timing import Conditions, forward_time, input_shape, longest_batch
from attnopt.compile_options import CompileOptions
from attnopt.ir.batch import as_batch, attention_mask_of
from attnopt.ir.calls import Recording
from attnopt.ir.outcomes import Status
from attnopt.passes import machine_load
from attnopt.passes.budget import E2E_TOLERANCE, hold_budget, within_budget
from attnopt.passes.crossover import resolve_thresholds
from attnopt.passes.plan import plan_sites
from attnopt.passes.verify import verification_length, verify_sites
from attnopt.policy import Policy
from attnopt.report import CompileReport, SiteRecord
from attnopt.selection import Selected, select_exact_heads
from attnopt.selection.probing import text_rows
from attnopt.selection.speed import decode_time
from attnopt.targets import Target, target_for

__all__ = ["compile", "backend", "as_batch", "within_budget", "E2E_TOLERANCE", "build_report"]


class _Timer:
    """Seconds per step, in pipeline order, and the conditions they were taken under, for the report."""

    def __init__(self):
        self.timings: dict = {}
        self._t = time.perf_counter()
        self._mark = machine_load.cpu_mark()

    def conditions(self, device: torch.device) -> Conditions:
        """Threads, cores, load, and the cores other work held since the compile started."""
        return Conditions.now(machine_load.others_since(self._mark), str(device))

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.timings[step] = now - self._t
        self._t = now


def compile(
    model: nn.Module,
    policy: Any = "hybrid",
    example_inputs: Any = None,
    *,
    tolerance: Optional[float] = None,
    e2e_tolerance: Optional[float] = E2E_TOLERANCE,
    calibration: Optional[Sequence[Any]] = None,
    verify_inputs: Optional[Sequence[Any]] = None,
    method: str = "auto",
    name: Optional[str] = None,
    dispatch: Optional[str] = None,
    progress: Optional[Any] = None,
    tokenizer: Optional[Any] = None,
) -> nn.Module:
    """Rewrite the attention of a copy of `model` per `policy`; return it with `.attnopt_report`.

    example_inputs: how the model is called (a tensor, a tuple of args, a dict of kwargs, or
    (args, kwargs)); the rewritten model is called the same way. calibration: more such batches;
    per-site drift is the worst over all batches. tolerance: max relative RMS drift of a site's
    output (default per form; a rule's own `tolerance` wins); sites at or above it revert to exact.
    e2e_tolerance: the budget for the worst relative RMS drift of the model's outputs (default
    0.5; None: no budget), and for sentence embeddings a mean cosine >= 1 - e2e_tolerance/6; while
    it is exceeded the worst rewritten site reverts. verify_inputs: batches used only to verify,
    e.g. inputs long enough for a window to act (a transformers model gets one built from the
    example when none is). method: "auto" (transformers models keep their class via the attention
    interface, anything else is captured with torch.export), "hf" or "graph". The original model is
    never modified. dispatch: "auto" (default; $ATTNOPT_DISPATCH when not given) gives every
    rewritten site whose rule leaves min_seq_len unset the form's measured crossover against exact
    attention on this device (cached; `attnopt.passes.crossover`), so short inputs run exact; "off"
    leaves them at 0 (the form at every length). Drift is verified on the form itself, before
    thresholds apply. progress: a callable(text, done=None, total=None) told each step as it
    starts, and the sites verified so far out of all (the CLI's progress bar). tokenizer: the
    model's, for rules that choose their exact heads by measurement (`+keep:recall`, attnopt.selection:
    its retrieval probes are built with it); None reads text as UTF-8 bytes, for a byte-level model.
    name: the model's name in the report (default its class's).
    """
    opts = CompileOptions.check(model, policy, example_inputs, tolerance=tolerance, e2e_tolerance=e2e_tolerance,
                                calibration=calibration, verify_inputs=verify_inputs, method=method, name=name,
                                dispatch=dispatch, progress=progress)
    # Beside other CPU-bound work, every step (not only the fits) runs at the threads the free cores
    # allow: at 2 threads on 2 shared cores, the small-op steps took 25-70x their quiet time.
    with machine_load.threads_for_load():
        return _compile_checked(model, opts, tokenizer)


def _compile_checked(model: nn.Module, opts: CompileOptions, tokenizer) -> nn.Module:
    timer, say = _Timer(), opts.progress
    check_runnable(model, opts.name)
    target = target_for(model, opts.method, opts.name)
    timer.lap("copy")
    say("capture + detect")
    found = target.detect(opts.batches[:1])
    timer.lap("capture+detect")
    say("record")
    recorded = record_and_plan(target, found, opts)
    planning = recorded.planning
    timer.lap("record")
    say("build + verify sites")
    context = target.build_context(found.sites, recorded.recording)
    verification = verify_sites(found.sites, planning.plans, context, opts.policy, opts.tolerance,
                                adapt=target.adapt_site, step=say)
    timer.lap("plan+verify_sites")
    selected = select_heads(target, found, recorded, verification, opts, context, tokenizer, say)
    if selected.selection is not None:
        timer.lap("select_heads")
    say("splice + end-to-end check")
    budget = hold_budget(lambda modules: _install(target, found.sites, modules), lambda m: target.run(m, recorded.batches),
                         selected.outcomes, selected.modules, recorded.recording.outputs,
                         [attention_mask_of(b) for b in recorded.batches], opts.e2e_tolerance)
    timer.lap("splice+verify_end_to_end")
    say("dispatch thresholds")
    # After the budget: the drifts above are the forms' own, measured where they act.
    dispatch_result = resolve_thresholds(found.sites, budget.outcomes, budget.modules, opts.dispatch,
                                         device=_device_of(budget.model), step=say, max_len=_position_limit(model))
    timer.lap("dispatch")
    say("timing the forward, original against rewritten")
    forward = time_forward(target, model, budget.model, recorded, dispatch_result.thresholds)
    timer.lap("time_forward")
    if selected.selection is not None and selected.selection.total_heads:
        say("keep:recall: decoding speed, original against selected")
        selected.selection.decode = selection_decode_time(model, budget.model, opts)
        timer.lap("decode_time")
    timer.timings["total"] = sum(timer.timings.values())
    _warn_if_nothing_rewritten(opts.name, planning.plans, dispatch_result.outcomes, budget.steps, opts.e2e_tolerance)
    counts = {"detect": found.counts, "record": recorded.recording.counts, "plan": planning.counts,
              "verify": verification.counts, **({"select": selected.counts} if selected.counts else {}),
              "splice": budget.install_counts,
              "budget": {"e2e_tolerance": opts.e2e_tolerance, **budget.counts}, "dispatch": dispatch_result.counts}
    budget.model.attnopt_report = build_report(
        model_name=opts.name, policy=opts.policy, found=found, plans=planning.plans, outcomes=dispatch_result.outcomes,
        end_to_end=budget.end_to_end, timings=timer.timings, counts=counts, budget_steps=budget.steps,
        thresholds=dispatch_result.thresholds, mechanism=target.mechanism, installs=target.installs(found.sites),
        notes=compile_notes(found, recorded, budget.install_counts, dispatch_result.thresholds),
        forward_time=forward, conditions=timer.conditions(_device_of(budget.model)),
        head_selection=None if selected.selection is None else selected.selection.to_dict())
    return budget.model


def selection_decode_time(model: nn.Module, compiled: nn.Module, opts: CompileOptions) -> Optional[dict]:
    """Per-token decoding, original against selected, after the longest verification text (keep:recall's
    report); None for a model that does not generate."""
    rows = text_rows(opts.batches)
    can = getattr(model, "can_generate", None)
    if not rows or not (callable(can) and can()):
        return None
    return decode_time(model, compiled, max(rows, key=lambda r: r.shape[1]))


def select_heads(target: Target, found, recorded: "Recorded", verification, opts: CompileOptions, context, tokenizer,
                 say) -> Selected:
    """The keep:recall step (attnopt.selection): nothing changes unless a rule asks it."""
    adapted = replace(context, sites=[target.adapt_site(s) for s in found.sites])
    return select_exact_heads(target, found, recorded, verification, opts, adapted, tokenizer,
                              step=lambda text: say(text))


def time_forward(target: Target, model: nn.Module, compiled: nn.Module, recorded: "Recorded", thresholds: dict):
    """The measured time of the report: both models' forward on the input verification checked the
    forms on (the longest), taking turns (`attnopt.analysis.timing.forward_time`)."""
    index, length = longest_batch(recorded.batches, recorded.recording.calls)
    batch = recorded.batches[index]
    return forward_time(lambda: target.run(model, [batch]), lambda: target.run(compiled, [batch]), input_shape(batch),
                        length, [t.min_seq_len for t in thresholds.values()])


def _warn_if_no_attention(found, name: str) -> None:
    if not found.sites:
        warnings.warn(f"attnopt.compile({name}): found no attention in this model, so nothing can be rewritten "
                      "(the result computes what the model computes); attnopt.inspect shows what looked close",
                      stacklevel=3)


def check_runnable(model: nn.Module, name: str) -> None:
    """One line, before any capture, for a model that cannot run: weights without values."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for path, t in named:
            if t.is_meta:
                raise ValueError(
                    f"attnopt.compile({name}): {kind} {path!r} is on the meta device (it has no values); load real "
                    "weights first (from_pretrained without a meta device map, or model.to_empty(device='cpu') and "
                    "then load_state_dict)")


def _install(target: Target, sites: list, modules: dict) -> tuple:
    installed = target.install(sites, modules)
    return installed.model, installed.counts


def plan_sites_of(found, opts: CompileOptions):
    """The plan step: the policy's form for every site, with a warning for rules no site matched."""
    planning = plan_sites(found.sites, opts.policy)
    if found.sites:
        layers = len({s.layer for s in found.sites})
        for index, text, claimed, hint in planning.unmatched_rules:
            if claimed:
                by = ", ".join(f"rule {j} ({t}) took {k} site{'s' if k > 1 else ''}" for j, t, k in claimed)
                warnings.warn(f"attnopt.compile({opts.name}): policy rule {index} ({text}) chose no site: every site "
                              f"it matches was claimed first by an earlier rule ({by}; the first matching rule "
                              f"wins); move rule {index} earlier or narrow the earlier rule's layers", stacklevel=3)
            else:
                warnings.warn(f"attnopt.compile({opts.name}): policy rule {index} ({text}) matches no attention site "
                              f"of this model ({layers} attention layers); " + (hint or "check its layers / module / source"),
                              stacklevel=3)
    return planning


@dataclass
class Recorded:
    """The record step: every site's calls on `batches` (the inputs given, plus a longer one built
    from the example when some planned form changes nothing at the example length), and the plan."""

    recording: Recording
    planning: Any
    batches: list
    notes: list = field(default_factory=list)


def record_and_plan(target: Target, found, opts: CompileOptions) -> Recorded:
    """Record every batch (a transformers model may describe its sites only now, or add what their
    calls show), plan the sites, and when some planned form acts only on longer inputs, add one and
    record again."""
    batches = list(opts.batches)
    recording = target.record(found, batches)
    _warn_if_no_attention(found, opts.name)
    planning = plan_sites_of(found, opts)
    need = verification_length(found.sites, planning.plans, recording.calls)
    if need is None:
        return Recorded(recording, planning, batches)
    longer = target.longer_batch(batches[0], need)
    if longer.batch is None:
        return Recorded(recording, planning, batches, [
            f"some planned forms act only from about {need} tokens and no input that long was given "
            f"({longer.reason}); pass verify_inputs=: those sites stay exact, reported unverified"])
    batches.append(longer.batch)
    return Recorded(target.record(found, batches), planning, batches, [
        f"verification also ran on a {longer.batch[1]['input_ids'].shape[1]}-token input built from the example's "
        f"tokens (repeated), for forms that act only on inputs longer than the example (about {need} tokens wanted)"])


def compile_notes(found, recorded: Recorded, install_counts: dict, thresholds: dict) -> list:
    """The report's notes, in the order the steps ran."""
    notes = list(found.notes) + recorded.notes
    if thresholds and any(t.min_seq_len for t in thresholds.values()):
        notes.append("sites run exact attention below their dispatch threshold (each site's min_seq_len, shown per "
                     "site); the drifts reported are the forms' own, measured where they act")
    if install_counts.get("model_window_taken_over"):
        notes.append(f"the model slides its own attention window (a sliding window); attnopt runs it on "
                     f"{install_counts['model_window_taken_over']} sites instead (exact sites keep the same band, "
                     "window sites the narrower band, linear/ssm/linear+window replace it), so prefill and decoding "
                     "agree; the KV cache is kept whole")
    return notes + recorded.recording.notes


def _warn_if_nothing_rewritten(name, plans, outcomes, steps, budget) -> None:
    """A policy that asked for rewrites and got none says so, with the reasons (never silence)."""
    asked = [o for p, o in zip(plans, outcomes) if p.candidates or p.unsupported]
    if not asked or any(o.status is Status.REWRITTEN for o in outcomes):
        return
    why = "; ".join(sorted({str(o.status) for o in asked}))
    extra = f"; {len(steps)} reverted to hold e2e_tolerance {budget:g}" if steps else ""
    warnings.warn(f"attnopt.compile({name}): the policy asked for {len(asked)} rewrites and none was kept "
                  f"({why}{extra}); see the report's reasons, or relax tolerance / e2e_tolerance", stacklevel=3)


def _device_of(model: nn.Module) -> torch.device:
    """Where the model runs (its first parameter or buffer; CPU when it has none)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _position_limit(model: nn.Module) -> Optional[int]:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) else None


def build_report(*, model_name, policy, found, plans, outcomes, end_to_end, timings, notes, counts, budget_steps=(),
                 thresholds=None, mechanism="", installs=None, forward_time=None, conditions=None, head_selection=None):
    """The report is assembled from exactly what the passes returned; only costs are computed here."""
    # A captured graph with dynamic shapes has symbolic lengths: cost them at the length the sites saw
    # on the verification input.
    example_len = next((s.q_len for s in found.sites if isinstance(s.q_len, int)),
                       getattr(forward_time, "length", None))
    records = []
    for site, plan, outcome in zip(found.sites, plans, outcomes):
        n = site.q_len if isinstance(site.q_len, int) else example_len
        try:
            before = cost_curve(site, "exact", {}, example_len=n)
            after = cost_curve(site, outcome.final_form, outcome.params, example_len=n)
        except (ValueError, KeyError) as exc:
            before, after = [], []
            why = "its length is symbolic and no site shows a static one" if "symbolic" in str(exc) else str(exc)
            notes.append(f"site {site.id}: cost not computed ({why})")
        records.append(SiteRecord(site=site, plan=plan, outcome=outcome, costs_before=before, costs_after=after,
                                  threshold=(thresholds or {}).get(site.id), install=(installs or {}).get(site.id, ""),
                                  exact_heads=exact_heads_of(site, outcome, head_selection)))
    return CompileReport(
        model_name=model_name, policy=policy, capture=found.capture, sites=records, near_misses=found.near_misses,
        end_to_end=end_to_end, timings=timings, notes=notes, counts=counts,
        budget_steps=[s.to_dict() for s in budget_steps], mechanism=mechanism, forward_time=forward_time,
        conditions=conditions, head_selection=head_selection,
    )


def size_sources(gm: torch.fx.GraphModule) -> Optional[dict]:
    """For a Dynamo graph's SymInt inputs, where each one is read: {input index: (tensor input index,
    dim)}, from the symbolic shapes its placeholders record; None when some size input is not any tensor
    input's dim (or there is none)."""
    values = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    found = {}
    for i, value in enumerate(values):
        if not isinstance(value, torch.SymInt):
            continue
        found[i] = next(((j, d) for j, t in enumerate(values) if isinstance(t, torch.Tensor)
                         for d, size in enumerate(t.shape)
                         if isinstance(size, torch.SymInt) and size.node.expr == value.node.expr), None)
        if found[i] is None:
            return None
    return found or None


def sizes_from_shapes(gm: torch.fx.GraphModule, sources: dict) -> torch.fx.GraphModule:
    """A copy of a Dynamo graph that takes its tensors only: each size input becomes a read of the
    tensor dim it names, so torch.export traces it as a symbol instead of holding one value as a
    constant. The graph's own nodes (and the module paths they record) stay as they were."""
    graph = copy.deepcopy(gm.graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1]
    for slot, (j, d) in sorted(sources.items(), reverse=True):
        with graph.inserting_after(last):
            size = graph.call_function(torch.ops.aten.sym_size.int, (placeholders[j], d))
        size.meta = dict(placeholders[slot].meta)
        placeholders[slot].replace_all_uses_with(size)
        graph.erase_node(placeholders[slot])
    return torch.fx.GraphModule(gm, graph)


def exact_heads_of(site, outcome, head_selection: Optional[dict]) -> list:
    """The KV heads a site keeps exact: its per-head site's, or every one where keep:recall kept the whole
    site exact; [] for any other site."""
    if outcome.status is Status.REWRITTEN:
        return list(outcome.params.get("exact_heads") or [])
    chosen = (head_selection or {}).get("chosen", {}).get(site.id)
    if outcome.status is Status.KEPT and chosen and len(chosen) == site.kv_heads:
        return list(chosen)
    return []


def backend(policy: Any = "hybrid", *, tolerance: Optional[float] = None, e2e_tolerance: Optional[float] = E2E_TOLERANCE,
            dispatch: Optional[str] = None):
    """A torch.compile backend: `torch.compile(model, backend=attnopt.backend("window:64"))`;
    tolerance, e2e_tolerance and dispatch mean what they do for compile().

    Each graph Dynamo hands over is rewritten on its first real call (verification needs real
    inputs); the reports collect in `backend_fn.reports`. A dynamic graph's size inputs (SymInts) are
    read from its tensors' shapes at run time, so one rewrite serves every length.
    """
    policy = Policy.parse(policy)
    # the options are checked now, as compile() checks them, not at the first compiled call
    CompileOptions.check(nn.Identity(), policy, (torch.zeros(1),), tolerance=tolerance, e2e_tolerance=e2e_tolerance,
                         dispatch=dispatch)
    reports: list = []

    def backend_fn(gm: torch.fx.GraphModule, example_inputs):
        sources = size_sources(gm)
        compiled: dict = {}

        def rewrite(args: tuple, key):
            mod = compile(gm if sources is None else sizes_from_shapes(gm, sources), policy,
                          example_inputs=args, tolerance=tolerance, e2e_tolerance=e2e_tolerance, method="graph",
                          name="dynamo graph", dispatch=dispatch)
            reports.append(mod.attnopt_report)
            compiled[key] = mod
            return mod

        def run(*args):
            if sources is not None:  # every size input is a tensor's dim: one rewrite for every length
                args = tuple(a for i, a in enumerate(args) if i not in sources)
                key = "every length"
            else:  # sizes no tensor carries (or none at all): one rewrite per distinct value of the int inputs
                key = tuple(a for a in args if isinstance(a, int))
            mod = compiled[key] if key in compiled else rewrite(tuple(args), key)
            return mod(*args)

        return run

    backend_fn.reports = reports
    return backend_fn
