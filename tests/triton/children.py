"""The two child processes of test_triton_kernels.py; each prints one JSON object on its last line.

    TRITON_INTERPRET=1 python tests/triton/children.py interpret
        every case of interpreted_cases.py, and the forms' support reasons
    python tests/triton/children.py build
        no interpreter: importing the kernels works without a GPU and a call fails with one line;
        every kernel compiled for sm_90 (compile_sm90.py); the triton_ops exported (export_ops.py)

TRITON_INTERPRET is read when triton is imported, so the two modes cannot share a process. One
process per mode (there were six: two interpreter shards, the compile, the export and two checks)
saves importing torch, triton and attnopt four times. test_gated_triton.py runs gated_cases.py the
same way, in its own two processes.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))


def interpret() -> dict:
    import interpreted_cases

    return {"cases": interpreted_cases.run_cases([]), "supported": interpreted_cases.supported_reasons()}


def without_a_driver() -> list:
    """What a CPU-only user sees: the window form declines, and a direct call raises one line."""
    import torch

    from attnopt import forms
    import attnopt.forms.window.triton as t

    q = torch.randn(1, 2, 5, 8)
    seen = [forms.get("window").triton_supported(q, window=4, causal=True)]
    try:
        t.window_attention(q, q, q, window=4, causal=True)
        seen.append("no error")
    except RuntimeError as e:
        seen.append(f"RuntimeError {e}")
    return seen


def build() -> dict:
    res = {"without_a_driver": without_a_driver()}  # first: before the other kernel modules are imported

    import compile_sm90
    import export_ops

    res["compile"] = compile_sm90.compile_all()
    res["export"] = export_ops.export_all()
    return res


if __name__ == "__main__":
    mode = sys.argv[1:]
    if mode == ["interpret"] and os.environ.get("TRITON_INTERPRET") == "1":
        print(json.dumps(interpret()))
    elif mode == ["build"] and os.environ.get("TRITON_INTERPRET", "0") == "0":
        print(json.dumps(build()))
    else:
        sys.exit("usage: TRITON_INTERPRET=1 python children.py interpret | python children.py build (without TRITON_INTERPRET)")
