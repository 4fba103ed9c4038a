"""The on-disk cache of keep:recall's measurements, as the crossovers have theirs: one JSON file
(SELECTION_CACHE, relocated by $ATTNOPT_SELECTION_CACHE), one entry per (what was measured, head set).

What was measured is a digest of everything a measurement depends on: the model's weights, every
accepted site module's fitted tensors, the verification text, the probe rows' recipe and the torch
version. A recompile of the same model and inputs reads its measurements back instead of taking
them again; anything else that changed gives other keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

ENV_CACHE = "ATTNOPT_SELECTION_CACHE"
SELECTION_CACHE = Path("~/.cache/attnopt/head_selection.json")
# Bumped when what a measurement computes changes (the probes, their scoring): old entries are not read.
MEASURE_REVISION = 1


def cache_path() -> Path:
    return Path(os.environ.get(ENV_CACHE) or SELECTION_CACHE).expanduser()


def load(path: Optional[Path] = None) -> dict:
    """The cached measurements ({} when the file is missing); a corrupt file is an error naming it."""
    path = path or cache_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"the keep:recall cache {path} cannot be read ({exc}); delete it to measure again, or set "
                         f"${ENV_CACHE} to another file") from None
    return data if isinstance(data, dict) else {}


def store(entries: dict, path: Optional[Path] = None) -> None:
    """Add `entries` to the cache file (written whole to a temporary file first, then renamed)."""
    if not entries:
        return
    path = path or cache_path()
    data = load(path)
    data.update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
