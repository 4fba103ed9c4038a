"""Capability of every rewrite form where it can fail: recall_lm (a byte-level decoder trained to retrieve,
benchmarks/train_recall_lm.py) before and after conversion, training-free and calibrated.

For the original and for each policy, training-free and then calibrated (`attnopt.calibrate`, forms+lora
by default), `attnopt.evaluate` measures:
  - perplexity on recall_lm's held-out text (heldout.txt: topics and modules it never trained on), by
    position, over windows of its trained context;
  - the five retrieval probes (passkey, needle, multikey, mqar, copy) at its trained context
    (train_log.json's seq_len) over five depths, scored by exact match of greedy generate() (decoding from
    each form's state) and teacher-forced; their haystacks are held-out text (passkey: its own filler).
The probes' formats are attnopt.evaluation's own, not the training data's.

Every site is rewritten (tolerance 10, no end-to-end budget, dispatch off): this measures the forms, not
compile's budget. Calibration runs on sequences of recall_lm's own training mix (train_recall_lm.Sampler:
text with recall events written in) at --calibration-length tokens, so calibrated forms see what the
model was trained on and are then audited on formats they never saw. The result is rewritten after each
policy, so a run cut short keeps what it measured.

    python benchmarks/capability.py                              # every policy below (long: hours on 2 cores)
    python benchmarks/capability.py --policies gla+window:64,linear --samples 2 --steps 50
Writes benchmarks/results/capability/<machine>.json (resultfile.py) and an HTML page of the heatmaps beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

POLICIES = [
    "exact", "window:256+sinks:4", "window:64+sinks:4", "linear", "linear:hedgehog", "linear+window:64+sinks:4",
    "ssm", "gla", "gla+window:64", "delta", "reuse", "hybrid",
]


def calibration_batches(n: int, length: int, seed: int) -> list:
    """`n` single-row batches of recall_lm's training mix (held-out topics excluded by corpus())."""
    import train_recall_lm as trl

    train_text, _ = trl.corpus()
    sampler = trl.Sampler(train_text.encode("utf-8"), seed)
    return [{"input_ids": sampler.batch(1, length)[0]} for _ in range(n)]  # (ids, induction targets)


def headline(audit: dict) -> dict:
    """The row of the table: perplexity and each probe's mean exact match / teacher-forced accuracy."""
    model = audit["model"]
    out = {"perplexity": model["perplexity"]["overall"] if model["perplexity"] else None,
           "perplexity_last_bucket": model["perplexity"]["buckets"][-1]["perplexity"] if model["perplexity"] else None,
           "decode_disagreements": model["decode_disagreements"]}
    for probe, by_length in model["retrieval"].items():
        cells = [v for row in by_length.values() for v in row.values()]
        forced = [v for row in model["teacher_forced"][probe].values() for v in row.values()]
        out[probe] = round(sum(cells) / len(cells), 4)
        out[f"{probe}_teacher_forced"] = round(sum(forced) / len(forced), 4)
    return out


def markdown(rows: list, probes: list) -> str:
    head = "| policy | variant | sites rewritten | perplexity | " + " | ".join(probes) + " |"
    lines = [head, "|" + "---|" * (4 + len(probes))]
    for r in rows:
        for variant in ("training_free", "calibrated"):
            h = r.get(f"{variant}_headline")
            if h is None:
                continue
            label = "original" if r["policy"] == "original" else variant.replace("_", "-")
            lines.append(f"| {r['policy']} | {label} | {r.get('rewritten', '-')}/{r.get('sites', '-')} | "
                         f"{h['perplexity']:.3f} | " + " | ".join(f"{100 * h[p]:.0f}%" for p in probes) + " |")
    return "\n".join(lines)


def page(reports: list) -> str:
    """Every audit's heatmaps on one page (each EvalReport's own fragment), the original first."""
    from attnopt.evaluation.html import PAGE_CSS, esc

    body = "".join(f"<h2>{esc(title)}</h2>{rep.html_fragment()}" for title, rep in reports)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>recall_lm capability</title>'
            f"<style>{PAGE_CSS}</style></head><body><main><h1>recall_lm: capability by form</h1>{body}</main></body></html>\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "data" / "recall_lm"))
    ap.add_argument("--policies", default=None, help="comma-separated; default: " + ",".join(POLICIES))
    ap.add_argument("--samples", type=int, default=4, help="probe rows per (probe, depth) cell")
    ap.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    ap.add_argument("--lengths", default=None, help="comma-separated; default: the trained context (train_log.json)")
    ap.add_argument("--perplexity-windows", type=int, default=16)
    ap.add_argument("--params", default="forms+lora", choices=("forms", "forms+lora", "none"),
                    help="what calibrate trains ('none': training-free only)")
    ap.add_argument("--steps", type=int, default=100, help="calibration steps per site")
    ap.add_argument("--calibration-batches", type=int, default=24)
    ap.add_argument("--calibration-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    import attnopt
    from attnopt.calibration import CalibrationError
    from attnopt.evaluation import evaluate
    from resultfile import result_path, write_result

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    log = json.loads((path / "train_log.json").read_text())
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path) if (path / "tokenizer.json").is_file() else None
    held = (path / "heldout.txt").read_text(encoding="utf-8")
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [log["seq_len"]]
    depths = [float(x) for x in args.depths.split(",")]
    policies = args.policies.split(",") if args.policies else POLICIES
    audit = dict(tokenizer=tokenizer, texts=held, lengths=lengths, depths=depths, samples=args.samples,
                 perplexity_windows=args.perplexity_windows)
    cal = calibration_batches(args.calibration_batches, args.calibration_length, seed=1) if args.params != "none" else []
    cal_train, cal_held = cal[: 3 * len(cal) // 4], cal[3 * len(cal) // 4 :]
    payload = {
        "model": str(path.relative_to(ROOT.parent)) if path.is_relative_to(ROOT.parent) else str(path),
        "trained_seq_len": log["seq_len"], "lengths": lengths, "depths": depths, "samples_per_cell": args.samples,
        "perplexity_text": f"{path.name}/heldout.txt ({len(held.encode('utf-8'))} bytes, never trained on), at most "
                           f"{args.perplexity_windows} windows of {max(lengths)} tokens",
        "compile": {"tolerance": 10.0, "e2e_tolerance": None, "dispatch": "off"},
        "calibration": None if args.params == "none" else {
            "params": args.params, "steps": args.steps, "train_batches": len(cal_train), "held_out_batches": len(cal_held),
            "tokens_per_batch": args.calibration_length, "data": "train_recall_lm.Sampler(seed=1): recall_lm's training "
                                                                 "mix (training text with recall events)"},
        "threads": args.threads, "load_average_start": list(os.getloadavg()), "rows": [],
    }
    reports = []

    def save() -> None:
        payload["load_average_end"] = list(os.getloadavg())
        payload["table"] = markdown(payload["rows"], list(reports[0][1].probes))
        out = write_result("capability", payload)
        result_path("capability").with_suffix(".html").write_text(page(reports), encoding="utf-8")
        print(f"wrote {out}", flush=True)

    t0 = time.perf_counter()
    original = evaluate(model, name="recall_lm (original)", **audit)
    reports.append(("original", original))
    payload["rows"].append({"policy": "original", "training_free": original.to_dict(),
                            "training_free_headline": headline(original.to_dict()),
                            "seconds": round(time.perf_counter() - t0, 1)})
    print(original.summary(), flush=True)
    save()
    for policy in policies:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        example = cal[0] if cal else {"input_ids": torch.tensor([list(held[:512].encode("utf-8"))])}
        opt = attnopt.compile(model, policy, example_inputs=example, tolerance=10.0, e2e_tolerance=None, dispatch="off")
        report = opt.attnopt_report
        row = {"policy": policy, "rewritten": report.count("rewritten"), "sites": len(report.sites),
               "compile_seconds": round(time.perf_counter() - t0, 1)}
        free = evaluate(opt, name=f"recall_lm [{policy}]", **audit)
        reports.append((f"{policy}, training-free", free))
        row.update(training_free=free.to_dict(), training_free_headline=headline(free.to_dict()))
        print(free.summary(), flush=True)
        if cal and report.count("rewritten"):
            try:
                t0 = time.perf_counter()
                attnopt.calibrate(opt, cal_train, held_out=cal_held, steps=args.steps, params=args.params,
                                  progress=False)
                row["calibration_seconds"] = round(time.perf_counter() - t0, 1)
                tuned = evaluate(opt, name=f"recall_lm [{policy}] calibrated ({args.params})", **audit)
                reports.append((f"{policy}, calibrated ({args.params})", tuned))
                row.update(calibrated=tuned.to_dict(), calibrated_headline=headline(tuned.to_dict()))
                print(tuned.summary(), flush=True)
            except CalibrationError as exc:
                row["not_calibrated"] = str(exc)
        payload["rows"].append(row)
        save()
    print(payload["table"])


if __name__ == "__main__":
    main()
