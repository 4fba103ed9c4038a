"""Where a decode step's time goes: torch.profiler over single-token steps of the decode benchmark's
model (benchmarks/decode_cpu.py), per variant, the top ops by self CPU time per layer and token.

    python benchmarks/profile_decode_cpu.py --context 1024 --steps 32 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import attnopt  # noqa: E402
from decode_cpu import build_model, ceiling_model, decode_steps, prefill  # noqa: E402

POLICIES = ["linear", "ssm", "window:64+sinks:4", "linear+window:64+sinks:4"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--dispatch", default="off")
    ap.add_argument("--policies", nargs="*", default=POLICIES)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build_model(args.context)
    ids = torch.randint(1, 1000, (1, 64), generator=torch.Generator().manual_seed(1))
    models = {"original": base, "ceiling": ceiling_model(base)}
    for p in args.policies:
        models[p] = attnopt.compile(base, p, example_inputs={"input_ids": ids, "use_cache": False},
                                    e2e_tolerance=None, dispatch=args.dispatch)
    layers = base.config.num_hidden_layers
    for name, m in models.items():
        cache, tok = prefill(m, args.context)
        decode_steps(m, cache, tok, 4)  # warm-up
        t = time.perf_counter()
        decode_steps(m, cache, tok, args.steps)
        wall = (time.perf_counter() - t) / args.steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decode_steps(m, cache, tok, args.steps)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        print(f"\n== {name}: {wall * 1e3:.3f} ms per token (unprofiled), context {args.context}")
        per = args.steps * layers
        for e in events[:args.top]:
            print(f"  {e.key[:60]:60s} {e.count / args.steps:7.1f} calls/token {e.self_cpu_time_total / per:8.1f} us/layer")


if __name__ == "__main__":
    main()
