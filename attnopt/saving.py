"""`attnopt.save` / `attnopt.load`: a compiled model on disk, and back in another process.

A saved directory holds the files of the model's mechanism (`attnopt.targets`: transformers models
as their own `save_pretrained` directory plus the site modules' tensors; graph-path models as their
captured torch.export program plus the site modules' tensors) and `attnopt.json`: format version,
versions, mechanism, policy, report, the sha256 of every file saved with it and of the header itself.

`load` treats the directory as untrusted: nothing in it is unpickled or executed. It reads JSON,
safetensors and (graph path) a torch.export archive whose every member and field is checked for
anything torch.export.load could unpickle or exec before torch reads it. The digests are not a
seal (they are unkeyed: whoever edits a directory can recompute them); they catch damage, and the
content checks behind them (each site module against the report) refuse a directory edited with
care. Every refusal is one `SaveError` line naming the file and the field. A load that succeeds
computes exactly the saved model.

Format 3 is the first without a pickle; a format-2 directory (graph path: a pickle) is refused
without reading its files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

import torch
from torch import nn

from attnopt.ir.digest import file_digest, json_digest
from attnopt.ir.errors import SaveError
from attnopt.report import CompileReport, finite_json, policy_from_dict
from attnopt.targets import MECHANISMS, target_class, target_of
from attnopt.version import __version__

__all__ = ["save", "load", "read_header", "SaveError", "FORMAT_VERSION", "HEADER_FILE"]

FORMAT_VERSION = 3  # 2: file and header digests; 3: no pickle (graph path: a torch.export archive)
HEADER_FILE = "attnopt.json"
REQUIRED_FIELDS = {"versions": dict, "report": dict, "files": dict, "checksum": str}


def save(model: nn.Module, path: Union[str, os.PathLike]) -> Path:
    """Write the compiled `model` (from `attnopt.compile`) into the directory `path`; return it."""
    report = getattr(model, "attnopt_report", None)
    if report is None:
        raise SaveError(f"attnopt.save: this {type(model).__name__} was not compiled by attnopt.compile "
                        "(it has no .attnopt_report); save the model attnopt.compile returned")
    try:
        target = target_of(model)
    except ValueError:
        raise SaveError(f"attnopt.save: a compiled {type(model).__name__} is neither a transformers model nor a "
                        "CompiledModule; attnopt.save knows only those two") from None
    path = _writable_directory(Path(path))
    entries = target.save(path, report)
    header = finite_json({
        "format": "attnopt", "format_version": FORMAT_VERSION, "mechanism": target.mechanism,
        "versions": {"attnopt": __version__, "torch": torch.__version__}, "model_class": type(model).__name__,
        **entries, "policy": report.policy_dict(), "report": report.to_dict(),
        "files": {f.name: file_digest(f) for f in sorted(path.iterdir()) if f.is_file() and f.name != HEADER_FILE},
    })
    header = json.loads(json.dumps(header, default=str, allow_nan=False))  # exactly what load will read
    header["checksum"] = json_digest(header)
    (path / HEADER_FILE).write_text(json.dumps(header, indent=2, allow_nan=False), encoding="utf-8")
    return path


def load(path: Union[str, os.PathLike]) -> nn.Module:
    """The compiled model saved in `path` by `attnopt.save`, with its `.attnopt_report`."""
    path = Path(path)
    header = read_header(path)
    try:
        report = CompileReport.from_dict(header["report"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SaveError(f"attnopt.load: {path / HEADER_FILE} field 'report' is damaged ({type(exc).__name__}: "
                        f"{exc})") from None
    report.policy = policy_from_dict(header["policy"])
    model = target_class(header["mechanism"]).load(path, header, report)
    model.attnopt_report = report
    return model


def read_header(path: Path) -> dict:
    """attnopt.json of a saved directory, its format version checked."""
    if not path.is_dir():
        raise SaveError(f"attnopt.load: {path} is not a directory saved by attnopt.save")
    file = path / HEADER_FILE
    if not file.is_file():
        raise SaveError(f"attnopt.load: {path} has no {HEADER_FILE}, so it was not saved by attnopt.save "
                        "(a plain transformers directory loads with from_pretrained)")
    try:
        header = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SaveError(f"attnopt.load: {file} cannot be read as JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SaveError(f"attnopt.load: {file} is not an attnopt header (not a JSON object)")
    _check_version(path, file, header)
    if header.get("format") != "attnopt":
        raise SaveError(f"attnopt.load: {file} is not an attnopt header (field 'format' is not \"attnopt\")")
    if header.get("mechanism") not in MECHANISMS:
        raise SaveError(f"attnopt.load: {file} names mechanism {header.get('mechanism')!r}; expected one of "
                        f"{', '.join(map(repr, MECHANISMS))}")
    for field, kind in REQUIRED_FIELDS.items():
        if not isinstance(header.get(field), kind):
            raise SaveError(f"attnopt.load: {file} field {field!r} is missing or not a {kind.__name__}; the "
                            "directory is damaged (save the model again)")
    if "policy" not in header:
        raise SaveError(f"attnopt.load: {file} field 'policy' is missing; the directory is damaged (save the model again)")
    if json_digest({k: v for k, v in header.items() if k != "checksum"}) != header["checksum"]:
        raise SaveError(f"attnopt.load: {file} was edited after attnopt.save wrote it (its checksum does not match "
                        "its content); save the model again")
    _check_files(path, header["files"])
    return header


def _check_version(path: Path, file: Path, header: dict) -> None:
    version = header.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise SaveError(f"attnopt.load: {file} has no integer format_version; it was not written by attnopt.save")
    saved_by = header.get("versions", {}).get("attnopt", "unknown") if isinstance(header.get("versions"), dict) else "?"
    if version > FORMAT_VERSION:
        raise SaveError(f"attnopt.load: {path} was saved in attnopt format {version}, newer than this attnopt "
                        f"reads (up to {FORMAT_VERSION}); upgrade attnopt (saved by attnopt {saved_by})")
    if version == 2:
        # Format 2 pickled graph-path models: reading one could run code, so none is read at all.
        raise SaveError(f"attnopt.load: {path} was saved in attnopt format 2 (by attnopt {saved_by}), which this "
                        f"attnopt does not read: a format-2 directory may hold a pickle, and loading never runs one; "
                        "compile the model again, then save it again with attnopt.save")
    if version != FORMAT_VERSION:
        raise SaveError(f"attnopt.load: {path} was saved in attnopt format {version}, which this attnopt does not "
                        f"read (it reads format {FORMAT_VERSION}); compile the model again, then save it again with "
                        "attnopt.save")


def _check_files(path: Path, files: dict) -> None:
    """Every file saved with the header is there, unchanged."""
    for name, digest in files.items():
        file = path / str(name)
        if not isinstance(digest, str) or Path(str(name)).name != str(name):
            raise SaveError(f"attnopt.load: {path / HEADER_FILE} field 'files' is damaged (entry {name!r})")
        if not file.is_file():
            raise SaveError(f"attnopt.load: {file} is missing; the directory is incomplete (save the model again)")
        if file_digest(file) != digest:
            raise SaveError(f"attnopt.load: {file} changed after attnopt.save wrote it (sha256 differs); "
                            "the directory is damaged (save the model again)")


def _writable_directory(path: Path) -> Path:
    if path.exists() and not path.is_dir():
        raise SaveError(f"attnopt.save: {path} exists and is not a directory; give a directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SaveError(f"attnopt.save: cannot create the directory {path} ({exc.strerror or exc})") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise SaveError(f"attnopt.save: the directory {path} is not writable")
    return path


