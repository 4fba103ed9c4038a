"""Timing on a shared machine, and the conditions a timing was taken under.

- `take_turns(runs, repeats, warmups, rotate, progress) -> Turns`: the subjects take turns, every one
  once per round, so a slow moment of the machine lands on all of them; untimed warm-up rounds
  first; `Turns.best()` keeps the fastest round (attnopt.bench and benchmarks/ build on it);
- `timed(fn, clock)`: a run that returns the seconds `fn()` took;
- `Conditions.now()`: torch threads, cores and how busy the machine was -- what a reader needs to
  judge a time;
- `forward_time(...) -> ForwardTime`: compile's measured forward, original against rewritten on
  the verification input, within a small time budget.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from attnopt.passes import machine_load
from attnopt.passes.crossover import is_loaded, load_average

Clock = Callable[[], float]
Measurement = Union[float, Mapping[str, Any]]  # seconds, or named measurements ("prefill", "per_token")
Run = Callable[[], Measurement]

# compile's forward timing: the rounds stop once they have taken this long (one warm-up and one timed
# round always run), and a model whose warm-up round alone took longer is not timed at all: it
# would add more than this to the compile (`attnopt bench` times it on request).
FORWARD_BUDGET_S = 2.0
FORWARD_REPEATS = 3


# ---------------------------------------------------------------- the loop


@dataclass
class Turns:
    """Every timed round of a take_turns: per subject (in the order given), one dict of measurements
    per round ({"seconds": s} for a run that returns a number)."""

    samples: dict[str, list[dict[str, Any]]]

    def values(self, metric: str = "seconds") -> dict[str, list]:
        """Per subject, `metric` of every round that measured it."""
        return {name: [s[metric] for s in rounds if metric in s] for name, rounds in self.samples.items()}

    def best(self, metric: str = "seconds") -> dict[str, float]:
        """The fastest round per subject (inf where no round measured `metric`)."""
        return {name: min(v, default=float("inf")) for name, v in self.values(metric).items()}

    def worst(self, metric: str = "seconds") -> dict[str, float]:
        """The slowest round per subject (0 where no round measured `metric`)."""
        return {name: max(v, default=0.0) for name, v in self.values(metric).items()}

    def spread(self, metric: str = "seconds") -> dict[str, float]:
        """Slowest / fastest round per subject: how steady the machine was."""
        best, worst = self.best(metric), self.worst(metric)
        return {name: worst[name] / best[name] if best[name] > 0 else float("nan") for name in best}


def take_turns(runs: Mapping[str, Run], repeats: int, warmups: int = 0, rotate: bool = False,
               progress: Optional[Callable[[str], None]] = None) -> Turns:
    """Call every run once per round: `warmups` untimed rounds, then `repeats` timed ones. rotate:
    timed round r starts at the r-th subject (who goes first changes); progress(name) is told
    before every call."""
    names = list(runs)
    samples: dict[str, list] = {name: [] for name in names}
    for r in range(warmups + repeats):
        shift = (r - warmups) % len(names) if rotate and r >= warmups else 0
        for name in names[shift:] + names[:shift]:
            if progress is not None:
                progress(name)
            measured = runs[name]()
            if r >= warmups:
                samples[name].append(dict(measured) if isinstance(measured, Mapping) else {"seconds": measured})
    return Turns(samples)


def timed(fn: Callable[[], Any], clock: Clock = time.perf_counter,
          keep: Optional[Callable[[Any], None]] = None) -> Callable[[], float]:
    """A run for take_turns: calls `fn` and returns the seconds it took; its result is dropped (or
    handed to keep) after the clock is read."""

    def run() -> float:
        start = clock()
        result = fn()
        seconds = clock() - start
        if keep is not None:
            keep(result)
        return seconds

    return run


# ---------------------------------------------------------------- conditions


@dataclass(frozen=True)
class Conditions:
    """What a time depends on besides the code: torch's threads, the cores, the 1-minute load average,
    the cores other work held while it was measured (None: unknown), and whether that made the
    machine a loaded one (the dispatch's own rule, `crossover.is_loaded`, judged when measured)."""

    threads: int
    cores: int
    load: Optional[float]
    others: Optional[float] = None
    device: str = "cpu"
    loaded: bool = False

    @classmethod
    def now(cls, others: Optional[float] = None, device: str = "cpu") -> "Conditions":
        load = round(load_average(), 2)
        return cls(torch.get_num_threads(), os.cpu_count() or 1, load, None if others is None else round(others, 2),
                   device, is_loaded(load, others))

    def text(self) -> str:
        """E.g. "2 torch threads on 2 cores (cpu), load average 7.9, other work holding 1.2 cores: a
        loaded machine, times are noisy"."""
        out = f"{self.threads} torch thread{'s' if self.threads != 1 else ''} on {self.cores} cores ({self.device})"
        if self.load is not None:
            out += f", load average {self.load:.1f}"
        if self.others is not None:
            out += f", other work holding {self.others:.1f} cores"
        return out + (": a loaded machine, times are noisy" if self.loaded else "")

    def short(self) -> str:
        """E.g. "2 threads, load 7.9 on 2 cores: loaded, noisy"."""
        load = "" if self.load is None else f", load {self.load:.1f} on {self.cores} cores"
        return f"{self.threads} thread{'s' if self.threads != 1 else ''}{load}" + (": loaded, noisy" if self.loaded
                                                                                    else "")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> Optional["Conditions"]:
        if not d:
            return None
        return cls(d["threads"], d["cores"], d.get("load"), d.get("others"), d.get("device", "cpu"),
                   bool(d.get("loaded", False)))


# ---------------------------------------------------------------- compile's forward timing


@dataclass(frozen=True)
class ForwardTime:
    """The whole model's forward on one input, original against rewritten, best of `repeats` rounds
    taking turns after one warm-up round; repeats 0: not timed, `skipped` says why."""

    input_shape: tuple  # the first tensor input's shape, e.g. (4, 256)
    length: Optional[int]  # the sites' query length on that input
    original_s: Optional[float]
    rewritten_s: Optional[float]
    repeats: int
    rewritten_sites: int
    exact_sites: int  # of those, the ones that ran exact attention here (below their dispatch threshold)
    conditions: Conditions
    skipped: str = ""

    @property
    def speedup(self) -> Optional[float]:
        if not self.original_s or not self.rewritten_s:
            return None
        return self.original_s / self.rewritten_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["input_shape"] = list(self.input_shape)
        d["conditions"] = self.conditions.to_dict()
        d["speedup"] = self.speedup
        return d

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> Optional["ForwardTime"]:
        if not d:
            return None
        return cls(tuple(d["input_shape"]), d.get("length"), d.get("original_s"), d.get("rewritten_s"),
                   d.get("repeats", 0), d.get("rewritten_sites", 0), d.get("exact_sites", 0),
                   Conditions.from_dict(d["conditions"]), d.get("skipped", ""))

    def text(self) -> str:
        """One line: where, the two times and the speed-up, and what ran exact."""
        shape = "×".join(map(str, self.input_shape)) or "scalar"
        where = f"input [{shape}]" + (f", {self.length} queries at the sites" if self.length is not None else "")
        if not self.repeats:
            return f"forward on the verification {where}: not timed ({self.skipped})"
        out = (f"forward on the verification {where}: {self.original_s * 1e3:.3g} ms original, "
               f"{self.rewritten_s * 1e3:.3g} ms rewritten ({self.speedup:.2f}x), best of {self.repeats}")
        if self.exact_sites:
            out += (f"; {self.exact_sites} of {self.rewritten_sites} rewritten sites ran exact attention at this "
                    "length (below their dispatch threshold)")
        return out


def input_shape(batch) -> tuple:
    """The first tensor input's shape of one (args, kwargs) batch; () when it has none."""
    args, kwargs = batch
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            return tuple(int(s) for s in value.shape)
    return ()


def longest_batch(batches: Sequence, calls: Mapping[str, list]) -> tuple[int, Optional[int]]:
    """(index, length) of the batch whose sites saw the most queries (what verification checked the
    forms on); (0, None) when no site recorded a call."""
    best, length = 0, None
    for i in range(len(batches)):
        lengths = [site_calls[i].q.shape[-2] for site_calls in calls.values() if i < len(site_calls)]
        if lengths and (length is None or max(lengths) > length):
            best, length = i, int(max(lengths))
    return best, length


def forward_time(run_original: Callable[[], Any], run_rewritten: Callable[[], Any], shape: tuple,
                 length: Optional[int], thresholds: Sequence[int], budget_s: float = FORWARD_BUDGET_S,
                 repeats: int = FORWARD_REPEATS, clock: Clock = time.perf_counter) -> ForwardTime:
    """Time both forwards on the same input, taking turns: one warm-up round, then timed rounds until
    `repeats` or `budget_s` (at least one), best of them. The runs set their own grad mode. thresholds: each rewritten site's
    min_seq_len, to count those that run exact at `length`. Not timed when the warm-up round
    alone takes longer than the budget."""
    runs = {"original": timed(run_original, clock), "rewritten": timed(run_rewritten, clock)}
    mark, start = machine_load.cpu_mark(), clock()
    exact = sum(1 for t in thresholds if length is not None and t > length)
    warm = take_turns(runs, 1).best()
    rounds: list[Turns] = []
    if sum(warm.values()) <= budget_s:
        while len(rounds) < repeats and (not rounds or clock() - start < budget_s):
            first = list(runs) if len(rounds) % 2 == 0 else list(reversed(runs))  # who goes first alternates
            rounds.append(take_turns({name: runs[name] for name in first}, 1))
    conditions = Conditions.now(machine_load.others_since(mark))
    if not rounds:
        why = (f"one original and one rewritten forward took {sum(warm.values()):.1f} s, more than the "
               f"{budget_s:g} s compile spends on timing; attnopt bench times it")
        return ForwardTime(shape, length, None, None, 0, len(thresholds), exact, conditions, why)
    best = {name: min(t.best()[name] for t in rounds) for name in runs}
    return ForwardTime(shape, length, best["original"], best["rewritten"], len(rounds), len(thresholds), exact,
                       conditions)
