"""The reuse form's Triton block-sparse kernel, run in Triton's interpreter (TRITON_INTERPRET=1, its own
process: the switch must be set before triton is imported), against the fp64 oracle of
tests/kernels/test_reuse.py (written from the op's definition, sharing no code with it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("kernel_tests", sys.argv[1])
tests = importlib.util.module_from_spec(spec); spec.loader.exec_module(tests)
from attnopt.forms.reuse import triton as kernels
from attnopt.forms.reuse.reference import block_sparse_attention
torch.set_num_threads(1)
out = {}
for name, causal, H, Hkv, N, D, Dv, padded in [("causal_gqa", True, 4, 2, 45, 12, 10, False),
                                              ("bidirectional_padded", False, 3, 3, 40, 16, 16, True)]:
    q, k, v = tests._inputs(2, H, Hkv, N, N, D, Dv, seed=3)
    lists = tests._random_lists(2, N, N, 16, 3, seed=4)
    keep = None
    if padded:
        keep = torch.ones(2, N, dtype=torch.bool); keep[1, 33:] = False; keep[0, 3] = False
    got = kernels.block_sparse_attention_triton(q, k, v, lists[:, ::16], block=16, causal=causal, scale=0.3,
                                                key_mask=keep)
    want = tests.oracle(q, k, v, lists, block=16, causal=causal, scale=0.3, key_mask=keep)
    out[name] = (got.double() - want).abs().max().item() / want.abs().max().item()
# The op hands a CUDA-less prefill to the kernel only where it is asked to; its reasons say why not.
q, k, v = tests._inputs(1, 2, 2, 20, 20, 8, 8, seed=5)
out["reasons"] = [kernels.unsupported(q, k=k, block=12), kernels.unsupported(q, k=k[:, :, :10], block=16),
                  kernels.unsupported(q, k=k, block=16)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_triton_kernel_equals_the_oracle_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "tests/kernels/test_reuse.py")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["causal_gqa"] < 2e-5 and res["bidirectional_padded"] < 2e-5, res
    not_pow2, decode, fine = res["reasons"]
    assert "power of two" in not_pow2 and "prefill" in decode and fine is None
