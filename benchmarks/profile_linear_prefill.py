"""Profile and time one layer's causal linear attention at prefill against SDPA (CPU).

    python benchmarks/profile_linear_prefill.py --n 16384 --threads 2 [--profile] [--repeats 3]
    python benchmarks/profile_linear_prefill.py --no-sdpa --repeats 15 --chunks 32,64 [--feature-map hedgehog]

Inputs as one layer of benchmarks/e2e_cpu.py sees them: q [1, 8, N, 64], k/v [1, 2, N, 64] (GQA,
G = 4), fp32, transposed views of [B, N, heads, D] as HF passes them. Timed, interleaved, best of the repeats: SDPA causal (enable_gqa), the
`attnopt::linear_attention` op (elu, the `linear` policy's default map) and the whole site module
(min_seq_len 1024 as the default dispatch measures it here: the first 1024 rows run exact), up
to the [B, N, H, Dv] the attention function returns. `--chunks` adds the op at fixed chunk sizes
(the op's default picks one from the feature count: `default_chunk`).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.nn.functional as F

import attnopt
from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.forms.linear.reference import linear_attention
from attnopt.kernels.feature_maps import make_feature_map
from resultfile import write_result  # benchmarks/ is on sys.path when run as a script

B, H, HKV, D = 1, 8, 2, 64


class _Gqa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def site_module(min_seq_len: int):
    """The `linear` policy's site module for a causal GQA site of this geometry."""
    q, k = torch.randn(B, H, 64, D), torch.randn(B, HKV, 64, D)
    (site,) = attnopt.inspect(_Gqa(), q, k, k, dynamic=False).sites
    form = forms.get("linear")
    return form.build(site, form.validate({"min_seq_len": min_seq_len}), BuildContext())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-seq-len", type=int, default=1024)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of each variant")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--chunks", default="", help="also time the op at these chunk sizes, e.g. 32,64 "
                                                "(each with blocks of BLOCK_CHUNKS chunks)")
    p.add_argument("--feature-map", default=None, help="the op's map (default: the linear policy's)")
    p.add_argument("--out", default=None, help="JSON path (default: the current result file, "
                   "benchmarks/results/profile_linear_prefill/<machine>.json)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    # HF's layout: q/k/v are [B, N, heads, D] projections seen through a transpose.
    q_BHND = torch.randn(B, a.n, H, D, generator=g).transpose(1, 2)
    k_BHND, v_BHND = (torch.randn(B, a.n, HKV, D, generator=g).transpose(1, 2) for _ in range(2))
    module = site_module(a.min_seq_len)
    fmap, scale, eps = module.feature_map, module.geometry.scale, module.eps
    if a.feature_map:
        fmap = make_feature_map(a.feature_map, D, H)
    variants = {
        "sdpa": lambda: F.scaled_dot_product_attention(q_BHND, k_BHND, v_BHND, is_causal=True, enable_gqa=True),
        "op": lambda: linear_attention(q_BHND, k_BHND, v_BHND, feature_map=fmap, causal=True, scale=scale, eps=eps),
        # what the attention function hands back to HF: [B, N, H, Dv], contiguous
        "site": lambda: module(q_BHND, k_BHND, v_BHND, None).transpose(1, 2).contiguous(),
    }
    if a.no_sdpa:
        del variants["sdpa"]
    for c in (int(x) for x in a.chunks.split(",") if x):
        variants[f"op C={c}"] = functools.partial(linear_attention, q_BHND, k_BHND, v_BHND, feature_map=fmap,
                                                  causal=True, scale=scale, eps=eps, chunk_size=c)
    with torch.no_grad():
        for fn in variants.values():
            fn()
        times = {name: [] for name in variants}
        for r in range(a.repeats):
            names = list(variants)
            names = names[r % len(names):] + names[:r % len(names)]
            for name in names:
                t0 = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - t0)
        best = {name: min(ts) for name, ts in times.items()}
        for name in variants:
            print(f"{name:8s} best {best[name] * 1e3:8.1f} ms  all {[round(t * 1e3, 1) for t in times[name]]}")
        if "sdpa" in best:
            print(f"sdpa/op {best['sdpa'] / best['op']:.2f}x  sdpa/site {best['sdpa'] / best['site']:.2f}x")
        if a.profile:
            for name in ("op", "site"):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    variants[name]()
                print(f"--- {name}")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    result = {"n": a.n, "threads": a.threads, "best_s": best, "all_s": times, "load_average": load}
    print("wrote", write_result("profile_linear_prefill", result, path=a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
