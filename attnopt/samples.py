"""Built-in sample inputs: English passages written for this project (no external data needed)."""

from __future__ import annotations

from importlib import resources


def english_passages() -> list[str]:
    """Four passages of plain English prose, each at least 256 MiniLM tokens long."""
    text = resources.files("attnopt").joinpath("data/english_passages.txt").read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]
