"""`attnopt` command line. Subcommands: `inspect MODEL` (more are added by other passes).

Every expected failure (bad MODEL, model that does not trace, no attention) prints one clear
message to stderr and exits non-zero; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

EXIT_BAD_MODEL = 2
EXIT_CAPTURE = 3
EXIT_NO_ATTENTION = 4


class CliError(Exception):
    """An expected failure: message for the user, and the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnopt", description="Find attention in PyTorch models and rewrite it.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("inspect", help="list the attention sites of a model and near misses with reasons")
    p.add_argument("model", metavar="MODEL", nargs="?", default="minilm",
                   help="'minilm' (default), a Hugging Face model directory, or path/to/file.py:factory")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--method", choices=("export", "dynamo"), default="export",
                   help="how to capture the graph (default: export)")
    p.add_argument("--static", action="store_true", help="capture with static shapes (default: dynamic length)")
    p.set_defaults(run=run_inspect)
    return parser


def run_inspect(ns: argparse.Namespace) -> int:
    from attnopt.inspection import inspect
    from attnopt.models import ModelSpecError, load_model
    from attnopt.passes.capture import CaptureError

    try:
        model, args, kwargs, description = load_model(ns.model)
    except ModelSpecError as exc:
        raise CliError(f"bad MODEL: {exc}", EXIT_BAD_MODEL) from exc
    try:
        result = inspect(model, *args, method=ns.method, dynamic=not ns.static, **kwargs)
    except CaptureError as exc:
        raise CliError(f"could not capture {description}: {exc}", EXIT_CAPTURE) from exc
    if ns.json:
        data = result.to_dict()
        data["model"] = description
        print(json.dumps(data, indent=2))
    else:
        print(f"model: {description}")
        print(result)
        c = result.counts
        print(f"\ncapture {c.get('seconds_capture', 0):.2f} s, detect {c.get('seconds_detect', 0):.2f} s")
    if not result.sites:
        raise CliError(f"no attention found in {description}"
                       + (f" ({len(result.near_misses)} near miss(es) listed above)" if result.near_misses else ""),
                       EXIT_NO_ATTENTION)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return ns.run(ns)
    except CliError as exc:
        print(f"attnopt {ns.command}: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
