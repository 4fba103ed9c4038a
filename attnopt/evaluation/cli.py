"""`attnopt eval MODEL [--policy P] [--reference]`: the capability audit from the command line.

MODEL is what `attnopt compile` takes (a Hugging Face directory, 'minilm', path/to/file.py:factory) or an
`attnopt.save` directory. With --policy the model is compiled first (dispatch off by default: the forms
act at every length, so the numbers do not depend on this machine's timings); --reference audits the
model before conversion beside it. Expected failures print one line to stderr and return their exit
code. Nothing here imports torch until a command runs, so `attnopt --help` stays fast.
`eval_command` is a typer command: `app.command("eval", help=EVAL_HELP, epilog=EVAL_EPILOG)(eval_command)`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from attnopt.evaluation.probes import DEPTHS, PROBES as PROBE_NAMES  # no torch: the CLI imports this module

EXIT_OK, EXIT_BAD_ARGUMENT, EXIT_CAPTURE, EXIT_NO_ATTENTION = 0, 2, 3, 4
DEFAULT_DEPTHS = ",".join(f"{d:g}" for d in DEPTHS)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "tokenizer.model")

EVAL_HELP = ("Audit what a model can still do where a cheap attention form can fail: retrieval probes (passkey, "
             "needle, multikey, mqar, copy) over a length x depth grid, scored by exact match of greedy generate() "
             "and teacher-forced accuracy, and perplexity by position; with --reference, the model before "
             "conversion side by side. Prints a summary; --html writes the depth x length heatmaps, --json the "
             "numbers.")
EVAL_EPILOG = ("Examples:\n\n  attnopt eval benchmarks/data/recall_lm --policy gla+window:64 --reference --lengths "
               "512,2048 --html audit.html\n\n  attnopt eval saved_dir --reference --probes passkey,copy --json "
               "audit.json\n\n  attnopt eval benchmarks/data/tiny_lm --lengths 256 --samples 2\n\nExit codes: 0 "
               "success; 2 bad argument, option or MODEL; 3 the model could not be captured; 4 no attention found; "
               "130 interrupted.")


class EvalError(Exception):
    def __init__(self, message: str, code: int = EXIT_BAD_ARGUMENT):
        super().__init__(message)
        self.code = code


def parse_lengths(text: Optional[str]) -> Optional[list]:
    if text is None:
        return None
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise EvalError(f"--lengths must be comma-separated positive token counts like 512,2048; got {text!r}")
    return lengths


def parse_probes(text: str) -> list:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in PROBE_NAMES]
    if unknown or not names:
        raise EvalError(f"--probes: unknown probe {(unknown or [text])[0]!r}; known probes: {', '.join(PROBE_NAMES)}")
    return names


def parse_depths(text: str) -> list:
    try:
        depths = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        depths = []
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise EvalError(f"--depths must be comma-separated fractions from 0 (start) to 1 (just before the question) "
                        f"like {DEFAULT_DEPTHS}; got {text!r}")
    return depths


def parse_tolerances(tolerance: Optional[float], e2e_text: Optional[str]) -> dict:
    """compile's tolerance options, given only when set (compile's defaults otherwise)."""
    out: dict = {}
    if tolerance is not None:
        if not 0 <= tolerance < float("inf"):
            raise EvalError(f"--tolerance must be a finite number >= 0 (relative RMS drift per site); got {tolerance}")
        out["tolerance"] = tolerance
    if e2e_text is not None:
        try:
            e2e = None if e2e_text.strip().lower() == "none" else float(e2e_text)
        except ValueError:
            e2e = float("nan")
        if e2e is not None and not 0 < e2e < float("inf"):
            raise EvalError(f"--e2e-tolerance must be a finite number > 0 or 'none'; got {e2e_text}")
        out["e2e_tolerance"] = e2e
    return out


def writable(flag: str, path: Optional[str]) -> None:
    if path is None:
        return
    if os.path.isdir(path):
        raise EvalError(f"{flag} {path} is a directory; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise EvalError(f"{flag} {path} cannot be written (no such writable folder {folder}); give a writable path")


def progress_printer(quiet: bool):
    """(update, close): a rich bar on a terminal, plain lines otherwise, nothing when quiet."""
    if quiet:
        return (lambda text, done=None, total=None: None), (lambda: None)
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        def line(text: str, done: Optional[int] = None, total: Optional[int] = None) -> None:
            count = f"[{done}/{total}] " if total else ""
            print(f"attnopt eval: {count}{text}", file=sys.stderr, flush=True)

        return line, (lambda: None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True)
    task = bar.add_task("attnopt eval", total=None)
    bar.start()

    def update(text: str, done: Optional[int] = None, total: Optional[int] = None) -> None:
        bar.update(task, description=f"eval: {text}"[:70], completed=done or 0, total=total, refresh=True)

    return update, bar.stop


def _tokenizer(spec: str, explicit: Optional[str]):
    """--tokenizer, else the MODEL directory's own tokenizer, else None (UTF-8 bytes)."""
    folder = explicit or (spec if os.path.isdir(spec) else None)
    if folder is None or (explicit is None and not any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise EvalError(f"--tokenizer {folder}: no tokenizer could be loaded ({type(exc).__name__}: "
                        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from exc


def _saved_reference(path: Path):
    """The saved directory's own transformers weights without attnopt's sites: the model before conversion."""
    import transformers

    from attnopt.models import task_class

    cls = task_class(transformers, path)
    return cls.from_pretrained(str(path), attn_implementation="sdpa").eval()


def load_models(spec: str, policy_text: Optional[str], reference: bool, compile_options: dict, say: Callable):
    """(model to audit, reference or None, description)."""
    from attnopt.models import ModelSpecError, load_model

    saved = os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "attnopt.json"))
    if saved:
        if policy_text is not None:
            raise EvalError(f"MODEL {spec} is an attnopt.save directory, already compiled; drop --policy")
        import attnopt
        from attnopt.ir.errors import SaveError

        say(f"loading {spec}")
        try:
            model = attnopt.load(spec)
        except SaveError as exc:
            raise EvalError(f"bad MODEL: {exc}") from exc
        return model, (_saved_reference(Path(spec)) if reference else None), f"attnopt.save directory {spec}"
    if reference and policy_text is None:
        raise EvalError("--reference audits the model before conversion beside the converted one: give --policy, "
                        "or MODEL as an attnopt.save directory")
    from attnopt.compiler import compile as attnopt_compile
    from attnopt.ir.errors import CaptureError, PolicyError
    from attnopt.policy import Policy
    from attnopt.samples import english_passages

    try:  # before the model loads: a typo costs nothing
        policy = Policy.parse(policy_text) if policy_text is not None else None
    except PolicyError as exc:
        raise EvalError(f"bad --policy: {exc}") from exc
    say(f"loading {spec}")
    try:
        model, args, kwargs, description = load_model(spec, texts=english_passages(), max_length=256)
    except ModelSpecError as exc:
        raise EvalError(f"bad MODEL: {exc}") from exc
    if policy is None:
        return model, None, description
    say(f"compiling {description} with {policy_text}")
    try:
        opt = attnopt_compile(model, policy, example_inputs=(args, kwargs), name=description,
                              progress=lambda text, done=None, total=None: say(f"compile: {text}"), **compile_options)
    except CaptureError as exc:
        raise EvalError(f"could not capture {description}: {exc}", EXIT_CAPTURE) from exc
    report = opt.attnopt_report
    if not report.sites:
        raise EvalError(f"no attention found in {description}", EXIT_NO_ATTENTION)
    print(f"compiled {description} with {policy_text}: {report.count('rewritten')}/{len(report.sites)} sites "
          "rewritten")
    return opt, (model if reference else None), description


def run_eval(spec: str, policy: Optional[str], reference: bool, lengths_text: Optional[str], probes_text: str,
             depths_text: str, samples: int, texts: Optional[str], tokenizer: Optional[str], html: Optional[str],
             json_out: Optional[str], seed: int, dispatch: str, threads: Optional[int], quiet: bool,
             tolerance: Optional[float] = None, e2e_tolerance: Optional[str] = None) -> int:
    lengths = parse_lengths(lengths_text)
    probes = parse_probes(probes_text)
    depths = parse_depths(depths_text)
    if samples < 1:
        raise EvalError(f"--samples must be >= 1; got {samples}")
    if dispatch not in ("off", "auto"):
        raise EvalError(f"--dispatch must be 'off' or 'auto'; got {dispatch!r}")
    compile_options = {"dispatch": dispatch, **parse_tolerances(tolerance, e2e_tolerance)}
    if policy is None and len(compile_options) > 1:
        raise EvalError("--tolerance and --e2e-tolerance are compile options: give them with --policy")
    if texts is not None and not os.path.isfile(texts):
        raise EvalError(f"--texts {texts}: no such file")
    writable("--html", html)
    writable("--json", json_out)
    text = Path(texts).read_text(encoding="utf-8") if texts else None
    update, close = progress_printer(quiet)
    try:
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        model, ref, description = load_models(spec, policy, reference, compile_options, update)
        tok = _tokenizer(spec, tokenizer)
        from attnopt.evaluation.audit import evaluate

        try:
            report = evaluate(model, reference=ref, tokenizer=tok, texts=text, probes=probes, lengths=lengths,
                              depths=depths, samples=samples, seed=seed, progress=update,
                              name=f"{spec} [{policy}]" if policy else spec,
                              reference_name=f"{spec} (original)" if ref is not None else None)
        except (ValueError, TypeError) as exc:
            raise EvalError(str(exc)) from exc
    finally:
        close()
    print(report.summary())
    try:
        if html:
            report.to_html(html)
        if json_out:
            report.to_json(json_out)
    except OSError as exc:
        raise EvalError(f"could not write the audit: {exc}") from exc
    written = [p for p in (html, json_out) if p]
    if written:
        print(f"wrote {' and '.join(written)}")
    return EXIT_OK


def eval_command(
    model: str = typer.Argument(..., metavar="MODEL", help="a Hugging Face model directory, path/to/file.py:factory, "
                                "or an attnopt.save directory"),
    policy: Optional[str] = typer.Option(None, "--policy", help="compile MODEL with this policy (a preset or a policy "
                                         "file) and audit the result"),
    reference: bool = typer.Option(False, "--reference", help="also audit the model before conversion, side by side"),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="comma-separated tokens per probe row (default: a "
                                          "quarter of the model's positions and all of them)"),
    probes: str = typer.Option(",".join(PROBE_NAMES), "--probes", help="comma-separated probes"),
    depths: str = typer.Option(DEFAULT_DEPTHS, "--depths", help="comma-separated depths of the fact, 0 (start) to 1"),
    samples: int = typer.Option(4, "--samples", help="rows per (probe, length, depth) cell"),
    texts: Optional[str] = typer.Option(None, "--texts", help="text file for perplexity and the probes' haystacks "
                                        "(default: the built-in English passages)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer directory (default: MODEL's own; "
                                            "none: UTF-8 bytes for a 256-token vocabulary)"),
    html: Optional[str] = typer.Option(None, "--html", help="write the heatmaps and tables here"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the numbers here"),
    seed: int = typer.Option(0, "--seed", help="probe seed"),
    dispatch: str = typer.Option("off", "--dispatch", help="with --policy: 'off' (default; the forms act at every "
                                 "length) or 'auto' (compile's measured thresholds: exact below them)"),
    tolerance: Optional[float] = typer.Option(None, "--tolerance", help="with --policy: compile's per-site drift "
                                              "tolerance (default: per form; 10 keeps every site rewritten)"),
    e2e_tolerance: Optional[str] = typer.Option(None, "--e2e-tolerance", metavar="FLOAT|none", help="with --policy: "
                                                "compile's end-to-end budget (default 0.5; 'none': no budget)"),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="torch threads (default: torch's own)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress on stderr"),
) -> int:
    try:
        return run_eval(model, policy, reference, lengths, probes, depths, samples, texts, tokenizer, html, json_out,
                        seed, dispatch, threads, quiet, tolerance, e2e_tolerance)
    except EvalError as exc:
        print(f"attnopt eval: {' '.join(str(exc).split())}", file=sys.stderr)
        return exc.code
