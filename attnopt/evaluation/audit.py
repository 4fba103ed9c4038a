"""`attnopt.evaluate`: what a model can still do where a cheap attention form can fail.

Retrieval probes over a length x depth grid (attnopt.evaluation.probes), scored by exact match of greedy
`generate()` output and by teacher-forced accuracy, and perplexity by position, for the model and,
side by side, its reference (the original). Every probe row is the same for both.
"""

from __future__ import annotations

import numbers

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from attnopt.analysis.perplexity import is_causal_lm
from attnopt.evaluation.codec import codec_for
from attnopt.evaluation.model_io import LanguageModel
from attnopt.evaluation.perplexity import perplexity
from attnopt.evaluation.probes import DEPTHS, PROBES, Haystacks, chance, grid
from attnopt.evaluation.report import EvalReport, ModelScores, mean
from attnopt.evaluation.scoring import calls, score_rows
from attnopt.samples import english_passages

DEFAULT_SAMPLES = 4
PERPLEXITY_WINDOWS = 8
BUILT_IN_TEXT = "the built-in English passages (attnopt/data/english_passages.txt)"


def check_probes(probes: Union[None, str, Sequence[str]]) -> list:
    if probes is None:
        return list(PROBES)
    names = [p.strip() for p in probes.split(",")] if isinstance(probes, str) else list(probes)
    unknown = [p for p in names if p not in PROBES]
    if unknown or not names:
        raise ValueError(f"unknown probe {unknown[0]!r}; known probes: {', '.join(PROBES)}" if unknown
                         else f"no probe given; known probes: {', '.join(PROBES)}")
    return list(dict.fromkeys(names))


def _is_int(n) -> bool:
    """An integer count, Python's or numpy's or a 0-dim integer tensor's."""
    return isinstance(n, numbers.Integral) or (hasattr(n, "dtype") and getattr(n, "ndim", 1) == 0
                                               and "int" in str(n.dtype))


def check_lengths(lengths: Optional[Sequence[int]], limit: Optional[int], name: str) -> list:
    if lengths is None:
        if limit is None:
            raise ValueError(f"{name} states no position limit (config.max_position_embeddings); pass lengths=[...]")
        return sorted({max(1, limit // 4), limit})
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise ValueError(f"lengths must be a list of positive token counts like [512, 2048]; got {lengths!r}")
    out = []
    for n in lengths:
        if isinstance(n, bool) or not _is_int(n) or n < 1:
            raise ValueError(f"lengths must be positive token counts; got {n!r}")
        n = int(n)
        if limit is not None and n > limit:
            raise ValueError(f"length {n} is beyond what {name} can embed ({limit} positions, "
                             f"config.max_position_embeddings); use lengths of at most {limit}")
        out.append(n)
    if not out:
        raise ValueError("lengths is empty; give at least one token count")
    return sorted(set(out))


def check_depths(depths: Optional[Sequence[float]]) -> list:
    if depths is None:
        return list(DEPTHS)
    if isinstance(depths, (str, bytes)) or not isinstance(depths, Sequence) or \
            not all(isinstance(d, numbers.Real) and not isinstance(d, bool) for d in depths):
        raise ValueError(f"depths must be a list of fractions of the context like [0, 0.5, 1]; got {depths!r}")
    out = [float(d) for d in depths]
    bad = [d for d in out if not 0.0 <= d <= 1.0]
    if bad or not out:
        raise ValueError(f"depths are fractions of the context from 0 (start) to 1 (just before the question); "
                         f"got {bad[0] if bad else 'none'}")
    return sorted(set(out))


def text_of(texts: Union[None, str, Sequence[str]]) -> tuple:
    """(text, what it is): the built-in passages by default."""
    if texts is None:
        return "\n\n".join(english_passages()), BUILT_IN_TEXT
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"texts must be a string or a list of strings; got {type(texts).__name__}")
    parts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not parts:
        raise ValueError("texts must be a string or a list of strings with some text")
    joined = "\n\n".join(parts)
    return joined, f"the given text ({len(joined)} characters)"


def model_name(model: Any) -> str:
    """A compiled model by its report (model and policy name), any other by its path or class."""
    report = getattr(model, "attnopt_report", None)
    if report is not None:
        policy = report.policy_dict()
        policy = policy.get("name") if isinstance(policy, dict) else policy
        return f"{report.model_name} [{policy or 'compiled'}]"
    return getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__


def score_model(lm: LanguageModel, plan: "AuditPlan", perplexity_windows: int, tick) -> ModelScores:
    """One model's numbers over the plan's rows and text; `tick(what)` after each model call."""
    start = time.perf_counter()
    retrieval, forced, first, disagree, rows = {}, {}, {}, 0, 0
    for (probe, length), cell in plan.cells.items():
        got = score_rows(lm, cell, plan.codec, lambda what: tick(f"{lm.name}: {probe} at {length} tokens ({what})"))
        rows += len(got)
        if lm.generates:
            disagree += sum(r.generated_tokens_exact != r.forward_exact for r in got)
        for k, d in enumerate(plan.depths):
            part = got[k * plan.samples : (k + 1) * plan.samples]
            retrieval.setdefault(probe, {}).setdefault(length, {})[d] = mean(float(r.generated_exact) for r in part)
            forced.setdefault(probe, {}).setdefault(length, {})[d] = mean(r.teacher_forced for r in part)
            first.setdefault(probe, {}).setdefault(length, {})[d] = mean(r.first_token for r in part)
    ppl = perplexity(lm, plan.text_ids, max(plan.lengths), plan.text_name, most=perplexity_windows)
    tick(f"{lm.name}: perplexity")
    return ModelScores(lm.name, "generate" if lm.generates else "forward", retrieval, forced, disagree, rows, ppl,
                       round(time.perf_counter() - start, 3), first)


@dataclass
class AuditPlan:
    """What every model of one audit reads: the same probe rows and the same text."""

    probes: list
    lengths: list
    depths: list
    samples: int
    seed: int
    codec: Any
    cells: dict  # {(probe, length): [Sample, ...]}, depth-major
    text_ids: list
    text_name: str

    def calls(self, lm: LanguageModel) -> int:
        return sum(calls(len(c), n, lm.generates) for (_, n), c in self.cells.items()) + 1  # + perplexity


def check_models(model: Any, reference: Any, name: Optional[str], reference_name: Optional[str]) -> tuple:
    """(LanguageModel, LanguageModel or None): modules with next-token logits, of one vocabulary."""
    lm = LanguageModel(model, name or model_name(model))
    ref = None if reference is None else LanguageModel(reference, reference_name or f"{model_name(reference)} (reference)")
    for m in (lm, ref):
        # A transformers model either is a registered causal LM or says it generates (remote-code decoders).
        if m is not None and m.transformers and not (is_causal_lm(m.model) or m.model.can_generate()):
            raise ValueError(f"{type(m.model).__name__} is not a causal language model (no next-token head); the "
                             "audit reads next-token logits, so give a *ForCausalLM model")
    if ref is not None and ref.vocab() != lm.vocab():
        raise ValueError(f"the reference's vocabulary ({ref.vocab()}) is not the model's ({lm.vocab()}); the reference "
                         "must be the same model before conversion")
    return lm, ref


def plan_audit(models: list, tokenizer: Any, texts, probes, lengths, depths, samples: int, seed: int) -> AuditPlan:
    """Check the options against the models and build every probe row once."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive number of rows per cell; got {samples!r}")
    probes = check_probes(probes)
    limits = [m.position_limit for m in models if m.position_limit is not None]
    lengths = check_lengths(lengths, min(limits) if limits else None, " / ".join(m.name for m in models))
    depths = check_depths(depths)
    codec = codec_for(tokenizer, models[0].vocab())
    text, text_name = text_of(texts)
    cells = grid(probes, lengths, depths, samples, codec, Haystacks(codec, text), seed)
    return AuditPlan(probes, lengths, depths, samples, seed, codec, cells, list(codec.prefix) + codec.encode(text),
                     text_name)


def notes_of(plan: AuditPlan, models: list, scores: list) -> list:
    notes = [f"{m.name} has no generate(): retrieval is the exact match of its full forward's greedy answer "
             "(teacher-forced); no decode state was exercised" for m in models if not m.generates]
    window = max(plan.lengths)
    if scores[0].perplexity is not None and scores[0].perplexity.window < window:
        notes.append(f"the text has only {len(plan.text_ids)} tokens, so perplexity is over one window of "
                     f"{scores[0].perplexity.window} tokens, shorter than the longest length {window}")
    return notes


def evaluate(model: Any, *, reference: Any = None, tokenizer: Any = None, texts: Union[None, str, Sequence[str]] = None,
             probes: Union[None, str, Sequence[str]] = None, lengths: Optional[Sequence[int]] = None,
             depths: Optional[Sequence[float]] = None, progress: Optional[Callable] = None,
             samples: int = DEFAULT_SAMPLES, seed: int = 0, name: Optional[str] = None,
             reference_name: Optional[str] = None, perplexity_windows: int = PERPLEXITY_WINDOWS,
             attach: bool = False) -> EvalReport:
    """Audit a causal LM's capability: retrieval probes and perplexity, beside `reference` when given.

    tokenizer: the model's (None: UTF-8 bytes, for a byte-level model of vocabulary 256). texts: the text
    for perplexity and for the probes' real-text haystacks (default: the built-in English passages).
    probes: names from PROBES (default all). lengths: tokens per probe row (default a quarter of the
    model's position limit and the limit). depths: where the fact is written, 0 (start) to 1 (just
    before the question); default 0, .25, .5, .75, 1. samples: rows per (probe, length, depth) cell.
    perplexity_windows: at most this many windows of the longest length are read for perplexity.
    attach: store the audit in the compiled model's report (`model.attnopt_report.evaluation`), so its
    HTML page shows rewrite and capability together.
    progress: a callable(text, done=None, total=None) told after each model call. seed: draws the
    probe rows (the same seed, the same rows for every model). name, reference_name: how the report
    labels the two models (default their compile reports' or classes' names).
    """
    if attach and getattr(model, "attnopt_report", None) is None:
        raise ValueError(f"attach=True stores the audit in the compiled model's report, and this "
                         f"{type(model).__name__} has no .attnopt_report; compile it with attnopt.compile first")
    if isinstance(perplexity_windows, bool) or not _is_int(perplexity_windows) or perplexity_windows < 1:
        raise ValueError(f"perplexity_windows must be a positive int (the most windows read for perplexity); "
                         f"got {perplexity_windows!r}")
    perplexity_windows = int(perplexity_windows)
    lm, ref = check_models(model, reference, name, reference_name)
    models = [m for m in (lm, ref) if m is not None]
    plan = plan_audit(models, tokenizer, texts, probes, lengths, depths, samples, seed)
    total, done = sum(plan.calls(m) for m in models), [0]

    def tick(text: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(text, done[0], total)

    if progress is not None:
        progress(f"{sum(map(len, plan.cells.values()))} probe rows built", 0, total)
    scores = [score_model(m, plan, perplexity_windows, tick) for m in models]
    report = EvalReport(scores[0], plan.probes, plan.lengths, plan.depths, plan.samples, plan.seed, plan.codec.name,
                        {p: chance(p, plan.codec) for p in plan.probes}, scores[1] if ref else None,
                        notes_of(plan, models, scores))
    if attach:
        model.attnopt_report.evaluation = report.to_dict()
    return report
