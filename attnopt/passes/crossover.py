"""Dispatch pass: from which length each rewritten site's form beats exact attention on this device.

A cheap form costs less than softmax attention only from some length on: below it SDPA's fused
kernel wins (a 256-key window over 256 tokens does the same work in a slower loop). A rule that
leaves `min_seq_len` unset (None) gets the form's *crossover*: the site module is timed against
exact attention (the SDPA call it falls back to) at ascending lengths for the site's own geometry
(B=1, its heads, kv heads and head dims, causality, dtype), and the threshold is the smallest
measured length from which the form stays faster. Results are cached on disk per device, torch
version, revision of the timed code, form parameters and geometry (CROSSOVER_CACHE, relocated by
$ATTNOPT_CROSSOVER_CACHE), so each is measured once. A rule's own `min_seq_len` wins (0 = the form at every length);
`compile(dispatch="off")` or $ATTNOPT_DISPATCH=off resolves unset thresholds to 0, as before.

A site that decodes from a state of its own is also timed as a decoding step (`decode_timer`: its
in-place one-token step at context N against appending to a KV cache and reading it, the
original's step), and its threshold is the larger of the two crossovers: the first T positions run
exact in prefill and decode alike, so one T must be safe for both.

A timing is only as good as the machine was quiet. The two ops take turns and the best of repeats
is kept; a result that contradicts the cost model by a wide margin (the form loses at the longest
length while doing a small fraction of exact attention's work) is measured once more; each entry
records the load average it was taken under (`load_average`, injectable) and the cores other work
held while it was timed (`machine_load`: the load average lags a minute and cannot tell our own
threads from others), and an entry taken on a loaded machine is measured again by the next compile
that finds the machine quiet. The report says
when a threshold came from a loaded machine. $ATTNOPT_RECALIBRATE=1 (`attnopt bench
--recalibrate-dispatch`) re-measures every entry a compile reads.

Verification judges the form itself: thresholds are applied after it (and after the end-to-end
budget), so a measured threshold never asks for a longer verification input, and a site's drift
is the form's own where it acts.

Letters: B batch, H query heads, Hkv key/value heads, N length, D / Dv head dims.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import torch

from attnopt import forms
from attnopt.ir import json_cache
from attnopt.ir.outcomes import Status
from attnopt.kernels import native
from attnopt.passes import machine_load

DISPATCH_MODES = ("auto", "off")
ENV_DISPATCH = "ATTNOPT_DISPATCH"
ENV_CACHE = "ATTNOPT_CROSSOVER_CACHE"
ENV_RECALIBRATE = "ATTNOPT_RECALIBRATE"
CROSSOVER_CACHE = Path("~/.cache/attnopt/crossover.json")
# Ascending; the search stops once the form wins at WINS_TO_STOP lengths in a row, so a typical
# form costs a handful of short timings. Exact attention at 8192 keys is about a second on 2 cores.
LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
WINS_TO_STOP = 2
REPEATS = 3  # best of, the two ops taking turns
MIN_SAMPLE_S = 2e-3  # short calls are looped until one sample lasts this long
# A machine is loaded when other work held more than OTHERS_LOADED cores while we timed (two busy
# jobs on 2 cores hold about one: they share the cores with our timing); where that cannot be
# read, when the 1-minute load average less our threads exceeds LOADED_SHARE of the cores.
OTHERS_LOADED = 0.5
LOADED_SHARE = 0.75
QUIET_SAMPLE_S = 0.25  # how long a cached loaded entry's "is it quiet now" looks at the machine
# Wide disagreement with the cost model: the form loses at the longest length measured although
# the model gives it at most this share of exact attention's FLOPs there.
MODEL_MARGIN = 0.25
# A decoding step wins only below this share of the KV-cache step's time. In the model the form's
# step pays fixed costs the timed op does not (its cache layer's Python, the output copy): on
# 2 cores, the linear step took 14.4 µs timed alone and about 45 µs per layer in the decode
# benchmark's model, HF's KV step 28 and 52 µs at 1k, so an op-level near tie loses in the model.
DECODE_WIN = 0.9
# Forms with a fixed threshold, and why they are not timed (none today: a reused layer is timed with
# its own q and k standing in for its anchor's, the selection included, see ReusedSite.timed_attend).
FIXED: dict = {}
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
    decode: the decoding crossover (None: not timed, the site keeps no state of its own);
    decode_timings as timings, for one decoding step at context N. load: the load average the
    timings were taken under (None: not timed); others: the cores other work held meanwhile (None:
    unknown); loaded: either says the machine was shared (`is_loaded`).
    """

    site_id: str
    form: str
    min_seq_len: int
    source: str
    detail: str
    timings: tuple = ()
    decode: Optional[int] = None
    decode_timings: tuple = ()
    load: Optional[float] = None
    loaded: bool = False
    others: Optional[float] = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["timings"] = [list(t) for t in self.timings]
        d["decode_timings"] = [list(t) for t in self.decode_timings]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Threshold":
        d = dict(d)
        d["timings"] = tuple(tuple(t) for t in d.get("timings", ()))
        d["decode_timings"] = tuple(tuple(t) for t in d.get("decode_timings", ()))
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


# The revision of the code the timings run (the forms' ops and decoding steps): a change that moves
# their speed bumps it, so every cached crossover is measured again instead of trusted.
# 2: token steppers made once per sequence (the decoding step got about 2x cheaper).
# 3: the causal linear scan's chunk follows the feature count; a decoding step must win by DECODE_WIN.
# 4: native (C) token steps on CPU; the key also says whether they are on ("native"), since the torch
#    step they stand in for is 2-4x dearer.
# 5: only the lengths where a form acts are timed (reuse, which computes exact attention until it
#    has more blocks than it reads, is timed).
TIMED_CODE_REVISION = 5


def cache_key(form: str, params: Mapping, geometry: Geometry) -> str:
    timed = {k: v for k, v in sorted(params.items()) if k not in UNTIMED_PARAMS}
    args = ",".join(f"{k}={v}" for k, v in timed.items())
    steps = " native" if geometry.device == "cpu" and native.library() is not None else ""
    return (f"{device_name(torch.device(geometry.device))} | torch {torch.__version__} | attnopt timing "
            f"r{TIMED_CODE_REVISION}{steps} | {form}({args}) | {geometry.text()}")


def load_cache(path: Optional[Path] = None) -> dict:
    """The cached crossovers ({} when the file is missing); a corrupt file is an error naming it."""
    return json_cache.read(path or cache_path(), "crossover cache", ENV_CACHE)


def store(key: str, entry: dict, path: Optional[Path] = None) -> None:
    """Add one entry to the cache file (written whole to a temporary file first, then renamed)."""
    json_cache.add(path or cache_path(), {key: entry}, "crossover cache", ENV_CACHE)


def crossover(timings: Sequence[tuple[int, float, float]], win: float = 1.0) -> Optional[int]:
    """The smallest measured N from which the form is faster at that and every longer measured N
    (0 when it wins at every one); None when it loses at the longest. The form wins at N when it
    takes less than `win` times exact attention's time."""
    at = None
    for n, form_s, exact_s in sorted(timings):
        if form_s < win * exact_s:
            at = n if at is None else at
        else:
            at = None
    if at is not None and at == min(t[0] for t in timings):
        return 0
    return at


def measure(time_pair: Callable[[int], tuple[float, float]], lengths: Sequence[int] = LENGTHS,
            wins_to_stop: int = WINS_TO_STOP, win: float = 1.0) -> tuple[int, str, tuple]:
    """(threshold, what it means in words, the timings) from timing ascending lengths until the form
    wins (`crossover`'s `win`) `wins_to_stop` in a row. A form that loses at the longest length gets
    twice that length: its cost grows more slowly, but not measured."""
    timings, streak = [], 0
    for n in lengths:
        form_s, exact_s = time_pair(n)
        timings.append((int(n), float(form_s), float(exact_s)))
        streak = streak + 1 if form_s < win * exact_s else 0
        if streak >= wins_to_stop:
            break
    return summarise(timings, win)


def summarise(timings: Sequence[tuple[int, float, float]], win: float = 1.0) -> tuple[int, str, tuple]:
    """`measure`'s (threshold, words, timings) for timings already taken."""
    timings = sorted(timings)
    at = crossover(timings, win)
    longest = timings[-1][0]
    if at is None:
        return 2 * longest, (f"slower than exact attention at every length measured up to {longest}: exact below "
                             f"{2 * longest} (not measured beyond; set min_seq_len to decide)"), tuple(timings)
    by = "" if win == 1.0 else f" by {1 / win:.2f}x or more"
    if at == 0:
        return 0, f"faster than exact attention{by} at every length measured ({timings[0][0]}..{longest})", tuple(timings)
    return at, f"faster than exact attention{by} from {at} tokens on (measured {timings[0][0]}..{longest})", tuple(timings)


def merged(*runs: Sequence[tuple[int, float, float]]) -> list:
    """Per length, the fastest form and the fastest exact time over several runs (min of repeats)."""
    best: dict = {}
    for run in runs:
        for n, form_s, exact_s in run:
            f, e = best.get(n, (float("inf"), float("inf")))
            best[n] = (min(f, form_s), min(e, exact_s))
    return [(n, f, e) for n, (f, e) in sorted(best.items())]


def load_average() -> float:
    """The 1-minute load average (tests inject their own)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def is_loaded(load: Optional[float], others: Optional[float] = None) -> bool:
    """Whether other work shared the cores: the cores it held (`others`) when known, else the load
    average less our own timing threads."""
    if others is not None:
        return others > OTHERS_LOADED
    cores = os.cpu_count() or 1
    return load is not None and load - min(torch.get_num_threads(), cores) > LOADED_SHARE * cores


def quiet_now() -> bool:
    """Whether the machine reads as quiet: a short look at what other work holds, else the load average."""
    mark = machine_load.cpu_mark()
    if mark is not None:
        time.sleep(QUIET_SAMPLE_S)
    return not is_loaded(load_average(), machine_load.others_since(mark))


def contradicts_model(form_obj, site, params: Mapping, timings: Sequence[tuple[int, float, float]]) -> bool:
    """Whether timings disagree with the cost model by a wide margin: the form loses at the longest
    length measured while the model gives it at most MODEL_MARGIN of exact attention's FLOPs there."""
    if site is None or not timings:
        return False
    n, form_s, exact_s = max(timings)
    if form_s < exact_s:
        return False
    try:
        ratio = form_obj.cost(site, params, 1, n, n).flops / exact_flops(site, n)
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return False
    return ratio <= MODEL_MARGIN


def exact_flops(site, n: int) -> float:
    """Softmax attention's FLOPs at N queries and keys (causal: half the score matrix)."""
    flops = 2.0 * site.heads * n * n * (site.head_dim + site.v_head_dim)
    return flops / 2 if site.causal else flops


def _dtype_device(geometry: "Geometry"):
    dtype = getattr(torch, geometry.dtype, torch.float32)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = torch.float32
    return dtype, torch.device(geometry.device)


def _time_ops(ops: dict, device: torch.device, repeats: int) -> dict:
    """Best-of-`repeats` seconds per call of each op, the ops taking turns (short ones looped)."""
    def once(fn) -> float:
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

    loops = {name: max(1, int(MIN_SAMPLE_S / max(once(op), 1e-7))) for name, op in ops.items()}  # + warm-up
    best = {name: float("inf") for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            best[name] = min(best[name], once(lambda: [op() for _ in range(loops[name])]) / loops[name])
    return best


def decode_timer(module: torch.nn.Module, geometry: Geometry, repeats: int = REPEATS) -> Callable[[int], tuple[float, float]]:
    """time_pair(N): best-of-`repeats` seconds of one decoding step at context N -- the site's
    in-place step (its token stepper) from the state of N random keys (its general step where it
    has none) against the original's: append to a KV cache of N keys and attend one query over it
    (SDPA)."""
    dtype, device = _dtype_device(geometry)

    @torch.inference_mode()
    def time_pair(n: int) -> tuple[float, float]:
        gen = torch.Generator(device=device).manual_seed(n)
        H, Hkv, D, Dv = geometry.heads, geometry.kv_heads, geometry.head_dim, geometry.v_head_dim
        q_BH1D = torch.randn(1, H, 1, D, generator=gen, device=device).to(dtype)
        k_BHkvND = torch.randn(1, Hkv, n, D, generator=gen, device=device).to(dtype)
        v_BHkvND = torch.randn(1, Hkv, n, Dv, generator=gen, device=device).to(dtype)
        k1, v1 = k_BHkvND[:, :, -1:].clone(), v_BHkvND[:, :, -1:].clone()
        _, state = module.decode_step(q_BH1D, k_BHkvND, v_BHkvND, None, None)
        held = [state]
        # As the cache layer steps: one stepper per sequence, made before the clock starts.
        stepper = module.token_stepper(state, q_BH1D, k1)

        def form_step():
            if stepper is not None:
                stepper(q_BH1D, k1, v1)
                return
            stepped = module.decode_token(q_BH1D, k1, v1, held[0])
            if stepped is None:
                stepped = module.decode_step(q_BH1D, k1, v1, None, held[0])
            held[0] = stepped[1]

        def exact_step():
            k_all, v_all = torch.cat([k_BHkvND, k1], dim=2), torch.cat([v_BHkvND, v1], dim=2)
            torch.nn.functional.scaled_dot_product_attention(q_BH1D, k_all, v_all, scale=geometry_scale(module),
                                                             enable_gqa=H != Hkv)

        best = _time_ops({"form": form_step, "exact": exact_step}, device, repeats)
        return best["form"], best["exact"]

    return time_pair


def geometry_scale(module) -> Optional[float]:
    g = getattr(module, "geometry", None)
    return None if g is None else g.scale


def module_timer(module: torch.nn.Module, geometry: Geometry, repeats: int = REPEATS) -> Callable[[int], tuple[float, float]]:
    """time_pair(N): best-of-`repeats` seconds of the site's form and of exact attention (SDPA) on
    random q [1, H, N, D], k/v [1, Hkv, N, D]; the two take turns so a busy moment hits both."""
    dtype, device = _dtype_device(geometry)

    @torch.inference_mode()
    def time_pair(n: int) -> tuple[float, float]:
        gen = torch.Generator(device=device).manual_seed(n)
        q_BHND = torch.randn(1, geometry.heads, n, geometry.head_dim, generator=gen, device=device).to(dtype)
        k_BHkvND = torch.randn(1, geometry.kv_heads, n, geometry.head_dim, generator=gen, device=device).to(dtype)
        v_BHkvND = torch.randn(1, geometry.kv_heads, n, geometry.v_head_dim, generator=gen, device=device).to(dtype)
        attend = getattr(module, "timed_attend", None) or (lambda q, k, v: module.attend(q, k, v, None, None, None))
        best = _time_ops({"form": lambda: attend(q_BHND, k_BHkvND, v_BHkvND),
                          "exact": lambda: module.exact(q_BHND, k_BHkvND, v_BHkvND, None)}, device, repeats)
        return best["form"], best["exact"]

    return time_pair


def stale(entry: Optional[Mapping], decodes: bool) -> str:
    """Why a cache entry must be measured (again), in words for the progress line; "" to use it."""
    if entry is None:
        return " "
    if os.environ.get(ENV_RECALIBRATE, "") not in ("", "0"):
        return f", ${ENV_RECALIBRATE} set"
    if decodes and "decode" not in entry:
        return ", decoding step not timed yet"
    if is_loaded(entry.get("load"), entry.get("others")) and quiet_now():
        return f", the cached entry was taken under load {entry['load']:.1f} and the machine is quiet now"
    return ""


def measure_entry(module, geometry: Geometry, site, params: Mapping, lengths: Sequence[int], decodes: bool,
                  timer: TimerFactory, dtimer: TimerFactory, step: Callable[[str], None], form: str) -> dict:
    """A cache entry: the prefill crossover (timed again once when it contradicts the cost model),
    the decoding crossover for sites that decode from a state, and the load they were taken under."""
    load, mark = load_average(), machine_load.cpu_mark()
    # Only where the form acts: below that it computes exact attention, and a tie there would read as
    # a win (reuse reads every block up to (sinks + window + 1 + top_k) blocks).
    acting = tuple(n for n in lengths if forms.get(form).acts_at(site, {**params, "min_seq_len": 0}, n, n))
    lengths = acting or tuple(lengths)[-1:]
    value, detail, timings = measure(timer(module, geometry), lengths)
    if contradicts_model(forms.get(form), site, params, timings):
        step(f"timing {form} again: it lost at {timings[-1][0]} tokens, which the cost model rules out")
        value, detail, timings = summarise(merged(timings, measure(timer(module, geometry), lengths)[2]))
        detail += " (timed twice: the first run contradicted the cost model)"
    entry = {"min_seq_len": value, "prefill": value, "detail": detail, "timings": [list(x) for x in timings]}
    if decodes:
        step(f"timing a {form} decoding step against a KV cache step ({geometry.text()})")
        dvalue, ddetail, dtimings = measure(dtimer(module, geometry), lengths, win=DECODE_WIN)
        entry.update(decode=dvalue, decode_timings=[list(x) for x in dtimings],
                     min_seq_len=max(value, dvalue), detail=f"{detail}; decoding: {ddetail}")
    load, others = max(load, load_average()), machine_load.others_since(mark)
    entry["load"] = load
    if others is not None:
        entry["others"] = round(others, 2)
    if is_loaded(load, others):
        held = "" if others is None else f", other work holding {others:.1f} cores"
        entry["detail"] += (f"; timed on a loaded machine (load {load:.1f}{held}, {os.cpu_count()} cores): "
                            "re-measured when quiet")
    return entry


def resolve_thresholds(sites: Sequence, outcomes: Sequence, modules: Mapping, mode: str,
                       device: torch.device = torch.device("cpu"), timer: Optional[TimerFactory] = None,
                       path: Optional[Path] = None, step: Callable[[str], None] = lambda text: None,
                       max_len: Optional[int] = None, decode_timer_factory: Optional[TimerFactory] = None) -> Dispatch:
    """Give every rewritten site its min_seq_len: the rule's own, else (mode "auto") the form's
    crossover for the site's geometry (cached, or measured now and cached), else 0. The site
    modules and the outcomes' params are updated to it; `step(text)` is called before each timing.
    timer: how a site is timed (default `module_timer`; tests inject fixed timings), and
    decode_timer_factory how its decoding step is (default `decode_timer`). max_len: the model's
    position limit; longer lengths are not timed (part of the cache key)."""
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
            site = by_id[outcome.site_id]
            geometry = Geometry.of(site, device)
            key = cache_key(form, outcome.params, geometry) + ("" if lengths == LENGTHS else f" | up to {lengths[-1]}")
            decodes = bool(getattr(module, "decodes", False))
            entry = known.get(key) or cache.get(key)
            why = "" if key in known else stale(entry, decodes)
            source = "cached"
            if why:
                step(f"timing {form} against exact attention ({geometry.text()}{why.rstrip()})")
                entry = measure_entry(module, geometry, site, outcome.params, lengths, decodes,
                                      timer or module_timer, decode_timer_factory or decode_timer, step, form)
                store(key, entry, path)
                source = "measured"
            known[key] = entry
            value, why = forms.get(form).dispatch_threshold(site, int(entry["min_seq_len"]))
            t = Threshold(outcome.site_id, form, value, source, entry["detail"] + why,
                          tuple(tuple(x) for x in entry["timings"]), entry.get("decode"),
                          tuple(tuple(x) for x in entry.get("decode_timings", ())), entry.get("load"),
                          is_loaded(entry.get("load"), entry.get("others")), entry.get("others"))
        window = getattr(by_id.get(outcome.site_id), "window", None)
        if window is not None and t.min_seq_len > window:
            # Below the model's own sliding window its band hides no key, so "exact" there is the model's
            # attention in a prefill and in decoding alike; past it the two would differ.
            t = replace(t, min_seq_len=int(window), detail=f"{t.detail}; capped at the model's sliding window {window}")
        thresholds[outcome.site_id] = t
        module.params["min_seq_len"] = t.min_seq_len
        module.min_seq_len = t.min_seq_len
        out.append(replace(outcome, params={**outcome.params, "min_seq_len": t.min_seq_len}))
    counts = {"mode": mode, **{s: 0 for s in ("given", "measured", "cached", "off", "fixed")}}
    for t in thresholds.values():
        counts[t.source] += 1
    return Dispatch(thresholds, out, counts)
