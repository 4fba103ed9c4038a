"""The on-disk cache of keep:recall's measurements, as the crossovers have theirs: one JSON file
(SELECTION_CACHE, relocated by $ATTNOPT_SELECTION_CACHE), one entry per (what was measured, head set).

What was measured is a digest of everything a measurement depends on: the model's weights, every
accepted site module's fitted tensors, the verification text, the probe rows' recipe and the torch
version. A recompile of the same model and inputs reads its measurements back instead of taking
them again; anything else that changed gives other keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from attnopt.ir import json_cache

ENV_CACHE = "ATTNOPT_SELECTION_CACHE"
SELECTION_CACHE = Path("~/.cache/attnopt/head_selection.json")
# Bumped when what a measurement computes changes (the probes, their scoring): old entries are not read.
MEASURE_REVISION = 1


def cache_path() -> Path:
    return Path(os.environ.get(ENV_CACHE) or SELECTION_CACHE).expanduser()


def load(path: Optional[Path] = None) -> dict:
    """The cached measurements ({} when the file is missing); a corrupt file is an error naming it."""
    return json_cache.read(path or cache_path(), "keep:recall cache", ENV_CACHE)


def store(entries: dict, path: Optional[Path] = None) -> None:
    """Add `entries` to the cache file (written whole to a temporary file first, then renamed)."""
    if entries:
        json_cache.add(path or cache_path(), entries, "keep:recall cache", ENV_CACHE)
