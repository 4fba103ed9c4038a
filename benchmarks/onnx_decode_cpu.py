"""Decoding outside PyTorch: per-token time and prefill of the decode folders in ONNX Runtime, against
torch generate() of the same rewrite, at contexts 1k / 4k / 8k / 16k.

Workload: a random-weight Llama-style decoder (4 layers, hidden 256, 8 query / 2 kv heads, head dim
32, vocab 1024; only speed and memory mean something), compiled as `exact` (the original attention:
K/V through GroupQueryAttention), `linear`, `ssm`, `window:256+sinks:4` and `linear+window:64+sinks:4`,
each exported with `attnopt.export_onnx(..., decode=True)` (checked against torch as always). At
every context N each variant is prefilled once with N tokens: in ORT in chunks of `--chunk` tokens
(timed: "ORT chunked prefill") and in one call (timed), and in torch by one forward (timed); then,
in rounds that take turns over the variants, ORT runs `--steps` single-token calls from the
prefilled state and torch runs generate() for `--steps` new tokens from a copy of its prefilled
cache, and the best round's mean per token is kept (interleaving spreads other processes' load over
all variants alike). State bytes are what the ORT state holds after the prefill (all layers,
batch 1). Writes JSON, a PNG plot, and the README table (with every target and whether it is met).

    python benchmarks/onnx_decode_cpu.py     # full run, 2 threads -> results/onnx_decode_cpu/<machine>.json
    python benchmarks/onnx_decode_cpu.py --quick --out /tmp/q.json   # a tiny smoke run (flagged quick)
    python benchmarks/onnx_decode_cpu.py --table benchmarks/results/onnx_decode_cpu/amd-epyc-2c.json
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from resultfile import write_result  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FULL = {"contexts": [1024, 4096, 8192, 16384], "hidden": 256, "heads": 8, "kv_heads": 2, "layers": 4,
        "vocab": 1024, "steps": 16, "rounds": 3, "chunk": 1024, "example": 256, "window": 256, "lw_window": 64}
# --quick: sizes that only show the script runs (the windows shrink so that the forms act on the example)
QUICK = {"contexts": [48, 96], "hidden": 64, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 128, "steps": 4,
         "rounds": 2, "chunk": 32, "example": 24, "window": 8, "lw_window": 8}


def policies(cfg: dict) -> dict:
    """exact is the original attention (K/V through GroupQueryAttention in ORT); linear+window skips its fit."""
    return {"exact": "exact", "linear": "linear", "ssm": "ssm", "window": f"window:{cfg['window']}+sinks:4",
            "linear+window": f"linear+window:{cfg['lw_window']}+sinks:4+fit_steps:0"}
# The targets: (what, numerator, denominator, the largest ratio that meets it, context)
TARGETS = [("ORT linear per token ≤ 0.6× ORT exact", ("ort_ms", "linear"), ("ort_ms", "exact"), 0.6, 8192),
           ("ORT linear per token ≤ 1.0× torch linear", ("ort_ms", "linear"), ("torch_ms", "linear"), 1.0, 8192),
           ("ORT linear prefill ≤ 1.25× torch linear", ("ort_prefill_s", "linear"), ("torch_prefill_s", "linear"),
            1.25, 8192),
           ("ORT linear prefill ≥ 3× faster than ORT exact", ("ort_prefill_s", "linear"), ("ort_prefill_s", "exact"),
            1 / 3, 8192)]


def build_model(cfg: dict):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["hidden"] * 8 // 3,
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=max(cfg["contexts"]) + 2 * cfg["steps"] + 8, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def export_all(model, cfg: dict, directory: Path) -> dict:
    """{name: (compiled model, DecodeExport)}: every policy compiled and exported as a decode folder."""
    import torch

    import attnopt

    ids = torch.randint(1, cfg["vocab"], (1, cfg["example"]), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, policy in policies(cfg).items():
        # random weights: keep every site rewritten (tolerance 10, no budget); dispatch off: the form everywhere
        opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids}, tolerance=10.0, e2e_tolerance=None,
                              dispatch="off")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            record = attnopt.export_onnx(opt, directory / name.replace("+", "_"), {"input_ids": ids}, decode=True)
        out[name] = (opt, record)
        print(f"exported {name}: {', '.join(sorted({s['lowering'] for s in record.sites}))}; parity "
              f"{max(p['rel_rms'] for p in record.parity):.1e}; {record.seconds:.0f} s", flush=True)
    return out


def _clock(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ort_prefill(session, ids, chunk):
    """(seconds, last logits, state) of the prompt through the graph in chunks of `chunk` (None: one call)."""
    import numpy as np

    holder = {}
    seconds = _clock(lambda: holder.update(zip(("logits", "state"), session.prefill(ids, np.ones_like(ids), chunk))))
    return seconds, holder["logits"], holder["state"]


def ort_per_token(session, state, n: int, token: int, steps: int) -> float:
    """Mean seconds of `steps` single-token calls from a prefilled state of n columns (not advanced)."""
    import numpy as np

    def run():
        s, tok = state, np.array([[token]], np.int64)
        for i in range(steps):
            mask = np.ones((1, n + i + 1), np.int64)
            logits, s = session.run(tok, mask, np.array([[n + i]], np.int64), s)
            tok = logits[:, -1].argmax(-1)[:, None]
    return _clock(run) / steps


def torch_prefilled(opt, ids):
    """A cache holding all prompt tokens but the last (generate() then feeds the last one itself)."""
    import torch
    from transformers import DynamicCache

    from attnopt.hf.cache import make_cache

    cache = make_cache(opt) if hasattr(opt, "attnopt_report") else DynamicCache(config=opt.config)
    name = "cache" if "cache" in inspect.signature(opt.forward).parameters else "past_key_values"
    with torch.no_grad():
        opt(input_ids=ids[:, :-1], use_cache=True, **{name: cache})
    return cache


def torch_per_token(opt, cache, ids, steps: int) -> float:
    """generate() of `steps` new tokens from a copy of the prefilled cache (the site modules not copied)."""
    import torch

    fresh = copy.deepcopy(cache, {id(m): m for m in opt.modules()})
    config = copy.deepcopy(opt.generation_config)
    config.update(max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _clock(lambda: opt.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=fresh,
                                           generation_config=config)) / steps


def torch_prefill(opt, ids) -> float:
    import torch

    with torch.no_grad():
        return _clock(lambda: opt(input_ids=ids, use_cache=False, logits_to_keep=1))


def measure_context(models: dict, sessions: dict, n: int, cfg: dict) -> dict:
    """One context: prefills (once per round, best kept) and per-token times, interleaved over the variants."""
    import numpy as np
    import torch

    ids_t = torch.randint(1, cfg["vocab"], (1, n), generator=torch.Generator().manual_seed(2))
    ids = ids_t.numpy()
    rows = {name: {k: float("inf") for k in ("ort_ms", "torch_ms", "ort_prefill_s", "ort_chunked_prefill_s",
                                             "torch_prefill_s")} for name in models}
    states, caches = {}, {}
    for _ in range(cfg["rounds"]):
        for name, (opt, _) in models.items():
            r = rows[name]
            t, logits, state = ort_prefill(sessions[name], ids, cfg["chunk"])
            r["ort_chunked_prefill_s"] = min(r["ort_chunked_prefill_s"], t)
            r["ort_prefill_s"] = min(r["ort_prefill_s"], ort_prefill(sessions[name], ids, None)[0])
            r["torch_prefill_s"] = min(r["torch_prefill_s"], torch_prefill(opt, ids_t))
            states.setdefault(name, (state, int(logits.argmax())))
            caches.setdefault(name, torch_prefilled(opt, ids_t))
            r["ort_ms"] = min(r["ort_ms"], 1e3 * ort_per_token(sessions[name], states[name][0], n, states[name][1],
                                                                cfg["steps"]))
            r["torch_ms"] = min(r["torch_ms"], 1e3 * torch_per_token(opt, caches[name], ids_t, cfg["steps"]))
    for name in models:
        rows[name]["state_bytes"] = int(sum(np.asarray(v).nbytes for v in states[name][0].values()))
    return rows


def targets(result) -> list:
    out = []
    for what, (num_key, num), (den_key, den), limit, n in TARGETS:
        row = result["contexts"].get(str(n))
        if row is None:
            out.append({"target": what, "context": n, "ratio": None, "met": None})
            continue
        ratio = row[num][num_key] / row[den][den_key]
        out.append({"target": what, "context": n, "ratio": ratio, "met": ratio <= limit})
    return out


def table(result) -> str:
    """The README table: ORT and torch ms per token, prefills, state; then the targets, met or lost."""
    ns = list(result["contexts"])
    lines = ["| variant | " + " | ".join(f"{int(n):,}: ORT / torch ms per token" for n in ns)
             + f" | ORT chunked prefill {int(ns[-1]):,} | ORT / torch prefill {int(ns[-1]):,} | state at "
             f"{int(ns[-1]):,} |", "|---|" + "---|" * (len(ns) + 3)]
    for name in result["contexts"][ns[0]]:
        cells = [f"{result['contexts'][n][name]['ort_ms']:.2f} / {result['contexts'][n][name]['torch_ms']:.2f}"
                 for n in ns]
        last = result["contexts"][ns[-1]][name]
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {last['ort_chunked_prefill_s']:.2f} s | "
                     f"{last['ort_prefill_s']:.2f} / {last['torch_prefill_s']:.2f} s | "
                     f"{last['state_bytes'] / 1e6:.2f} MB |")
    lines.append("")
    for t in result["targets"]:
        verdict = "not measured" if t["met"] is None else ("met" if t["met"] else "**missed (a loss)**")
        ratio = "—" if t["ratio"] is None else f"{t['ratio']:.2f}×"
        lines.append(f"- {t['target']} at {t['context']:,}: {ratio}, {verdict}")
    return "\n".join(lines)


def plot(result, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    ns = [int(n) for n in result["contexts"]]
    names = list(result["contexts"][str(ns[0])])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        rows = [result["contexts"][str(n)][name] for n in ns]
        line, = a.plot(ns, [r["ort_ms"] for r in rows], marker="o", label=f"ORT {name}")
        a.plot(ns, [r["torch_ms"] for r in rows], marker="x", ls="--", color=line.get_color(), label=f"torch {name}")
        b.plot(ns, [r["state_bytes"] / 1e6 for r in rows], marker="o", label=name)
    for ax, label in ((a, "ms per token"), (b, "decode state (MB, batch 1)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=7)
    fig.suptitle(result["model"] + (" — QUICK smoke run, not a measurement" if result["quick"] else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check that the benchmark runs")
    ap.add_argument("--contexts", type=int, nargs="*")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--chunk", type=int)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="JSON path (default: the current result file, benchmarks/results/"
                    "onnx_decode_cpu/<machine>.json; a --quick run needs --out: it measures nothing)")
    ap.add_argument("--table", metavar="JSON", help="print the README table of an earlier run and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: getattr(args, k) for k in ("contexts", "steps", "rounds", "chunk") if getattr(args, k)})
    if args.quick and not args.out:
        ap.error("--quick measures nothing worth keeping: give --out (e.g. --out /tmp/onnx_decode_cpu_quick.json)")
    result = run(cfg, args.threads, args.quick)
    out = write_result("onnx_decode_cpu", result, path=args.out)
    plot(result, out.with_suffix(".png"))
    print(table(result))
    print("wrote", out)


def run(cfg: dict, threads: int, quick: bool) -> dict:
    import onnxruntime
    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' past_key_values -> cache rename
    from attnopt.onnx import Session

    torch.set_num_threads(threads)
    model = build_model(cfg)
    with tempfile.TemporaryDirectory(prefix="onnx_decode_cpu-") as tmp:
        models = export_all(model, cfg, Path(tmp))
        sessions = {name: Session(Path(record.folder) / "model.onnx", threads=threads)
                    for name, (_, record) in models.items()}
        result = {"quick": quick, "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                  f"{threads} threads (ORT intra-op and torch)", "torch": torch.__version__,
                  "onnxruntime": onnxruntime.__version__,
                  "model": f"Llama-style, {cfg['layers']} layers, hidden {cfg['hidden']}, heads {cfg['heads']}/"
                           f"{cfg['kv_heads']}, vocab {cfg['vocab']}, random weights, batch 1, fp32",
                  "method": f"per token: mean of {cfg['steps']} steps, best of {cfg['rounds']} interleaved rounds; "
                            f"prefill: best of {cfg['rounds']}; ORT chunks of {cfg['chunk']}",
                  "policies": policies(cfg), "state_bytes_per_site": {n: r.state_bytes for n, (_, r) in models.items()},
                  "contexts": {}}
        for n in cfg["contexts"]:
            result["contexts"][str(n)] = measure_context(models, sessions, n, cfg)
            print(n, {k: f"{v['ort_ms']:.2f}/{v['torch_ms']:.2f} ms" for k, v in result["contexts"][str(n)].items()},
                  flush=True)
    result["targets"] = targets(result)
    return result


if __name__ == "__main__":
    main()
