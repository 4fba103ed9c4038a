"""How the audit calls a model: next-token logits of a batch (teacher-forced), and greedy continuation
through `generate()` with the model's own cache, so a compiled model decodes from its fixed-size states.

A transformers causal LM is called with keywords (`logits_to_keep` where its forward takes it, so only
the scored tail's logits are materialised); any other module with its token ids as the one argument
(or `input_ids=`), its logits read from `.logits`, a "logits" entry, the first tuple item or the tensor
itself. Models without `generate()` are scored from the full forward alone (the report says so).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from attnopt.hf.routes import position_limit


def is_transformers_model(model: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _logits_of(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class LanguageModel:
    """A model as the audit sees it: `logits(ids, keep)`, `greedy(prompts, new)`, its vocabulary and
    position limit."""

    def __init__(self, model: Any, name: str):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{name} must be a torch.nn.Module (a causal LM); got {type(model).__name__}")
        self.model, self.name = model, name
        self.transformers = is_transformers_model(model)
        can = getattr(model, "can_generate", None)
        self.generates = self.transformers and callable(getattr(model, "generate", None)) and (
            can() if callable(can) else True)
        params = inspect.signature(model.forward).parameters if self.transformers else {}
        self._keep_arg = "logits_to_keep" in params
        self._call_style: Optional[str] = None  # how a non-transformers module takes its ids, once known
        self.device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))

    @property
    def position_limit(self) -> Optional[int]:
        return position_limit(self.model)

    def vocab(self) -> int:
        """The size of the output distribution (config, else one forward of 4 tokens)."""
        config = getattr(self.model, "config", None)
        head = self.model.get_output_embeddings() if callable(getattr(self.model, "get_output_embeddings", None)) else None
        if head is not None and getattr(head, "out_features", None):
            return int(head.out_features)
        if isinstance(getattr(config, "vocab_size", None), int):
            return config.vocab_size
        return int(self.logits(torch.zeros(1, 4, dtype=torch.long), 1).shape[-1])

    def logits(self, ids_BN: torch.Tensor, keep: int) -> torch.Tensor:
        """[B, keep, V] next-token logits of the last `keep` positions of `ids_BN` (no padding, no cache)."""
        ids_BN = ids_BN.to(self.device)
        with torch.no_grad():
            if self.transformers:
                extra = {"logits_to_keep": keep} if self._keep_arg else {}
                logits = _logits_of(self.model(input_ids=ids_BN, use_cache=False, **extra))
            else:
                logits = self._plain_call(ids_BN)
        if logits is None or logits.dim() != 3 or logits.shape[0] != ids_BN.shape[0]:
            raise ValueError(f"{self.name} must return next-token logits [batch, tokens, vocab]; got "
                             f"{None if logits is None else tuple(logits.shape)}")
        return logits[:, -keep:].float()

    def _plain_call(self, ids_BN: torch.Tensor) -> Optional[torch.Tensor]:
        if self._call_style is not None:
            out = self.model(ids_BN) if self._call_style == "positional" else self.model(input_ids=ids_BN)
            return _logits_of(out)
        failure = None
        for style in ("positional", "keyword"):
            try:
                out = self.model(ids_BN) if style == "positional" else self.model(input_ids=ids_BN)
            except Exception as exc:  # whatever a module raises on input it does not take
                failure = failure or exc
                continue
            self._call_style = style
            return _logits_of(out)
        first = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
        raise ValueError(f"{self.name} cannot be called with token ids [batch, tokens] "
                         f"({type(failure).__name__}: {first}); the audit needs a causal LM that takes token ids "
                         "and returns next-token logits")

    def greedy(self, prompts: list, new: int, pad_id: int) -> list:
        """Greedy `generate()` of `new` tokens after each prompt (left-padded into one batch)."""
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        own = getattr(self.model, "generation_config", None)
        config = GenerationConfig(max_new_tokens=new, do_sample=False, num_beams=1, pad_token_id=pad_id,
                                  eos_token_id=getattr(own, "eos_token_id", None),
                                  use_cache=getattr(own, "use_cache", True))
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config)
        return [row[width:].tolist() for row in out.cpu()]
