"""The Triton kernels against dense fp64 oracles in Triton's CPU interpreter, compiled for sm_90
without a GPU, and their triton_ops exported.

TRITON_INTERPRET=1 must be set before triton is imported, so the work runs in two child processes
(`children.py`), started together at the first test that needs either: one runs every case of
`interpreted_cases.py` under the interpreter, the other, without it, imports the kernels as a
CPU-only user would, compiles each for sm_90 and exports the ops. Each test below asserts its own
numbers from their JSON. The gated kernels: test_gated_triton.py.
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

from interpreted_cases import CASES  # noqa: E402  (imports torch and the oracles only, not triton)


def _start(mode: str):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.Popen([sys.executable, os.path.join(HERE, "children.py"), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _json_of(proc) -> dict:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def children():
    """Both start together, so the wall time is the slower child's where a core is free."""
    return {mode: _start(mode) for mode in ("interpret", "build")}


@pytest.fixture(scope="module")
def interpreted(children):
    return _json_of(children["interpret"])


@pytest.fixture(scope="module")
def built(children):
    return _json_of(children["build"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_dense_oracle(interpreted, name):
    """One case of a form's kernel: window, linear, linear_window ("hybrid") or ssm ("decay")."""
    res = interpreted["cases"][name]
    assert "error" not in res, res.get("traceback", res.get("error"))
    checks = res["checks"]
    assert checks, "a case must check at least one tensor"
    for what, c in checks.items():
        assert c["err"] <= c["tol"], f"{name}: {what} relative error {c['err']:.3g} > {c['tol']:.3g}"
        if what != "blind_rows_max":
            assert c["scale"] > 1e-3, f"{name}: {what} oracle is ~0, the comparison would prove nothing"


def test_is_supported_reasons(interpreted):
    r = interpreted["supported"]
    assert r["window"] is None and r["linear_elu"] is None
    assert "state" in r["linear_state"]
    assert "1057 features" in r["taylor_d32"]
    assert "torch.float64" in r["fp64"]
    assert "favor" in r["decay_bad_map"]
    assert "backward" in r["hybrid_grad"]
    assert "exact" in r["unknown"]


def test_import_without_driver_then_one_line_error(built):
    declined, raised = built["without_a_driver"]
    assert declined == "Triton kernels need CUDA tensors, got cpu"
    assert raised.startswith("RuntimeError window_attention: the Triton kernels need CUDA tensors (got cpu)")
    assert "\n" not in raised


def test_kernels_compile_for_sm90_without_a_gpu(built):
    """The real backend (not the interpreter) accepts every kernel; the heaviest tiles fit in shared memory."""
    res = built["compile"]
    assert len(res) == 25
    for name, r in res.items():
        assert 0 <= r["shared"] <= 227 * 1024, (name, r)  # H100/H200 per-block limit


def test_every_op_exports_as_one_node(built):
    """torch.export keeps each triton_op as one node, also after run_decompositions, with the right output meta."""
    res = built["export"]
    assert sorted(res) == ["decay", "linear_causal", "linear_noncausal", "linear_window", "window"]
    for name, r in res.items():
        assert r["nodes"] == 1 and r["nodes_after_decompositions"] == 1, (name, r)
        assert r["shape"] == [2, 6, 37, 24] and r["dtype"] == "torch.float32", (name, r)
