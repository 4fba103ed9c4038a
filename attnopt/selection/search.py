"""The greedy search of keep:recall: from every head cheap, add back the unit (a KV head, or a layer)
that recovers the most, trying the cheap signals' best few first, until the budget holds or the
exact share is spent. Plain logic over a `measure(units) -> Quality` callable, so it is tested
without a model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

from attnopt.selection.probing import Quality

TRIES = 3  # candidates measured per step, best cheap signal first


@dataclass(frozen=True)
class Unit:
    """What the search adds back at once: one KV head of one site, or every KV head of a layer's sites."""

    name: str  # "layer 1" or "<site id> kv 0"
    heads: tuple  # ((site id, KV head), ...)
    signal: float = 0.0  # the cheap signal's rank score (higher: try first)


@dataclass(frozen=True)
class Budget:
    """keep:recall's budget: probe accuracy >= recall x the original's, perplexity <= perplexity x the
    original's, at most `exact` of the KV heads exact."""

    recall: float = 0.95
    exact: float = 0.25
    perplexity: float = 1.01
    by: str = "head"

    def probe_ratio(self, q: Quality, original: Quality) -> float:
        return q.probe / original.probe if original.probe > 0 else 1.0

    def perplexity_ratio(self, q: Quality, original: Quality) -> Optional[float]:
        if q.perplexity is None or original.perplexity is None:
            return None
        return q.perplexity / original.perplexity

    def holds(self, q: Quality, original: Quality) -> bool:
        """Probe accuracy, then perplexity (a causal LM's) or the pooled embeddings' cosine to the
        original's (an encoder's: at least `recall`)."""
        ppl = self.perplexity_ratio(q, original)
        return (self.probe_ratio(q, original) >= self.recall and (ppl is None or ppl <= self.perplexity)
                and (q.cosine is None or q.cosine >= self.recall))

    def shortfall(self, q: Quality, original: Quality) -> tuple:
        """(probe deficit, perplexity ratio or cosine deficit): what the search compares, lowest first."""
        ppl = self.perplexity_ratio(q, original)
        second = ppl if ppl is not None else (1.0 - q.cosine if q.cosine is not None else 1.0)
        return max(0.0, self.recall - self.probe_ratio(q, original)), second

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Point:
    """One model on the search's path: its exact units, their share of the KV heads, what it reached."""

    exact: list
    exact_heads: int
    fraction: float
    probe: float  # accuracy / the original's
    perplexity: Optional[float]  # perplexity / the original's
    holds: bool
    quality: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Search:
    path: list  # Point, one per unit added (the curve)
    chosen: list  # Unit
    measured: int  # candidate models measured
    holds: bool
    tried: list = field(default_factory=list)  # (unit names, probe ratio) of every measured candidate

    @property
    def heads(self) -> list:
        return [h for u in self.chosen for h in u.heads]


def greedy(units: Sequence[Unit], total_heads: int, budget: Budget, original: Quality,
           measure: Callable[[list], Quality], tries: int = TRIES,
           step: Callable[[str], None] = lambda text: None) -> Search:
    """Add units back until `budget` holds or no unit fits within `budget.exact` of `total_heads`."""
    cap = int(budget.exact * total_heads + 1e-9)
    chosen: list = []
    quality = measure(chosen)
    path = [_point(chosen, quality, total_heads, budget, original)]
    measured, tried = 1, []
    while not budget.holds(quality, original):
        used = sum(len(u.heads) for u in chosen)
        remaining = [u for u in units if u not in chosen and used + len(u.heads) <= cap]
        if not remaining:
            break
        best = None
        for unit in sorted(remaining, key=lambda u: -u.signal)[:tries]:
            step(f"keep:recall: trying {unit.name} exact ({len(chosen) + 1} exact so far)")
            q = measure(chosen + [unit])
            measured += 1
            tried.append(([u.name for u in chosen + [unit]], budget.probe_ratio(q, original)))
            if best is None or budget.shortfall(q, original) < budget.shortfall(best[1], original):
                best = (unit, q)
            if budget.holds(q, original):
                break  # the fewest exact: the first that holds, in signal order
        chosen.append(best[0])
        quality = best[1]
        path.append(_point(chosen, quality, total_heads, budget, original))
    return Search(path, chosen, measured, budget.holds(quality, original), tried)


def _point(chosen: list, q: Quality, total: int, budget: Budget, original: Quality) -> Point:
    n = sum(len(u.heads) for u in chosen)
    return Point([u.name for u in chosen], n, n / total if total else 0.0, budget.probe_ratio(q, original),
                 budget.perplexity_ratio(q, original), budget.holds(q, original), q.to_dict())
