"""Decode memory per site: what each site holds per batch row while generating at a few context
lengths -- its form's decode state (attnopt.forms.*.decode_state_bytes) against the KV cache the
original attention keeps. Computed from the report's site records, like the attention costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from attnopt import forms
from attnopt.forms.common.decoding import kv_cache_bytes

CONTEXTS = (1024, 32768, 131072)
_ELEMENT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class DecodeMemory:
    """Bytes per batch row at each context: per causal site, the model's total, and the original's."""

    contexts: tuple
    per_site: dict = field(default_factory=dict)  # site id -> [bytes at each context]
    total: list = field(default_factory=list)
    original: list = field(default_factory=list)  # KV cache of the same sites, all exact

    @property
    def ratio(self) -> list[Optional[float]]:
        return [t / o if o else None for t, o in zip(self.total, self.original)]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "contexts": list(self.contexts), "ratio": self.ratio}


def decode_memory(records, contexts=CONTEXTS) -> Optional[DecodeMemory]:
    """None when no site is causal (an encoder has nothing to decode)."""
    per_site, total, original = {}, [0] * len(contexts), [0] * len(contexts)
    for r in records:
        site = r.site
        if not site.causal:
            continue
        nbytes = _ELEMENT_BYTES.get(str(site.dtype).replace("torch.", ""), 4)
        form = forms.get(r.outcome.final_form)
        params = form.validate(r.outcome.params) if r.outcome.final_form != "exact" else form.validate({})
        row = [form.decode_state_bytes(site, params, n, nbytes) for n in contexts]
        per_site[site.id] = row
        for i, n in enumerate(contexts):
            total[i] += row[i]
            original[i] += kv_cache_bytes(site.kv_heads, site.head_dim, site.v_head_dim or site.head_dim, n, nbytes)
    if not per_site:
        return None
    return DecodeMemory(tuple(contexts), per_site, total, original)
