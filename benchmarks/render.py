"""Write every generated table of the README and the docs from its source, so none can drift.

    python benchmarks/render.py           # rewrite the generated blocks
    python benchmarks/render.py --check   # exit 1 naming each block that differs (tests/docs runs this)

A generated block sits between `<!-- NAME -->` and `<!-- /NAME -->` in a Markdown file; everything
outside the markers is hand-written. The sources:

* benchmark results: `benchmarks/results/<benchmark>/<machine>.json` (one current file per benchmark
  and machine, written by `resultfile.write_result`), judged against `benchmarks/goals.yaml`;
* the forms registry (`attnopt.forms`): the policy table, each form's parameters, the compatibility
  matrix's capability columns;
* `docs/compat_tests.yaml` (which tests cover which cell) and `docs/compat_gaps.yaml` (why a cell is a gap);
* the CLI's own help text (typer/click).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from resultfile import current_results  # noqa: E402

GOALS = ROOT / "benchmarks" / "goals.yaml"
COMPAT_TESTS = ROOT / "docs" / "compat_tests.yaml"
COMPAT_GAPS = ROOT / "docs" / "compat_gaps.yaml"
DECODE_FORMS = ("linear", "ssm", "window:64+sinks:4")

# Every benchmark script, the command that makes its current result, and how long that takes on the
# 2-core CPU VM: the benchmarks page lists those without a current result as "to re-run".
SCRIPTS: dict[str, tuple[str, str]] = {
    "decode_cpu": ("python benchmarks/decode_cpu.py --dispatch auto --rounds 40 --threads 1 --no-growth",
                   "about 15 minutes (14 on 2026-12-05)"),
    "decode_cpu_2threads": ("python benchmarks/decode_cpu.py --dispatch auto --rounds 40 --threads 2 "
                            "--contexts 256 8192 --no-growth", "about 5 minutes"),
    "e2e_cpu": ("python benchmarks/e2e_cpu.py --threads 2", "about 30 minutes (N = 256 … 32k)"),
    "onnx_cpu": ("python benchmarks/onnx_cpu.py", "about 15 minutes; the exact file needs 13 GB at 8k"),
    "onnx_decode_cpu": ("python benchmarks/onnx_decode_cpu.py", "about 30 minutes (contexts 1k … 16k)"),
    "compile_cpu": ("python benchmarks/compile_cpu.py", "about 3 minutes"),
    "compile_dispatch_cpu": ("python benchmarks/compile_dispatch_cpu.py --profile", "about 5 minutes"),
    "calibrate_torchrun": ("torchrun --standalone --nproc_per_node=2 benchmarks/calibrate_torchrun.py",
                           "about 10 minutes"),
    "dispatch_under_load": ("python benchmarks/dispatch_under_load.py", "about 6 minutes"),
    "profile_linear_prefill": ("python benchmarks/profile_linear_prefill.py --chunks 32,64 --repeats 15 --no-sdpa",
                               "about 2 minutes"),
    "gpu": ("python benchmarks/gpu.py", "under 6 minutes, on a CUDA machine only"),
    # Scripts whose owners move them to resultfile.py in this round; their durations are their docstrings' words.
    "ops_cpu": ("python benchmarks/ops_cpu.py --repeats 3 --threads 2 --busy 0,2 --busy-ops gla,gla_head,delta,"
                "gla_window,delta_c64,delta_blocked", "about 40 minutes"),
    "fidelity": ("python benchmarks/fidelity.py --threads 1", "about an hour (its last MiniLM calibrations alone took "
                 "over 20 minutes)"),
    "gla_window_mixing": ("python benchmarks/gla_window_mixing.py", "not recorded"),
    "capability": ("python benchmarks/capability.py --policies exact,window:64+sinks:4,linear+window:64+sinks:4,"
                   "gla+window:64,linear,ssm,gla,delta,reuse --samples 2 --steps 40 --calibration-batches 8 "
                   "--perplexity-windows 8 --threads 1", "about 8 minutes (2026-12-05)"),
}


# ---------------------------------------------------------------- small formatting helpers


def fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def short(commit: Optional[str]) -> str:
    return commit[:7] if commit else "not recorded"


def commit_text(meta: dict) -> str:
    """A result's commit as the docs show it: `abc1234`, with "+ uncommitted changes" where the run's tree
    was dirty, or "commit not recorded" where the run did not record its own (meta.commit_note)."""
    if meta.get("commit_note") or meta.get("adopted_from") or not meta.get("commit"):
        added = f" (added to the repository at `{short(meta['commit'])}`)" if meta.get("commit") else ""
        return f"commit not recorded{added}"
    return f"commit `{short(meta['commit'])}`" + (" + uncommitted changes" if meta.get("dirty") else "")


def table(head: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def provenance(result: dict) -> str:
    """One line naming what produced a result: machine, commit, date, command, fingerprint."""
    m = result.get("meta", {})
    fp = m.get("fingerprint")
    fingerprint = ("not recorded" if not fp else
                   f"Python loop {fp.get('python_loop_ns_per_iter')} ns/iter, small op {fp.get('small_op_us')} µs, "
                   f"sgemm {fp.get('sgemm_512_gflops')} GFLOP/s, {fp.get('torch_threads')} torch threads")
    command_note = " (rebuilt from the settings it records)" if m.get("adopted_from") else ""
    return (f"Machine `{m.get('machine')}`, {commit_text(m)}, "
            f"{str(m.get('date', ''))[:10]}. Command{command_note}: `{m.get('command')}`. "
            f"Fingerprint: {fingerprint}.")


# ---------------------------------------------------------------- reading results


def decode_ratio(result: dict, n: int, variant: str, paired: bool = False) -> Optional[float]:
    """A variant's per-token time ÷ the baseline's at context n (best rounds, or the paired median).
    The baseline is the faster original (appending cache or HF's DynamicCache) where the run had both."""
    row = result.get("contexts", {}).get(str(n), {}).get(variant)
    if row is None:
        return None
    against = "baseline" if "speedup_vs_baseline" in row else "original"
    key = f"speedup_vs_{against}_paired_median" if paired else f"speedup_vs_{against}"
    return 1 / row[key] if row.get(key) else None


def ceiling_name(row: dict) -> Optional[str]:
    return next((k for k in row if k.startswith("ceiling")), None)


def e2e_row(result: dict, n: int) -> Optional[dict]:
    return next((r for r in result.get("rows", []) if r["N"] == n), None)


def onnx_row(result: dict, n: int) -> Optional[dict]:
    return next((r for r in result.get("rows", []) if r["N"] == n), None)


def fidelity_rows(result: dict, model: str) -> list[dict]:
    for m in result.get("models", []):
        if m.get("model") == model:
            return m.get("rows", [])
    return []


def fidelity_ratio(result: dict, policy: str) -> Optional[float]:
    rows = fidelity_rows(result, "tiny_lm")
    base = next((r["perplexity"] for r in rows if r.get("policy") == "original"), None)
    row = next((r for r in rows if r.get("policy") == policy), None)
    if not base or row is None:
        return None
    after = (row.get("after") or row.get("before") or {}).get("perplexity")
    return after / base if after else None


# ---------------------------------------------------------------- goals


def _decode_time_ratio_8k(r):
    return [(v, decode_ratio(r, 8192, v)) for v in DECODE_FORMS]


def _decode_growth(r):
    out = []
    for v in DECODE_FORMS:
        a, b = (r.get("contexts", {}).get(str(n), {}).get(v) for n in (8192, 256))
        out.append((v, a["ms_per_token"] / b["ms_per_token"] if a and b else None))
    return out


def _decode_speed_256(r):
    row = r.get("contexts", {}).get("256", {})
    return [(v, x.get("speedup_vs_baseline", x["speedup_vs_original"])) for v, x in row.items()
            if v != "original" and not v.startswith(("ceiling", "original,"))]


def _e2e(n, variant, key):
    def metric(r):
        row = e2e_row(r, n)
        return [(variant, row[key].get(variant) if row else None)]
    return metric


# benchmarks/e2e_cpu.py's default policies: the "every policy" of the short-length goal.
E2E_POLICIES = ("linear", "window:256+sinks:4", "ssm", "hybrid", "linear+window:64+sinks:4")


def _e2e_short(r):
    """Each (policy, N) of the goal the run measured, then one entry per length naming what it did not."""
    out = []
    for n in (256, 1024):
        row = e2e_row(r, n)
        measured = [v for v in (row["speedup"] if row else {}) if v not in ("original", "ceiling")]
        out += [(f"{v} at {n}", row["speedup"][v]) for v in measured]
        missing = [v for v in E2E_POLICIES if v not in measured]
        if missing:
            out.append((f"{'every policy' if not measured else ', '.join(missing)} at {n}", None))
    return out


def _onnx(key):
    def metric(r):
        row = onnx_row(r, 8192)
        s = row["seconds"] if row else {}
        if not s:
            return [("linear", None)]
        a, b = key
        return [("linear", s[a] / s[b])]
    return metric


def _ort_decode(key_a, var_a, key_b, var_b):
    def metric(r):
        row = r.get("contexts", {}).get("8192")
        if not row:
            return [("linear", None)]
        return [("linear", row[var_a][key_a] / row[var_b][key_b])]
    return metric


def _fidelity(policies):
    return lambda r: [(p, fidelity_ratio(r, p)) for p in policies]


def _ops_gated(r):
    out = []
    for row in r.get("results", []):
        if row.get("op") in ("gla", "gla_head", "delta") and row.get("N") == 16384 and row.get("causal", True) \
                and not row.get("busy_processes"):
            out.append((row["op"], row.get("ratio_sdpa_over_op")))
    return out or [("gla / delta", None)]


METRICS: dict[str, Callable[[dict], list]] = {
    "decode_time_ratio_8k": _decode_time_ratio_8k,
    "decode_growth_8k_over_256": _decode_growth,
    "decode_speed_256": _decode_speed_256,
    "e2e_linear_speedup_16k": _e2e(16384, "linear", "speedup"),
    "e2e_linear_of_ceiling_16k": _e2e(16384, "linear", "of_ceiling"),
    "e2e_hybrid_speedup_16k": _e2e(16384, "hybrid", "speedup"),
    "e2e_short_speedups": _e2e_short,
    "onnx_linear_over_exact_8k": _onnx(("ort_exact", "ort_linear")),
    "onnx_linear_ort_over_torch_8k": _onnx(("ort_linear", "torch_linear")),
    "ort_decode_linear_over_exact_8k": _ort_decode("ort_ms", "linear", "ort_ms", "exact"),
    "ort_decode_linear_over_torch_8k": _ort_decode("ort_ms", "linear", "torch_ms", "linear"),
    "ort_prefill_linear_over_torch_8k": _ort_decode("ort_prefill_s", "linear", "torch_prefill_s", "linear"),
    "ort_prefill_exact_over_linear_8k": _ort_decode("ort_prefill_s", "exact", "ort_prefill_s", "linear"),
    "fidelity_ppl_ratio_gla_window": _fidelity(["gla+window:64"]),
    "fidelity_ppl_ratio_gla_delta": _fidelity(["gla", "delta"]),
    "ops_gated_speedup_16k": _ops_gated,
}


def load_goals() -> list[dict]:
    goals = yaml.safe_load(GOALS.read_text())["goals"]
    for g in goals:
        if g["metric"] not in METRICS:
            raise ValueError(f"goals.yaml: goal {g['id']!r} names metric {g['metric']!r}, which render.py does not have")
        if not re.fullmatch(r"(<=|>=) [0-9.]+", g["bound"]):
            raise ValueError(f"goals.yaml: goal {g['id']!r} has bound {g['bound']!r}; write '<= x' or '>= x'")
        if not g.get("source", {}).get("issue") or not g["source"].get("quote"):
            raise ValueError(f"goals.yaml: goal {g['id']!r} needs a source with an issue and a quote")
    return goals


def bound_text(bound: str) -> str:
    return bound.replace("<=", "≤").replace(">=", "≥")


def judge(bound: str, value: Optional[float]) -> Optional[bool]:
    if value is None:
        return None
    op, x = bound.split()
    return value <= float(x) if op == "<=" else value >= float(x)


def verdict(goal: dict, result: Optional[dict]) -> str:
    """'met' / 'missed' with the values, or 'no current result'."""
    if result is None:
        return "no current result"
    values = METRICS[goal["metric"]](result)
    judged = [(name, v, judge(goal["bound"], v)) for name, v in values]
    if all(ok is None for _, _, ok in judged):
        return "not in the current result"
    cells = ", ".join(f"{name} {fmt(v)}" for name, v, _ in judged if v is not None)
    unmeasured = "; ".join(name for name, _, ok in judged if ok is None)
    rest = f"; not measured: {unmeasured}" if unmeasured else ""
    if all(ok for _, _, ok in judged if ok is not None):
        return f"**met** ({cells}){rest}" if not unmeasured else f"**met where measured** ({cells}){rest}"
    missed = ", ".join(name for name, _, ok in judged if ok is False)
    return f"**missed** by {missed} ({cells}){rest}"


def goals_block(results: dict) -> str:
    rows = []
    for g in load_goals():
        for bench in g["benchmarks"]:
            for machine, result in sorted(results.get(bench, {}).items()) or [(None, None)]:
                rows.append([g["what"], bound_text(g["bound"]),
                             f"`{bench}`" + (f" on `{machine}`" if machine else ""), verdict(g, result),
                             f"issue {g['source']['issue']}: “{g['source']['quote']}”"])
    return table(["goal", "bound", "benchmark", "current result", "source"], rows)


# ---------------------------------------------------------------- benchmark tables


def decode_table(r: dict) -> str:
    ns = list(r["contexts"])
    names = list(r["contexts"][ns[0]])
    rows = []
    for name in names:
        cells = []
        for n in ns:
            x = decode_ratio(r, int(n), name)
            p = decode_ratio(r, int(n), name, paired=True)
            cells.append(f"{fmt(x)} ({fmt(p)})")
        rows.append([f"`{name}`"] + cells + [f"{r['contexts'][ns[-1]][name]['state_bytes'] / 1e6:.2f} MB"])
    baselines = r.get("baselines")
    if baselines:
        rows.append(["baseline, ms per token (best)"]
                    + [f"{r['contexts'][n][baselines[n]]['ms_per_token']:.2f}" for n in ns] + [""])
        rows.append(["baseline"] + [baselines[n] for n in ns] + [""])
        head = ["time ÷ baseline's: best (paired median)"] + [f"{int(n):,}" for n in ns] + [f"state at {int(ns[-1]):,}"]
        caveat = ("The baseline at each context is the faster original: with transformers' DynamicCache, which "
                  "copies its whole K/V cache every token (`torch.cat`), or with appending layers "
                  "(`attnopt.hf.cache.append_layers`); both originals' rows are in the table.")
    else:
        rows.append(["original, ms per token (best)"]
                    + [f"{r['contexts'][n]['original']['ms_per_token']:.2f}" for n in ns] + [""])
        head = ["time ÷ original's: best (paired median)"] + [f"{int(n):,}" for n in ns] + [f"state at {int(ns[-1]):,}"]
        caveat = ("The original decodes with transformers' default DynamicCache, which copies its whole K/V cache "
                  "every token (`torch.cat`); with appending layers (`attnopt.hf.cache.append_layers`) the same "
                  "original is faster at long contexts (the `reuse_cpu` decode rows on this page measure by how much), "
                  "so these ratios are against HF's default cache, not the strongest KV baseline.")
    return (f"{r.get('model', '')}; {r.get('hardware', '')}. {r.get('method', '')}.\n\n" + table(head, rows)
            + "\n\n" + caveat)


def e2e_table(r: dict) -> str:
    rows = r["rows"]
    variants = list(rows[0]["seconds"])
    head = ["N", "original s"] + [f"`{v}` speed-up" if v != "ceiling" else "ceiling speed-up" for v in variants[1:]]
    head += ["`linear` of the ceiling"] if "linear" in variants else []
    body = []
    for row in rows:
        cells = [f"{row['N']:,}", fmt(row["seconds"]["original"])]
        cells += [f"{row['speedup'][v]:.2f}×" for v in variants[1:]]
        if "linear" in variants:
            cells.append(f"{row['of_ceiling']['linear']:.3f}")
        body.append(cells)
    medians = []
    for row in rows:
        med = {v: statistics.median(ts) for v, ts in row["seconds_all"].items()}
        medians.append([f"{row['N']:,}", fmt(med["original"])] + [f"{med['original'] / med[v]:.2f}×" for v in variants[1:]]
                       + ([f"{med['ceiling'] / med['linear']:.3f}"] if "linear" in variants else []))
    m = r.get("model", {})
    model = (f"Llama-style decoder, {m.get('num_hidden_layers')} layers, hidden {m.get('hidden_size')}, "
             f"{m.get('num_attention_heads')}/{m.get('num_key_value_heads')} heads, random weights, fp32, batch 1")
    return (f"{model}; {r.get('hardware', {}).get('threads')} torch threads per worker. Best of the repeats:\n\n"
            + table(head, body) + "\n\nMedian of the same repeats:\n\n" + table(head, medians))


def onnx_table(r: dict) -> str:
    pol = r.get("policies", {})
    shared = "; the machine was shared with other work" if r.get("machine", {}).get("shared") else ""
    keys = [k for k in pol]
    head = ["N"] + [f"ORT `{pol[k]}`" for k in keys] + [f"torch `{pol[k]}`" for k in keys]
    body = []
    for row in r["rows"]:
        s = row["seconds"]
        body.append([f"{row['N']:,}"] + [f"{s.get('ort_' + k, float('nan')):.2f} s" for k in keys]
                    + [f"{s.get('torch_' + k, float('nan')):.2f} s" for k in keys])
    return (f"{r.get('model', '')}, exported at {r.get('export', {}).get('length')} tokens with "
            f"`target=\"{r.get('export', {}).get('target')}\"`; {r.get('threads')} threads, {r.get('timing')}"
            f" (best of {r.get('repeats')}){shared}.\n\n"
            + table(head, body))


def onnx_decode_table(r: dict) -> str:
    ns = list(r["contexts"])
    names = list(r["contexts"][ns[0]])
    head = ["variant"] + [f"per token {int(n):,}: ORT / torch" for n in ns] + \
           [f"prefill {int(ns[-1]):,}: ORT / torch", f"ORT state at {int(ns[-1]):,}"]
    body = []
    for name in names:
        cells = [f"{r['contexts'][n][name]['ort_ms']:.2f} / {r['contexts'][n][name]['torch_ms']:.2f} ms" for n in ns]
        last = r["contexts"][ns[-1]][name]
        cells.append(f"{last['ort_prefill_s']:.2f} / {last['torch_prefill_s']:.2f} s")
        cells.append(f"{last['state_bytes'] / 1e6:.2f} MB")
        body.append([f"`{r['policies'].get(name, name)}`"] + cells)
    return f"{r.get('model', '')}; {r.get('hardware', '')}. {r.get('method', '')}.\n\n" + table(head, body)


def compile_table(r: dict) -> str:
    body = []
    for row in r.get("minilm", []):
        body.append([f"`{row['policy']}`", f"{row['rewritten']}/{row['sites']}",
                     fmt(row.get("embedding_cosine")), fmt(row.get("embedding_cosine_held_out")),
                     flops_cell(row.get("attention_flops_ratio"))])
    return ("Real all-MiniLM-L6-v2 under the default tolerances and end-to-end budget. In-sample: compiled and "
            "measured on the four built-in 256-token passages; held out: compiled on passages 1–2, measured on 3–4 with dispatch off (the chosen forms act). "
            "Mean embedding cosine against the original:\n\n"
            + table(["policy", "sites rewritten", "cosine in-sample", "cosine held out", "attention FLOPs at 1× / 16×"],
                    body))


def flops_cell(ratios) -> str:
    """Attention FLOPs after / before at 1× and at the longest multiplier (a list, or a dict by multiplier)."""
    values = list(ratios.values()) if isinstance(ratios, dict) else list(ratios or [])
    return " / ".join(fmt(x, 2) for x in values[:1] + values[-1:]) if values else "—"


def calibrate_table(r: dict) -> str:
    after = r["per_rank_after"]
    return table(["policy", "ranks", "held-out cosine before", "after (every rank)", "largest tensor difference",
                  "seconds per rank"],
                 [[f"`{r['policy']}`", f"{r['world_size']} ({r['backend']})", fmt(r["before"]["embedding_cosine"]),
                   " / ".join(fmt(a["after"]["embedding_cosine"]) for a in after),
                   fmt(r["max_abs_tensor_difference_across_ranks"]), " / ".join(str(a["seconds"]) for a in after)]])


def dispatch_load_table(r: dict) -> str:
    body = []
    for form in r["loaded_phase"]:
        def thresholds(phase):
            return ", ".join(sorted({str(t["min_seq_len"]) for t in r[phase][form]["thresholds"]}))

        def flagged(phase):
            return "yes" if any(t.get("loaded") for t in r[phase][form]["thresholds"]) else "no"
        body.append([f"`{form}`", thresholds("loaded_phase"), flagged("loaded_phase"),
                     thresholds("quiet_phase"), flagged("quiet_phase")])
    return (f"{r.get('method', '')}. Loaded: {r.get('loaded_rule', '')}.\n\n"
            + table(["form", "thresholds under load", "flagged loaded", "thresholds once quiet", "flagged loaded"], body))


def compile_dispatch_table(r: dict) -> str:
    b = r["best_seconds"]
    return table(["dispatch off", "default, new geometry", "default, crossovers cached"],
                 [[f"{b['off']:.2f} s", f"{b['first']:.2f} s", f"{b['cached']:.2f} s"]])


def profile_prefill_table(r: dict) -> str:
    return table(["variant", "best ms"], [[f"`{k}`", f"{v * 1e3:.1f}"] for k, v in r["best_s"].items()])


def _text_name(text: str) -> str:
    """A held-out text's short name: a path's file name, else the name as given."""
    return Path(text).name if "/" in text else text


def fidelity_table(r: dict) -> str:
    """Per model and policy: held-out perplexity per byte training-free and calibrated, and the calibrated
    perplexity ÷ the original's on each held-out text (the goals' measure)."""
    parts = []
    for m in r.get("models", []):
        rows = m.get("rows", [])
        orig = next((x for x in rows if x.get("policy") == "original"), {})
        texts = list(m.get("held_out_text") or (orig.get("held_out") or {}))
        body = []
        for x in rows:
            if x.get("policy") == "original":
                body.append(["original", "—", fmt(x.get("perplexity")), "—"] + ["1"] * len(texts) + ["—"])
                continue
            held = x.get("held_out") or {}
            ratios = [fmt(held[t]["perplexity"] / orig["held_out"][t]["perplexity"])
                      if t in held and t in (orig.get("held_out") or {}) else "—" for t in texts]
            body.append([f"`{x['policy']}`", f"{x.get('rewritten')}/{x.get('sites')}",
                         fmt((x.get("before") or {}).get("perplexity")), fmt((x.get("after") or {}).get("perplexity"))]
                        + ratios + [fmt(x.get("calibration_seconds"), 4)])
        head = (["policy", "sites", f"perplexity, training-free ({_text_name(texts[0]) if texts else 'held out'})",
                 "calibrated"] + [f"calibrated ÷ original, {_text_name(t)}" for t in texts] + ["calibration s"])
        batches = m.get("held_out_batches") or {}
        parts.append(f"`{m.get('model')}` at {m.get('seq_len')} tokens, batch {m.get('batch')}: calibrated with "
                     f"`{m.get('params', r.get('params'))}` for {r.get('steps')} steps (lr {r.get('lr')}) on "
                     f"{m.get('calibration_batches')} batches; held out: "
                     + ", ".join(f"{_text_name(t)} ({batches.get(t, '?')} batches)" for t in texts)
                     + ". Perplexity per byte.\n\n" + table(head, body))
    runs = r.get("runs") or []
    notes = sorted({(x.get("commit") or {}).get("note", "") for x in runs} - {""})
    commits = sorted({short((x.get("commit") or {}).get("commit")) for x in runs})
    hw = r.get("hardware", {})
    cond = (f"{hw.get('threads')} torch thread(s) in each run, on {hw.get('cores')} cores"
            + (f"; {hw['note']}" if hw.get("note") else ""))
    if runs:
        cond += (f". Combined from {len(runs)} runs at commit {', '.join(f'`{c}`' for c in commits)}"
                 + (f" ({'; '.join(notes)})" if notes else ""))
    return "\n\n".join(parts) + f"\n\n{cond}."


def gla_window_mixing_table(r: dict) -> str:
    body = []
    for x in r.get("rows", []):
        orig = (x.get("original") or {}).get("perplexity")
        after = (x.get("after") or {}).get("perplexity")
        body.append([x.get("variant", ""), f"`{x.get('policy')}`", fmt((x.get("before") or {}).get("perplexity"), 4),
                     fmt(after, 4), fmt(orig, 4), f"{after / orig:.4f}" if after and orig else "—",
                     fmt((x.get("after") or {}).get("logits_rel_rms")), fmt(x.get("calibration_seconds"), 4)])
    return (f"The tiny LM, calibrated with `{r.get('params')}` for {r.get('steps')} steps on "
            f"{r.get('calibration_texts')} texts, torch threads {r.get('threads')}; held out: {r.get('held_out')} "
            f"({r.get('held_out_texts')} texts). Perplexity per byte.\n\n"
            + table(["variant", "policy", "perplexity training-free", "calibrated", "original",
                     "calibrated ÷ original", "logits relative RMS, calibrated", "calibration s"], body))


def ops_cpu_table(r: dict) -> str:
    """SDPA's time ÷ each op's at each N (same causal flag), quiet and with busy processes beside it."""
    rows = [x for x in r.get("results", []) if x.get("op") != "sdpa"]
    ns = sorted({x["N"] for x in rows})
    cfg, hw = r.get("config", {}), r.get("hardware", {})

    def cell(x):
        if not x or x.get("ratio_sdpa_over_op") is None:
            return "—" if not x else x.get("status", "—")
        return f"{x['ratio_sdpa_over_op']:.2f}" + (" (estimated)" if x.get("ratio_estimated") else "")

    parts = [f"B {cfg.get('B')}, H {cfg.get('H')}, D {cfg.get('D')}, {cfg.get('dtype')}, "
             f"{hw.get('torch_threads')} torch threads on {hw.get('cpu_count')} cores; {cfg.get('repeats_rule')}. "
             "Each cell: SDPA's time ÷ the op's (above 1: the op is faster), same N and causal flag."]
    for busy in sorted({x.get("busy_processes", 0) for x in rows}):
        keys = []
        for x in rows:
            k = (x["op"], x.get("causal", True), json.dumps(x.get("params", {}), sort_keys=True))
            if x.get("busy_processes", 0) == busy and k not in keys:
                keys.append(k)
        body = []
        for op, causal, params in keys:
            by_n = {x["N"]: x for x in rows if (x["op"], x.get("causal", True),
                                                 json.dumps(x.get("params", {}), sort_keys=True)) == (op, causal, params)
                    and x.get("busy_processes", 0) == busy}
            p = {k: v for k, v in json.loads(params).items() if v is not None}
            label = f"`{op}`" + (" causal" if causal else " non-causal") + \
                (f" ({', '.join(f'{k} {v}' for k, v in p.items())})" if p else "")
            body.append([label] + [cell(by_n.get(n)) for n in ns])
        title = ("Quiet" if not busy else f"With {busy} busy processes beside it")
        parts.append(f"{title}:\n\n" + table(["op"] + [f"{n:,}" for n in ns], body))
    return "\n\n".join(parts)


def head_hybrid_table(r: dict) -> str:
    """Per model: each variant's exact share, retrieval and quality against the original, K/V kept, decode time;
    then the run's checks."""
    parts = []
    st = r.get("settings", {})
    for name, m in (r.get("models") or {}).items():
        variants = m.get("variants") or {}
        encoder = m.get("kind") == "encoder"
        body = []
        for label, v in variants.items():
            kv = (v.get("kv") or {}).get("measured_ratio")
            row = [label, f"`{v.get('policy')}`", f"{v.get('exact_share', 0):.3f}", fmt(v.get("probe_ratio"))]
            if encoder:
                row += [fmt(v.get("cosine"), 4)]
            else:
                row += [fmt(v.get("exact_match_ratio")), fmt(v.get("perplexity_ratio"), 4), fmt(kv),
                        f"{v['decode_ms']:.2f} ({v['decode_ratio']:.2f}×)" if v.get("decode_ms") else "—"]
            row.append(fmt(v.get("compile_seconds")))
            body.append(row)
        head = ["variant", "policy", "exact share", "probe accuracy ÷ original's"]
        head += (["embedding cosine to the original"] if encoder else
                 ["exact match ÷ original's", "held-out perplexity ÷ original's", "decode K/V ÷ original's",
                  f"decode ms per token at {(m.get('decode_time') or {}).get('context', '?')} (÷ original's)"])
        head.append("compile s")
        orig = m.get("original") or {}
        if encoder:
            base = f"original: fact retrieval {fmt(orig.get('probe'))}"
            what = m.get("measure", "")
        else:
            dt = m.get("decode_time") or {}
            base = (f"original: teacher-forced probe accuracy {fmt((orig.get('probes') or {}).get('teacher_forced'))}, "
                    f"exact match {fmt((orig.get('probes') or {}).get('exact_match'))}, perplexity "
                    f"{fmt(orig.get('perplexity'), 4)}, decode {fmt(((dt.get('ms') or {}).get('original')))} ms per token "
                    f"({dt.get('steps')} steps, best of {dt.get('rounds')} rounds)")
            what = f"probes: {m.get('probe_rows')} rows; held out: {m.get('held_out_text')}"
        parts.append(f"`{m.get('model')}` ({m.get('kind')}, {m.get('layers')} layers × {m.get('kv_heads_per_layer')} "
                     f"KV heads, at {m.get('context')} tokens), form `{m.get('form')}`, window {m.get('window')}; "
                     f"{what}; {base}.\n\n" + table(head, body))
        checks = m.get("checks") or []
        if checks:
            parts.append(table(["check", "value", "bound", "verdict"],
                               [[c["check"].replace("max |Δ logit|", "largest absolute logit difference"), fmt(c["value"], 4) if isinstance(c["value"], float) else str(c["value"]),
                                str(c["bound"]).replace("<=", "≤").replace(">=", "≥"), "met" if c.get("met") else "missed"]
                                for c in checks]))
    comp = st.get("compile") or {}
    parts.append(f"{st.get('threads')} torch threads; compile with dispatch {comp.get('dispatch')}, tolerance "
                 f"{comp.get('tolerance')}, end-to-end budget {comp.get('e2e_tolerance') or 'none'}; "
                 f"{st.get('samples_per_cell')} samples per probe cell.")
    return "\n\n".join(parts)


def compile_under_load_table(r: dict) -> str:
    """Compile's wall time quiet and with busy processes beside it (the busy loop's code stays in the file)."""
    body = []
    for x in r.get("rows", []):
        q, b = x.get("quiet") or {}, x.get("busy") or {}
        body.append([f"`{x.get('case')}`", f"{q.get('rewritten')}/{q.get('sites')}", f"{q.get('wall_s')} s",
                     f"{b.get('wall_s')} s", f"{x.get('busy_over_quiet')}×", f"{q.get('others_cores')} / {b.get('others_cores')}",
                     "met" if x.get("quiet_within_goal") and x.get("busy_within_goal") else "missed"])
    g = r.get("goals", {})
    return (f"`attnopt.compile` on {r.get('example')}, dispatch {r.get('dispatch')}, {r.get('threads')} threads; busy: "
            f"{r.get('busy_processes')} other processes each running the matrix-multiply loop the result file records "
            f"(`busy_loop`), after {r.get('warm_s')} s of warm-up. Goals: quiet ≤ {g.get('quiet_wall_s_at_most')} s, "
            f"busy ÷ quiet ≤ {g.get('busy_over_quiet_at_most')}.\n\n"
            + table(["case", "sites rewritten", "quiet wall", "busy wall", "busy ÷ quiet",
                     "other work's cores, quiet / busy", "goals"], body))


def generic_table(r: dict) -> str:
    scalars = [(k, v) for k, v in r.items() if k != "meta" and isinstance(v, (int, float, str)) and len(str(v)) < 120]
    return table(["field", "value"], [[k, str(v)] for k, v in scalars]) if scalars else "(no scalar fields)"


def capability_table(r: dict) -> str:
    """Per policy and variant: held-out perplexity (and its ratio to the original's), then each probe's
    teacher-forced accuracy, exact match of greedy generate() in brackets."""
    probes = ("passkey", "needle", "multikey", "mqar", "copy")
    base = next((row["training_free_headline"] for row in r.get("rows", []) if row["policy"] == "original"), None)
    rows = []
    for row in r.get("rows", []):
        for variant in ("training_free", "calibrated"):
            h = row.get(f"{variant}_headline")
            if not h:
                continue
            ppl = h.get("perplexity")
            ratio = f" ({ppl / base['perplexity']:.3f}×)" if ppl and base and base.get("perplexity") else ""
            rows.append([f"`{row['policy']}`", variant.replace("_", "-"),
                         f"{row['rewritten']}/{row['sites']}" if "sites" in row else "—", f"{fmt(ppl)}{ratio}",
                         *[f"{h.get(p + '_teacher_forced', 0):.0%} ({h.get(p, 0):.0%})" for p in probes]])
    note = (f"`{r.get('model', 'recall_lm')}` at {', '.join(map(str, r.get('lengths', [])))} tokens, depths "
            f"{', '.join(f'{d:g}' for d in r.get('depths', []))}, {r.get('samples_per_cell')} rows per cell; "
            f"perplexity on {r.get('perplexity_text', 'held-out text')}. Each probe: teacher-forced token accuracy "
            "(exact match of greedy `generate()` in brackets).")
    return note + "\n\n" + table(["policy", "variant", "sites", "perplexity", *probes], rows)


RENDERERS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "capability": ("What recall_lm can still retrieve, per policy", capability_table),
    "decode_cpu": ("Per-token decoding, one torch thread", decode_table),
    "decode_cpu_2threads": ("Per-token decoding, two torch threads", decode_table),
    "e2e_cpu": ("End to end: a Llama-style decoder's forward", e2e_table),
    "onnx_cpu": ("ONNX Runtime forward against torch", onnx_table),
    "onnx_decode_cpu": ("Decoding in ONNX Runtime against torch generate()", onnx_decode_table),
    "compile_cpu": ("Compile on real MiniLM: sites kept and embedding cosine", compile_table),
    "calibrate_torchrun": ("Calibration across processes (torchrun)", calibrate_table),
    "dispatch_under_load": ("Dispatch thresholds measured under load", dispatch_load_table),
    "compile_dispatch_cpu": ("Compile time with the default dispatch", compile_dispatch_table),
    "profile_linear_prefill": ("Causal linear prefill, one layer at 16k", profile_prefill_table),
    "fidelity": ("Held-out perplexity of the tiny LM, training-free and calibrated", fidelity_table),
    "gla_window_mixing": ("gla+window: how its two halves mix, calibrated", gla_window_mixing_table),
    "ops_cpu": ("Each op against SDPA, one layer", ops_cpu_table),
    "reuse_cpu": ("reuse: op, end to end, decoding, quality, dispatch, ONNX",
                  lambda r: reuse_cpu_block(r["meta"].get("machine"), r)),
    "head_hybrid": ("Per-head hybrids: exact heads chosen by keep:recall", head_hybrid_table),
    "compile_under_load": ("Compile time quiet and under load", compile_under_load_table),
}


def results_block(results: dict) -> str:
    parts = []
    for bench in sorted(results):
        title, render = RENDERERS.get(bench, (bench, generic_table))
        for machine, r in sorted(results[bench].items()):
            parts.append(f"### {title} (`{bench}`, `{machine}`)\n\n{provenance(r)}\n\n{render(r)}")
    missing = [b for b in SCRIPTS if b not in results]
    if missing:
        parts.append("### To re-run (no current result)\n\n" + table(
            ["benchmark", "command", "duration on the 2-core CPU VM"],
            [[f"`{b}`", f"`{SCRIPTS[b][0]}`", SCRIPTS[b][1]] for b in missing]))
    return "\n\n".join(parts)


# ---------------------------------------------------------------- the README headline


@dataclass
class Headline:
    what: str
    value: Callable[[dict], Optional[str]]
    benchmark: str
    goal: Optional[str] = None


def _decode_headline(r):
    vals = [decode_ratio(r, 8192, v) for v in DECODE_FORMS]
    ceiling = ceiling_name(r.get("contexts", {}).get("8192", {}))
    if None in vals or ceiling is None:
        return None
    against = "the faster original's" if r.get("baselines") else "the original's"
    return f"{' / '.join(f'{x:.3f}' for x in vals)}× {against} time (ceiling {decode_ratio(r, 8192, ceiling):.3f})"


def _e2e_headline(r):
    row = e2e_row(r, 16384)
    if not row or "linear" not in row["speedup"]:
        return None
    return f"{row['speedup']['linear']:.2f}× the original, {row['of_ceiling']['linear']:.3f} of the ceiling"


def _onnx_headline(r):
    row = onnx_row(r, 8192)
    return None if not row else f"{row['seconds']['ort_exact'] / row['seconds']['ort_linear']:.1f}× the exact export"


def _ort_decode_headline(r):
    row = r.get("contexts", {}).get("8192")
    if not row:
        return None
    return (f"{row['linear']['ort_ms']:.2f} ms against {row['exact']['ort_ms']:.2f} ms "
            f"({row['linear']['ort_ms'] / row['exact']['ort_ms']:.2f}×)")


def _minilm_headline(r):
    row = next((x for x in r.get("minilm", []) if x["policy"] == "linear+window:64+sinks:4"), None)
    return None if not row else (f"cosine {row['embedding_cosine_held_out']:.3f} held out "
                                 f"({row['rewritten']}/{row['sites']} sites)")


HEADLINES = [
    Headline("Per-token decoding at 8k context, 1 thread: `linear` / `ssm` / `window:64+sinks:4`",
             _decode_headline, "decode_cpu", "decode-8k"),
    Headline("Per-token decoding at 8k context, 2 threads: `linear` / `ssm` / `window:64+sinks:4`",
             _decode_headline, "decode_cpu_2threads", "decode-8k"),
    Headline("Prefill end to end at 16k tokens, `linear`", _e2e_headline, "e2e_cpu", "e2e-16k-ceiling"),
    Headline("ONNX Runtime forward at 8k tokens, `linear` export", _onnx_headline, "onnx_cpu", "onnx-prefill-vs-exact"),
    Headline("ONNX Runtime decoding at 8k context, `linear` per token", _ort_decode_headline, "onnx_decode_cpu",
             "ort-decode-vs-exact"),
    Headline("Real MiniLM, `linear+window:64+sinks:4`, training-free", _minilm_headline, "compile_cpu"),
]


def headline_block(results: dict) -> str:
    goals = {g["id"]: g for g in load_goals()}
    rows = []
    for h in HEADLINES:
        for machine, r in sorted(results.get(h.benchmark, {}).items()):
            value = h.value(r)
            if value is None:
                continue
            g = goals.get(h.goal) if h.goal else None
            goal = "—" if g is None else f"{bound_text(g['bound'])}: {verdict(g, r).split(' (')[0]}"
            m = r["meta"]
            rows.append([h.what, value, goal, f"`{machine}`, {commit_text(m)}, {str(m.get('date'))[:10]}"])
    return table(["measured", "current result", "goal", "machine, commit, date"], rows)


# ---------------------------------------------------------------- forms: parameters and measurements


def form_of(policy: str) -> Optional[str]:
    """The form a single-rule preset spells under today's registry; None for recipes and stale presets."""
    from attnopt.ir.errors import PolicyError
    from attnopt.policy.presets import parse_preset

    try:
        rules = parse_preset(policy).get("rules") or ()
    except PolicyError:
        return None
    return rules[0].form if len(rules) == 1 else None


def params_block(form) -> str:
    rows = []
    for key, p in form.params.items():
        short_keys = [s for s, full in form.preset_keys.items() if full == key]
        extra = ("; the preset's `:arg`" if form.preset_arg == key else "") + \
                (f"; preset key `{short_keys[0]}`" if short_keys else "")
        allowed = (", ".join(f"`{c}`" for c in p.choices) if p.choices else
                   " ".join(x for x in (f"≥ {p.minimum}" if p.minimum is not None else "",
                                        f"> {p.above}" if p.above is not None else "",
                                        f"≤ {p.maximum}" if p.maximum is not None else "") if x) or "—")
        rows.append([f"`{key}`", f"`{p.default!r}`", allowed, p.doc + extra])
    presets = ", ".join(f"`{p}`" for p in form.presets) or f"`{form.name}`"
    return (f"Presets: {presets}. Default site tolerance {form.default_tolerance}.\n\n"
            + (table(["parameter", "default", "allowed", "meaning"], rows) if rows else "No parameters."))


def measured_block(name: str, results: dict) -> str:
    parts = []

    def each(bench):
        return sorted(results.get(bench, {}).items())

    for machine, r in each("compile_cpu"):
        rows = [[f"`{x['policy']}`", f"{x['rewritten']}/{x['sites']}", fmt(x.get("embedding_cosine")),
                 fmt(x.get("embedding_cosine_held_out"))] for x in r.get("minilm", []) if form_of(x["policy"]) == name]
        if rows:
            parts.append("Quality on real MiniLM, training-free, default budget "
                         f"(`compile_cpu`, `{machine}`, {commit_text(r['meta'])}):\n\n"
                         + table(["policy", "sites kept", "cosine in-sample", "cosine held out"], rows))
    for bench in ("decode_cpu", "decode_cpu_2threads"):
        for machine, r in each(bench):
            variants = [v for v in r["contexts"][next(iter(r["contexts"]))] if form_of(v) == name]
            rows = [[f"`{v}`"] + [f"{fmt(decode_ratio(r, int(n), v))}" for n in r["contexts"]] for v in variants]
            if rows:
                against = ("the baseline's (the faster original: HF's DynamicCache or appending layers)"
                           if r.get("baselines") else "the original's (HF's DynamicCache)")
                parts.append(f"Per-token decode time ÷ {against}, best rounds (`{bench}`, `{machine}`, "
                             f"{commit_text(r['meta'])}):\n\n"
                             + table(["policy"] + [f"{int(n):,}" for n in r["contexts"]], rows))
    for machine, r in each("e2e_cpu"):
        variants = [v for v in r["rows"][0]["speedup"] if form_of(v) == name]
        rows = [[f"`{v}`"] + [f"{row['speedup'][v]:.2f}×" for row in r["rows"]] for v in variants]
        if rows:
            parts.append(f"End-to-end forward, speed-up over the original (`e2e_cpu`, `{machine}`, "
                         f"{commit_text(r['meta'])}):\n\n"
                         + table(["policy"] + [f"{row['N']:,}" for row in r["rows"]], rows))
    for machine, r in each("onnx_decode_cpu"):
        keys = [k for k, p in r.get("policies", {}).items() if form_of(p) == name]
        rows = [[f"`{r['policies'][k]}`"] + [f"{r['contexts'][n][k]['ort_ms']:.2f} / {r['contexts'][n][k]['torch_ms']:.2f}"
                                              for n in r["contexts"]] for k in keys]
        if rows:
            parts.append(f"Decoding, ms per token, ONNX Runtime / torch (`onnx_decode_cpu`, `{machine}`, "
                         f"{commit_text(r['meta'])}):\n\n"
                         + table(["policy"] + [f"{int(n):,}" for n in r["contexts"]], rows))
    for machine, r in each("fidelity"):
        rows = [[f"`{x['policy']}`", fmt((x.get("before") or {}).get("perplexity")),
                 fmt((x.get("after") or {}).get("perplexity"))]
                for x in fidelity_rows(r, "tiny_lm") if form_of(x.get("policy", "")) == name]
        if rows:
            parts.append(f"Held-out perplexity per byte of the tiny LM (`fidelity`, `{machine}`, "
                         f"{commit_text(r['meta'])}):\n\n"
                         + table(["policy", "training-free", "calibrated"], rows))
    if name == "reuse":
        parts += [reuse_cpu_block(machine, r) for machine, r in each("reuse_cpu")]
    if not parts:
        return "No current result measures this form yet (see [Benchmarks](../benchmarks.md))."
    return "\n\n".join(parts)


def reuse_cpu_block(machine: str, r: dict) -> str:
    """benchmarks/reuse_cpu.py's sections, each with its goal from the reuse issue (losses included)."""
    head = (f"`reuse_cpu`, `{machine}`, {commit_text(r['meta'])}, 2 threads unless a row says "
            "otherwise, best of interleaved rounds")
    sections = [name for name in ("op", "e2e", "decode", "decode_1thread", "quality", "minilm", "dispatch", "onnx")
                if r.get(name)]
    by = {name: (r[name].get("measured_by") or {}).get("commit") for name in sections}
    dirty = {name: (r[name].get("measured_by") or {}).get("dirty") for name in sections}
    earlier = sorted({c for c in by.values() if c and c != r["meta"].get("commit")})
    for c in earlier:
        names = [n for n, x in by.items() if x == c]
        head += (f"; sections {', '.join(names)} measured at commit `{short(c)}`"
                 + (" + uncommitted changes" if any(dirty[n] for n in names) else ""))
    # Sections measured on different VMs of the machine type (a run records one fingerprint): each group
    # with its fingerprint, so no ratio is read against a VM it was not measured on.
    keys = ("python_loop_ns_per_iter", "small_op_us", "sgemm_512_gflops")
    groups: dict = {}
    for name in by:
        fp = (r[name].get("measured_by") or {}).get("fingerprint") or r["meta"].get("fingerprint") or {}
        groups.setdefault(tuple(fp.get(k) for k in keys), []).append(name)
    if len(groups) > 1:
        head += "; on different VMs: " + "; ".join(
            f"sections {', '.join(names)} with Python loop {loop} ns/iter, small op {op} µs, sgemm {gemm} GFLOP/s"
            for (loop, op, gemm), names in groups.items())
    head += ":"
    rows = []
    for n, row in (r.get("op") or {}).get("lengths", {}).items():
        ratio = row["vs_sdpa"]["reuse_op"]["best"]
        rows.append([f"op at {int(n):,} (one layer, top_k {row['top_k']} of 64-token blocks, "
                     f"{row['key_share']:.3g} of the keys) ÷ SDPA causal", f"{ratio:.2f}×", "≤ 0.5×",
                     "met" if ratio <= 0.5 else "missed"])
        with_sel = row["vs_sdpa"].get("reuse_op_with_selection")
        if with_sel:
            rows.append([f"op + its own selection at {int(n):,} ÷ SDPA causal", f"{with_sel['best']:.2f}×", "—", "—"])
    for n, row in (r.get("e2e") or {}).get("lengths", {}).items():
        sp = row["speedup"]["best"]
        rows.append([f"end to end at {int(n):,}, `{r['e2e']['policy']}` (8 layers, hidden 512), speed-up",
                     f"{sp:.2f}×", "≥ 1.3×", "met" if sp >= 1.3 else "missed"])
    for dec in (r.get("decode"), r.get("decode_1thread")):
        if not dec:
            continue
        vs = dec.get("vs_baseline") or dec["vs_original"]
        base = dec.get("baseline", "original")
        ratio = vs[dec["policy"]]["best"]
        threads = dec.get("threads", 2)

        def both(x):  # best of the rounds, and their median
            return f"{x['best']:.2f}× (median {x['median']:.2f}×)"
        rows.append([f"decode per token at {dec['context']:,}, {threads} thread{'s' if threads > 1 else ''}, "
                     f"`{dec['policy']}` (8 layers, hidden 128) ÷ the original's ({base})", both(vs[dec["policy"]]),
                     "≤ 0.8×", "met" if ratio <= 0.8 else "missed"])
        if base != "original" and "original" in vs:
            rows.append(["the original with HF's DynamicCache (torch.cat per token) ÷ that baseline",
                         both(vs["original"]), "—", "—"])
        ceiling = next((k for k in vs if k.startswith("ceiling")), None)
        if ceiling:
            rows.append(["the same, with the reused layers' attention free", both(vs[ceiling]), "physical ceiling", "—"])
        general = next((k for k in vs if "general path" in k), None)
        if general:
            rows.append(["the same, every token through the attention function's general path (no decoding hot path)",
                         both(vs[general]), "—", "—"])
        noise = next((k for k in dec["vs_original"] if "noise" in k), None)
        if noise:  # both with the DynamicCache
            rows.append(["the original's deep copy ÷ the original (noise)", both(dec["vs_original"][noise]), "—", "—"])
        padded = dec.get("padded_batch")
        if padded:
            rows.append([f"the same, a batch of {padded['batch']} with the second row left-padded by "
                         f"{padded['leading_pads'][-1]} ({padded['rounds']} rounds) ÷ the original's ({padded['baseline']})",
                         both(padded["vs_baseline"][dec["policy"]]), "—", "—"])
    for policy, row in ((r.get("quality") or {}).get("policies") or {}).items():
        ppl, hid = row.get("perplexity_ratio"), (row.get("hidden_probe_ratio") or {}).get("overall")
        reused = sum(f == "reuse" for f in row["forms"])
        share = row.get("key_share", {}).get("2048")
        ok = ppl is not None and hid is not None and ppl <= 1.01 and hid >= 0.95
        rows.append([f"recall_lm at 2048, `{policy}` ({reused} of {len(row['forms'])} layers reused, "
                     f"{fmt(share)} of the keys): held-out perplexity ratio / hidden probes ratio",
                     f"{fmt(ppl, 4)} / {fmt(hid)}", "≤ 1.01 / ≥ 0.95", "met" if ok else "missed"])
    for policy, row in ((r.get("minilm") or {}).get("policies") or {}).items():
        c = row["held_out_cosine_mean"]
        reused = sum(f == "reuse" for f in row["forms"])
        rows.append([f"MiniLM at 512 tokens, `{policy}` ({reused} of {len(row['forms'])} layers reused, "
                     f"{row['key_share']:.3g} of the keys), held-out cosine", f"{c:.4f}", "≥ 0.98",
                     "met" if c >= 0.98 and reused else ("reads every key" if not reused or row["key_share"] >= 1
                                                         else "missed")])
    disp = r.get("dispatch")
    if disp:
        T = disp["threshold"]["min_seq_len"]
        for n, row in disp["lengths"].items():
            vs = row["vs_original"]
            rows.append([f"forward time at {int(n):,}, `{disp['policy']}` (8 layers, hidden 128) ÷ the original's: the form "
                         f"at every length / with the threshold dispatch measured ({T:,})",
                         f"{vs['form_every_length']['best']:.2f}× / {vs['measured_threshold']['best']:.2f}×", "—", "—"])
            if "noise_original_copy" in vs:
                rows.append([f"the original's deep copy ÷ the original at {int(n):,} (noise)",
                             f"{vs['noise_original_copy']['best']:.2f}×", "—", "—"])
    onnx = r.get("onnx")
    for n, row in ((onnx or {}).get("lengths") or {}).items():
        vs = row["vs_exact"][onnx["policy"]]
        rows.append([f"ONNX Runtime prefill at {int(n):,}, `{onnx['policy']}` (8 layers, hidden 128, "
                     f"{row['key_share']:.3g} of the keys) ÷ the all-exact file", f"{vs['best']:.2f}× (median "
                     f"{vs['median']:.2f}×)", "—", "—"])
        folders = row.get("folder_vs_exact_folder") or {}
        for name, x in folders.items():
            rows.append([f"the same through the decode folders: the prompt of {int(n):,} tokens ÷ the all-exact "
                         "folder's", f"{x['best']:.2f}× (median {x['median']:.2f}×)", "—", "—"])
    return head + "\n\n" + table(["measure", "value", "goal", "verdict"], rows)


# ---------------------------------------------------------------- compatibility matrix

COLUMNS = {
    "generate": "generate()",
    "threads": "threads",
    "save_load": "save / load",
    "onnx_prefill": "ONNX prefill",
    "onnx_decode": "ONNX decode",
    "genai": "onnxruntime-genai",
    "triton": "Triton",
    "tensorrt": "TensorRT",
}
# Columns whose code has only run against a stand-in: the Triton interpreter, a fake torch-tensorrt API.
STAND_IN = {"triton": "Triton interpreter on CPU; never run on a GPU",
            "tensorrt": "a fake torch-tensorrt API; TensorRT never run"}


def capability(form, column: str) -> Optional[bool]:
    """What the registry says of a form for a column; None where the registry has no hook for it."""
    if column == "onnx_prefill":
        return form.onnx_lowering() is not None or form.name == "exact"  # exact exports as the model would
    if column == "onnx_decode":
        return form.graph_step() is not None
    if column == "triton":
        import importlib.util

        package = type(form).__module__.rpartition(".")[0]
        return importlib.util.find_spec(f"{package}.triton") is not None
    if column == "tensorrt":
        return form.onnx_lowering() is not None  # a plugin is generated from the form's custom op
    return None


@dataclass
class Cell:
    form: str
    column: str
    status: str  # "yes" | "stand-in" | "gap"
    tests: list
    reason: Optional[str]


def compat_cells() -> list[Cell]:
    from attnopt import forms

    tests = yaml.safe_load(COMPAT_TESTS.read_text()) or {}
    gaps = yaml.safe_load(COMPAT_GAPS.read_text()) or {}
    cells = []
    for name, form in forms.registry().items():
        for column in COLUMNS:
            listed = list((tests.get(name) or {}).get(column) or [])
            reason = (gaps.get(name) or {}).get(column)
            able = capability(form, column)
            ok = bool(listed) and able is not False
            status = ("stand-in" if column in STAND_IN else "yes") if ok else "gap"
            cells.append(Cell(name, column, status, listed, reason))
    return cells


def compat_problems() -> list[str]:
    """What makes the matrix untrue: a gap without a reason, a reason on a covered cell, a test that
    does not exist or does not name the form, a form or column the data files invent."""
    from attnopt import forms

    problems = []
    for cell in compat_cells():
        where = f"{cell.form} × {cell.column}"
        if cell.status == "gap" and not cell.reason:
            problems.append(f"{where}: a gap with no reason in docs/compat_gaps.yaml")
        if cell.status != "gap" and cell.reason:
            problems.append(f"{where}: covered by tests, yet docs/compat_gaps.yaml gives a reason; remove it")
        if cell.tests and cell.status == "gap":
            problems.append(f"{where}: docs/compat_tests.yaml lists tests, yet the forms registry says the form has "
                            "no such capability; remove them")
        for test in cell.tests:
            problems += [f"{where}: {p}" for p in check_test(test, cell.form)]
    for path in (COMPAT_TESTS, COMPAT_GAPS):
        data = yaml.safe_load(path.read_text()) or {}
        for name, cols in data.items():
            if name not in forms.registry():
                problems.append(f"{path.name}: {name!r} is not a registered form")
            for column in cols or {}:
                if column not in COLUMNS:
                    problems.append(f"{path.name}: {name} has column {column!r}; columns are {', '.join(COLUMNS)}")
    return problems


def check_test(node_id: str, form: str) -> list[str]:
    """A test id `tests/path.py::test_name` exists and its file names the form."""
    path, _, func = node_id.partition("::")
    file = ROOT / path
    if not file.is_file():
        return [f"{node_id}: no such test file"]
    src = file.read_text()
    names = {n.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)}
    if func not in names:
        return [f"{node_id}: no such test function"]
    spelled = {form, form.replace("+", "_")}
    if "every_form" not in func and not any(s in src for s in spelled):
        return [f"{node_id}: the test file never names the form {form!r}"]
    return []


def compat_block() -> str:
    from attnopt import forms

    cells = {(c.form, c.column): c for c in compat_cells()}
    notes: list[str] = []
    body = []
    for name in forms.registry():
        row = [f"[`{name}`](forms/{name.replace('+', '_')}.md)"]
        for column in COLUMNS:
            c = cells[(name, column)]
            if c.status == "gap":
                notes.append(f"{name} × {COLUMNS[column]}: {c.reason}")
                row.append(f"❌ [{len(notes)}]")
            else:
                row.append("🔶" if c.status == "stand-in" else "✅")
        body.append(row)
    legend = ("✅ tested here on CPU · 🔶 the code path exists and is tested against a stand-in "
              f"({'; '.join(f'{COLUMNS[k]}: {v}' for k, v in STAND_IN.items())}) · ❌ a gap, its reason below.")
    gaps = "\n".join(f"{i}. {n}" for i, n in enumerate(notes, 1))
    tests = "\n".join(f"- {name} × {COLUMNS[col]}: " + ", ".join(f"`{t}`" for t in c.tests)
                      for (name, col), c in cells.items() if c.tests and c.status != "gap")
    return (table(["form"] + list(COLUMNS.values()), body) + f"\n\n{legend}\n\n**Gaps.**\n\n{gaps}\n\n"
            f"<details><summary>Which test covers each ✅ and 🔶</summary>\n\n{tests}\n\n</details>")


# ---------------------------------------------------------------- CLI reference


def cli_block() -> str:
    """Each command's `--help` as the CLI prints it, at a fixed width and without colour."""
    import typer
    from typer.testing import CliRunner

    from attnopt.cli import app

    env = {"COLUMNS": "100", "TERMINAL_WIDTH": "100", "NO_COLOR": "1", "TERM": "dumb"}

    def help_of(args: list) -> str:
        result = CliRunner().invoke(app, [*args, "--help"], env=env, prog_name="attnopt")
        if result.exit_code != 0:
            raise RuntimeError(f"attnopt {' '.join(args)} --help exited {result.exit_code}: {result.output[-500:]}")
        return "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines()).strip("\n")

    group = typer.main.get_command(app)
    parts = [f"### `attnopt`\n\n```text\n{help_of([])}\n```"]
    for name in sorted(group.commands):
        if not group.commands[name].hidden:
            parts.append(f"### `attnopt {name}`\n\n```text\n{help_of([name])}\n```")
    return "\n\n".join(parts)


# ---------------------------------------------------------------- writing the blocks


QUICKSTART = ROOT / "examples" / "quickstart.py"


def quickstart_block() -> str:
    """examples/quickstart.py as a Python block (GitHub shows no snippet includes), less its
    snippet section markers."""
    lines = [line for line in QUICKSTART.read_text(encoding="utf-8").splitlines() if "--8<--" not in line]
    return "```python\n" + "\n".join(lines) + "\n```"


def policy_block() -> str:
    from attnopt.policy.presets import policy_reference

    return policy_reference()


def capability_block(results: dict) -> str:
    """The capability audit's table for the evaluation guide, with its provenance and a link to its heatmap page."""
    found = results.get("capability") or {}
    if not found:
        return "No current result: run `python benchmarks/capability.py`."
    parts = []
    for machine, r in sorted(found.items()):
        # benchmarks/mkdocs_hooks.py puts each machine's page into the site as assets/capability-<machine>.html
        page = ROOT / "benchmarks" / "results" / "capability" / f"{machine}.html"
        link = (f"\n\nThe depth × length heatmaps of every probe, each policy beside the original: "
                f"[capability-{machine}.html](../assets/capability-{machine}.html).") if page.is_file() else ""
        parts.append(f"{provenance(r)}\n\n{capability_table(r)}{link}")
    return "\n\n".join(parts)


def head_hybrid_block(results: dict) -> str:
    """benchmarks/head_hybrid.py's current result for the per-head guide, with its provenance."""
    found = results.get("head_hybrid") or {}
    if not found:
        return "No current result: run `python benchmarks/head_hybrid.py --threads 2`."
    return "\n\n".join(f"`head_hybrid` on `{machine}`. {provenance(r)}\n\n{head_hybrid_table(r)}"
                         for machine, r in sorted(found.items()))


def blocks() -> dict[Path, dict[str, str]]:
    """{file: {block name: body}} of everything generated."""
    from attnopt import forms

    results = current_results()
    out: dict[Path, dict[str, str]] = {
        ROOT / "README.md": {"headline": headline_block(results), "policy-table": policy_block(),
                             "quickstart": quickstart_block()},
        ROOT / "docs" / "index.md": {"headline": headline_block(results)},
        ROOT / "docs" / "guides" / "policies.md": {"policy-table": policy_block()},
        ROOT / "docs" / "benchmarks.md": {"headline": headline_block(results), "goals": goals_block(results),
                                          "results": results_block(results)},
        ROOT / "docs" / "compatibility.md": {"compat-matrix": compat_block()},
        ROOT / "docs" / "reference" / "cli.md": {"cli-help": cli_block()},
        ROOT / "docs" / "guides" / "evaluation.md": {"capability": capability_block(results)},
        ROOT / "docs" / "guides" / "per-head.md": {"head-hybrid": head_hybrid_block(results)},
    }
    for name, form in forms.registry().items():
        out[ROOT / "docs" / "forms" / f"{name.replace('+', '_')}.md"] = {
            "form-params": params_block(form), "form-measured": measured_block(name, results)}
    return out


def fill(text: str, name: str, body: str, path: Path) -> str:
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    if start not in text or end not in text:
        raise ValueError(f"{path.relative_to(ROOT)}: no {start} … {end} markers for the generated block {name!r}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def rendered() -> dict[Path, str]:
    """{file: its full text with every generated block as the sources make it now}."""
    out = {}
    for path, named in blocks().items():
        if not path.is_file():
            raise ValueError(f"{path.relative_to(ROOT)} is missing: it holds generated blocks {', '.join(named)}")
        text = path.read_text(encoding="utf-8")
        for name, body in named.items():
            text = fill(text, name, body, path)
        out[path] = text
    return out


def stale() -> list[str]:
    """The files whose generated blocks differ from what the sources make now."""
    return [str(p.relative_to(ROOT)) for p, text in rendered().items() if p.read_text(encoding="utf-8") != text]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file that differs")
    args = ap.parse_args(argv)
    if args.check:
        differ = stale()
        for path in differ:
            print(f"{path}: a generated block differs from its source; run `python benchmarks/render.py`")
        return 1 if differ else 0
    for path, text in rendered().items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print("wrote", path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
