"""torch.export of every attnopt_triton op on CPU tensors, no GPU and no interpreter: the kernels
are never launched while tracing (triton_op traces its Python body with fake tensors and records
the wrap_triton calls), so this checks the registration that the GPU path relies on. Prints one
JSON object {op: {"nodes": n, "nodes_after_decompositions": n, "shape": [...]}}.

Usage: python tests/triton/export_ops.py          (without TRITON_INTERPRET)
The tests call `export_all()` from `children.py`'s build process.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import attnopt.forms.linear.triton  # noqa: E402, F401  (each import registers its form's ops)
import attnopt.forms.linear_window.triton  # noqa: E402, F401
import attnopt.forms.ssm.triton  # noqa: E402, F401
import attnopt.forms.window.triton  # noqa: E402, F401

B, H, Hkv, Nq, Nk, D, Dv = 2, 6, 3, 37, 45, 16, 24


def export_all() -> dict:
    ops = torch.ops.attnopt_triton
    keep = torch.ones(B, Nk, dtype=torch.bool)
    sinks = torch.zeros(B, 2, dtype=torch.int32)
    log2g = torch.full((H,), -0.1)
    beta = torch.ones(H)
    calls = {
        "linear_causal": lambda q, k, v: ops.linear_causal(q, k, v, keep, 1, 1e-6)[0],
        "linear_noncausal": lambda q, k, v: ops.linear_noncausal(q, k, v, keep, 1, 1e-6),
        "decay": lambda q, k, v: ops.decay(q, k, v, keep, log2g, 0, False, 0.25, 1e-6)[0],
        "window": lambda q, k, v: ops.window(q, k, v, keep, sinks, 8, True, 0.25)[0],
        "linear_window": lambda q, k, v: ops.linear_window(q, k, v, q, k, keep, sinks, beta, 8, True, 1, 0.25),
    }
    res = {}
    for name, fn in calls.items():
        class Mod(torch.nn.Module):
            def forward(self, q, k, v):
                return fn(q, k, v)

        q, k, v = torch.randn(B, H, Nq, D), torch.randn(B, Hkv, Nk, D), torch.randn(B, Hkv, Nk, Dv)
        ep = torch.export.export(Mod(), (q, k, v))
        target = f"attnopt_triton.{name}.default"
        count = lambda g: sum(str(n.target) == target for n in g.nodes if n.op == "call_function")  # noqa: E731
        out_node = [n for n in ep.graph.nodes if n.op == "output"][0].args[0][0]
        res[name] = {"nodes": count(ep.graph), "nodes_after_decompositions": count(ep.run_decompositions().graph),
                     "shape": list(out_node.meta["val"].shape), "dtype": str(out_node.meta["val"].dtype)}
    return res


if __name__ == "__main__":
    print(json.dumps(export_all()))
