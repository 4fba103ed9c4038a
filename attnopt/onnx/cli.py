"""`attnopt generate DIR --prompt TEXT`: generate text from a decode folder that holds a tokenizer.

Runs `attnopt.onnx.Generator` (numpy and onnxruntime; no torch) and the folder's tokenizer
(tokenizer.json through the `tokenizers` package, else transformers' AutoTokenizer). Prompts are
left-padded into one batch. Expected failures print one line to stderr and return exit code 2.
`generate_command` is a typer command: `app.command("generate", help=GENERATE_HELP)(generate_command)`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer

from attnopt.onnx.generator import MODEL_EOS, Generator

EXIT_OK, EXIT_BAD_ARGUMENT = 0, 2

GENERATE_HELP = ("Generate from a folder written by export_onnx(..., decode=True) that holds a tokenizer, with ONNX "
                 "Runtime only (no torch): each --prompt is one row of the batch, left-padded. A row stops at the "
                 "model's end-of-sequence token (from its generation config) unless --ignore-eos.")
GENERATE_EPILOG = ("Examples:\n\n  attnopt generate out_dir --prompt 'Once upon a time' --max-new-tokens 40\n\n"
                   "  attnopt generate out_dir --prompt 'a' --prompt 'b c' --sample --temperature 0.8 --top-p 0.9 "
                   "--seed 0\n\nExit codes: 0 success; 2 bad argument or folder.")


class _Tokenizer:
    """encode(text) -> ids and decode(ids) -> text over the folder's tokenizer files."""

    def __init__(self, folder: Path):
        self.fast = self.auto = None
        try:
            from tokenizers import Tokenizer

            if (folder / "tokenizer.json").is_file():
                self.fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except ImportError:
            pass
        if self.fast is None:
            if not (folder / "tokenizer_config.json").is_file() and not (folder / "tokenizer.json").is_file():
                raise FileNotFoundError(f"{str(folder)!r} holds no tokenizer (tokenizer.json); export with "
                                        "export_onnx(..., tokenizer=tok), or pass token ids to attnopt.onnx.Generator")
            from transformers import AutoTokenizer

            self.auto = AutoTokenizer.from_pretrained(str(folder))

    def encode(self, text: str) -> list:
        return self.fast.encode(text).ids if self.fast is not None else self.auto(text)["input_ids"]

    def decode(self, ids: list) -> str:
        if self.fast is not None:
            return self.fast.decode(ids, skip_special_tokens=True)
        return self.auto.decode(ids, skip_special_tokens=True)


def _fail(message: str) -> int:
    print(f"attnopt generate: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_BAD_ARGUMENT


def run_generate(directory: str, prompts: list, max_new_tokens: int, sample: bool, temperature: float, top_k: int,
                 top_p: float, seed: Optional[int], threads: Optional[int], progress: bool,
                 ignore_eos: bool = False) -> int:
    if not prompts:
        return _fail("give at least one --prompt")
    if max_new_tokens < 0:
        return _fail(f"--max-new-tokens must be >= 0; got {max_new_tokens}")
    folder = Path(directory)
    try:
        generator = Generator(folder, threads=threads)
        tokenizer = _Tokenizer(folder)
        rows = [tokenizer.encode(p) for p in prompts]
    except (FileNotFoundError, ValueError, ImportError, OSError) as exc:
        return _fail(str(exc))
    except Exception as exc:  # ONNX Runtime's own errors (a file that is no ONNX model, a damaged graph)
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return _fail(f"{directory}: ONNX Runtime cannot load it ({first[:200]}); give a folder export_onnx wrote")
    if any(not r for r in rows):
        return _fail("a prompt encodes to no tokens; give some text")
    pad = generator.contract.token_id("pad_token_id") or 0
    width = max(len(r) for r in rows)
    ids = np.array([[pad] * (width - len(r)) + r for r in rows], dtype=np.int64)
    mask = np.array([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=np.int64)
    try:
        out = generator.generate(ids, mask, max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, progress=progress,
                                 eos_token_id=None if ignore_eos else MODEL_EOS)
    except ValueError as exc:
        return _fail(str(exc))
    for row, keep in zip(out.tolist(), np.concatenate([mask, np.ones_like(out[:, width:])], axis=1).tolist()):
        print(tokenizer.decode([t for t, k in zip(row, keep) if k]))  # the prompt and its continuation
    return EXIT_OK


def generate_command(
    directory: str = typer.Argument(..., metavar="DIR", help="a decode folder with a tokenizer"),
    prompt: List[str] = typer.Option([], "--prompt", help="a prompt; repeat for a batch"),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="tokens to generate per prompt"),
    sample: bool = typer.Option(False, "--sample", help="sample (default: greedy)"),
    temperature: float = typer.Option(1.0, "--temperature", help="sampling temperature"),
    top_k: int = typer.Option(0, "--top-k", help="sample among the k likeliest tokens (0: all)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed"),
    threads: Optional[int] = typer.Option(None, "--threads", help="ONNX Runtime intra-op threads"),
    progress: bool = typer.Option(False, "--progress", help="a progress bar on stderr"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="never stop a row early (default: it stops at the "
                                    "model's end-of-sequence token, from its generation config)"),
) -> int:
    return run_generate(directory, list(prompt), max_new_tokens, sample, temperature, top_k, top_p, seed, threads,
                        progress, ignore_eos)
