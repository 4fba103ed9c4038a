"""`attnopt` command line (typer, rich): `inspect MODEL`, `compile MODEL --policy P`, `calibrate`, `export`,
`generate DIR`, `bench`, `demo`.

Every expected failure (bad argument or MODEL, model that does not trace, no attention, Ctrl-C)
prints one line to stderr and returns its exit code; no traceback. Progress goes to stderr too: a
bar on a terminal, plain lines "attnopt <command>: [m:ss] ..." otherwise (attnopt.progress).
`main(argv) -> int` is the entry point; it never calls sys.exit, so tests read the code it returns.

Importing this module must not import torch or transformers (`attnopt --help` would take seconds):
every command imports what it needs when it runs, and the help text is written out here.
"""

from __future__ import annotations

import contextvars
import enum
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import typer

from attnopt import progress as progress_lines

try:  # typer 0.2x vendors click: its parse errors derive from TyperException
    from typer import TyperException as _ParseError
except ImportError:  # older typer raises click's own
    from click import ClickException as _ParseError

EXIT_OK = 0
EXIT_BAD_ARGUMENT = 2
EXIT_CAPTURE = 3
EXIT_NO_ATTENTION = 4
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = (
    "Exit codes: 0 success; 2 bad argument, option or MODEL; 3 the model could not be captured; "
    "4 no attention found; 130 interrupted."
)
MODEL_KINDS = "a Hugging Face model directory, or path/to/file.py:factory"
MODEL_HELP = f"'minilm' (default), {MODEL_KINDS}"


class CliError(Exception):
    """An expected failure: message for the user, and the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
        self.command: Optional[str] = None  # the subcommand it came from, set by _guarded


# The presets --policy lists: each registered form's own (attnopt.forms.registry(), cheapest first),
# then the recipes. Written out, not read from the registry, which imports torch; tests/test_cli.py
# checks that it is the registry's list.
POLICY_PRESETS = (
    "linear", "linear:favor", "linear:hedgehog", "linear:taylor", "linear:relu", "delta", "delta:0.5", "gla",
    "gla:elu", "gla+gate:head", "gla+window:64", "gla+window:64+sinks:4", "linear+window:64",
    "linear+window:64+sinks:4", "linear+window:64+map:elu", "ssm", "ssm:0.95", "window:256", "window:256+sinks:4",
    "reuse", "reuse:16", "reuse+block:64", "reuse+every:3", "exact", "hybrid", "auto",
)


def policy_presets_help() -> str:
    """The preset list of --policy."""
    return ", ".join(POLICY_PRESETS)


def _epilog(*examples: str) -> str:
    # typer's rich help joins single newlines; each paragraph is separated by a blank line.
    return "\n\n".join(["Examples:"] + [f"  {e}" for e in examples] + [EXIT_CODES_HELP])


# The subcommand running now and when it started (time.monotonic()), for the progress lines
# ("attnopt compile: [m:ss] ...", counted from the command's start).
_COMMAND: contextvars.ContextVar[str] = contextvars.ContextVar("attnopt_command", default="")
_STARTED: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("attnopt_started", default=None)


def _prefix() -> str:
    return f"attnopt {_COMMAND.get()}".rstrip()


def progress(message: str, quiet: bool = False):
    """One slow step (model load, capture): a spinner on a terminal, a plain line on stderr otherwise,
    nothing when quiet. A context manager yielding update(text, done, total)."""
    return progress_lines.spinner(message, _prefix(), quiet, _STARTED.get())


def step_bar(title: str, quiet: bool = False):
    """A job of named steps (compile, bench): a bar on a terminal, rate-limited plain lines on stderr
    otherwise, nothing when quiet. A context manager yielding update(text, done, total)."""
    return progress_lines.step_bar(title, _prefix(), quiet, _STARTED.get())


class Dispatch(str, enum.Enum):
    auto = "auto"
    off = "off"


DISPATCH_HELP = ("auto: each rewritten site runs exact attention below its form's measured crossover length "
                 "(timed once, cached in ~/.cache/attnopt/crossover.json); off: the form at every length (unless "
                 "a rule sets min_seq_len). Default: $ATTNOPT_DISPATCH, else auto")


class Method(str, enum.Enum):
    export = "export"
    dynamo = "dynamo"


def _version(value: bool) -> None:
    if value:
        from attnopt import __version__

        typer.echo(f"attnopt {__version__}")
        raise typer.Exit()


app = typer.Typer(
    name="attnopt",
    help="Find attention in PyTorch models, rewrite it into cheaper forms per policy, and report how far "
         "the output moved.",
    epilog=_epilog("attnopt inspect minilm", "attnopt compile minilm --policy window:64+sinks:4",
                   "attnopt bench --policy linear --lengths 512,2048", "attnopt demo --out demo_out"),
    add_completion=False,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


# `attnopt generate DIR --prompt ...`: the decode-folder runner (numpy + onnxruntime; no torch)
from attnopt.onnx.cli import GENERATE_EPILOG, GENERATE_HELP, generate_command  # noqa: E402

app.command("generate", help=GENERATE_HELP, epilog=GENERATE_EPILOG)(generate_command)
# `attnopt eval MODEL`: the capability audit (retrieval probes, perplexity by position); torch loads when it runs
from attnopt.evaluation.cli import EVAL_EPILOG, EVAL_HELP, eval_command  # noqa: E402
app.command("eval", help=EVAL_HELP, epilog=EVAL_EPILOG)(eval_command)

@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="print the version and exit"),
) -> None:
    """Find attention in PyTorch models, rewrite it into cheaper forms per policy, and report how far
    the output moved."""


def _guarded(command: str, fn):
    """Run a subcommand: its failures and progress lines name it, and Ctrl-C is an expected failure
    (one line, code 130), not a traceback."""
    token, started = _COMMAND.set(command), _STARTED.set(time.monotonic())
    try:
        return fn()
    except CliError as exc:
        exc.command = exc.command or command
        raise
    except KeyboardInterrupt as exc:
        error = CliError("interrupted", EXIT_INTERRUPTED)
        error.command = command
        raise error from exc
    finally:
        _COMMAND.reset(token)
        _STARTED.reset(started)


def _load(spec: str, quiet: bool = False, **text_opts):
    with progress(f"loading {spec} ...", quiet):
        from attnopt.models import ModelSpecError, load_model  # torch: seconds on a cold start, after the line

        try:
            return load_model(spec, **text_opts)
        except ModelSpecError as exc:
            raise CliError(f"bad MODEL: {exc}", EXIT_BAD_ARGUMENT) from exc


@app.command(
    "inspect",
    help="List the attention sites of a model, and its near misses with reasons.",
    epilog=_epilog("attnopt inspect minilm", "attnopt inspect examples/custom_model.py:build --json",
                   "attnopt inspect path/to/hf_model_dir --method dynamo --static"),
)
def inspect_command(
    model: str = typer.Argument("minilm", metavar="MODEL", help=MODEL_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON (no progress line)"),
    method: Method = typer.Option(Method.export, "--method", help="how to capture the graph"),
    static: bool = typer.Option(False, "--static", help="capture with static shapes (default: dynamic length)"),
) -> int:
    return _guarded("inspect", lambda: run_inspect(model, as_json, method.value, static))


def run_inspect(spec: str, as_json: bool, method: str, static: bool) -> int:
    model, args, kwargs, description = _load(spec, quiet=as_json)  # the line first: torch takes seconds cold
    from attnopt.inspection import inspect
    from attnopt.ir.errors import CaptureError

    try:
        with progress(f"capturing {description} ...", as_json):
            result = inspect(model, *args, method=method, dynamic=not static, **kwargs)
    except CaptureError as exc:
        raise CliError(f"could not capture {description}: {exc}", EXIT_CAPTURE) from exc
    if as_json:
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
    return EXIT_OK


@app.command(
    "compile",
    help="Rewrite a model's attention per a policy, verify the drift, and write the HTML and JSON reports (and "
         "Markdown with --md); print a short summary: sites rewritten, drift, measured time, where the files are.",
    epilog=_epilog("attnopt compile minilm --policy window:64+sinks:4",
                   "attnopt compile minilm --policy linear+window:64+sinks:4 --html out/report.html",
                   "attnopt compile examples/custom_model.py:build --policy my_policy.yaml --e2e-tolerance none",
                   "attnopt compile minilm --policy linear --dispatch off",
                   "attnopt compile minilm --policy linear --md report.md --quiet"),
)
def compile_command(
    model: str = typer.Argument("minilm", metavar="MODEL", help=MODEL_HELP),
    policy: str = typer.Option("window:64+sinks:4", "--policy",
                               help=f"preset ({policy_presets_help()}) or a .yaml/.toml/.json policy file"),
    tolerance: Optional[float] = typer.Option(
        None, "--tolerance", help="relative RMS drift of a site's output at which it reverts (default: per form, "
                                  "all below 1)"),
    e2e_tolerance: str = typer.Option(
        "0.5", "--e2e-tolerance", metavar="FLOAT|none",
        help="end-to-end budget: worst relative RMS drift of the model outputs at which the worst sites revert "
             "one by one ('none': no budget)"),
    seq_len: int = typer.Option(256, "--seq-len", help="tokens per example for Hugging Face models (built-in "
                                                       "English passages)"),
    html: str = typer.Option("report.html", "--html", help="where to write the HTML report"),
    json_out: Optional[str] = typer.Option(None, "--json", help="where to write the JSON report (default: beside "
                                                                "--html)"),
    md: Optional[str] = typer.Option(None, "--md", help="also write the report as Markdown to this file"),
    dispatch: Optional[Dispatch] = typer.Option(None, "--dispatch", help=DISPATCH_HELP),
    quiet: bool = typer.Option(False, "--quiet", help="no progress on stderr"),
) -> int:
    return _guarded("compile", lambda: run_compile(model, policy, tolerance, e2e_tolerance, seq_len, html, json_out,
                                                   dispatch.value if dispatch else None, md, quiet))


def run_compile(spec: str, policy_text: str, tolerance: Optional[float], e2e_text: str, seq_len: int,
                html: str, json_out: Optional[str], dispatch: Optional[str] = None, md: Optional[str] = None,
                quiet: bool = False) -> int:
    """Compile, write the reports, and print a short summary (the full report is in the files)."""
    from attnopt.ir.errors import PolicyError
    from attnopt.policy import Policy
    from attnopt.samples import english_passages

    try:
        policy = Policy.parse(policy_text)
    except PolicyError as exc:
        raise CliError(f"bad --policy: {exc}", EXIT_BAD_ARGUMENT) from exc
    if tolerance is not None and not 0 <= tolerance < float("inf"):
        raise CliError(f"--tolerance must be a finite number >= 0 (relative RMS drift per site); got {tolerance}",
                       EXIT_BAD_ARGUMENT)
    e2e = parse_e2e_tolerance(e2e_text)
    if seq_len < 1:
        raise CliError(f"--seq-len must be >= 1; got {seq_len}", EXIT_BAD_ARGUMENT)
    json_path = json_out or os.path.splitext(html)[0] + ".json"
    check_writable({"--html": html, "--json": json_path, **({"--md": md} if md else {})})
    model, args, kwargs, description = _load(spec, quiet=quiet, texts=english_passages(), max_length=seq_len)
    from torch import nn

    from attnopt.hf.routes import position_limit

    limit = position_limit(model) if isinstance(model, nn.Module) else None
    if isinstance(limit, int) and seq_len > limit:
        raise CliError(f"--seq-len {seq_len} is beyond {description}'s {limit} positions; use --seq-len {limit} "
                       "or less", EXIT_BAD_ARGUMENT)
    opt = compile_or_fail(model, policy, (args, kwargs), description, quiet=quiet, tolerance=tolerance,
                          e2e_tolerance=e2e, dispatch=dispatch)
    report = opt.attnopt_report
    judged = judge_decoder(model, opt, args, kwargs, description, quiet)
    if judged:
        report.notes.append(f"{sites_text(report)}; {judged}")
    paths = write_reports(report, html, json_path, md)
    print("\n".join(compile_summary(report, description, judged, paths)))
    return EXIT_OK


def compile_summary(report, description: str, judged: Optional[str], paths: list) -> list[str]:
    """What `attnopt compile` prints: the sites, the drift, the measured time, and where the full report is."""
    lines = [f"{description}: {sites_text(report)}", f"drift: {judged or drift_text(report)}"]
    if report.forward_time is not None:
        ft = report.forward_time
        lines.append(f"time: {ft.text()}; {ft.conditions.short()}; compile took {report.timings.get('total', 0):.1f} s")
    shown = f"{', '.join(paths[:-1])} and {paths[-1]}" if len(paths) > 1 else paths[0]
    lines.append(f"wrote {shown} (every site's form or reason, drift, costs, decode memory, timings)")
    return lines


def sites_text(report) -> str:
    """E.g. "10/12 sites rewritten (1 kept, 1 reverted)"."""
    t = report.totals
    others = ", ".join(f"{t[s]} {s}" for s in ("kept", "reverted", "unsupported", "unverified") if t[s])
    return f"{t['rewritten']}/{t['sites']} sites rewritten" + (f" ({others})" if others else "")


def drift_text(report) -> str:
    """The end-to-end drift, as measured, and the budget that held it."""
    e2e, parts = report.end_to_end, []
    if e2e is not None and e2e.embedding_cosine is not None:
        parts.append(f"mean embedding cosine {e2e.embedding_cosine:.4f}")
    if e2e is not None and e2e.worst is not None:
        parts.append(f"worst output relative RMS {e2e.worst.rel_rms:.4g}")
    text = ", ".join(parts) or "not measured"
    budget = (report.counts.get("budget") or {}).get("e2e_tolerance")
    if budget is not None:
        reverted = len(report.budget_steps or [])
        text += f" (end-to-end budget {budget:g}" + (f"; {reverted} sites reverted to hold it)" if reverted else ")")
    return text


def check_writable(paths: dict) -> None:
    """One line before any work when a report path cannot be written (a folder, no permission)."""
    for flag, path in paths.items():
        if os.path.isdir(path):
            raise CliError(f"{flag} {path} is a directory; give a file path", EXIT_BAD_ARGUMENT)
        existed = os.path.exists(path)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a"):
                pass
        except OSError as exc:
            raise CliError(f"{flag} {path} cannot be written ({exc.strerror or exc}); give a writable path",
                           EXIT_BAD_ARGUMENT) from exc
        if not existed:
            os.remove(path)


def judge_decoder(model, opt, args, kwargs, description: str, quiet: bool = False) -> Optional[str]:
    """For a causal LM: its logits drift and the perplexity of the original and the rewritten model on
    the built-in text (the example compile verified on, so in-sample), as one line; None for other
    models."""
    from attnopt.analysis.perplexity import is_causal_lm, perplexity

    if args or not is_causal_lm(model) or "input_ids" not in kwargs:
        return None
    from attnopt.targets import target_of

    report = opt.attnopt_report
    per_output = getattr(report.end_to_end, "per_output", None) or {}
    drift = next((d for name, d in per_output.items() if "logits" in name), None)
    parts = [] if drift is None else [f"logits relative RMS drift {drift.rel_rms:.4g} (worst verification batch)"]
    ids = kwargs["input_ids"]
    if "random token ids" in description:
        return "; ".join(parts + ["perplexity not measured (random token ids: the directory has no tokenizer)"])
    with progress("measuring perplexity, original and rewritten ...", quiet):
        before, after = perplexity(model, kwargs), perplexity(opt, kwargs)
    if before is None or after is None:
        return "; ".join(parts) or None
    text = "; ".join(parts + [f"perplexity on the built-in text ({ids.shape[0]}x{ids.shape[1]} tokens, in-sample): "
             f"{before:.4g} original, {after:.4g} rewritten ({after / before:.3f}x)"])
    waiting = {sid: m for sid, m in target_of(opt).site_modules().items() if m.min_seq_len > ids.shape[1]}
    if not waiting:
        return text
    saved = {sid: m.min_seq_len for sid, m in waiting.items()}
    try:
        for m in waiting.values():
            m.min_seq_len = 0
        acting = perplexity(opt, kwargs)
    finally:
        for sid, m in waiting.items():
            m.min_seq_len = saved[sid]
    return text + (f", where {len(waiting)} sites run exact below their dispatch threshold; with every form "
                   f"acting at this length {acting:.4g} ({acting / before:.3f}x)")


def parse_e2e_tolerance(text: str) -> Optional[float]:
    try:
        e2e = None if text.strip().lower() == "none" else float(text)
    except ValueError:
        e2e = float("nan")
    if e2e is not None and not 0 < e2e < float("inf"):
        raise CliError(f"--e2e-tolerance must be a finite number > 0 or 'none'; got {text}", EXIT_BAD_ARGUMENT)
    return e2e


def compile_or_fail(model, policy, example_inputs, description: str, quiet: bool = False, **options):
    """attnopt.compile with the CLI's progress and failures: capture (3) and no attention (4)."""
    from attnopt.compiler import compile as attnopt_compile
    from attnopt.ir.errors import CaptureError

    try:
        # The policy's name ("window:64+sinks:4", a file's stem), not its multi-line description.
        with step_bar(f"compiling {description} with {getattr(policy, 'name', policy)}", quiet) as update, \
                warnings.catch_warnings():
            # The CLI says "no attention found" itself, once, as its error (exit 4).
            warnings.filterwarnings("ignore", message=r"attnopt\.compile\(.*\): found no attention")
            opt = attnopt_compile(model, policy, example_inputs=example_inputs, name=description, progress=update,
                                  **options)
    except CaptureError as exc:
        raise CliError(f"could not capture {description}: {exc}", EXIT_CAPTURE) from exc
    if not opt.attnopt_report.sites:
        raise CliError(f"no attention found in {description}", EXIT_NO_ATTENTION)
    return opt


def write_reports(report, html: str, json_path: str, md: Optional[str] = None) -> list:
    """Write the HTML and JSON reports (and the Markdown one when asked); the paths written."""
    paths = [html, json_path] + ([md] if md else [])
    try:
        for path in paths:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        report.to_html(html)
        report.to_json(json_path)
        if md:
            with open(md, "w", encoding="utf-8") as f:
                f.write(report.to_markdown())
    except OSError as exc:
        raise CliError(f"could not write the report: {exc}", EXIT_BAD_ARGUMENT) from exc
    return paths


BENCH_POLICIES = ("linear", "window:256+sinks:4")  # attnopt.bench.DEFAULT_POLICIES; not imported (torch loads lazily)
BENCH_LENGTHS = "512,2048"


@app.command(
    "bench",
    help="Time a model's forward, original against each policy (compiled with the default dispatch), at a few "
         "lengths: interleaved, best of --repeats. MODEL 'decoder' (the default) is a built-in random-weight "
         "Llama-style decoder (4 layers, hidden 256, 8/2 heads); a Hugging Face model directory is fed random "
         "token ids of each length; a file.py:factory model is timed at its own example only. For the full "
         "study (8 layers, up to 32k tokens, peak memory, the zero-cost ceiling) run benchmarks/e2e_cpu.py.",
    epilog=_epilog("attnopt bench", "attnopt bench --policy linear --policy hybrid --lengths 1024,4096",
                   "attnopt bench minilm --policy window:64+sinks:4 --lengths 128,512 --json",
                   "attnopt bench examples/custom_model.py:build --policy linear --repeats 5"),
)
def bench_command(
    model: str = typer.Argument("decoder", metavar="MODEL", help=f"'decoder', 'minilm', {MODEL_KINDS}"),
    policy: Optional[list[str]] = typer.Option(None, "--policy", help="a policy to time (repeat the option); "
                                               f"default: {', '.join(BENCH_POLICIES)}"),
    lengths: str = typer.Option(BENCH_LENGTHS, "--lengths", help="comma-separated token counts"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="forwards per model and length (the best is kept)"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's own)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON (no progress bar)"),
    dispatch: Optional[Dispatch] = typer.Option(None, "--dispatch", help=DISPATCH_HELP),
    recalibrate_dispatch: bool = typer.Option(
        False, "--recalibrate-dispatch", help="measure every dispatch threshold the compiles read again, replacing "
        "the cached ones (run it on a quiet machine)"),
) -> int:
    if recalibrate_dispatch:
        os.environ["ATTNOPT_RECALIBRATE"] = "1"  # attnopt.passes.crossover.ENV_RECALIBRATE (torch loads lazily)
    return _guarded("bench", lambda: run_bench(model, list(policy or BENCH_POLICIES), lengths, repeats, threads,
                                               as_json, dispatch.value if dispatch else None))


def run_bench(spec: str, policies: list, lengths_text: str, repeats: int, threads: Optional[int],
              as_json: bool, dispatch: Optional[str] = None) -> int:
    """Compile each policy, then time every model at every length, taking turns (attnopt.bench); print
    a table or JSON."""
    import torch

    from attnopt import bench

    lengths = parse_lengths(lengths_text)
    parsed = parse_policies(policies)
    if threads is not None:
        torch.set_num_threads(threads)
    workload = bench_workload(spec, lengths, as_json)

    def compiler(model, policy, example_inputs, **options):
        return compile_or_fail(model, policy, example_inputs, workload.description, quiet=as_json, **options)

    with step_bar(f"bench {workload.description}", quiet=as_json) as update:
        result = bench.compare(workload, parsed, lengths, repeats, names=policies, compiler=compiler,
                               progress=update, dispatch=dispatch)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print_bench(result)
    return EXIT_OK


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise CliError(f"--lengths must be comma-separated positive token counts like 512,2048; got {text!r}",
                       EXIT_BAD_ARGUMENT)
    return lengths


def parse_policies(texts: list) -> list:
    from attnopt.ir.errors import PolicyError
    from attnopt.policy import Policy

    try:
        return [Policy.parse(p) for p in texts]
    except PolicyError as exc:
        raise CliError(f"bad --policy: {exc}", EXIT_BAD_ARGUMENT) from exc


def bench_workload(spec: str, lengths: list[int], quiet: bool):
    """MODEL as an attnopt.bench.Workload: 'decoder' is the built-in one, sized for the longest length."""
    from attnopt import bench

    if spec == "decoder":
        workload = bench.decoder_workload(max(lengths))
    else:
        model, args, kwargs, description = _load(spec, quiet=quiet)
        workload = bench.Workload(model, tuple(args), dict(kwargs), description)
    limit = workload.positions
    if workload.resizable and limit is not None and max(lengths) > limit:
        raise CliError(f"--lengths {max(lengths)} is beyond {workload.description}'s {limit} positions; use at most "
                       f"{limit}", EXIT_BAD_ARGUMENT)
    return workload


def print_bench(result) -> None:
    """The bench table (ms and speed-up per length), then each policy's sites and thresholds."""
    from rich.console import Console
    from rich.table import Table

    names = result.names
    table = Table("tokens", *[f"{name} ms" + ("" if name == "original" else " (speed-up)") for name in names],
                  title=f"{result.model}: forward, best of {result.repeats}, interleaved, {result.threads} thread(s)")
    for row in result.rows:
        table.add_row(str(row.length or "example"), *[
            f"{row.seconds[name] * 1e3:.1f}" + ("" if name == "original" else f" ({row.speedup[name]:.2f}x)")
            for name in names])
    console = Console(highlight=False)
    console.print(table)
    for text, thresholds in result.thresholds.items():
        shown = sorted({t for t in thresholds if t is not None})
        console.print(f"{text}: {result.rewritten[text]} sites rewritten; exact below "
                      f"{', '.join(map(str, shown)) or '-'} tokens (dispatch thresholds)")


@app.command(
    "demo",
    help="The whole job on built-in defaults, in under 3 minutes on 2 CPU cores: inspect and compile the "
         "pretrained MiniLM (window:64+sinks:4, linear+window:64+sinks:4; sites rewritten, mean embedding "
         "cosine), then time a small random-weight Llama-style decoder, original against rewritten, at "
         "several lengths. Writes report.html and report.json (the linear+window MiniLM report).",
    epilog=_epilog("attnopt demo", "attnopt demo --out demo_out", "attnopt demo --quick --threads 1"),
)
def demo_command(
    out: str = typer.Option(".", "--out", help="directory for report.html and report.json"),
    quick: bool = typer.Option(False, "--quick", help="time one length only, with a shorter fit (for tests)"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1,
                                          help="torch threads for the run (default: torch's own; 1 gives steadier "
                                               "timings on a busy machine)"),
) -> int:
    return _guarded("demo", lambda: run_demo(out, quick, threads))


def run_demo(out: str, quick: bool, threads: Optional[int]) -> int:
    import importlib.util

    from attnopt import demo
    from attnopt.ir.errors import CaptureError
    from attnopt.models import ModelSpecError

    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"--out {out} is a file; give a directory", EXIT_BAD_ARGUMENT)
    if importlib.util.find_spec("transformers") is None:
        raise CliError("the demo needs transformers (pip install -e '.[hf]')", EXIT_BAD_ARGUMENT)
    try:
        result = demo.run(out, quick=quick, step=step_bar, threads=threads)
    except ModelSpecError as exc:
        raise CliError(f"the demo needs the pretrained MiniLM: {exc}", EXIT_BAD_ARGUMENT) from exc
    except CaptureError as exc:
        raise CliError(f"could not capture: {exc}", EXIT_CAPTURE) from exc
    except OSError as exc:
        raise CliError(f"could not write the report under {out}: {exc}", EXIT_BAD_ARGUMENT) from exc
    demo.render(result)
    return EXIT_OK


@app.command(
    "export",
    help="Compile a model per a policy and export it to one ONNX file: each rewritten site lowered by its form "
         "for the target, checked with onnx.checker and against torch in ONNX Runtime at two lengths before the "
         "file is kept. Exit code 3 also covers an export that fails its checks.",
    epilog=_epilog("attnopt export minilm --policy window:64+sinks:4 --out minilm.onnx",
                   "attnopt export path/to/llama_dir --policy linear --target ort --out llama.onnx --json",
                   "attnopt export examples/custom_model.py:build --policy ssm --target onnx-std --out m.onnx"),
)
def export_command(
    model: str = typer.Argument("minilm", metavar="MODEL", help=MODEL_HELP),
    policy: str = typer.Option("linear", "--policy", help=f"preset ({policy_presets_help()}) or a policy file"),
    target: str = typer.Option("ort", "--target", help="ort (ONNX Runtime contrib kernels where exact), onnx-std "
                                                       "(standard ops only) or custom (attnopt-domain nodes)"),
    out: str = typer.Option("model.onnx", "--out", help="the ONNX file to write; for a causal LM, a path without "
                                                        "the .onnx suffix writes a decode folder instead"),
    seq_len: int = typer.Option(128, "--seq-len", help="export length for Hugging Face models (built-in passages)"),
    as_json: bool = typer.Option(False, "--json", help="print the export record (lowerings, op histograms, parity) "
                                                       "as JSON"),
) -> int:
    return _guarded("export", lambda: run_export(model, policy, target, out, seq_len, as_json))


def run_export(spec: str, policy_text: str, target: str, out: str, seq_len: int, as_json: bool) -> int:
    from attnopt.backends.onnx.export import check_target, export_onnx, writable_file
    from attnopt.ir.errors import ParityError, PolicyError
    from attnopt.policy import Policy
    from attnopt.samples import english_passages

    try:
        policy = Policy.parse(policy_text)
        check_target(target, None)
        writable_file(out)
    except (PolicyError, ValueError, OSError) as exc:
        raise CliError(f"bad option: {exc}", EXIT_BAD_ARGUMENT) from exc
    if seq_len < 2:
        raise CliError(f"--seq-len must be >= 2; got {seq_len}", EXIT_BAD_ARGUMENT)
    model, args, kwargs, description = _load(spec, quiet=as_json, texts=english_passages()[:1], max_length=seq_len)
    opt = compile_or_fail(model, policy, (args, kwargs), description, quiet=as_json)
    try:
        with progress(f"exporting {description} to {out} ...", as_json):
            result = export_onnx(opt, out, (args, kwargs), target=target, tokenizer=_directory_tokenizer(spec))
    except (ParityError, ValueError, RuntimeError) as exc:
        raise CliError(f"could not export {description}: {exc}", EXIT_CAPTURE) from exc
    except ImportError as exc:
        raise CliError(str(exc), EXIT_BAD_ARGUMENT) from exc
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        worst = max(p["rel_rms"] for p in result.parity)
        lowered = ", ".join(sorted({f"{s['form']}: {s['lowering']}" for s in result.sites})) or "no site rewritten"
        print(f"wrote {out} ({target}, opset {result.opset}): {lowered}; parity with torch: worst relative RMS "
              f"{worst:.2e} at lengths {', '.join(str(p['length']) for p in result.parity)}")
    return EXIT_OK


def _directory_tokenizer(spec: str):
    """The tokenizer a Hugging Face model directory ships (a decode folder carries it, so `attnopt
    generate` reads text); None for anything else."""
    from attnopt.models import _TOKENIZER_FILES

    path = Path(spec)
    if not path.is_dir() or not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer: the folder goes without one, as before
        return None


@app.command(
    "calibrate",
    help="Compile a model per a policy, then calibrate its rewritten sites (attention transfer on text, one passage "
         "per batch, every 4th held out) and report per-site and end-to-end drift before and after.",
    epilog=_epilog("attnopt calibrate minilm --policy linear+window:64",
                   "attnopt calibrate minilm --policy linear:hedgehog --steps 300 --texts passages.txt --out calib/",
                   "torchrun --nproc_per_node=2 -m attnopt calibrate minilm --policy linear+window:64 --json"),
)
def calibrate_command(
    model: str = typer.Argument("minilm", metavar="MODEL", help=MODEL_HELP),
    policy: str = typer.Option("linear+window:64", "--policy", help=f"preset ({policy_presets_help()}) or a policy file"),
    steps: Optional[int] = typer.Option(None, "--steps", min=1, help="Adam steps per site (default 200)"),
    params: str = typer.Option("forms", "--params", help="'forms' (maps, β, residuals) or 'forms+lora' (also LoRA "
                                                         "on q/k/v/o)"),
    texts: Optional[str] = typer.Option(None, "--texts", help="text file, one passage per line (default: the "
                                                              "built-in English passages)"),
    seq_len: int = typer.Option(256, "--seq-len", min=1, help="tokens per passage"),
    out: Optional[str] = typer.Option(None, "--out", help="directory for the calibrated model (attnopt.save), "
                                                          "report.html, report.json and the checkpoint"),
    as_json: bool = typer.Option(False, "--json", help="print the calibration record as JSON"),
) -> int:
    def run() -> int:
        import attnopt
        from attnopt.calibration import CalibrationError
        from attnopt.ir.errors import PolicyError
        from attnopt.policy import Policy
        from attnopt.samples import english_passages

        try:
            parsed = Policy.parse(policy)
        except PolicyError as exc:
            raise CliError(f"bad --policy: {exc}", EXIT_BAD_ARGUMENT) from exc
        if texts is not None and not os.path.isfile(texts):
            raise CliError(f"--texts {texts}: no such file", EXIT_BAD_ARGUMENT)
        from attnopt.calibration.options import PARAMS

        if params not in PARAMS:  # before the compile, not after it
            raise CliError(f"bad --params {params!r}: choose one of {', '.join(PARAMS)}", EXIT_BAD_ARGUMENT)
        if out is not None and os.path.exists(out) and not os.path.isdir(out):
            raise CliError(f"--out {out}: is a file; give a directory (made if missing) for the model, reports and "
                           "checkpoint", EXIT_BAD_ARGUMENT)
        passages = ([t for t in open(texts, encoding="utf-8").read().splitlines() if t.strip()] if texts
                    else english_passages())
        loaded, args, kwargs, description = _load(model, quiet=as_json, texts=passages, max_length=seq_len)
        rows = [v.shape[0] for v in list(args) + list(kwargs.values()) if hasattr(v, "shape") and v.dim() >= 1]
        if args or not rows or min(rows) < 2:
            raise CliError(f"{description}: calibration needs keyword inputs with at least 2 rows (passages) to "
                           "split into batches", EXIT_BAD_ARGUMENT)
        batches = [{k: (v[i : i + 1] if hasattr(v, "shape") and v.dim() >= 1 else v) for k, v in kwargs.items()}
                   for i in range(rows[0])]
        opt = compile_or_fail(loaded, parsed, batches[0], description, quiet=as_json)
        import torch

        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():  # torchrun
            torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        leader = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        try:
            attnopt.calibrate(opt, batches, steps=steps, params=params, progress=not as_json,
                              checkpoint=os.path.join(out, "checkpoint") if out else None)
        except CalibrationError as exc:
            raise CliError(str(exc), EXIT_BAD_ARGUMENT) from exc
        if out and leader:
            attnopt.save(opt, os.path.join(out, "model"))
            write_reports(opt.attnopt_report, os.path.join(out, "report.html"), os.path.join(out, "report.json"))
        if leader:
            cal = opt.attnopt_report.calibration
            print(json.dumps(cal, default=str) if as_json else opt.attnopt_report.notes[-1])
        return EXIT_OK

    return _guarded("calibrate", run)


def _one_line(message: str) -> str:
    return " ".join(message.split())


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line on `argv` (default sys.argv[1:]); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # transformers' own "Loading weights" bar would sit under the spinner and in captured stderr;
    # read when transformers is first imported, so in a fresh process it is off for the whole run.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="attnopt", standalone_mode=False)
    except CliError as exc:
        where = f"attnopt {exc.command}" if exc.command else "attnopt"
        print(f"{where}: {_one_line(str(exc))}", file=sys.stderr)
        return exc.code
    except _ParseError as exc:  # click's parse errors: no such command or option, bad value
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `attnopt`: the help, as a success
            print(ctx.get_help() if ctx is not None else exc.format_message())
            return EXIT_OK
        where = ctx.command_path if ctx is not None else "attnopt"
        print(f"{where}: {_one_line(exc.format_message())} (see '{where} --help')", file=sys.stderr)
        return EXIT_BAD_ARGUMENT if getattr(exc, "exit_code", 2) == 2 else exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        print("attnopt: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return rv if isinstance(rv, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
