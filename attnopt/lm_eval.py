"""`python -m attnopt.lm_eval ARGS`: lm-evaluation-harness's own command line with the model "attnopt"
registered (attnopt.evaluation.harness), as fla's `python -m evals.harness`:

    python -m attnopt.lm_eval --model attnopt --model_args pretrained=DIR,policy=gla+window:64 \\
        --tasks TASK --include_path TASKDIR --device cpu

This module is `attnopt.lm_eval`; `import lm_eval` inside it is the harness (absolute imports).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

if __name__ == "__main__" and not __package__:  # run as a file: its folder must not shadow the real lm_eval
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main(argv: Optional[list] = None) -> int:
    """Run lm-eval's command line on `argv` (default sys.argv[1:]) with "attnopt" registered."""
    try:
        import attnopt.evaluation.harness  # noqa: F401  (registers the model)
        from lm_eval.__main__ import cli_evaluate
    except ImportError as exc:
        print(f"attnopt.lm_eval: {exc}", file=sys.stderr)
        return 2
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
