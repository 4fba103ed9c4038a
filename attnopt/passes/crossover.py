"""Dispatch pass: from which length each rewritten site's form beats exact attention on this device.

A cheap form costs less than softmax attention only from some length on: below it SDPA's fused
kernel wins (a 256-key window over 256 tokens does the same work in a slower loop). A rule that
leaves `min_seq_len` unset (None) gets the form's *crossover*: the site module is timed against
exact attention (the SDPA call it falls back to) at ascending lengths for the site's own geometry
(B=1, its heads, kv heads and head dims, causality, dtype), and the threshold is the smallest
measured length from which the form stays faster. Results are cached on disk per device, torch
version, form parameters and geometry (CROSSOVER_CACHE, relocated by $ATTNOPT_CROSSOVER_CACHE), so
each is measured once. A rule's own `min_seq_len` wins (0 = the form at every length);
`compile(dispatch="off")` or $ATTNOPT_DISPATCH=off resolves unset thresholds to 0, as before.

Verification judges the form itself: thresholds are applied after it (and after the end-to-end
budget), so a measured threshold never asks for a longer verification input, and a site's drift
is the form's own where it acts.

Letters: B batch, H query heads, Hkv key/value heads, N length, D / Dv head dims.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

from attnopt.ir.outcomes import Status

DISPATCH_MODES = ("auto", "off")
ENV_DISPATCH = "ATTNOPT_DISPATCH"
ENV_CACHE = "ATTNOPT_CROSSOVER_CACHE"
CROSSOVER_CACHE = Path("~/.cache/attnopt/crossover.json")
# Ascending; the search stops once the form wins at WINS_TO_STOP lengths in a row, so a typical
# form costs a handful of short timings. Exact attention at 8192 keys is about a second on 2 cores.
LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
WINS_TO_STOP = 2
REPEATS = 3  # best of, the two ops taking turns
MIN_SAMPLE_S = 2e-3  # short calls are looped until one sample lasts this long
# Forms with a fixed threshold, and why they are not timed.
FIXED = {
    "reuse": "reuse saves the site's own q/k projections, outside the attention op, and below a threshold it "
             "would still read the anchor's q and k: always the form (0)",
}
# The parameters that cannot change an op's speed stay out of the cache key.
UNTIMED_PARAMS = ("min_seq_len", "tolerance", "seed", "fit_steps")

# site module, its geometry -> time_pair(N) -> (form seconds, exact seconds)
TimerFactory = Callable[[torch.nn.Module, "Geometry"], Callable[[int], tuple[float, float]]]


@dataclass(frozen=True)
class Geometry:
    """What the speed of one site's op depends on, besides its form and parameters."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    causal: bool
    model_window: Optional[int]
    dtype: str
    device: str  # torch device type + index, e.g. "cpu", "cuda:0"

    @classmethod
    def of(cls, site, device: torch.device) -> "Geometry":
        return cls(site.heads, site.kv_heads, site.head_dim, site.v_head_dim, bool(site.causal), site.window,
                   site.dtype, str(device))

    def text(self) -> str:
        w = "" if self.model_window is None else f", model window {self.model_window}"
        return (f"H={self.heads}, Hkv={self.kv_heads}, D={self.head_dim}, Dv={self.v_head_dim}, "
                f"{'causal' if self.causal else 'bidirectional'}, {self.dtype}{w}")


@dataclass(frozen=True)
class Threshold:
    """One site's dispatch length and where it came from.

    source: "given" (the rule's min_seq_len), "measured" (timed now), "cached" (timed earlier on
    this device), "off" (dispatch off: 0), "fixed" (a form that is never timed, FIXED).
    timings: (N, form seconds, exact seconds) per measured length, when timed.
    """

    site_id: str
    form: str
    min_seq_len: int
    source: str
    detail: str
    timings: tuple = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["timings"] = [list(t) for t in self.timings]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Threshold":
        d = dict(d)
        d["timings"] = tuple(tuple(t) for t in d.get("timings", ()))
        return cls(**d)


@dataclass
class Dispatch:
    """The thresholds by site id (rewritten sites only), the outcomes with them filled in, and the counts."""

    thresholds: dict = field(default_factory=dict)
    outcomes: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)  # mode, and sites per source


def dispatch_mode(dispatch: Optional[str]) -> str:
    """compile(dispatch=...) if given, else $ATTNOPT_DISPATCH, else "auto"; anything else is an error."""
    value = dispatch if dispatch is not None else os.environ.get(ENV_DISPATCH, "auto")
    if value not in DISPATCH_MODES:
        where = "dispatch" if dispatch is not None else f"${ENV_DISPATCH}"
        raise ValueError(f"{where} must be 'auto' (measured crossover thresholds) or 'off' (the form at every "
                         f"length unless a rule sets min_seq_len); got {value!r}")
    return value


def cache_path() -> Path:
    return Path(os.environ.get(ENV_CACHE) or CROSSOVER_CACHE).expanduser()


def device_name(device: torch.device) -> str:
    """The hardware a timing holds for: the GPU's name, or the CPU model and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


def cache_key(form: str, params: Mapping, geometry: Geometry) -> str:
    timed = {k: v for k, v in sorted(params.items()) if k not in UNTIMED_PARAMS}
    args = ",".join(f"{k}={v}" for k, v in timed.items())
    return (f"{device_name(torch.device(geometry.device))} | torch {torch.__version__} | {form}({args}) | "
            f"{geometry.text()}")


def load_cache(path: Optional[Path] = None) -> dict:
    """The cached crossovers ({} when the file is missing); a corrupt file is an error naming it."""
    path = path or cache_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the crossover cache {path} cannot be read ({exc}); delete it to measure again, or set "
                         f"${ENV_CACHE} to another file") from None
    return data if isinstance(data, dict) else {}


def store(key: str, entry: dict, path: Optional[Path] = None) -> None:
    """Add one entry to the cache file (written whole to a temporary file first, then renamed)."""
    path = path or cache_path()
    data = load_cache(path)
    data[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def crossover(timings: Sequence[tuple[int, float, float]]) -> Optional[int]:
    """The smallest measured N from which the form is faster at that and every longer measured N
    (0 when it wins at every one); None when it loses at the longest."""
    at = None
    for n, form_s, exact_s in sorted(timings):
        if form_s < exact_s:
            at = n if at is None else at
        else:
            at = None
    if at is not None and at == min(t[0] for t in timings):
        return 0
    return at


def measure(time_pair: Callable[[int], tuple[float, float]], lengths: Sequence[int] = LENGTHS,
            wins_to_stop: int = WINS_TO_STOP) -> tuple[int, str, tuple]:
    """(threshold, what it means in words, the timings) from timing ascending lengths until the form
    wins `wins_to_stop` in a row. A form that loses at the longest length gets twice that length:
    its cost grows more slowly, but not measured."""
    timings, streak = [], 0
    for n in lengths:
        form_s, exact_s = time_pair(n)
        timings.append((int(n), float(form_s), float(exact_s)))
        streak = streak + 1 if form_s < exact_s else 0
        if streak >= wins_to_stop:
            break
    at = crossover(timings)
    longest = timings[-1][0]
    if at is None:
        return 2 * longest, (f"slower than exact attention at every length measured up to {longest}: exact below "
                             f"{2 * longest} (not measured beyond; set min_seq_len to decide)"), tuple(timings)
    if at == 0:
        return 0, f"faster than exact attention at every length measured ({timings[0][0]}..{longest})", tuple(timings)
    return at, f"faster than exact attention from {at} tokens on (measured {timings[0][0]}..{longest})", tuple(timings)


def module_timer(module: torch.nn.Module, geometry: Geometry, repeats: int = REPEATS) -> Callable[[int], tuple[float, float]]:
    """time_pair(N): best-of-`repeats` seconds of the site's form and of exact attention (SDPA) on
    random q [1, H, N, D], k/v [1, Hkv, N, D]; the two take turns so a busy moment hits both."""
    dtype = getattr(torch, geometry.dtype, torch.float32)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = torch.float32
    device = torch.device(geometry.device)

    def once(fn) -> float:
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    @torch.inference_mode()
    def time_pair(n: int) -> tuple[float, float]:
        gen = torch.Generator(device=device).manual_seed(n)
        q_BHND = torch.randn(1, geometry.heads, n, geometry.head_dim, generator=gen, device=device).to(dtype)
        k_BHkvND = torch.randn(1, geometry.kv_heads, n, geometry.head_dim, generator=gen, device=device).to(dtype)
        v_BHkvND = torch.randn(1, geometry.kv_heads, n, geometry.v_head_dim, generator=gen, device=device).to(dtype)
        ops = {"form": lambda: module.attend(q_BHND, k_BHkvND, v_BHkvND, None, None, None),
               "exact": lambda: module.exact(q_BHND, k_BHkvND, v_BHkvND, None)}
        loops = {name: max(1, int(MIN_SAMPLE_S / max(once(op), 1e-7))) for name, op in ops.items()}  # + warm-up
        best = {name: float("inf") for name in ops}
        for _ in range(repeats):
            for name, op in ops.items():
                best[name] = min(best[name], once(lambda: [op() for _ in range(loops[name])]) / loops[name])
        return best["form"], best["exact"]

    return time_pair


def resolve_thresholds(sites: Sequence, outcomes: Sequence, modules: Mapping, mode: str,
                       device: torch.device = torch.device("cpu"), timer: Optional[TimerFactory] = None,
                       path: Optional[Path] = None, step: Callable[[str], None] = lambda text: None,
                       max_len: Optional[int] = None) -> Dispatch:
    """Give every rewritten site its min_seq_len: the rule's own, else (mode "auto") the form's
    crossover for the site's geometry (cached, or measured now and cached), else 0. The site
    modules and the outcomes' params are updated to it; `step(text)` is called before each timing.
    timer: how a site is timed (default `module_timer`; tests inject fixed timings). max_len: the
    model's position limit; longer lengths are not timed (part of the cache key)."""
    lengths = tuple(n for n in LENGTHS if max_len is None or n <= max_len) or LENGTHS[:1]

    by_id = {s.id: s for s in sites}
    thresholds, out, known = {}, [], {}
    cache = load_cache(path) if mode == "auto" else {}
    for outcome in outcomes:
        module = modules.get(outcome.site_id)
        if outcome.status is not Status.REWRITTEN or module is None:
            out.append(outcome)
            continue
        given = outcome.params.get("min_seq_len")
        form = outcome.final_form
        if given is not None:
            t = Threshold(outcome.site_id, form, int(given), "given", "set by the policy rule")
        elif mode == "off":
            t = Threshold(outcome.site_id, form, 0, "off", "dispatch off: the form at every length")
        elif form in FIXED:
            t = Threshold(outcome.site_id, form, 0, "fixed", FIXED[form])
        else:
            geometry = Geometry.of(by_id[outcome.site_id], device)
            key = cache_key(form, outcome.params, geometry) + ("" if lengths == LENGTHS else f" | up to {lengths[-1]}")
            if key in known:
                value, detail, timings, source = known[key]
            elif key in cache:
                entry = cache[key]
                value, detail, timings, source = (int(entry["min_seq_len"]), entry["detail"],
                                                  tuple(tuple(x) for x in entry["timings"]), "cached")
            else:
                step(f"timing {form} against exact attention ({geometry.text()})")
                value, detail, timings = measure((timer or module_timer)(module, geometry), lengths)
                source = "measured"
                store(key, {"min_seq_len": value, "detail": detail, "timings": [list(x) for x in timings]}, path)
            known[key] = (value, detail, timings, "cached" if source == "measured" else source)
            t = Threshold(outcome.site_id, form, value, source, detail, timings)
        thresholds[outcome.site_id] = t
        module.params["min_seq_len"] = t.min_seq_len
        module.min_seq_len = t.min_seq_len
        out.append(replace(outcome, params={**outcome.params, "min_seq_len": t.min_seq_len}))
    counts = {"mode": mode, **{s: 0 for s in ("given", "measured", "cached", "off", "fixed")}}
    for t in thresholds.values():
        counts[t.source] += 1
    return Dispatch(thresholds, out, counts)
