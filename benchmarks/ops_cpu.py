"""CPU benchmark of attnopt's attention ops against F.scaled_dot_product_attention, same run, same inputs.

Every (op, causal, N) is measured in a fresh subprocess, so its peak-RSS delta (ru_maxrss after the runs
minus after building the inputs) is that op's own working memory, not a high-water mark left behind by
an earlier op; torch's CPU allocations are invisible to tracemalloc, so RSS is the honest measure.
Time is the median of `repeats` calls after one warm-up call; the ratio is SDPA seconds / op seconds,
both measured by this invocation. An N² op (SDPA) whose time extrapolated from the largest N
already measured exceeds --max-seconds is not run; its time and ratio are then marked "estimated".

    python benchmarks/ops_cpu.py --sizes 1024,4096 --repeats 3 --out /tmp/ops_cpu.json
    python benchmarks/ops_cpu.py --repeats 3 --threads 2 --busy 0,2 --result ops_cpu \
        --busy-ops gla,gla_head,delta,gla_window,delta_c64,delta_blocked
        # every op quiet, the gated ops also beside two busy processes -> results/ops_cpu/<machine>.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = (1024, 4096, 16384, 32768)
B, H, D = 1, 8, 64  # fixed shape of the study: one sequence, 8 heads of 64, fp32
REUSE_BLOCKS = {"block": 64, "top_k": 16, "window": 1, "sinks": 1}  # the reuse form's defaults
SEED = 0


@dataclass(frozen=True)
class OpCase:
    """One benchmarked call: which op, causal or not, and how its cost grows with N (for estimates)."""

    name: str  # "sdpa", "linear", "window", "decay", "reuse"
    causal: bool
    module: str  # import path; a missing module skips the case with a note
    exponent: int  # time ∝ N**exponent, used only to extrapolate skipped sizes
    params: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.name}/{'causal' if self.causal else 'full'}"


CASES = (
    OpCase("sdpa", False, "torch.nn.functional", 2),
    OpCase("sdpa", True, "torch.nn.functional", 2),
    OpCase("linear", False, "attnopt.forms.linear.reference", 1, {"feature_map": "elu"}),
    OpCase("linear", True, "attnopt.forms.linear.reference", 1, {"feature_map": "elu"}),
    OpCase("window", True, "attnopt.forms.window.reference", 1, {"window": 256, "sinks": 4}),
    OpCase("decay", True, "attnopt.forms.ssm.reference", 1, {"decay": None}),  # None: RetNet γ_h = 1 − 2^(−5−h)
    OpCase("reuse", False, "attnopt.forms.reuse.reference", 1, REUSE_BLOCKS),
    OpCase("reuse", True, "attnopt.forms.reuse.reference", 1, REUSE_BLOCKS),
    # The gated ops (causal by construction), gates as the forms make them: logsigmoid(·)/16-sized.
    OpCase("gla", True, "attnopt.forms.gla.reference", 1, {"gate": "channel", "feature_map": "elu"}),
    OpCase("gla_head", True, "attnopt.forms.gla.reference", 1, {"gate": "head", "feature_map": "elu"}),
    OpCase("delta", True, "attnopt.forms.delta.reference", 1, {}),
    OpCase("gla_window", True, "attnopt.forms.gla_window.reference", 1, {"window": 64, "gate": "channel"}),
    # Gated delta's algorithmic choices (issue 39), run as the op's plain body
    # (delta.reference.gated_delta_chunked): the earlier chunk of 64, and the blocked intra-chunk solve.
    # "delta" above is the op as compiled models call it (chunk 128 since these rows measured it faster).
    OpCase("delta_c64", True, "attnopt.forms.delta.reference", 1, {"chunk_size": 64, "solve_block": 0}),
    OpCase("delta_blocked", True, "attnopt.forms.delta.reference", 1, {"chunk_size": 128, "solve_block": 32}),
)
GATED_OPS = ("gla", "gla_head", "delta", "gla_window", "delta_c64", "delta_blocked")
# A busy neighbour as issue 39 describes it: a torch matmul loop at torch's default threads.
BUSY_LOOP = "import torch\na = torch.randn(2000, 2000)\nwhile 1:\n    a @ a"


# ---------------------------------------------------------------------------------------------
# worker: one (op, causal, N) in its own process
# ---------------------------------------------------------------------------------------------


def _build_call(case: OpCase, N: int):
    """Inputs (seeded) and a zero-argument callable running the op once; imports only this op's module."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    scale = D**-0.5
    if case.name == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, scale=scale)
    mod = importlib.import_module(case.module)
    if case.name == "linear":
        fn = mod.linear_attention
        return lambda: fn(q, k, v, feature_map=case.params["feature_map"], causal=case.causal, scale=scale)
    if case.name == "window":
        fn = mod.window_attention
        return lambda: fn(q, k, v, window=case.params["window"], causal=case.causal, sinks=case.params["sinks"], scale=scale)
    if case.name == "decay":
        fn = mod.decay_attention  # causal by construction: no causal flag
        return lambda: fn(q, k, v, decay=case.params["decay"], scale=scale)
    if case.name in GATED_OPS:
        return _gated_call(mod, case, q, k, v, g)
    if case.name == "reuse":  # the block-sparse op over lists an anchor (random here) selected
        from attnopt.forms.reuse.selection import BlockRule, select_call

        p = case.params
        rule = BlockRule(block=p["block"], top_k=p["top_k"], window=p["window"], sinks=p["sinks"], probes=p["block"],
                         causal=case.causal)
        anchor_q, anchor_k = (torch.randn(B, H, N, D, generator=g) for _ in range(2))
        blocks = select_call(anchor_q, anchor_k, None, rule, scale, None)[0].blocks_BQK
        return lambda: mod.block_sparse_attention(q, k, v, blocks, block=rule.block, causal=case.causal, scale=scale)
    raise ValueError(f"unknown op case {case.name!r}")


def _gated_call(mod, case: OpCase, q, k, v, g):
    """A gated op with gates of the size the forms build (logsigmoid(x)/16 <= 0), elu features."""
    import torch
    import torch.nn.functional as F

    per_channel = case.params.get("gate", "head") == "channel"
    gates = F.logsigmoid(torch.randn(k.shape if per_channel else k.shape[:3], generator=g)) / 16
    if case.name.startswith("delta"):
        beta = torch.sigmoid(torch.randn(k.shape[:3], generator=g))
        kn = F.normalize(k, dim=-1)
        if case.params:
            return lambda: mod.gated_delta_chunked(q, kn, v, gates, beta, **case.params)
        return lambda: mod.gated_delta_attention(q, kn, v, gates, beta)
    if case.name == "gla_window":
        return lambda: mod.gla_window_attention(q, k, v, F.elu(q) + 1, F.elu(k) + 1, gates,
                                                window=case.params["window"])
    return lambda: mod.gated_linear_attention(q, k, v, gates, feature_map=case.params["feature_map"], normalize=True)


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def _worker(spec: dict) -> dict:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    case = OpCase(**spec["case"])
    try:
        # A first call at a tiny N triggers the lazy imports and op registrations (~150 MB of RSS for
        # a custom op), so the baseline below already holds them and the delta is the op's own memory.
        with torch.no_grad():
            _build_call(case, 64)()
        call = _build_call(case, spec["N"])
    except (ImportError, AttributeError) as err:
        return {"status": "missing", "note": f"{case.module}: {type(err).__name__}: {err}"}
    rss_inputs = _maxrss_mb()
    times = []
    with torch.no_grad():
        call()  # warm-up at the real size: allocator growth, thread-pool start
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            out = call()
            times.append(time.perf_counter() - t0)
            del out
    return {
        "status": "measured",
        "seconds": statistics.median(times),
        "seconds_all": times,
        "peak_rss_delta_mb": max(0.0, _maxrss_mb() - rss_inputs),
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _hardware(threads: Optional[int]) -> dict:
    import torch

    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": threads or torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _repeats_for(N: int, repeats: int) -> int:
    """Fewer repeats where one call takes long: up to 3 at 16k, up to 2 at 32k and beyond."""
    if N >= 32768:
        return max(1, min(repeats, 2))
    if N >= 16384:
        return max(1, min(repeats, 3))
    return max(1, repeats)


def _run_worker(case: OpCase, N: int, repeats: int, threads: Optional[int], timeout: float) -> dict:
    spec = {"case": asdict(case), "N": N, "repeats": repeats, "threads": threads}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"timed out after {timeout:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"status": "error", "note": f"worker exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def _estimate(history: dict, case: OpCase, N: int) -> Optional[tuple[float, int]]:
    """Seconds at N extrapolated from the largest smaller N measured for this case (t ∝ N^exponent)."""
    measured = [(n, r["seconds"]) for n, r in history.get(case.key, {}).items() if r["status"] == "measured" and n < N]
    if not measured:
        return None
    n0, t0 = max(measured)
    return t0 * (N / n0) ** case.exponent, n0


def run(sizes, repeats, threads, max_seconds, timeout, only) -> dict:
    history: dict[str, dict[int, dict]] = {}
    missing: dict[str, str] = {}
    results = []
    cases = [c for c in CASES if not only or c.name in only]
    if only and "sdpa" not in only:
        cases = [c for c in CASES if c.name == "sdpa"] + cases  # the ratio needs the baseline
    for N in sizes:
        reps = _repeats_for(N, repeats)
        for case in cases:
            if case.name in missing:
                continue
            est = _estimate(history, case, N)
            if est is not None and est[0] > max_seconds:
                rec = {"status": "estimated", "seconds": est[0], "peak_rss_delta_mb": None,
                       "note": f"not run: ~{est[0]:.3g} s per call extrapolated as N^{case.exponent} from N={est[1]}"}
            else:
                print(f"  running {case.key:14s} N={N:6d} repeats={reps}", file=sys.stderr, flush=True)
                rec = _run_worker(case, N, reps, threads, timeout)
            if rec["status"] == "missing":
                missing[case.name] = rec["note"]
                continue
            history.setdefault(case.key, {})[N] = rec
            results.append({"op": case.name, "causal": case.causal, "N": N, "params": case.params, **rec})
    by_key = {(r["op"], r["causal"], r["N"]): r for r in results}
    for r in results:
        base = by_key.get(("sdpa", r["causal"], r["N"]))
        ok = base is not None and base.get("seconds") and r.get("seconds")
        r["sdpa_seconds"] = base.get("seconds") if base else None
        r["ratio_sdpa_over_op"] = base["seconds"] / r["seconds"] if ok else None
        r["ratio_estimated"] = bool(ok) and (base["status"] == "estimated" or r["status"] == "estimated")
    return {
        "benchmark": "attnopt ops vs F.scaled_dot_product_attention, CPU",
        "hardware": _hardware(threads),
        "config": {
            "B": B, "H": H, "D": D, "dtype": "float32", "sizes": list(sizes), "repeats": repeats,
            "repeats_rule": "median of min(repeats, 3) at N>=16384 and min(repeats, 2) at N>=32768, after one warm-up",
            "max_seconds": max_seconds, "reuse_blocks": REUSE_BLOCKS, "seed": SEED,
            "ratio": "sdpa_seconds / op_seconds, both from this run, same causal flag and N",
            "memory": "peak RSS (ru_maxrss) after the runs minus after building inputs, fresh process per row",
        },
        "skipped_ops": [{"op": k, "note": v} for k, v in missing.items()],
        "results": results,
    }


def run_beside_busy(n_busy: int, warm: float, *args) -> dict:
    """`run(*args)` with n_busy BUSY_LOOP processes running beside it (started `warm` seconds before);
    every row is tagged with the count, and the SDPA ratio is taken within the pass."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdout=subprocess.DEVNULL) for _ in range(n_busy)]
    try:
        if procs:
            time.sleep(warm)
        load = list(os.getloadavg())
        report = run(*args)
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
    for r in report["results"]:
        r["busy_processes"] = n_busy
    report["load_average"] = load
    return report


def gated_summary(results: list, N: int) -> list:
    """SDPA causal seconds / gated op seconds at N, per op and busy count (the >= 4x regression check)."""
    rows = [r for r in results if r["N"] == N and r["op"] in GATED_OPS and r.get("ratio_sdpa_over_op")]
    return [{"op": r["op"], "params": r["params"], "busy_processes": r["busy_processes"], "N": N,
             "sdpa_over_op": round(r["ratio_sdpa_over_op"], 2), "at_least_4x": r["ratio_sdpa_over_op"] >= 4.0}
            for r in rows]


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(report: dict) -> None:
    hw = report["hardware"]
    print(f"\n{hw['cpu_model']} · {hw['torch_threads']} threads · torch {hw['torch_version']}")
    print(f"{'busy':>4} {'N':>6}  {'op':<18} {'mask':<6} {'seconds':>10} {'sdpa s':>10} {'sdpa/op':>8}{'':4}{'peak MB':>9}  note")
    for r in sorted(report["results"], key=lambda r: (r.get("busy_processes", 0), r["N"], r["causal"], r["op"] != "sdpa", r["op"])):
        est = " est" if r.get("ratio_estimated") else ""
        note = r.get("note", "") if r["status"] != "measured" else ""
        print(
            f"{r.get('busy_processes', 0):>4} {r['N']:>6}  {r['op']:<18} {'causal' if r['causal'] else 'full':<6} "
            f"{_fmt(r.get('seconds'), '10.4f')} "
            f"{_fmt(r.get('sdpa_seconds'), '10.4f')} {_fmt(r.get('ratio_sdpa_over_op'), '8.2f')}{est:<4}"
            f"{_fmt(r.get('peak_rss_delta_mb'), '9.1f')}  {note}"
        )
    for s in report["skipped_ops"]:
        print(f"skipped {s['op']}: {s['note']}")


def plot(report: dict, path: Path) -> Optional[str]:
    """Seconds per call against N (log-log), one line per (op, mask, busy processes), as a PNG; matplotlib is optional:
    without it no file is written and the reason is returned."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is not installed ({exc})"
    lines: dict = {}
    for r in report["results"]:
        if r["status"] == "measured" and r.get("seconds"):
            busy = f", {r['busy_processes']} busy" if r.get("busy_processes") else ""
            lines.setdefault(f"{r['op']} ({'causal' if r['causal'] else 'full'}{busy})", []).append((r["N"], r["seconds"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([n for n, _ in pts], [t * 1e3 for _, t in pts], marker="o",
                linestyle="--" if label.startswith("sdpa") else "-", label=label)
    hw = report["hardware"]
    ax.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="ms per call (median)",
           title=f"attnopt ops vs SDPA, CPU ({hw['torch_threads']} threads), B=1 H={H} D={D} fp32")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--sizes must be comma-separated integers like 1024,4096; got {text!r}")
    if not sizes or any(n < 1 for n in sizes):
        raise SystemExit(f"--sizes needs at least one positive integer; got {text!r}")
    return sorted(set(sizes))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated N (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per row after one warm-up (fewer at 16k/32k)")
    p.add_argument("--out", default=None, help="JSON report path instead of results/ops_cpu/<machine>.json")
    p.add_argument("--quick", action="store_true", help="sizes 1024,2048 and 1 repeat: a smoke run")
    p.add_argument("--threads", type=int, default=None, help="torch threads in each worker (default: torch's)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="skip (and estimate) a row whose extrapolated seconds per call exceed this (default %(default)s)")
    p.add_argument("--timeout", type=float, default=3600.0, help="kill a worker after this many seconds")
    p.add_argument("--ops", default="",
                   help="comma-separated subset of: " + ",".join(dict.fromkeys(c.name for c in CASES)))
    p.add_argument("--plot", default=None, help="also write a PNG of ms per call against N here (needs matplotlib)")
    p.add_argument("--busy", default="0", help="comma-separated counts of busy processes (the issue-39 torch matmul "
                                                "loop) beside the whole run, one pass per count, e.g. 0,2")
    p.add_argument("--warm", type=float, default=5.0, help="seconds busy processes run before a pass starts")
    p.add_argument("--busy-ops", default="", help="comma-separated ops of the passes with busy processes (default: "
                                                  "--ops); SDPA is always run, as every ratio needs it")
    p.add_argument("--result", default=None, metavar="NAME",
                   help="write through resultfile as benchmarks/results/NAME/<machine>.json (default without "
                        "--out: ops_cpu)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    only = {s.strip() for s in args.ops.split(",") if s.strip()}
    unknown = only - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"--ops: unknown {sorted(unknown)}; choose from {','.join(sorted({c.name for c in CASES}))}")
    busy_only = {s.strip() for s in args.busy_ops.split(",") if s.strip()} or only
    unknown = busy_only - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"--busy-ops: unknown {sorted(unknown)}; choose from {','.join(sorted({c.name for c in CASES}))}")
    sizes = [1024, 2048] if args.quick else _parse_sizes(args.sizes)
    repeats = 1 if args.quick else args.repeats
    try:
        phases = [int(x) for x in args.busy.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--busy must be comma-separated counts like 0,2; got {args.busy!r}")
    if not phases or any(n < 0 for n in phases):
        raise SystemExit(f"--busy needs counts >= 0 like 0,2; got {args.busy!r}")
    report = None
    for n_busy in phases:
        phase = run_beside_busy(n_busy, args.warm, sizes, repeats, args.threads, args.max_seconds, args.timeout,
                                busy_only if n_busy else only)
        if report is None:
            report = {**phase, "results": [], "phases": []}
        report["results"] += phase["results"]
        report["phases"].append({"busy_processes": n_busy, "load_average": phase["load_average"]})
    report["gated_at_largest_n"] = gated_summary(report["results"], max(sizes))
    if args.result or args.out is None:
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
        from resultfile import write_result

        out = write_result(args.result or "ops_cpu", report)
    else:
        out = Path(args.out)
        if not out.is_absolute():
            out = REPO_ROOT / out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nwrote {out}")
    if args.plot:
        why = plot(report, Path(args.plot))
        print(why or f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
