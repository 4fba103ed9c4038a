"""A measurement cache on disk: one JSON object per file, read whole and written whole through a
renamed temporary file (the crossovers and keep:recall's head measurements each keep one)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read(path: Path, what: str, env: str) -> dict:
    """The cached entries ({} when the file is missing); a corrupt file is a one-line error naming it,
    `what` it holds and the variable `env` that relocates it."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the {what} {path} cannot be read ({exc}); delete it to measure again, or set "
                         f"${env} to another file") from None
    return data if isinstance(data, dict) else {}


def add(path: Path, entries: dict, what: str, env: str) -> None:
    """Add `entries` to the file (written whole to a temporary file first, then renamed)."""
    data = read(path, what, env)
    data.update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
