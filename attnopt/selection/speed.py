"""Decoding speed per token, original against selected, for keep:recall's report: greedy generate()
after the same prompt; per token = (time for 1 + n new tokens − time for 1) / n, so the prompt's
prefill cancels out."""

from __future__ import annotations

import time
import warnings
from typing import Optional

import torch

NEW_TOKENS = 16
REPEATS = 1  # compile's own glance (each repeat prefills the prompt twice per model); the benchmark repeats


def _generate_seconds(model, ids: torch.Tensor, new: int) -> float:
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, eos_token_id=None)
    return time.perf_counter() - start


def decode_time(original, selected, ids: torch.Tensor, new: int = NEW_TOKENS,
                repeats: int = REPEATS) -> Optional[dict]:
    """{"context", "new_tokens", "original_ms", "selected_ms", "ratio", "threads"}: milliseconds per decoded
    token after `ids` [1, N] (its last tokens, where N + the new ones would pass the model's position limit);
    None for a model without generate()."""
    if not all(callable(getattr(m, "generate", None)) for m in (original, selected)):
        return None
    limit = getattr(getattr(original, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and ids.shape[1] + new + 1 > limit:  # decode within the positions the model knows
        ids = ids[:, -max(1, limit - new - 1):]
    best = {"original": float("inf"), "selected": float("inf")}
    for _ in range(repeats):
        for name, model in (("original", original), ("selected", selected)):
            t = (_generate_seconds(model, ids, new + 1) - _generate_seconds(model, ids, 1)) / new
            best[name] = min(best[name], max(t, 0.0))
    return {"context": int(ids.shape[1]), "new_tokens": new, "original_ms": best["original"] * 1e3,
            "selected_ms": best["selected"] * 1e3,
            "ratio": best["selected"] / best["original"] if best["original"] > 0 else None,
            "threads": torch.get_num_threads()}
