"""Hugging Face transformers integration through `AttentionInterface` and `AttentionMaskInterface`.

    attnopt.hf.register("window:64+sinks:4")
    model = AutoModel.from_pretrained(path, attn_implementation="attnopt")

    interface.py  the registered attention function and the per-call channels it reads
    routes.py     how a model's attention reaches that function (the interface, or per module)
    sites.py      a site described from an attention-function call
    recording.py  recording every call of an exact run (verification inputs)
    cache.py      the cache layers of sites that decode from a state (or keep reuse inputs)
    install.py    attaching verified site modules (compile's transformers path)
    register.py   `register(policy)`: plan each module on its first call, unverified
"""

from __future__ import annotations

from attnopt.hf.interface import (
    IMPL_EAGER,
    IMPL_SDPA,
    attention_forward,
    switch,
)
from attnopt.hf.register import register
from attnopt.hf.routes import is_hf_model

__all__ = ["register", "is_hf_model", "switch", "attention_forward", "IMPL_SDPA", "IMPL_EAGER"]
