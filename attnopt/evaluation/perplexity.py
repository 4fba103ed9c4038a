"""Perplexity of a causal LM on text, overall and by position bucket: the long-context picture (a form
that forgets shows a curve that stops falling, or rises, with position)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from attnopt.evaluation.report import Perplexity

FIRST_EDGE = 32  # buckets: [1, 32), [32, 64), [64, 128), ... up to the window
TOKEN_BUDGET = 16384  # tokens per forward batch


def bucket_edges(window: int) -> list:
    """[1, 32, 64, ..., window]: doubling buckets of predicted-token positions."""
    edges, edge = [1], FIRST_EDGE
    while edge < window:
        edges.append(edge)
        edge *= 2
    return edges + [window]


def windows_of(ids: list, window: int, most: int) -> list:
    """Up to `most` non-overlapping windows of `window` tokens (one shorter window if the text is short)."""
    if len(ids) < window:
        return [ids] if len(ids) >= 2 else []
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)][:most]


def token_nll(lm, rows: list) -> torch.Tensor:
    """[R, N - 1] next-token NLL (float64) of equal-length rows, in batches of TOKEN_BUDGET tokens."""
    n = len(rows[0])
    per_batch = max(1, TOKEN_BUDGET // n)
    out = []
    for i in range(0, len(rows), per_batch):
        ids = torch.tensor(rows[i : i + per_batch], dtype=torch.long)
        logits = lm.logits(ids, n)[:, :-1]
        # rows of [tokens, vocab], contiguous: cross_entropy over a transposed [B, V, N] is many times slower
        flat = logits.reshape(-1, logits.shape[-1]).double()
        nll = torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1).to(flat.device), reduction="none")
        out.append(nll.reshape(ids.shape[0], n - 1).cpu())
    return torch.cat(out)


def perplexity(lm, ids: list, window: int, text: str, most: int = 8, progress=None) -> Optional[Perplexity]:
    """The perplexity of `lm` on token ids `ids`: overall and by position bucket; None if under 2 tokens."""
    rows = windows_of(ids, window, most)
    if not rows:
        return None
    if progress:
        progress(f"perplexity of {lm.name}")
    nll = token_nll(lm, rows)  # position p predicts token p + 1
    n = len(rows[0])
    edges = bucket_edges(n)
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        part = nll[:, a - 1 : b - 1]  # predicted tokens at positions a .. b-1
        buckets.append({"start": a, "end": b, "perplexity": math.exp(float(part.mean())), "tokens": part.numel()})
    return Perplexity(math.exp(float(nll.mean())), nll.numel(), len(rows), n, text, buckets)
