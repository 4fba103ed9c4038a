"""The capability audit: `evaluate(model, reference=...)` -> `EvalReport` (retrieval probes over a length x
depth grid, perplexity by position), and `lm_eval_model(opt, tokenizer)` for lm-evaluation-harness.

Imports are lazy, so the command line can register `attnopt eval` without loading torch.
"""

from __future__ import annotations

__all__ = ["evaluate", "EvalReport", "ModelScores", "PROBES", "lm_eval_model"]


def __getattr__(name: str):
    if name == "evaluate":
        from attnopt.evaluation.audit import evaluate

        return evaluate
    if name in ("EvalReport", "ModelScores"):
        from attnopt.evaluation import report

        return getattr(report, name)
    if name == "PROBES":
        from attnopt.evaluation.probes import PROBES

        return PROBES
    if name == "lm_eval_model":
        from attnopt.evaluation.harness import lm_eval_model

        return lm_eval_model
    raise AttributeError(f"module 'attnopt.evaluation' has no attribute {name!r}")
