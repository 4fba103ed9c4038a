"""Compile time of a 24-layer decoder with dispatch off, default dispatch measuring, default cached.

    python benchmarks/compile_dispatch_cpu.py [--profile]   # -> results/compile_dispatch_cpu/<machine>.json

The model is benchmarks/compile_cpu.py's llama24 (random weights, 24 layers, hidden 512, 8/4
heads, N = 512 example) under the `linear` policy. "first" compiles against an empty crossover
cache (a fresh file: every geometry is timed), "cached" compiles again on the same file. Each
variant runs `--repeats` times, interleaved (best and all kept), with attnopt's per-step timings.
--profile: cProfile's top functions of one cached compile and one dispatch-off compile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import attnopt  # noqa: E402
from resultfile import write_result  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def build(layers: int, seq_len: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4 * seq_len)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, seq_len), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "use_cache": False}


def compile_once(model, inputs, policy: str, dispatch: str, cache: Path) -> dict:
    os.environ["ATTNOPT_CROSSOVER_CACHE"] = str(cache)
    t = time.perf_counter()
    opt = attnopt.compile(model, policy, example_inputs=inputs, tolerance=0.99, e2e_tolerance=None, dispatch=dispatch)
    seconds = time.perf_counter() - t
    rep = opt.attnopt_report
    sources = sorted({r.threshold.source for r in rep.sites if r.threshold is not None})
    return {"seconds": seconds, "timings": {k: round(v, 3) for k, v in rep.timings.items()}, "sources": sources}


def profile(fn, top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    return s.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--policy", default="linear")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default: the current result file, "
                   "benchmarks/results/compile_dispatch_cpu/<machine>.json)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, inputs = build(a.layers, a.seq_len)
    tmp = Path(tempfile.mkdtemp(prefix="attnopt_xover_"))
    shared = tmp / "cached.json"
    runs = {"off": [], "first": [], "cached": []}
    compile_once(model, inputs, a.policy, "auto", shared)  # warms the cache "cached" reads (and imports)
    for r in range(a.repeats):
        runs["off"].append(compile_once(model, inputs, a.policy, "off", tmp / "unused.json"))
        runs["first"].append(compile_once(model, inputs, a.policy, "auto", tmp / f"fresh{r}.json"))
        runs["cached"].append(compile_once(model, inputs, a.policy, "auto", shared))
        print({k: round(v[-1]["seconds"], 2) for k, v in runs.items()}, flush=True)
    best = {k: min(x["seconds"] for x in v) for k, v in runs.items()}
    load = os.getloadavg()
    print("best", {k: round(v, 2) for k, v in best.items()}, "load", load)
    result = {"benchmark": "attnopt.compile wall time, llama24, benchmarks/compile_dispatch_cpu.py",
              "model": {"layers": a.layers, "seq_len": a.seq_len, "heads": 8, "kv_heads": 4, "hidden": 512},
              "policy": a.policy, "threads": a.threads, "torch": torch.__version__, "best_seconds": best,
              "runs": runs, "load_average": load}
    if a.profile:
        result["profile_cached"] = profile(lambda: compile_once(model, inputs, a.policy, "auto", shared))
        result["profile_off"] = profile(lambda: compile_once(model, inputs, a.policy, "off", tmp / "unused.json"))
        print(result["profile_cached"])
        print(result["profile_off"])
    print("wrote", write_result("compile_dispatch_cpu", result, path=a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
