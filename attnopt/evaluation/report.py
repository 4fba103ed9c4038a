"""`EvalReport`: what `attnopt.evaluate` measured, for people (`summary()`, `to_html()`) and tools
(`to_dict()`, `to_json()`).

    report.retrieval["passkey"][2048][0.5]            exact-match accuracy of the model
    report.reference.retrieval["passkey"][2048][0.5]  the same for the reference (the original)
    report.teacher_forced[...]                        teacher-forced token accuracy, same keys
    report.first_token[...]                           teacher-forced accuracy of each answer's first token
                                                      (finding the fact; the rest is copying it)

In JSON the length and depth keys are strings ("2048", "0.5", "1.0"). No torch here: the compile
report's page renders a stored audit with this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from attnopt.evaluation.html import fragment, page

SCORED_BY = {
    "generate": "exact match of greedy generate() output (decoding through the model's cache)",
    "forward": "exact match of the full forward's greedy answer (the model has no generate())",
}


@dataclass
class Perplexity:
    """exp(mean next-token NLL) over `windows` windows of `window` tokens; `buckets` by the predicted
    token's position in its window."""

    overall: float
    tokens: int  # predicted tokens
    windows: int
    window: int
    text: str  # which text
    buckets: list = field(default_factory=list)  # [{"start", "end", "perplexity", "tokens"}]

    def to_dict(self) -> dict:
        return {"overall": self.overall, "tokens": self.tokens, "windows": self.windows, "window": self.window,
                "text": self.text, "buckets": [dict(b) for b in self.buckets]}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> Optional["Perplexity"]:
        return None if d is None else cls(**{**d, "buckets": [dict(b) for b in d.get("buckets", [])]})


def _grid_to_json(grid: dict) -> dict:
    return {p: {str(n): {str(float(d)): v for d, v in row.items()} for n, row in by_len.items()} for p, by_len in grid.items()}


def _grid_from_json(grid: dict) -> dict:
    return {p: {int(n): {float(d): v for d, v in row.items()} for n, row in by_len.items()} for p, by_len in grid.items()}


def written_page(text: str, path: Union[str, Path, None]) -> str:
    """A report's HTML page `text`, written to `path` first when one is given (the reports' `to_html`)."""
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


def mean(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


@dataclass
class ModelScores:
    """One model's numbers: retrieval[probe][length][depth] exact match, the same teacher-forced (every
    answer token, and the first token alone), and perplexity."""

    name: str
    scored_by: str  # "generate" or "forward" (SCORED_BY)
    retrieval: dict
    teacher_forced: dict
    decode_disagreements: int  # rows where generate() and the full forward's greedy answer differ
    rows: int
    perplexity: Optional[Perplexity] = None
    seconds: float = 0.0
    first_token: dict = field(default_factory=dict)  # audits saved before it was measured have none

    @property
    def scored_by_text(self) -> str:
        return SCORED_BY[self.scored_by]

    def probe_mean(self, probe: str, length: Optional[int] = None, which: str = "retrieval") -> Optional[float]:
        grid = getattr(self, which)[probe]
        return mean(v for n, row in grid.items() if length in (None, n) for v in row.values())

    def to_dict(self) -> dict:
        return {"name": self.name, "scored_by": self.scored_by, "retrieval": _grid_to_json(self.retrieval),
                "teacher_forced": _grid_to_json(self.teacher_forced),
                "decode_disagreements": self.decode_disagreements, "rows": self.rows,
                "perplexity": None if self.perplexity is None else self.perplexity.to_dict(),
                "seconds": self.seconds, "first_token": _grid_to_json(self.first_token)}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelScores":
        return cls(d["name"], d["scored_by"], _grid_from_json(d["retrieval"]), _grid_from_json(d["teacher_forced"]),
                   d["decode_disagreements"], d["rows"], Perplexity.from_dict(d.get("perplexity")), d.get("seconds", 0.0),
                   _grid_from_json(d.get("first_token", {})))


@dataclass
class EvalReport:
    """The capability audit of a model, side by side with its reference (the original) when given."""

    model: ModelScores
    probes: list
    lengths: list
    depths: list
    samples: int  # per cell
    seed: int
    tokenizer: str
    chance: dict  # probe -> per-token teacher-forced accuracy of a uniform guess (None where not known)
    reference: Optional[ModelScores] = None
    notes: list = field(default_factory=list)

    @property
    def retrieval(self) -> dict:
        return self.model.retrieval

    @property
    def teacher_forced(self) -> dict:
        return self.model.teacher_forced

    @property
    def first_token(self) -> dict:
        return self.model.first_token

    @property
    def perplexity(self) -> Optional[Perplexity]:
        return self.model.perplexity

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "reference": None if self.reference is None else self.reference.to_dict(),
                "probes": list(self.probes), "lengths": list(self.lengths), "depths": list(self.depths),
                "samples": self.samples, "seed": self.seed, "tokenizer": self.tokenizer, "chance": dict(self.chance),
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> "EvalReport":
        ref = d.get("reference")
        return cls(ModelScores.from_dict(d["model"]), list(d["probes"]), [int(n) for n in d["lengths"]],
                   [float(x) for x in d["depths"]], d["samples"], d["seed"], d["tokenizer"], dict(d["chance"]),
                   None if ref is None else ModelScores.from_dict(ref), list(d.get("notes", [])))

    def to_json(self, path: Union[str, Path, None] = None) -> str:
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def html_fragment(self) -> str:
        """The audit as an HTML section (heatmaps, perplexity by position), for a page of its own or the
        compile report's."""
        return fragment(self)

    def to_html(self, path: Union[str, Path, None] = None) -> str:
        """One self-contained page (inline CSS and SVG, nothing fetched); written to `path` if given."""
        return written_page(page(self), path)

    def summary(self) -> str:
        """A few lines: perplexity, then each probe's accuracy by length, against the reference."""
        ref = self.reference
        head = f"capability audit of {self.model.name}" + (f" against {ref.name}" if ref else "")
        lines = [f"{head}: {len(self.probes)} probes x {len(self.lengths)} lengths x {len(self.depths)} depths x "
                 f"{self.samples} samples, scored by {self.model.scored_by_text}; tokens: {self.tokenizer}"]
        ppl = self.model.perplexity
        if ppl is not None:
            text = f"perplexity {ppl.overall:.4g}"
            if ref is not None and ref.perplexity is not None:
                text += f" (reference {ref.perplexity.overall:.4g}, {ppl.overall / ref.perplexity.overall:.3f}x)"
            last = ppl.buckets[-1]
            text += f"; positions {last['start']}-{last['end'] - 1}: {last['perplexity']:.4g}"
            if ref is not None and ref.perplexity is not None:
                text += f" (reference {ref.perplexity.buckets[-1]['perplexity']:.4g})"
            lines.append(text + f"; {ppl.windows} window(s) of {ppl.window} tokens of {ppl.text}")
        width = max(len(p) for p in self.probes)
        for probe in self.probes:
            cells = []
            for n in self.lengths:
                cell = f"{n}: {_pct(self.model.probe_mean(probe, n))}"
                if ref is not None:
                    cell += f" (ref {_pct(ref.probe_mean(probe, n))})"
                cells.append(cell)
            tf = f"teacher-forced {_pct(self.model.probe_mean(probe, which='teacher_forced'))}"
            if self.model.first_token:
                tf += f", first token {_pct(self.model.probe_mean(probe, which='first_token'))}"
            if self.chance.get(probe) is not None:
                tf += f", chance {_pct(self.chance[probe])}"
            lines.append(f"  {probe:<{width}}  exact match by length  " + ";  ".join(cells) + f"  [{tf}]")
        for scores in (self.model, ref):
            if scores is not None and scores.decode_disagreements:
                lines.append(f"  {scores.name}: {scores.decode_disagreements}/{scores.rows} rows where generate() "
                             "and the full forward disagree on the answer (the decode state differs from prefill)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
