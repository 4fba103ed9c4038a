"""Decode memory per site: what each site holds per batch row while generating at a few context
lengths -- its form's decode state (attnopt.forms.*.decode_state_bytes) against the KV cache the
original attention keeps. Computed from the report's site records, like the attention costs.

A rewritten site with a dispatch threshold T (min_seq_len) runs exact attention until the context
reaches T, so below T it keeps the exact KV cache besides its own state and can hold more than the
original; `past_threshold` is what the sites hold once every context is past its threshold."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from attnopt import forms
from attnopt.forms.common.decoding import kv_cache_bytes
from attnopt.forms.common.mixed_heads import state_bytes

CONTEXTS = (1024, 32768, 131072)
_ELEMENT_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class DecodeMemory:
    """Bytes per batch row at each context: per causal site, the model's total, and the original's."""

    contexts: tuple
    per_site: dict = field(default_factory=dict)  # site id -> [bytes at each context]
    total: list = field(default_factory=list)
    original: list = field(default_factory=list)  # KV cache of the same sites, all exact
    past_threshold: list = field(default_factory=list)  # total without the exact prefix below each threshold
    thresholds: tuple = ()  # the distinct dispatch thresholds (min_seq_len > 0) of the causal sites

    @property
    def prefix_counted(self) -> list[bool]:
        """Per context: whether some site still keeps its exact prefix there (context below its threshold)."""
        return [t != p for t, p in zip(self.total, self.past_threshold)]

    @property
    def ratio_past_threshold(self) -> list[Optional[float]]:
        return [t / o if o else None for t, o in zip(self.past_threshold, self.original)]

    @property
    def ratio(self) -> list[Optional[float]]:
        return [t / o if o else None for t, o in zip(self.total, self.original)]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "contexts": list(self.contexts), "thresholds": list(self.thresholds),
                "ratio": self.ratio, "ratio_past_threshold": self.ratio_past_threshold}


def decode_memory(records, contexts=CONTEXTS) -> Optional[DecodeMemory]:
    """None when no site is causal (an encoder has nothing to decode)."""
    per_site, total, original = {}, [0] * len(contexts), [0] * len(contexts)
    past, thresholds = [0] * len(contexts), set()
    for r in records:
        site = r.site
        if not site.causal:
            continue
        nbytes = _ELEMENT_BYTES.get(str(site.dtype).replace("torch.", ""), 4)
        form = forms.get(r.outcome.final_form)
        params = form.validate(r.outcome.params) if r.outcome.final_form != "exact" else form.validate({})
        row = [state_bytes(form, site, params, n, nbytes) for n in contexts]  # per-head sites: exact heads' K/V
        acting = {**params, "min_seq_len": 0}
        past_row = [state_bytes(form, site, acting, n, nbytes) for n in contexts]
        if params.get("min_seq_len"):
            thresholds.add(int(params["min_seq_len"]))
        per_site[site.id] = row
        for i, n in enumerate(contexts):
            total[i] += row[i]
            past[i] += past_row[i]
            original[i] += kv_cache_bytes(site.kv_heads, site.head_dim, site.v_head_dim or site.head_dim, n, nbytes)
    if not per_site:
        return None
    return DecodeMemory(tuple(contexts), per_site, total, original, past, tuple(sorted(thresholds)))
