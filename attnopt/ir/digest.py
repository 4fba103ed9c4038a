"""Content digests for saved directories: a file, a set of tensors, a JSON header (sha256, hex).

Unkeyed on purpose: they tell a damaged or half-copied directory from the one attnopt.save wrote,
not an edit made with care (anyone can recompute them). Loading is safe without them: attnopt.load
reads only data and checks content against the report (see attnopt/saving.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

import torch

CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """Names, dtypes, shapes and bytes of `tensors`, in name order: equal digests, equal tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def json_digest(obj) -> str:
    """The digest of a JSON-able object, independent of key order and whitespace."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
