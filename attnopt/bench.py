"""Forward and generate() timing: the one implementation behind `attnopt bench`, `attnopt demo` and
the scripts in benchmarks/.

The method, everywhere: the subjects (the original model, then one compiled model per policy) take
turns, every subject once per round, so a slow moment of the machine lands on all of them rather
than on one; untimed warm-up rounds come first; the best (fastest) of the timed rounds is kept.

- `take_turns(runs, repeats, warmups, rotate, progress) -> Turns`: the loop, for any zero-argument
  callables that return their seconds (or a dict of measurements); `Turns.best()` is the best-of;
  `timed(fn, clock)`: a run that returns the seconds `fn()` took (both from attnopt.analysis.timing);
- `build_subjects(model, policies, example_inputs, ...)`: {"original": model, policy: compiled, ...};
- `time_forward(subjects, lengths, inputs, repeats, ...) -> [Timing]`;
- `time_generate(subjects, ids, new_tokens, repeats, ...) -> DecodeTiming`;
- `compare(workload, policies, lengths, ...) -> BenchResult`: all of it for one `Workload`;
  `BenchResult.to_dict()` is the JSON of `attnopt bench --json`.

Every timing function takes `clock=` (default time.perf_counter), so tests time nothing.
"""

from __future__ import annotations

import functools
import itertools
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from attnopt.analysis.timing import Clock, Run, Turns, take_turns, timed
from attnopt.compiler import compile as attnopt_compile

__all__ = ["take_turns", "timed", "Turns", "build_subjects", "time_forward", "time_generate", "compare", "Workload",
           "Timing", "DecodeTiming", "BenchResult", "build_decoder", "decoder_workload", "random_ids"]

Progress = Callable[..., None]  # update(text, done=None, total=None), as compile's progress and the CLI's bar
Inputs = tuple  # (args, kwargs) of one forward

DEFAULT_POLICIES = ("linear", "window:256+sinks:4")
DECODER_EXAMPLE_TOKENS = 128  # compile's verification adds a longer input where a window needs one
SEED = 0


# ---------------------------------------------------------------- subjects


def random_ids(n: int, vocab: int, seed: int = SEED) -> torch.Tensor:
    """[1, n] token ids in 1..vocab-1 from a seeded generator (0 is often padding)."""
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def build_decoder(max_len: int):
    """A small Llama-style decoder (GQA 8/2 heads, RoPE) with seeded random weights, `max_len`
    positions, and its description."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=max_len,
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).eval()  # generate() needs the LM head
    return model, (f"Llama-style decoder ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
                   f"{config.num_attention_heads}/{config.num_key_value_heads} heads, random weights)")


def build_subjects(model, policies: Sequence[Any], example_inputs, names: Optional[Sequence[str]] = None,
                   compiler: Callable[..., Any] = attnopt_compile, progress: Optional[Progress] = None,
                   **options) -> dict:
    """{"original": model, then each policy's compiled model under its name (default: str(policy))}.
    compiler: attnopt.compile or a wrapper called the same way (the CLI's maps failures to exit
    codes); options go to it. Compile warnings are silenced: the timings' table says what a warning
    would."""
    subjects = {"original": model}
    for name, policy in zip(names or [str(p) for p in policies], policies):
        if progress is not None:
            progress(f"compiling {name}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            subjects[name] = compiler(model, policy, example_inputs=example_inputs, **options)
    return subjects


def rewritten_counts(subjects: Mapping[str, Any]) -> dict[str, str]:
    """Per compiled subject, "k/n": sites rewritten of sites found."""
    return {name: f"{m.attnopt_report.count('rewritten')}/{len(m.attnopt_report.sites)}"
            for name, m in subjects.items() if name != "original"}


def dispatch_thresholds(subjects: Mapping[str, Any]) -> dict[str, list]:
    """Per compiled subject, each site's dispatch threshold (min_seq_len; None where none is set)."""
    return {name: [None if r.threshold is None else r.threshold.min_seq_len for r in m.attnopt_report.sites]
            for name, m in subjects.items() if name != "original"}


# ---------------------------------------------------------------- forward


@dataclass
class Timing:
    """Best-of-repeats forward seconds at one length, per subject (the original first)."""

    length: Optional[int]  # None: the model's own example inputs
    seconds: dict[str, float]
    spread: dict[str, float]  # slowest / fastest of the repeats: how steady the machine was
    samples: dict[str, list[float]] = field(default_factory=dict)  # every timed repeat

    @property
    def speedup(self) -> dict[str, float]:
        """The first subject's (the original's) seconds over each subject's."""
        base = next(iter(self.seconds.values()))
        return {name: base / s for name, s in self.seconds.items()}

    def to_dict(self) -> dict:
        return {"tokens": self.length, "seconds": dict(self.seconds), "speedup": self.speedup}


def time_forward(subjects: Mapping[str, Callable], lengths: Sequence[Optional[int]],
                 inputs: Callable[[Optional[int]], Inputs], repeats: int, warmups: int = 1,
                 progress: Optional[Progress] = None, clock: Clock = time.perf_counter) -> list[Timing]:
    """Forward seconds per subject at each length, best of `repeats`, the subjects taking turns after
    `warmups` untimed rounds. inputs(n) -> (args, kwargs) of the forward at length n (made once per
    length, shared by the subjects). progress(text, done, total) is told before every forward."""
    total, done = len(lengths) * (warmups + repeats) * len(subjects), itertools.count()
    rows = []
    for n in lengths:
        args, kwargs = inputs(n)
        runs = {name: timed(functools.partial(m, *args, **kwargs), clock) for name, m in subjects.items()}
        tell = None if progress is None else (
            lambda name, n=n: progress(f"N={n or 'example'} {name}", next(done), total))
        with torch.inference_mode():
            turns = take_turns(runs, repeats, warmups, progress=tell)
        rows.append(Timing(n, turns.best(), turns.spread(), turns.values()))
    return rows


# ---------------------------------------------------------------- generate()


@dataclass
class DecodeTiming:
    """generate() per subject, best of the repeats: seconds to the first token's logits, and per further token."""

    prompt: int
    new_tokens: int
    prefill: dict[str, float]
    per_token: dict[str, float]

    def to_dict(self) -> dict:
        return asdict(self)


def generate_run(model, ids: torch.Tensor, new_tokens: int, clock: Clock = time.perf_counter) -> Run:
    """A run for take_turns: one greedy generate() of `new_tokens` tokens after `ids`, read by a logits
    processor that notes the clock at every step; returns {"prefill": seconds to the first token's
    logits, "per_token": the mean gap between the next ones (absent for one token)}."""
    import transformers

    class Ticks(transformers.LogitsProcessor):
        def __init__(self):
            self.at = []

        def __call__(self, input_ids, scores):
            self.at.append(clock())
            return scores

    def run() -> dict:
        ticks = Ticks()
        start = clock()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       logits_processor=transformers.LogitsProcessorList([ticks]))
        measured = {"prefill": ticks.at[0] - start}
        if len(ticks.at) > 1:
            measured["per_token"] = (ticks.at[-1] - ticks.at[0]) / (len(ticks.at) - 1)
        return measured

    return run


def time_generate(subjects: Mapping[str, Any], ids: torch.Tensor, new_tokens: int, repeats: int,
                  clock: Clock = time.perf_counter) -> DecodeTiming:
    """Greedy generate() per subject, taking turns, best of `repeats` (no warm-up round): the
    prefill and the time per token (the original keeps HF's KV cache, the rewritten models their
    sites' decode states)."""
    runs = {name: generate_run(m, ids, new_tokens, clock) for name, m in subjects.items()}
    with torch.inference_mode():
        turns = take_turns(runs, repeats)
    return DecodeTiming(int(ids.shape[1]), new_tokens, turns.best("prefill"), turns.best("per_token"))


# ---------------------------------------------------------------- one call: `attnopt bench`


@dataclass
class Workload:
    """A model and its example inputs, as `attnopt bench` times it. A model called with 2-D
    `input_ids` keywords only is resizable: it is fed random ids of each length (seeded by the
    length); any other is timed at its own example."""

    model: Any
    args: tuple
    kwargs: dict
    description: str
    random_weights: bool = False  # compile then sets no end-to-end budget: drift would measure noise

    def __post_init__(self):
        if self.resizable and "use_cache" in getattr(self._config, "to_dict", dict)():
            self.kwargs = {**self.kwargs, "use_cache": False}  # the forward alone, no KV cache

    @property
    def _config(self):
        return getattr(self.model, "config", None)

    @property
    def resizable(self) -> bool:
        ids = self.kwargs.get("input_ids")
        return not self.args and isinstance(ids, torch.Tensor) and ids.dim() == 2

    @property
    def positions(self) -> Optional[int]:
        """The model's position limit where its config names one."""
        limit = getattr(self._config, "max_position_embeddings", None)
        return limit if isinstance(limit, int) else None

    def lengths(self, requested: Sequence[int]) -> list[Optional[int]]:
        """The lengths it is timed at: `requested`, or [None] (its own example) when not resizable."""
        return list(requested) if self.resizable else [None]

    def inputs(self, n: Optional[int]) -> Inputs:
        """(args, kwargs) at length n: random ids replace the example's (its attention_mask and
        token_type_ids, shaped for its own length, are dropped); n None: the example."""
        if n is None:
            return self.args, self.kwargs
        vocab = int(getattr(self._config, "vocab_size", 1000) or 1000)
        kwargs = {k: v for k, v in self.kwargs.items() if k not in ("attention_mask", "token_type_ids")}
        return self.args, {**kwargs, "input_ids": random_ids(n, vocab, seed=n)}


def decoder_workload(max_len: int) -> Workload:
    """The built-in random-weight decoder (build_decoder) with its 128-token example."""
    model, description = build_decoder(max_len)
    example = {"input_ids": random_ids(DECODER_EXAMPLE_TOKENS, model.config.vocab_size)}
    return Workload(model, (), example, description, random_weights=True)


@dataclass
class BenchResult:
    """What `attnopt bench` prints: forward timings per length, and per policy its sites rewritten
    and dispatch thresholds."""

    model: str  # the workload's description
    threads: int  # torch threads the timings ran on
    repeats: int
    rows: list[Timing]
    rewritten: dict[str, str]  # policy -> "k/n"
    thresholds: dict[str, list]  # policy -> each site's min_seq_len (None: none set)

    @property
    def names(self) -> list[str]:
        return ["original", *self.rewritten]

    def to_dict(self) -> dict:
        return {"model": self.model, "threads": self.threads, "repeats": self.repeats,
                "rows": [r.to_dict() for r in self.rows], "rewritten": dict(self.rewritten),
                "thresholds": dict(self.thresholds)}


def compare(workload: Workload, policies: Sequence[Any], lengths: Sequence[int], repeats: int = 3,
            names: Optional[Sequence[str]] = None, compiler: Callable[..., Any] = attnopt_compile,
            progress: Optional[Progress] = None, clock: Clock = time.perf_counter, **options) -> BenchResult:
    """Compile `workload.model` with each policy (options go to compiler), then time the forward of
    the original and each compiled model at each length (workload.lengths), taking turns after one
    warm-up round, best of `repeats`."""
    if workload.random_weights:
        options = {"e2e_tolerance": None, **options}
    subjects = build_subjects(workload.model, policies, (workload.args, workload.kwargs), names, compiler,
                              progress, **options)
    rows = time_forward(subjects, workload.lengths(lengths), workload.inputs, repeats, progress=progress,
                        clock=clock)
    return BenchResult(workload.description, torch.get_num_threads(), repeats, rows, rewritten_counts(subjects),
                       dispatch_thresholds(subjects))
