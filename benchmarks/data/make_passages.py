"""Write benchmarks/data/passages.txt: English prose passages of at least 256 MiniLM tokens.

Source: the prose paragraphs of the Python reference manual's help topics as shipped with CPython
(`pydoc_data.topics`, © Python Software Foundation, PSF License Version 2); code samples, lists
and short lines are dropped. Consecutive paragraphs (topics in sorted order) are joined until a
passage has at least MIN_CHARS characters. One passage per line.

    python benchmarks/data/make_passages.py
"""

from __future__ import annotations

import re
from pathlib import Path

MIN_CHARS = 1500  # about 300 MiniLM tokens: truncated to 256, every passage fills the window
PROSE_SHARE = 0.93  # share of letters and spaces a paragraph needs to count as prose


def passages() -> list[str]:
    from pydoc_data.topics import topics

    out, current = [], ""
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            para = " ".join(para.split())
            if len(para) < 200 or para.startswith("*"):
                continue
            if sum(ch.isalpha() or ch == " " for ch in para) / len(para) < PROSE_SHARE:
                continue
            current = f"{current} {para}".strip()
            if len(current) >= MIN_CHARS:
                out.append(current)
                current = ""
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("passages.txt")
    texts = passages()
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    print(f"{len(texts)} passages, {sum(map(len, texts))} characters -> {path}")
