"""attnopt: find the attention in a PyTorch model, rewrite it per policy, and prove how far it moved.

    opt = attnopt.compile(model, policy, example_inputs=...)
    opt.attnopt_report.to_html("report.html")
"""

from __future__ import annotations

from attnopt.version import __version__

__all__ = ["inspect", "compile", "backend", "calibrate", "export_onnx", "Policy", "PolicyError", "ops", "hf", "forms",
           "save", "load", "evaluate", "__version__"]


def __getattr__(name: str):
    # Imports are lazy so `import attnopt` stays cheap and the CLI can print errors before torch loads.
    if name == "inspect":
        from attnopt.inspection import inspect

        return inspect
    if name in ("compile", "backend"):
        from attnopt import compiler

        return getattr(compiler, "compile" if name == "compile" else "backend")
    if name in ("save", "load"):
        from attnopt import saving

        return getattr(saving, name)
    if name == "export_onnx":
        from attnopt.backends.onnx.export import export_onnx

        return export_onnx
    if name == "evaluate":
        from attnopt.evaluation.audit import evaluate

        return evaluate
    if name == "calibrate":
        from attnopt.calibration import calibrate

        return calibrate
    if name == "Policy":
        from attnopt.policy import Policy

        return Policy
    if name == "PolicyError":
        from attnopt.ir.errors import PolicyError

        return PolicyError
    if name in ("ops", "hf", "forms"):
        import importlib

        return importlib.import_module(f"attnopt.{name}")
    raise AttributeError(f"module 'attnopt' has no attribute {name!r}")
