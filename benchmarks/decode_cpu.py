"""Per-token decode time and decode-state bytes on CPU: the original model's KV cache against each
policy's fixed-size state, at contexts 256 … 16k, in one run.

Workload: a random-weight Llama-style decoder (4 layers, hidden 128, 4 query / 2 kv heads, head dim
32; only its speed and memory mean something). For each context N every variant is prefilled with
N tokens (the ceiling is the same model with attention replaced by a zero-cost stand-in and a
cache that stores nothing: the floor any decode state could reach), afresh in every round, and
takes one step, both untimed (that step is where a site whose threshold the context reaches builds
its state, once per sequence), so every round decodes at the same context; in rounds that take
turns over the variants, each then runs `--steps` single-token decode steps through its cache
(`model(next_id, past_key_values=cache)`), and the best round's mean per step is kept (the median
round's beside it; who goes first rotates from round to round). The original decodes twice: with
transformers' DynamicCache (one `torch.cat` of the whole K/V cache per token and layer) and with
attnopt's appending layers (`attnopt.hf.cache.append_layers`); every ratio is against the faster of
the two at that context, the strongest KV baseline. An identical deep copy of the original runs as
a control: the compiled models are deep copies too, and how far it lands from the original is the
run's noise floor. State bytes are what the cache holds after
the last round's steps (all layers, batch 1).
Separately, each policy generates 512 tokens from a 16-token prompt and the cache is measured after
64 and after 512 tokens (a fixed-size state stays flat; a KV cache grows 8×).

    python benchmarks/decode_cpu.py --dispatch auto --rounds 40 --threads 1 --no-growth
        # -> benchmarks/results/decode_cpu/<machine>.json and .png (decode_cpu_2threads/ at --threads 2)
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import attnopt  # noqa: E402
from compile_cpu import cpu_name  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from resultfile import write_result  # noqa: E402
from attnopt.bench import take_turns  # noqa: E402
from attnopt.hf.cache import append_layers, decode_state_bytes, make_cache  # noqa: E402
from transformers.cache_utils import CacheLayerMixin  # noqa: E402

POLICIES = ["linear", "ssm", "window:64+sinks:4", "linear+window:64+sinks:4"]
CONTEXTS = [256, 1024, 4096, 8192, 16384]


MODEL_TEXT = "Llama-style, 4 layers, hidden 128, heads 4/2, head dim 32, random weights, batch 1, fp32"


def build_model(max_len: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len + 1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


CONTROL = "original, deep copy (noise control)"
APPENDING = "original, appending cache"
ORIGINALS = ("original", APPENDING)


def variants(base, dispatch: str = "off"):
    ids = torch.randint(1, 1000, (1, 64), generator=torch.Generator().manual_seed(1))
    example = {"input_ids": ids, "use_cache": False}
    # An identical deep copy of the original (the compiled models are deep copies too): how far two
    # equal models land apart in one run, the noise floor of every ratio.
    out = {"original": base, CONTROL: copy.deepcopy(base), APPENDING: copy.deepcopy(base)}
    out[APPENDING].appending_cache = True
    for policy in POLICIES:
        # Random weights: drift means nothing here, so every site is kept (no end-to-end budget).
        # dispatch off: the state alone (an automatic threshold T would add an exact prefix of up to T
        # tokens while the context is shorter than T).
        opt = attnopt.compile(base, policy, example_inputs=example, e2e_tolerance=None, dispatch=dispatch)
        out[policy] = opt
        print(f"compiled {policy}: {opt.attnopt_report.count('rewritten')} of 4 sites rewritten", flush=True)
    out["ceiling (zero-cost attention, no cache)"] = ceiling_model(base)
    return out


class _NullLayer(CacheLayerMixin):
    """The ceiling's cache layer: keeps nothing but the token count."""

    is_sliding = False

    def __init__(self, **kwargs):
        super().__init__()
        self.columns = 0

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.columns += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length):
        return self.columns, 0

    def get_seq_length(self):
        return self.columns

    def get_max_length(self):
        return -1


def _zero_attention(module, query, key, value, attention_mask, **kwargs):
    """Zero-cost stand-in for attention: the ceiling a perfect O(1) form could approach."""
    B, H, N, _ = query.shape
    return query.new_zeros(B, N, H, value.shape[-1]), None


def ceiling_model(base):
    import copy

    from transformers import AttentionInterface

    AttentionInterface.register("zero_cost", _zero_attention)
    model = copy.deepcopy(base)
    model.set_attn_implementation("zero_cost")
    model.is_ceiling = True
    return model


def new_cache(model):
    if hasattr(model, "attnopt_report"):
        return make_cache(model)
    from transformers import DynamicCache

    if getattr(model, "is_ceiling", False):
        from transformers import Cache

        return Cache(layers=[_NullLayer() for _ in range(model.config.num_hidden_layers)])
    cache = DynamicCache(config=model.config)
    if getattr(model, "appending_cache", False):
        append_layers(cache)
    return cache


@torch.no_grad()
def prefill(model, n: int):
    ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(2))
    cache = new_cache(model)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def decode_steps(model, cache, token, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t) / steps


def decode_at(model, n: int, steps: int, caches: dict, name: str) -> float:
    """Prefill n tokens and take one step (both untimed), then the seconds per token of `steps`
    decoding steps; the cache is kept in caches[name] for its size. The untimed step is where a site
    whose threshold the context reaches turns its kept keys into its state, once per sequence."""
    cache, token = prefill(model, n)
    with torch.no_grad():
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    seconds = decode_steps(model, cache, token, steps)
    caches[name] = cache
    return seconds


@torch.no_grad()
def growth(model) -> dict:
    """Cache bytes after 64 and after 512 generated tokens (16-token prompt, greedy)."""
    ids = torch.randint(1, 1000, (1, 16), generator=torch.Generator().manual_seed(3))
    cache = new_cache(model)
    tok = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    sizes = {}
    for i in range(1, 513):
        tok = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        if i in (64, 512):
            sizes[i] = sum(decode_state_bytes(cache).values())
    return {"after_64": sizes[64], "after_512": sizes[512],
            "ratio_512_to_64": sizes[512] / sizes[64] if sizes[64] else None}


def table(result) -> str:
    """Per-token ms (× the baseline's speed, the faster original: best rounds; paired: median of
    per-round ratios) and state MB at each context."""
    ns = list(result["contexts"])
    names = list(result["contexts"][ns[0]])
    lines = ["| variant | " + " | ".join(f"{int(n):,}" for n in ns) + f" | state at {int(ns[-1]):,} | 512 vs 64 tokens |",
             "|---|" + "---|" * (len(ns) + 2)]
    for name in names:
        cells = []
        for n in ns:
            r = result["contexts"][n][name]
            paired = r.get("speedup_vs_baseline_paired_median")
            cells.append(f"{r['ms_per_token']:.2f} ms ({r['speedup_vs_baseline']:.2f}×"
                         + ("" if paired is None else f"; paired {paired:.2f}×") + ")")
        last = result["contexts"][ns[-1]][name]["state_bytes"]
        g = result["growth"].get(name) or {}
        ratio = g.get("ratio_512_to_64")
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {last / 1e6:.2f} MB | "
                     + ("—" if ratio is None else f"{ratio:.2f}×") + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", metavar="JSON", help="print the README table of an earlier run and exit")
    ap.add_argument("--contexts", type=int, nargs="*", default=CONTEXTS)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dispatch", choices=("off", "auto"), default="auto",
                    help="off: each form's state at every length; auto: the measured thresholds (exact below them)")
    ap.add_argument("--no-growth", action="store_true", help="skip the 512-token state growth check")
    ap.add_argument("--out", default=None, help="JSON path (default: the current result file, "
                    "benchmarks/results/<benchmark>/<machine>.json)")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table(json.load(f)))
        return
    torch.set_num_threads(args.threads)
    base = build_model(max(args.contexts))
    models = variants(base, args.dispatch)
    result = {"hardware": f"{cpu_name()}, {os.cpu_count()} cores, torch threads {args.threads}",
              "torch": torch.__version__, "model": MODEL_TEXT, "method": f"per-token decode, mean of {args.steps} steps, best of "
              f"{args.rounds} interleaved rounds (who goes first rotates), each from a fresh prefill of the context; "
              "medians of the same rounds beside them, and the median of per-round ratios (paired)", "dispatch": args.dispatch, "contexts": {}, "baselines": {}, "growth": {},
              "load_average": os.getloadavg()[0]}
    for name, model in ({} if args.no_growth else models).items():
        result["growth"][name] = growth(model)
        print(f"growth {name}: {result['growth'][name]}", flush=True)
    for n in args.contexts:
        caches = {}
        # attnopt.bench's loop: rounds that take turns over the variants (who goes first rotates, so
        # no variant always follows the same one), the best round kept. Each
        # round prefills n tokens afresh (untimed), so every round decodes at the same context.
        runs = {name: functools.partial(decode_at, m, n, args.steps, caches, name) for name, m in models.items()}
        turns = take_turns(runs, args.rounds, rotate=True)
        seconds = turns.values()
        best, median = turns.best(), {k: statistics.median(v) for k, v in seconds.items()}
        row = {}
        base_name = min(ORIGINALS, key=lambda k: best[k])  # the strongest baseline at this context
        for name in models:
            # Paired: the baseline's time over this variant's in the same round, the median of the
            # rounds (a slow spell that hits one round hits both sides of its ratio).
            paired = statistics.median(o / x for o, x in zip(seconds[base_name], seconds[name]))
            row[name] = {"ms_per_token": best[name] * 1e3, "ms_per_token_median": median[name] * 1e3,
                         "state_bytes": sum(decode_state_bytes(caches[name]).values()),
                         "speedup_vs_baseline": best[base_name] / best[name],
                         "speedup_vs_baseline_median": median[base_name] / median[name],
                         "speedup_vs_baseline_paired_median": paired,
                         "speedup_vs_original": best["original"] / best[name]}
        result["contexts"][str(n)] = row
        result["baselines"][str(n)] = base_name
        print(n, {k: f"{v['ms_per_token']:.2f} ms, {v['state_bytes'] / 1e6:.2f} MB" for k, v in row.items()}, flush=True)
        del caches
    out = write_result(benchmark_name(args), result, path=args.out)
    plot(result, str(out.with_suffix(".png")))
    print("wrote", out)


def benchmark_name(args) -> str:
    """The result's benchmark: one per thread count and dispatch, since each is its own question."""
    return ("decode_cpu" + ("" if args.threads == 1 else f"_{args.threads}threads")
            + ("" if args.dispatch == "auto" else "_dispatch_off"))


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    ns = [int(n) for n in result["contexts"]]
    names = list(next(iter(result["contexts"].values())))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        a.plot(ns, [result["contexts"][str(n)][name]["ms_per_token"] for n in ns], marker="o", label=name)
        b.plot(ns, [result["contexts"][str(n)][name]["state_bytes"] / 1e6 for n in ns], marker="o", label=name)
    for ax, label in ((a, "ms per token"), (b, "decode state (MB, batch 1)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(result["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
