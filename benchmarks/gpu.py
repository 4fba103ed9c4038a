"""GPU checks and benchmarks of attnopt's Triton kernels: one script, one JSON, under 6 minutes.

How to run (on the CUDA machine, from the repository root):

    python benchmarks/gpu.py                 # writes benchmarks/results/gpu/<machine>.json (after every section)
    python benchmarks/gpu.py $OUT            # writes $OUT/gpu.json instead (a device machine's $OUT comes back)
    python benchmarks/gpu.py $OUT --quick    # correctness + one shape per benchmark (~1 min)

Either file is written through benchmarks/resultfile.py (command, commit, date, fingerprint); where the
checkout has no git history, set ATTNOPT_COMMIT to the commit it was copied from.

Sections, each in its own try/except (a failing section records its error and the script goes on):

  env          torch / triton / GPU / fla versions
  ceilings     measured copy bandwidth (GB/s) and bf16 matmul (TFLOP/s) of this GPU, this run
  correctness  every Triton kernel vs the fp32 PyTorch reference ops (attnopt.kernels.*) on the GPU,
               fp32 / bf16 / fp16 inputs, GQA, padding, sinks, Nq != Nk, forward and backward; the
               hybrid vs the dense formula of tests/triton/oracles.py; left-padded sinks vs that
               dense formula (the reference window op counts sinks by position, not by real token)
  graph        torch.export keeps one attnopt_triton node; torch.compile (Inductor) matches eager
  kernels      forward and forward+backward times, T = 2k..64k, D = 64 / 128, bf16, B·H = 32:
               SDPA (flash backend, causal), Triton linear (elu), decay, window 256 + 4 sinks,
               hybrid linear+window 64 (fwd), fla-core (chunk_linear_attn / chunk_simple_gla /
               chunk_retention / parallel_attn with window_size) when importable, FlexAttention
               with a sliding-window block mask. Implementations are interleaved (round-robin,
               best of the rounds of `triton.testing.do_bench` medians); ms, TFLOP/s (counted
               FLOPs, see `_flops`), GB/s of the q/k/v/o traffic, and fractions of the ceilings
  gated        the gated forms' Triton forwards (gla per channel / per head, gated delta, gla+window
               64) against their PyTorch reference ops on the GPU (fp32, bf16), then forward times
               at T = 4k / 16k (D = 128, bf16) next to fla-core's chunk_gla and
               chunk_gated_delta_rule when fla imports (a note says so when it does not)
  reuse        the reuse form's Triton block-sparse prefill vs its PyTorch op (fp32, bf16), then forward
               times at T = 4k..32k (D = 128, bf16, 16/4 heads, blocks of 64, 1/8 of the keys read)
               next to SDPA causal, FlexAttention with the same BlockMask and fla's NSA (its
               selected-block branch on the same lists) when importable
  e2e          prefill of a small random-weight Llama-style transformers model from a config:
               original SDPA vs attnopt.compile with "linear", "window:256+sinks:4" and
               "linear+window:64" (policies that may not exist yet: errors are recorded)

A global time budget (`--budget`, default 330 s) skips the remaining measurements once spent
(recorded as "skipped: time budget"), so the script finishes under 6 minutes whatever the GPU does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "triton"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from resultfile import result_path, write_result  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

T0 = time.time()
BUDGET = 330.0
DEV = "cuda"  # "cpu" only in --smoke (TRITON_INTERPRET=1, tiny shapes: checks this script, not the GPU)
SMOKE = False
RESULT: dict = {}
OUT_PATH = None


def time_left() -> float:
    return BUDGET - (time.time() - T0)


def save() -> None:
    RESULT["elapsed_s"] = round(time.time() - T0, 1)
    write_result("gpu", json.loads(json.dumps(RESULT, default=str)), path=OUT_PATH)


def section(name):
    def wrap(fn):
        def run(*a, **kw):
            t = time.time()
            try:
                RESULT[name] = fn(*a, **kw)
            except Exception as e:  # recorded; the next section still runs
                RESULT[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            RESULT.setdefault("section_seconds", {})[name] = round(time.time() - t, 1)
            save()
            print(f"[gpu.py] {name}: {RESULT['section_seconds'][name]} s", flush=True)
        return run
    return wrap


def guarded(fn):
    """Run fn(); an exception becomes {"error": ...} so one failing case does not stop a section."""
    try:
        return fn()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:800]}


# ---------------------------------------------------------------------------------------------



def triton_kernels():
    """Every form's Triton entry points in one namespace (each form keeps its own in its folder)."""
    from types import SimpleNamespace

    import attnopt.forms.linear.triton as linear
    import attnopt.forms.linear_window.triton as linear_window
    import attnopt.forms.ssm.triton as ssm
    import attnopt.forms.window.triton as window

    return SimpleNamespace(linear_attention=linear.linear_attention, decay_attention=ssm.decay_attention,
                           window_attention=window.window_attention,
                           linear_window_attention=linear_window.linear_window_attention)

@section("env")
def env():
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "importable")
    except Exception as e:
        info["fla"] = f"not importable: {type(e).__name__}"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception as e:
        info["transformers"] = f"not importable: {type(e).__name__}"
    return info


def bench(fn, rep_ms=60) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


@section("ceilings")
def ceilings():
    n = 1 << 28  # 512 MiB of bf16 each way
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = min(bench(lambda: b.copy_(a)) for _ in range(3))
    copy_gbps = 2 * a.numel() * a.element_size() / (ms * 1e-3) / 1e9
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    ms_mm = min(bench(lambda: x @ y) for _ in range(3))
    tflops = 2 * m**3 / (ms_mm * 1e-3) / 1e12
    return {"copy_GBps": round(copy_gbps, 1), "bf16_matmul_TFLOPs": round(tflops, 1),
            "how": "copy_ of 512 MiB bf16 (read + write counted); 8192^3 bf16 matmul; best of 3 do_bench medians"}


# ---------------------------------------------------------------------------------------------


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _inputs(B, H, Hkv, Nq, Nk, D, Dv, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, Nq, D, device=DEV, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Nk, D, device=DEV, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Nk, Dv, device=DEV, generator=g).to(dtype)
    return q, k, v


def _check(kernel, reference, q, k, v, backward: bool, tol_fwd: float, tol_bwd: float) -> dict:
    """kernel on (q, k, v) in their dtype vs reference on their fp32 copies; forward and grads."""
    xs = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
    rs = [t.detach().float().clone().requires_grad_(backward) for t in (q, k, v)]
    out = kernel(*xs)
    ref = reference(*rs)
    res = {"out": _rel(out, ref)}
    if backward:
        g = torch.randn(ref.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3))
        out.backward(g.to(out.dtype))
        ref.backward(g)
        for name, a, b in zip(("dq", "dk", "dv"), xs, rs):
            res[name] = _rel(a.grad, b.grad)
    res["ok"] = all((v <= (tol_fwd if k == "out" else tol_bwd)) for k, v in res.items() if k != "ok")
    return res


TOL = {torch.float32: (2e-4, 5e-4), torch.bfloat16: (3e-2, 6e-2), torch.float16: (5e-3, 1e-2)}


@section("correctness")
def correctness():
    tk = triton_kernels()
    import oracles
    from attnopt.forms.ssm.reference import decay_attention_reference
    from attnopt.forms.linear.reference import linear_attention_reference
    from attnopt.forms.window.reference import window_attention_reference

    shape = dict(B=2, H=8, Hkv=2, Nq=1000, Nk=1100, D=64, Dv=48)
    if SMOKE:
        shape.update(Nq=40, Nk=90, D=16, Dv=24)
    B, Nk = shape["B"], shape["Nk"]
    right_pad = torch.ones(B, Nk, dtype=torch.bool, device=DEV)
    right_pad[1, Nk - 23:] = False
    left_pad = torch.ones(B, Nk, dtype=torch.bool, device=DEV)
    left_pad[1, :17] = False
    gamma = 1 - 2.0 ** (-5 - torch.arange(8, dtype=torch.float64))
    beta = torch.linspace(0.0, 2.0, 8)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tf, tb = TOL[dtype]
        dn = str(dtype).replace("torch.", "")
        q, k, v = _inputs(**shape, dtype=dtype)
        cases = {
            "linear_causal_elu": (lambda q, k, v: tk.linear_attention(q, k, v, causal=True, key_mask=right_pad),
                                  lambda q, k, v: linear_attention_reference(q, k, v, causal=True, key_mask=right_pad), True),
            "linear_causal_relu": (lambda q, k, v: tk.linear_attention(q, k, v, feature_map="relu", causal=True),
                                   lambda q, k, v: linear_attention_reference(q, k, v, feature_map="relu", causal=True), True),
            "linear_noncausal_elu": (lambda q, k, v: tk.linear_attention(q, k, v, causal=False, key_mask=right_pad),
                                     lambda q, k, v: linear_attention_reference(q, k, v, causal=False, key_mask=right_pad), True),
            "linear_causal_favor": (lambda q, k, v: tk.linear_attention(q * 0.5, k * 0.5, v, feature_map="favor", causal=True),
                                    lambda q, k, v: linear_attention_reference(q * 0.5, k * 0.5, v, feature_map="favor", causal=True), True),
            "decay_identity": (lambda q, k, v: tk.decay_attention(q, k, v, decay=gamma, key_mask=right_pad),
                               lambda q, k, v: decay_attention_reference(q, k, v, decay=gamma, key_mask=right_pad), True),
            "decay_elu_normalized": (lambda q, k, v: tk.decay_attention(q, k, v, decay=gamma, feature_map="elu", normalize=True),
                                     lambda q, k, v: decay_attention_reference(q, k, v, decay=gamma, feature_map="elu", normalize=True), True),
            "window_causal_256_sinks4_rightpad": (
                lambda q, k, v: tk.window_attention(q, k, v, window=256, causal=True, sinks=4, key_mask=right_pad),
                lambda q, k, v: window_attention_reference(q, k, v, window=256, causal=True, sinks=4, key_mask=right_pad), True),
            "window_bidirectional_100": (
                lambda q, k, v: tk.window_attention(q, k, v, window=100, causal=False),
                lambda q, k, v: window_attention_reference(q, k, v, window=100, causal=False), True),
            "window_causal_sinks4_leftpad_vs_dense": (
                lambda q, k, v: tk.window_attention(q, k, v, window=64, causal=True, sinks=4, key_mask=left_pad),
                lambda q, k, v: oracles.window(q, k, v, window=64, causal=True, sinks=4, key_mask=left_pad), True),
            "hybrid_causal_64_sinks4_vs_dense": (
                lambda q, k, v: tk.linear_window_attention(q, k, v, window=64, sinks=4, causal=True, linear_weight=beta, key_mask=left_pad),
                lambda q, k, v: oracles.linear_window(q, k, v, window=64, sinks=4, causal=True, fmap="elu", beta=beta, key_mask=left_pad), False),
            "hybrid_bidirectional_32_vs_dense": (
                lambda q, k, v: tk.linear_window_attention(q, k, v, window=32, causal=False, linear_weight=beta),
                lambda q, k, v: oracles.linear_window(q, k, v, window=32, sinks=0, causal=False, fmap="elu", beta=beta), False),
        }
        for name, (kern, ref, bwd) in cases.items():
            if time_left() < 220:  # leave the kernels and e2e sections their share
                out[f"{name}/{dn}"] = "skipped: time budget"
                continue
            out[f"{name}/{dn}"] = guarded(lambda: _check(kern, ref, q, k, v, bwd, tf, tb))
        save()
    out["all_ok"] = all(isinstance(r, dict) and r.get("ok") for r in out.values() if r != "skipped: time budget")
    return out


@section("graph")
def graph():
    tk = triton_kernels()

    q, k, v = _inputs(1, 4, 2, 300, 300, 64, 64, torch.bfloat16)
    res = {}

    class Win(torch.nn.Module):
        def forward(self, q, k, v):
            return tk.window_attention(q, k, v, window=64, causal=True, sinks=4)

    class Lin(torch.nn.Module):
        def forward(self, q, k, v):
            return tk.linear_attention(q, k, v, causal=True)

    for name, mod, op in (("window", Win(), "attnopt_triton.window"), ("linear", Lin(), "attnopt_triton.linear_causal")):
        def one():
            ep = torch.export.export(mod, (q, k, v))
            n_before = sum(op in str(n.target) for n in ep.graph.nodes if n.op == "call_function")
            ep2 = ep.run_decompositions()
            n_after = sum(op in str(n.target) for n in ep2.graph.nodes if n.op == "call_function")
            eager = mod(q, k, v)
            compiled = torch.compile(mod)(q, k, v)
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            torch.compile(mod)(*xs).float().sum().backward()
            ys = [t.clone().requires_grad_() for t in (q, k, v)]
            mod(*ys).float().sum().backward()
            return {"export_nodes": n_before, "export_nodes_after_decompositions": n_after,
                    "compile_vs_eager": _rel(compiled, eager),
                    "compile_backward_vs_eager": max(_rel(a.grad, b.grad) for a, b in zip(xs, ys))}
        res[name] = guarded(one)
    return res


# ---------------------------------------------------------------------------------------------


def _flops(kind: str, B: int, H: int, T: int, D: int, W: int = 0, C: int = 64) -> float:
    """Counted forward FLOPs (multiply-add = 2). Backward is counted as 2.5x forward for the
    softmax kernels (FlashAttention's convention) and 2x for the linear scans."""
    if kind == "causal_softmax":
        return 4 * B * H * T * T * D / 2
    if kind == "window":
        return 4 * B * H * T * W * D
    if kind == "linear":  # intra-chunk C×C blocks (halved by the mask) + state read + state update
        return B * H * T * (2 * C * D + 2 * C * D + 4 * D * D)
    if kind == "hybrid":
        return 4 * B * H * T * W * D + 2 * B * H * T * (2 * W * D + 2 * D * D)
    raise ValueError(kind)


def _impls(B, H, T, D, dtype):
    """name -> (forward fn, fwd+bwd fn or None, FLOP kind, W). Every input is built here once."""
    tk = triton_kernels()

    q, k, v = _inputs(B, H, H, T, T, D, D, dtype)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g = torch.randn_like(q)
    impls = {}

    def fb(f):
        def run():
            f(qg, kg, vg).backward(g)
        return run

    def sdpa(q, k, v):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls["sdpa_flash_causal"] = (lambda: sdpa(q, k, v), fb(sdpa), "causal_softmax", 0)
    lin = lambda q, k, v: tk.linear_attention(q, k, v, causal=True)  # noqa: E731
    impls["triton_linear_causal_elu"] = (lambda: lin(q, k, v), fb(lin), "linear", 0)
    dec = lambda q, k, v: tk.decay_attention(q, k, v)  # noqa: E731
    impls["triton_decay_retnet"] = (lambda: dec(q, k, v), fb(dec), "linear", 0)
    win = lambda q, k, v: tk.window_attention(q, k, v, window=256, causal=True, sinks=4)  # noqa: E731
    impls["triton_window_256_sinks4"] = (lambda: win(q, k, v), fb(win), "window", 260)
    hyb = lambda q, k, v: tk.linear_window_attention(q, k, v, window=64, sinks=4, causal=True)  # noqa: E731
    impls["triton_linear_window_64"] = (lambda: hyb(q, k, v), None, "hybrid", 68)

    try:  # fla-core, layout [B, T, H, D]
        import inspect as _inspect

        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        qtg, ktg, vtg = (t.clone().requires_grad_() for t in (qt, kt, vt))
        gt = g.transpose(1, 2).contiguous()

        def fla_fb(f):
            def run():
                o = f(qtg, ktg, vtg)
                (o[0] if isinstance(o, tuple) else o).backward(gt)
            return run

        def add(name, fn, kind, W=0, **kw):
            params = _inspect.signature(fn).parameters
            kw = {a: b for a, b in kw.items() if a in params}
            f = lambda q, k, v: fn(q, k, v, **kw)  # noqa: E731
            impls[name] = (lambda: f(qt, kt, vt), fla_fb(f), kind, W)

        try:
            from fla.ops.linear_attn import chunk_linear_attn

            add("fla_chunk_linear_attn", chunk_linear_attn, "linear", normalize=True)
        except Exception:
            pass
        try:
            from fla.ops.simple_gla import chunk_simple_gla

            add("fla_chunk_simple_gla", chunk_simple_gla, "linear")
        except Exception:
            pass
        try:
            from fla.ops.retention import chunk_retention

            add("fla_chunk_retention", chunk_retention, "linear")
        except Exception:
            pass
        try:
            from fla.ops.attn import parallel_attn

            if "window_size" in _inspect.signature(parallel_attn).parameters:
                add("fla_parallel_attn_window256", parallel_attn, "window", 256, window_size=256)
        except Exception:
            pass
    except Exception:
        pass

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def sliding(b, h, qi, ki):
            return (qi >= ki) & (qi - ki < 256)

        bm = create_block_mask(sliding, None, None, T, T, device=DEV)
        flex = torch.compile(flex_attention)
        fx = lambda q, k, v: flex(q, k, v, block_mask=bm)  # noqa: E731
        impls["flex_sliding_window_256"] = (lambda: fx(q, k, v), fb(fx), "window", 256)
    except Exception as e:
        impls["flex_sliding_window_256"] = ("error", f"{type(e).__name__}: {e}"[:300])
    return impls, (q, k, v)


@section("kernels")
def kernels(quick: bool):
    ceil = RESULT.get("ceilings", {})
    peak_tf = ceil.get("bf16_matmul_TFLOPs")
    peak_bw = ceil.get("copy_GBps")
    BH = 32
    lengths = [8192] if quick else [2048, 4096, 8192, 16384, 32768, 65536]
    dims = (128, 64)
    if SMOKE:
        lengths, dims = [100], (16,)
    rows = []
    for D in dims:
        for T in lengths:
            if time_left() < 110:  # the rest is e2e's
                rows.append({"D": D, "T": T, "skipped": "time budget"})
                continue
            B, H = 2, BH // 2
            try:
                impls, (q, k, v) = _impls(B, H, T, D, torch.bfloat16)
            except Exception as e:
                rows.append({"D": D, "T": T, "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            best: dict = {}
            errors: dict = {}
            for name, spec in impls.items():
                if spec[0] == "error":
                    errors[name] = spec[1]
            live = {n: s for n, s in impls.items() if s[0] != "error"}
            # warm-up / compile each once (errors recorded), then interleaved rounds
            for name, (f, fbw, _, _) in list(live.items()):
                try:
                    f()
                    if fbw is not None:
                        fbw()
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                except Exception as e:
                    errors[name] = f"{type(e).__name__}: {e}"[:500]
                    live.pop(name)
            rounds = 2 if T >= 32768 else 3
            for _ in range(rounds):
                for name, (f, fbw, _, _) in live.items():
                    if time_left() < 95:
                        break
                    b = best.setdefault(name, {})
                    b["fwd_ms"] = min(b.get("fwd_ms", math.inf), bench(f))
                    if fbw is not None:
                        b["fwd_bwd_ms"] = min(b.get("fwd_bwd_ms", math.inf), bench(fbw))
            for name, b in best.items():
                kind, W = live[name][2], live[name][3]
                fl = _flops(kind, B, H, T, D, W)
                byts = 4 * B * H * T * D * 2  # q, k, v read + o written, bf16
                b["fwd_TFLOPs"] = round(fl / (b["fwd_ms"] * 1e-3) / 1e12, 2)
                b["fwd_GBps"] = round(byts / (b["fwd_ms"] * 1e-3) / 1e9, 1)
                if peak_tf:
                    b["fwd_frac_matmul_peak"] = round(b["fwd_TFLOPs"] / peak_tf, 3)
                if peak_bw:
                    b["fwd_frac_copy_bw"] = round(b["fwd_GBps"] / peak_bw, 3)
                if "fwd_bwd_ms" in b:
                    mult = 3.5 if kind in ("causal_softmax", "window", "hybrid") else 3.0
                    b["fwd_bwd_TFLOPs"] = round(mult * fl / (b["fwd_bwd_ms"] * 1e-3) / 1e12, 2)
                for key in ("fwd_ms", "fwd_bwd_ms"):
                    if key in b:
                        b[key] = round(b[key], 4)
            rows.append({"D": D, "T": T, "B": B, "H": H, "dtype": "bfloat16", "results": best, "errors": errors})
            del impls, q, k, v
            if DEV == "cuda":
                torch.cuda.empty_cache()
            save()
            print(f"[gpu.py] kernels D={D} T={T}: " + ", ".join(f"{n} {b.get('fwd_ms')}" for n, b in best.items()), flush=True)
        if quick:
            break
    return {"rows": rows, "flops_note": _flops.__doc__}


def _gated_inputs(B, H, Hkv, T, D, dtype, per_channel=True):
    """q, k, v, log-gates of the forms' size (logsigmoid/16), β, and a left-padded key mask."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, H, T, D, device=DEV, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, T, D, device=DEV, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, T, D, device=DEV, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn((B, Hkv, T, D) if per_channel else (B, Hkv, T), device=DEV, generator=gen)) / 16
    beta = torch.sigmoid(torch.randn(B, Hkv, T, device=DEV, generator=gen))
    keep = torch.ones(B, T, dtype=torch.bool, device=DEV)
    keep[-1, : T // 7] = False
    return q, k, v, g, beta, keep


def _gated_correctness() -> dict:
    import attnopt.forms.delta.reference  # noqa: F401  (registers torch.ops.attnopt.gated_delta_attention)
    import attnopt.forms.delta.triton as tdelta
    import attnopt.forms.gla.reference  # noqa: F401
    import attnopt.forms.gla.triton as tgla
    import attnopt.forms.gla_window.reference  # noqa: F401
    import attnopt.forms.gla_window.triton as tglaw

    T, D = (40, 16) if SMOKE else (1500, 64)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        tol = TOL[dtype][0]
        dn = str(dtype).replace("torch.", "")
        for per_channel in (True, False):
            q, k, v, g, beta, keep = _gated_inputs(2, 4, 2, T, D, dtype, per_channel)
            ref = torch.ops.attnopt.gated_linear_attention(q.float(), k.float(), v.float(), g, keep, "elu", True,
                                                           D ** -0.5, 1e-6, 64)  # the PyTorch op itself
            got = tgla.gated_linear_attention(q, k, v, g, feature_map="elu", normalize=True, key_mask=keep)
            out[f"gla_{'channel' if per_channel else 'head'}/{dn}"] = {"rel": _rel(got, ref), "ok": _rel(got, ref) <= tol}
        q, k, v, g, beta, keep = _gated_inputs(2, 4, 2, T, D, dtype, per_channel=False)
        kn = F.normalize(k.float(), dim=-1).to(dtype)
        ref = torch.ops.attnopt.gated_delta_attention(q.float(), kn.float(), v.float(), g, beta, keep, D ** -0.5, 64)
        got = tdelta.gated_delta_attention(q, kn, v, g, beta, key_mask=keep)
        out[f"delta/{dn}"] = {"rel": _rel(got, ref), "ok": _rel(got, ref) <= tol}
        q, k, v, g, beta, keep = _gated_inputs(2, 4, 2, T, D, dtype)
        fq, fk = F.elu(q.float()) + 1, F.elu(k.float()) + 1
        w = torch.linspace(0.5, 2.0, 4, device=DEV)
        ref = torch.ops.attnopt.gla_window_attention(q.float(), k.float(), v.float(), fq, fk, g, w, keep, 64, 4,
                                                     D ** -0.5, 64)
        got = tglaw.gla_window_attention(q, k, v, fq.to(dtype), fk.to(dtype), g, window=64, sinks=4, linear_weight=w,
                                         key_mask=keep)
        real = keep[:, None, :, None]
        out[f"gla_window_64_sinks4/{dn}"] = {"rel": _rel(got * real, ref * real), "ok": _rel(got * real, ref * real) <= tol}
    return out


def _fla_gated(B, H, T, D, q, k, v, g_channel, g_head, beta) -> tuple[dict, list]:
    """fla-core's chunk_gla / chunk_gated_delta_rule on the same inputs ([B, T, H, D] layout)."""
    import inspect as _inspect

    impls, notes = {}, []
    try:
        import fla  # noqa: F401
    except Exception as e:
        return impls, [f"fla-core not importable ({type(e).__name__}): its rows are skipped"]
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    gct, ght, bt = g_channel.transpose(1, 2).contiguous(), g_head.transpose(1, 2).contiguous(), beta.transpose(1, 2).contiguous()
    try:
        from fla.ops.gla import chunk_gla

        impls["fla_chunk_gla"] = lambda: chunk_gla(qt, kt, vt, gct, scale=D ** -0.5)
    except Exception as e:
        notes.append(f"fla chunk_gla: {type(e).__name__}: {e}"[:200])
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        kn = F.normalize(kt.float(), dim=-1).to(kt.dtype)
        kw = {"scale": D ** -0.5}
        if "use_qk_l2norm_in_kernel" in _inspect.signature(chunk_gated_delta_rule).parameters:
            kw["use_qk_l2norm_in_kernel"] = False
        impls["fla_chunk_gated_delta_rule"] = lambda: chunk_gated_delta_rule(qt, kn, vt, ght, bt, **kw)
    except Exception as e:
        notes.append(f"fla chunk_gated_delta_rule: {type(e).__name__}: {e}"[:200])
    return impls, notes


@section("gated")
def gated(quick: bool):
    import attnopt.forms.delta.triton as tdelta
    import attnopt.forms.gla.triton as tgla
    import attnopt.forms.gla_window.triton as tglaw

    res = {"correctness": guarded(_gated_correctness), "rows": [], "notes": []}
    save()
    lengths = [40] if SMOKE else ([8192] if quick else [4096, 16384])
    D = 16 if SMOKE else 128
    for T in lengths:
        if time_left() < 75:  # e2e keeps its share
            res["rows"].append({"T": T, "skipped": "time budget"})
            continue
        B, H = (1, 2) if SMOKE else (2, 16)
        q, k, v, gc, beta, _ = _gated_inputs(B, H, H, T, D, torch.bfloat16)
        gh = gc[..., 0].contiguous()
        kn = F.normalize(k.float(), dim=-1).to(k.dtype)
        fq, fk = F.elu(q) + 1, F.elu(k) + 1
        impls = {
            "sdpa_flash_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "triton_gla_channel": lambda: tgla.gated_linear_attention(q, k, v, gc, scale=D ** -0.5),
            "triton_gla_head": lambda: tgla.gated_linear_attention(q, k, v, gh, scale=D ** -0.5),
            "triton_gated_delta": lambda: tdelta.gated_delta_attention(q, kn, v, gh, beta, scale=D ** -0.5),
            "triton_gla_window_64": lambda: tglaw.gla_window_attention(q, k, v, fq, fk, gc, window=64),
        }
        fla_impls, notes = _fla_gated(B, H, T, D, q, k, v, gc, gh, beta)
        impls.update(fla_impls)
        res["notes"] = sorted(set(res["notes"]) | set(notes))
        row = {"T": T, "B": B, "H": H, "D": D, "dtype": "bfloat16", "fwd_ms": {}, "errors": {}}
        for name, f in impls.items():
            if time_left() < 45:
                row["errors"][name] = "skipped: time budget"
                continue
            try:
                with torch.no_grad():
                    f()
                    row["fwd_ms"][name] = round(bench(f), 4)
            except Exception as e:
                row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
        res["rows"].append(row)
        save()
        print(f"[gpu.py] gated T={T}: {row['fwd_ms']}", flush=True)
    return res


def _reuse_inputs(B, H, Hkv, T, D, dtype, block, share=8, seed=0):
    """q, k, v and per-query-block lists reading 1/share of the keys (own block, the one before, block 0
    and random earlier ones), as the reuse form's selection makes them."""
    q, k, v = _inputs(B, H, Hkv, T, T, D, D, dtype, seed)
    M = -(-T // block)
    slots = max(3, M // share)
    g = torch.Generator().manual_seed(seed)
    lists = torch.full((B, M, slots), -1, dtype=torch.long)
    for m in range(M):
        own = [m] + ([m - 1] if m >= 1 else []) + ([0] if m >= 2 else [])
        rest = torch.randperm(max(m - 1, 1), generator=g)[: slots - len(own)] + 1 if m > 2 else torch.tensor([], dtype=torch.long)
        ids = sorted(set(own) | {int(x) for x in rest if 0 < int(x) < m - 1})[:slots]
        lists[:, m, :len(ids)] = torch.tensor(ids)
    return q, k, v, lists.to(DEV)


@section("reuse")
def reuse(quick: bool):
    """The reuse form's Triton block-sparse prefill: against its PyTorch op (fp32, bf16), then forward
    times next to FlexAttention with the same BlockMask and fla's NSA when importable."""
    from attnopt.forms.reuse import triton as treuse
    from attnopt.forms.reuse.reference import _block_sparse_op, flex_attention_cpu  # noqa: F401

    res = {"correctness": {}, "rows": [], "notes": []}
    block = 16 if SMOKE else 64
    for dtype in (torch.float32, torch.bfloat16):
        def one(dtype=dtype):
            q, k, v, lists = _reuse_inputs(2, 4, 2, 70 if SMOKE else 1000, 16 if SMOKE else 64, dtype, block)
            per_query = lists.repeat_interleave(block, 1)[:, :q.shape[2]]
            got = treuse.block_sparse_attention_triton(q, k, v, lists, block=block, causal=True, scale=0.125)
            want = _block_sparse_op(q.float(), k.float(), v.float(), per_query, block, True, 0.125, None, None)
            return {"rel_err": _rel(got, want), "tol": TOL[dtype][0]}
        res["correctness"][str(dtype).replace("torch.", "")] = guarded(one)
    save()
    lengths = [128] if SMOKE else ([8192] if quick else [4096, 16384, 32768])
    for T in lengths:
        if time_left() < 60:
            res["rows"].append({"T": T, "skipped": "time budget"})
            continue
        B, H, D = (1, 2, 16) if SMOKE else (1, 16, 128)
        q, k, v, lists = _reuse_inputs(B, H, H // 4 if H >= 4 else H, T, D, torch.bfloat16, block)
        row = {"T": T, "B": B, "H": H, "D": D, "block": block, "blocks_read": lists.shape[-1], "fwd_ms": {},
               "errors": {}}
        impls = {"sdpa_flash_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                 "triton_block_sparse": lambda: treuse.block_sparse_attention_triton(q, k, v, lists, block=block,
                                                                                     causal=True)}
        try:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention

            flex = torch.compile(flex_attention)
            M = lists.shape[1]
            ids = lists.clamp_min(0)
            diag = lists == torch.arange(M, device=DEV)[None, :, None]
            full_n = ((lists >= 0) & ~diag).sum(-1).to(torch.int32)[:, None]
            order = torch.sort((~((lists >= 0) & ~diag)).to(torch.int8), dim=-1, stable=True).indices
            full_i = torch.nn.functional.pad(torch.gather(ids, -1, order), (0, M - lists.shape[-1])).to(torch.int32)[:, None]
            part_n = torch.ones(B, 1, M, dtype=torch.int32, device=DEV)
            part_i = torch.arange(M, device=DEV, dtype=torch.int32).view(1, 1, M, 1).expand(B, 1, M, M).contiguous()
            mask = BlockMask.from_kv_blocks(part_n, part_i, full_n, full_i.contiguous(), BLOCK_SIZE=block,
                                            mask_mod=lambda b, h, qi, ki: ki <= qi, seq_lengths=(T, T))
            impls["flex_block_mask"] = lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)
        except Exception as e:
            row["errors"]["flex_block_mask"] = f"{type(e).__name__}: {e}"[:300]
        try:
            from fla.ops.nsa import parallel_nsa

            # NSA's selected-block branch on the same lists ([B, T, H, D] layout, per-query block indices).
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            idx = lists.repeat_interleave(block, 1)[:, :T][:, :, None].expand(B, T, k.shape[1], lists.shape[-1])
            counts = (lists >= 0).sum(-1).repeat_interleave(block, 1)[:, :T][:, :, None].expand(B, T, k.shape[1])
            impls["fla_parallel_nsa_selected"] = lambda: parallel_nsa(
                qt, kt, vt, block_indices=idx.contiguous(), block_counts=counts.contiguous(), block_size=block,
                scale=D ** -0.5)
        except Exception as e:
            res["notes"].append(f"fla NSA not run: {type(e).__name__}: {e}"[:300])
        for name, f in impls.items():
            if time_left() < 45:
                row["errors"][name] = "skipped: time budget"
                continue
            try:
                with torch.no_grad():
                    f()
                    row["fwd_ms"][name] = round(bench(f), 4)
            except Exception as e:
                row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
        res["rows"].append(row)
        save()
        print(f"[gpu.py] reuse T={T}: {row['fwd_ms']}", flush=True)
    return res


@section("e2e")
def e2e(quick: bool):
    import transformers

    import attnopt

    T = 2048 if quick else 8192
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=2 * T,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (1, T), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    inputs = {"input_ids": ids, "use_cache": False}
    small = {"input_ids": ids[:, :1024], "use_cache": False}
    res = {"T": T, "config": "Llama 8 layers, hidden 1024, 16 heads / 4 kv heads, bf16, random weights"}
    with torch.no_grad():
        model(**inputs)
        res["original_sdpa_ms"] = round(bench(lambda: model(**inputs), rep_ms=200), 3)
        ref_logits = model(**inputs).logits.float()
    for policy in ("linear", "window:256+sinks:4", "linear+window:64"):
        if time_left() < 20:
            res[policy] = "skipped: time budget"
            continue

        def one():
            t = time.time()
            opt = attnopt.compile(model, policy, example_inputs=small, tolerance=10.0)
            r = {"compile_s": round(time.time() - t, 1)}
            rep = getattr(opt, "attnopt_report", None)
            if rep is not None:
                r["sites"] = len(rep.sites)
                r["rewritten"] = rep.count("rewritten")
            with torch.no_grad():
                opt(**inputs)
                r["prefill_ms"] = round(bench(lambda: opt(**inputs), rep_ms=200), 3)
                r["speedup_vs_sdpa"] = round(res["original_sdpa_ms"] / r["prefill_ms"], 3)
                r["logits_rel_rms_vs_original"] = float(
                    (opt(**inputs).logits.float() - ref_logits).pow(2).mean().sqrt() / ref_logits.pow(2).mean().sqrt())
            return r
        res[policy] = guarded(one)
        save()
    return res


def main(argv=None):
    global OUT_PATH, BUDGET, DEV, SMOKE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", help="folder for gpu.json (default: benchmarks/results/gpu/<machine>.json)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes: checks the script only")
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds before remaining measurements are skipped")
    args = ap.parse_args(argv)
    BUDGET = args.budget
    if args.smoke and not args.out_dir:
        print("--smoke checks the script, not a GPU: give an out_dir for its gpu.json")
        return 2
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        OUT_PATH = os.path.join(args.out_dir, "gpu.json")
    else:
        OUT_PATH = str(result_path("gpu"))
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke needs TRITON_INTERPRET=1")
            return 2
        DEV, SMOKE = "cpu", True
        correctness()
        kernels(True)
        gated(True)
        reuse(True)
        print(f"[gpu.py] smoke done in {time.time() - T0:.0f} s -> {OUT_PATH}")
        return 0
    if not torch.cuda.is_available():
        RESULT["error"] = "no CUDA device: this script is for the GPU machine"
        save()
        print(RESULT["error"])
        return 1
    env()
    ceilings()
    correctness()
    graph()
    kernels(args.quick)
    gated(args.quick)
    reuse(args.quick)
    e2e(args.quick)
    print(f"[gpu.py] done in {time.time() - T0:.0f} s -> {OUT_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
