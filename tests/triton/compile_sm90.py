"""Compiles every Triton kernel ahead of time for an H200 (sm_90) with no GPU present, and prints
one JSON object {kernel: {"shared": bytes, "num_warps": n}}: the real backend (TTIR -> TTGIR ->
LLVM -> PTX -> cubin) rejects what the interpreter lets through (loop-carried types, tile shapes
tl.dot refuses, shared memory over the limit). The bf16 variants at head dim 128 are the heaviest.

Usage: python tests/triton/compile_sm90.py          (without TRITON_INTERPRET)
The tests call `compile_all()` from `children.py`'s build process. Triton caches each compiled
kernel (~/.triton/cache, keyed by its source): a cold run compiles 25 kernels (~45 CPU seconds),
a warm one only those whose source changed.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import attnopt.kernels.triton.chunk_scan as cs  # noqa: E402
import attnopt.kernels.triton.state_step as step  # noqa: E402
import attnopt.forms.linear.triton as lin  # noqa: E402
import attnopt.forms.linear_window.triton as lw  # noqa: E402
import attnopt.forms.window.triton as win  # noqa: E402

FLOATS = ("scale", "eps", "scale2")
POINTERS = {"Q", "K", "V", "O", "KEEP", "LOG2G", "DEN", "DN", "DD", "DQ", "DK", "DV", "S", "Z", "SINK", "LSE", "DO",
            "DELTA", "FQ", "FK", "SP", "ZP", "BETA", "S_OUT", "Z_OUT", "KC", "VC", "POS"}


def build(kernel, dtype, fp32=(), i8=(), i32=(), num_warps=8, **constexprs):
    """Compile one specialisation; pointers default to `dtype`, named ones to fp32/i8/i32."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = "*fp32" if name in fp32 else "*i8" if name in i8 else "*i32" if name in i32 else f"*{dtype}"
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return {"shared": k.metadata.shared, "num_warps": num_warps}


def compile_all() -> dict:
    bf = "bf16"
    keep = dict(i8=("KEEP",))
    res = {}
    for decay in (False, True):
        tag = "decay" if decay else "linear"
        res[f"chunk_fwd/{tag}"] = build(cs._chunk_fwd_kernel, bf, fp32=("LOG2G", "DEN"), **keep, FMAP=1, HAS_KEEP=True,
                                        HAS_DECAY=decay, NORMALIZE=not decay, LOWP=1, BC=64, BM=128, BV=64)
        res[f"chunk_dq/{tag}"] = build(cs._dq_kernel, bf, fp32=("LOG2G", "DN", "DD", "DQ"), **keep, FMAP=1, HAS_KEEP=True,
                                       HAS_DECAY=decay, HAS_DD=not decay, LOWP=1, BC=64, BM=64, BV=128)
        for for_k in (True, False):
            res[f"chunk_{'dk' if for_k else 'dv'}/{tag}"] = build(
                cs._dkv_kernel, bf, fp32=("LOG2G", "DN", "DD", "DK", "DV"), **keep, FMAP=1, HAS_KEEP=True,
                HAS_DECAY=decay, HAS_DD=not decay, FOR_K=for_k, LOWP=1, BC=64, BM=64 if for_k else 128, BV=128 if for_k else 64)
    res["chunk_fwd/fp32"] = build(cs._chunk_fwd_kernel, "fp32", fp32=("LOG2G", "DEN"), **keep, FMAP=2, HAS_KEEP=False,
                                  HAS_DECAY=False, NORMALIZE=True, LOWP=0, BC=64, BM=64, BV=64, num_warps=4)
    res["kv_state"] = build(lin._kv_state_kernel, bf, fp32=("S", "Z"), **keep, num_warps=4, FMAP=1, HAS_KEEP=True,
                            LOWP=1, BC=64, BM=128, BV=64)
    res["query_state"] = build(lin._query_state_kernel, bf, fp32=("S", "Z", "DEN"), num_warps=4, FMAP=1, LOWP=1,
                               BQ=64, BM=128, BV=64)
    for causal in (True, False):
        tag = "causal" if causal else "bidirectional"
        c = dict(CAUSAL=causal, HAS_KEEP=True, LOWP=1, BQ=64, BK=64, BD=128, BV=128)
        res[f"window_fwd/{tag}"] = build(win._window_fwd_kernel, bf, fp32=("LSE",), i32=("SINK",), **keep, **c)
        res[f"window_dq/{tag}"] = build(win._window_dq_kernel, bf, fp32=("LSE", "DELTA", "DQ"), i32=("SINK",), **keep, **c)
        res[f"window_dkv/{tag}"] = build(win._window_dkv_kernel, bf, fp32=("LSE", "DELTA", "DK", "DV"), i32=("SINK",), **keep, **c)
        res[f"window_sink_dkv/{tag}"] = build(win._window_sink_dkv_kernel, bf, fp32=("LSE", "DELTA", "DK", "DV"), i32=("SINK",), **keep, **c)
        res[f"hybrid_fwd/{tag}"] = build(lw._hybrid_fwd_kernel, bf, fp32=("SP", "ZP", "BETA"), i32=("SINK",), **keep,
                                         CAUSAL=causal, FMAP=1, HAS_KEEP=True, LOWP=1, BQ=64, BK=64, BD=128, BM=128, BV=128)
    res["window_fwd/fp32"] = build(win._window_fwd_kernel, "fp32", fp32=("LSE",), i32=("SINK",), **keep, num_warps=4,
                                   CAUSAL=True, HAS_KEEP=False, LOWP=0, BQ=64, BK=64, BD=64, BV=64)
    res["prefix_state"] = build(lw._prefix_state_kernel, bf, fp32=("SP", "ZP"), i32=("SINK",), **keep, num_warps=4,
                                FMAP=1, HAS_KEEP=True, LOWP=1, BK=64, BM=128, BV=64)
    res["decode_state_step"] = build(step._state_step_kernel, bf, fp32=("S", "Z", "LOG2G", "S_OUT", "Z_OUT"), num_warps=4,
                                     FMAP=1, HAS_DECAY=True, NORMALIZE=True, HAS_Z=True, BM=128, BV=64)
    res["decode_ring_attend"] = build(win._ring_attend_kernel, bf, i32=("POS",), num_warps=4, BL=64, BD=128, BV=128)
    return res


if __name__ == "__main__":
    print(json.dumps(compile_all()))
