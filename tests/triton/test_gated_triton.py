"""The gated Triton kernels (forward) against the fp64 oracles in Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before triton is imported, so the cases run in a child process
(`gated_cases.py`) that reports JSON; a second child, without the interpreter, compiles the kernels
for sm_90 and exports the triton_ops. Both start together at the first test that needs them.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from gated_cases import CASES  # noqa: E402  (torch and the oracles only, not triton)


def _start(args, interpret: bool):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.Popen([sys.executable, os.path.join(HERE, "gated_cases.py"), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _json_of(proc) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def children():
    return {"cases": _start([], True), "build": _start(["--build"], False)}


@pytest.fixture(scope="module")
def interpreted(children):
    return _json_of(children["cases"])


NUMERIC = sorted(n for n in CASES if n != "unsupported_reasons")


@pytest.mark.parametrize("name", NUMERIC)
def test_kernel_matches_oracle(interpreted, name):
    res = interpreted[name]
    assert "error" not in res, res.get("traceback", res.get("error"))
    for what, c in res["checks"].items():
        assert c["scale"] > 1e-3, f"{name}: the oracle is ~0, the comparison would prove nothing"
        assert c["err"] <= c["tol"], f"{name}: {what} relative error {c['err']:.3g} > {c['tol']:.3g}"


def test_unsupported_reasons(interpreted):
    res = interpreted["unsupported_reasons"]
    assert "error" not in res, res.get("traceback")
    r = res["reasons"]
    assert r["gla_ok"] is None and r["delta_ok"] is None
    assert "forward-only" in r["gla_grad"] and "forward-only" in r["delta_grad"]
    assert "carried state" in r["gla_state"]
    assert "favor" in r["gla_map"]
    assert "torch.float64" in r["gla_fp64"]
    assert "exceeds" in r["delta_wide"]
    assert r["gla_window_ok"] is None and "exceed" in r["gla_window_wide"] and "forward-only" in r["gla_window_grad"]


def test_kernels_compile_for_sm90_and_export_as_one_node(children):
    res = _json_of(children["build"])
    assert sorted(res["compile"]) == ["delta", "gla_channel", "gla_head"]
    for name, r in res["compile"].items():
        assert 0 < r["shared"] <= 227 * 1024, (name, r)  # H100/H200 per-block limit
    for name, r in res["export"].items():
        assert r["nodes"] == 1 and r["shape"] == [2, 6, 37, 24], (name, r)
