"""Dispatch thresholds measured under load, then on the quiet machine (issue 21, item 4).

Two busy processes share the cores while each form of the decode benchmark's model is compiled
against an empty crossover cache; then the busy processes stop and, once the load average has
fallen, the same compiles run again against that cache. The JSON says, per form, the thresholds
and their sources in both phases, whether the entry was flagged as loaded, and whether the site
acts at a context of 8192 (its threshold at or under it) in the model compiled under load and in
the one compiled after.

    python benchmarks/dispatch_under_load.py   # -> benchmarks/results/dispatch_under_load/<machine>.json
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode_cpu  # noqa: E402
from resultfile import write_result  # noqa: E402

import attnopt  # noqa: E402
from attnopt.passes import crossover  # noqa: E402

FORMS = ("linear", "ssm", "window:64+sinks:4")
CONTEXT = 8192


def busy(n: int) -> list:
    """n processes that spin a core each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def compile_all(base) -> dict:
    ids = torch.randint(1, 1000, (1, 64), generator=torch.Generator().manual_seed(1))
    out = {}
    for form in FORMS:
        t = time.perf_counter()
        opt = attnopt.compile(base, form, example_inputs={"input_ids": ids, "use_cache": False}, e2e_tolerance=None)
        rows = [r.threshold for r in opt.attnopt_report.sites if r.threshold is not None]
        out[form] = {"compile_s": round(time.perf_counter() - t, 2),
                     "thresholds": [{"min_seq_len": th.min_seq_len, "source": th.source, "load": th.load,
                                     "others": th.others, "loaded": th.loaded} for th in rows],
                     "acts_at_8192": all(th.min_seq_len <= CONTEXT for th in rows)}
        print(form, out[form], flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="busy processes during the first phase")
    ap.add_argument("--warm", type=float, default=150.0, help="seconds the busy processes run before the compiles")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON path (default: the current result file, "
                    "benchmarks/results/dispatch_under_load/<machine>.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ[crossover.ENV_CACHE] = str(Path(tempfile.mkdtemp()) / "crossover.json")
    base = decode_cpu.build_model(CONTEXT + 1024)
    result = {"hardware": f"{decode_cpu.cpu_name()}, {os.cpu_count()} cores, torch threads {args.threads}",
              "torch": torch.__version__, "model": decode_cpu.MODEL_TEXT,
              "method": f"{args.busy} busy processes started {args.warm:.0f} s before compiling each form against an "
                        "empty crossover cache; then stopped, and once the machine read as quiet the same compiles "
                        "ran against that cache",
              "loaded_rule": f"other work held more than {crossover.OTHERS_LOADED} cores while timing (/proc/stat less "
                             "this process), else 1-minute load average minus torch threads > "
                             f"{crossover.LOADED_SHARE} x cores"}
    procs = busy(args.busy)
    try:
        time.sleep(args.warm)
        result["load_before_loaded_phase"] = os.getloadavg()[0]
        result["loaded_phase"] = compile_all(base)
    finally:
        for p in procs:
            p.kill()
    waited = 0.0
    while crossover.is_loaded(os.getloadavg()[0]) and waited < 600:
        time.sleep(5)
        waited += 5
    result["quiet_wait_s"], result["load_before_quiet_phase"] = waited, os.getloadavg()[0]
    result["quiet_phase"] = compile_all(base)
    print("wrote", write_result("dispatch_under_load", result, path=args.out))


if __name__ == "__main__":
    main()
