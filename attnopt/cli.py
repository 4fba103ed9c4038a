"""`attnopt` command line. Subcommands: `inspect MODEL` and `compile MODEL --policy P`.

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


def policy_presets_help() -> str:
    """The preset list of --policy, from the forms registry (never typed twice)."""
    from attnopt import forms

    examples = [p for f in forms.registry().values() for p in f.presets]
    return ", ".join(examples + ["hybrid", "auto"])


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

    c = sub.add_parser("compile", help="rewrite a model's attention per a policy, verify drift, write the report")
    c.add_argument("model", metavar="MODEL", nargs="?", default="minilm",
                   help="'minilm' (default), a Hugging Face model directory, or path/to/file.py:factory")
    c.add_argument("--policy", default="window:64+sinks:4",
                   help=f"preset ({policy_presets_help()}) or a .yaml/.toml/.json policy file "
                        "(default: window:64+sinks:4)")
    c.add_argument("--tolerance", type=float, default=None,
                   help="relative RMS drift of a site's output at which it reverts (default: per form, all below 1)")
    c.add_argument("--e2e-tolerance", default="0.5", metavar="FLOAT|none",
                   help="end-to-end budget: worst relative RMS drift of the model outputs at which the worst sites "
                        "revert one by one (default 0.5; 'none': no budget)")
    c.add_argument("--seq-len", type=int, default=256,
                   help="tokens per example for Hugging Face models (built-in English passages; default 256)")
    c.add_argument("--html", default="report.html", help="where to write the HTML report (default report.html)")
    c.add_argument("--json", dest="json_out", default=None, help="where to write the JSON report (default: beside --html)")
    c.set_defaults(run=run_compile)
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


def run_compile(ns: argparse.Namespace) -> int:
    import os

    from attnopt.compiler import compile as attnopt_compile
    from attnopt.models import ModelSpecError, load_model
    from attnopt.passes.capture import CaptureError
    from attnopt.policy.errors import PolicyError
    from attnopt.policy import Policy
    from attnopt.samples import english_passages

    try:
        policy = Policy.parse(ns.policy)
    except PolicyError as exc:
        raise CliError(f"bad --policy: {exc}", EXIT_BAD_MODEL) from exc
    if ns.tolerance is not None and not 0 <= ns.tolerance < float("inf"):
        raise CliError(f"--tolerance must be a finite number >= 0 (relative RMS drift per site); got {ns.tolerance}",
                       EXIT_BAD_MODEL)
    try:
        e2e = None if ns.e2e_tolerance.strip().lower() == "none" else float(ns.e2e_tolerance)
    except ValueError:
        e2e = float("nan")
    if e2e is not None and not 0 < e2e < float("inf"):
        raise CliError(f"--e2e-tolerance must be a finite number > 0 or 'none'; got {ns.e2e_tolerance}", EXIT_BAD_MODEL)
    if ns.seq_len < 1:
        raise CliError(f"--seq-len must be >= 1; got {ns.seq_len}", EXIT_BAD_MODEL)
    try:
        model, args, kwargs, description = load_model(ns.model, texts=english_passages(), max_length=ns.seq_len)
    except ModelSpecError as exc:
        raise CliError(f"bad MODEL: {exc}", EXIT_BAD_MODEL) from exc
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and ns.seq_len > limit:
        raise CliError(f"--seq-len {ns.seq_len} is beyond {description}'s {limit} positions; use --seq-len {limit} or less",
                       EXIT_BAD_MODEL)
    try:
        opt = attnopt_compile(model, policy, example_inputs=(args, kwargs), tolerance=ns.tolerance,
                              e2e_tolerance=e2e, name=description)
    except CaptureError as exc:
        raise CliError(f"could not capture {description}: {exc}", EXIT_CAPTURE) from exc
    report = opt.attnopt_report
    if not report.sites:
        raise CliError(f"no attention found in {description}", EXIT_NO_ATTENTION)
    print(report.to_markdown())
    json_path = ns.json_out or os.path.splitext(ns.html)[0] + ".json"
    try:
        for path in (ns.html, json_path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        report.to_html(ns.html)
        report.to_json(json_path)
    except OSError as exc:
        raise CliError(f"could not write the report: {exc}", EXIT_BAD_MODEL) from exc
    e2e = report.end_to_end
    summary = f"{report.count('rewritten')}/{len(report.sites)} sites rewritten"
    if e2e is not None and e2e.embedding_cosine is not None:
        summary += f"; mean embedding cosine {e2e.embedding_cosine:.4f}"
    elif e2e is not None and e2e.worst is not None:
        summary += f"; worst output relative RMS drift {e2e.worst.rel_rms:.4g}"
    print(f"\n{summary}\nwrote {ns.html} and {json_path}")
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
