"""Next-token perplexity of a causal LM on a padded batch: how the CLI judges a rewritten decoder."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


def is_causal_lm(model: Any) -> bool:
    """True for a transformers model with a causal LM head (what `generate()` continues text with)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def perplexity(model: Any, batch: dict) -> Optional[float]:
    """exp of the mean next-token cross-entropy over the pairs of real (unpadded) tokens of `batch`
    (input_ids [B, N], optional attention_mask [B, N]); None when the output has no [B, N, V] logits."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    with torch.no_grad():
        logits = getattr(model(**batch), "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != ids.shape:
        return None
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    pairs = real[:, 1:] & real[:, :-1]
    if not bool(pairs.any()):
        return None
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].double().transpose(1, 2), ids[:, 1:], reduction="none")
    return math.exp(float(nll[pairs].mean()))
