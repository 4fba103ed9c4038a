"""The Triton kernels against dense fp64 oracles, run in Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before triton is imported, so every case runs in one child process
(`interpreted_cases.py`, started once per session) and reports JSON; each case below asserts its
own numbers. A second child imports the package without the interpreter: that must work and a
call must fail with one clear line.
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


def _child_env(interpret: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _start(args, interpret: bool):
    return subprocess.Popen([sys.executable, *args], env=_child_env(interpret), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _json_of(proc) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def children():
    """All child processes start together (two interpreter shards and the sm_90 compile), so the
    wall time is the slowest child's where cores are free, not their sum."""
    names = sorted(CASES)
    cases = os.path.join(HERE, "interpreted_cases.py")
    return {
        "shards": [_start([cases, *names[i::2]], True) for i in range(2)],
        "compile": _start([os.path.join(HERE, "compile_sm90.py")], False),
        "export": _start([os.path.join(HERE, "export_ops.py")], False),
    }


@pytest.fixture(scope="session")
def interpreted(children):
    res = {}
    for proc in children["shards"]:
        res.update(_json_of(proc))
    return res


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_dense_oracle(interpreted, name):
    res = interpreted[name]
    assert "error" not in res, res.get("traceback", res.get("error"))
    checks = res["checks"]
    assert checks, "a case must check at least one tensor"
    for what, c in checks.items():
        assert c["err"] <= c["tol"], f"{name}: {what} relative error {c['err']:.3g} > {c['tol']:.3g}"
        if what != "blind_rows_max":
            assert c["scale"] > 1e-3, f"{name}: {what} oracle is ~0, the comparison would prove nothing"


def test_import_without_driver_then_one_line_error():
    code = (
        "import torch\n"
        "from attnopt import forms\n"
        "import attnopt.forms.window.triton as t\n"
        "q = torch.randn(1, 2, 5, 8)\n"
        "print(forms.get('window').triton_supported(q, window=4, causal=True))\n"
        "try:\n"
        "    t.window_attention(q, q, q, window=4, causal=True)\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_child_env(False), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "Triton kernels need CUDA tensors, got cpu"
    assert lines[1].startswith("RuntimeError window_attention: the Triton kernels need CUDA tensors (got cpu)")
    assert len(lines) == 2


def test_kernels_compile_for_sm90_without_a_gpu(children):
    """The real backend (not the interpreter) accepts every kernel; the heaviest tiles fit in shared memory."""
    res = _json_of(children["compile"])
    assert len(res) == 25
    for name, r in res.items():
        assert 0 <= r["shared"] <= 227 * 1024, (name, r)  # H100/H200 per-block limit


def test_every_op_exports_as_one_node(children):
    """torch.export keeps each triton_op as one node, also after run_decompositions, with the right output meta."""
    res = _json_of(children["export"])
    assert sorted(res) == ["decay", "linear_causal", "linear_noncausal", "linear_window", "window"]
    for name, r in res.items():
        assert r["nodes"] == 1 and r["nodes_after_decompositions"] == 1, (name, r)
        assert r["shape"] == [2, 6, 37, 24] and r["dtype"] == "torch.float32", (name, r)


def test_is_supported_reasons():
    code = (
        "import json, torch\n"
        "from attnopt import forms\n"
        "t = lambda q, form, **kw: forms.get(form).triton_supported(q, **kw)\n"
        "q = torch.randn(1, 2, 5, 8)\n"
        "big = torch.randn(1, 2, 5, 32)\n"
        "print(json.dumps({\n"
        "  'window': t(q, form='window', window=4, causal=True, sinks=2),\n"
        "  'linear_elu': t(q, form='linear', feature_map='elu', causal=True),\n"
        "  'linear_state': t(q, form='linear', state=(q, q)),\n"
        "  'taylor_d32': t(big, form='linear', feature_map='taylor'),\n"
        "  'fp64': t(q.double(), form='window', window=4, causal=True),\n"
        "  'decay_bad_map': t(q, form='ssm', feature_map='favor'),\n"
        "  'hybrid_grad': t(q.requires_grad_(), form='linear+window', window=4, causal=True),\n"
        "  'unknown': t(q, form='exact'),\n"
        "}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_child_env(True), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["window"] is None and r["linear_elu"] is None
    assert "state" in r["linear_state"]
    assert "1057 features" in r["taylor_d32"]
    assert "torch.float64" in r["fp64"]
    assert "favor" in r["decay_bad_map"]
    assert "backward" in r["hybrid_grad"]
    assert "exact" in r["unknown"]
