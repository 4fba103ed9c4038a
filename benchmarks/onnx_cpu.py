"""ONNX Runtime CPU against torch, exact against rewritten: one Llama-style decoder exported four ways.

A random-weight Llama-style decoder from a config (speed only: its outputs mean nothing) is
compiled four times, `exact`, `linear`, `window:256+sinks:4` and `window:256`, and each is written by
`attnopt.export_onnx(target="ort")` (checked against torch as always). Then at every N the four
ORT sessions (2 intra-op threads) and the torch forwards of the same four models (2 threads) run
in turns, `--repeats` rounds after one warm-up call each, and the best time of each is kept: interleaving spreads any load
from other processes over all variants alike. Writes JSON and a PNG plot.

    python benchmarks/onnx_cpu.py            # -> benchmarks/results/onnx_cpu/<machine>.json and .png
    python benchmarks/onnx_cpu.py --sizes 512,1024 --repeats 2 --out /tmp/onnx_cpu.json   # smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from resultfile import write_result  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

DEFAULT_SIZES = (1024, 4096, 8192)
# window+sinks exports the banded form; window without sinks GroupQueryAttention (behind an If on padding)
POLICIES = {"exact": "exact", "linear": "linear", "window": "window:256+sinks:4", "window_nosinks": "window:256"}
THREADS = 2
EXPORT_LENGTH = 256


def build_model():
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def export_all(model, directory: Path) -> dict:
    """Compile and export each policy; returns {name: (compiled model, export record)}."""
    import torch

    import attnopt

    ids = torch.randint(0, 1000, (1, EXPORT_LENGTH), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, policy in POLICIES.items():
        # tolerance 10, no budget: keep every site rewritten (random weights: only speed is measured)
        opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids}, tolerance=10.0, e2e_tolerance=None)
        record = attnopt.export_onnx(opt, directory / f"{name}.onnx", {"input_ids": ids}, target="ort",
                                     baseline=False, check_lengths=[EXPORT_LENGTH, 3 * EXPORT_LENGTH // 2 + 1])
        out[name] = (opt, record)
        print(f"exported {name}: {record.ops_after.get('com.microsoft.LinearAttention', 0)} LinearAttention, "
              f"parity {[round(p['rel_rms'], 9) for p in record.parity]}, {record.seconds:.1f} s", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="JSON path (default: the current result file, "
                        "benchmarks/results/onnx_cpu/<machine>.json)")
    parser.add_argument("--shared", action="store_true", help="record that the machine was shared with other work")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    import numpy as np
    import onnxruntime as ort
    import torch

    # After OMP_NUM_THREADS is set, like torch.
    from attnopt.bench import take_turns, timed

    torch.set_num_threads(THREADS)
    model = build_model()
    with tempfile.TemporaryDirectory() as tmp:
        exported = export_all(model, Path(tmp))
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = THREADS, 1
        # Idle ORT threads spin by default and would steal the cores from the torch run that follows.
        # Without the memory plan the exact export's N×N buffers are reused instead of planned side by
        # side: with it ORT grew to ~19 GB at N = 8192 and was killed; without, 12.6 GB. (Turning the
        # arena off as well made the exact export 4× slower.) Same options for every session.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.enable_mem_pattern = False
        sessions = {name: ort.InferenceSession(rec.path, options, providers=["CPUExecutionProvider"])
                    for name, (_, rec) in exported.items()}

        rows = []
        for n in sizes:
            ids = torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(n))
            feed = {sessions["exact"].get_inputs()[0].name: ids.numpy()}
            calls = {}
            for name, sess in sessions.items():
                calls[f"ort_{name}"] = (lambda s=sess: s.run(None, feed)[0])
                opt = exported[name][0]
                calls[f"torch_{name}"] = (lambda m=opt: m(input_ids=ids, use_cache=False).logits)
            outputs = {}
            # attnopt.bench's loop: one warm-up call each (allocator, ORT's first-run planning), then
            # interleaved rounds (every variant once per round), the best time of each kept.
            # The last call's output is kept (outside the timing) to compare ORT with torch.
            runs = {key: timed(fn, keep=functools.partial(outputs.__setitem__, key)) for key, fn in calls.items()}
            with torch.no_grad():
                best = take_turns(runs, args.repeats, warmups=1).best()
            # The same rewrite in ORT and torch computes the same logits (here at N, not just at export).
            agree = {name: float(np.sqrt(np.mean((np.asarray(outputs[f"ort_{name}"]) -
                                                  outputs[f"torch_{name}"].numpy()) ** 2) /
                                         np.mean(outputs[f"torch_{name}"].numpy() ** 2))) for name in POLICIES}
            row = {"N": n, "seconds": best, "ort_vs_torch_rel_rms": agree,
                   "ort_speedup_vs_ort_exact": {k: best["ort_exact"] / best[f"ort_{k}"] for k in POLICIES},
                   "ort_over_torch": {k: best[f"ort_{k}"] / best[f"torch_{k}"] for k in POLICIES}}
            rows.append(row)
            print(json.dumps(row), flush=True)

    result = {
        "model": "LlamaForCausalLM from a config: 4 layers, hidden 256, 8 query / 2 kv heads (D 32), random weights",
        "policies": POLICIES, "export": {"target": "ort", "length": EXPORT_LENGTH,
                                         "lowerings": {k: rec.sites for k, (_, rec) in exported.items()}},
        "threads": THREADS, "repeats": args.repeats, "timing": "best of repeats, variants interleaved",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "shared": bool(args.shared)},
        "versions": {"torch": torch.__version__, "onnxruntime": ort.__version__},
        "rows": rows,
    }
    out = write_result("onnx_cpu", result, path=args.out)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = [r["N"] for r in result["rows"]]
    for key, style in (("ort_exact", "k-o"), ("ort_linear", "b-o"), ("ort_window", "g-o"), ("ort_window_nosinks", "m-o"),
                       ("torch_exact", "k--s"), ("torch_linear", "b--s"), ("torch_window", "g--s"),
                       ("torch_window_nosinks", "m--s")):
        ax.plot(ns, [r["seconds"][key] for r in result["rows"]], style, label=key.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens N")
    ax.set_ylabel("forward seconds (best of %d)" % result["repeats"])
    shared = ", shared machine" if result["machine"]["shared"] else ""
    ax.set_title(f"Llama-style decoder, CPU {result['threads']} threads{shared}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
