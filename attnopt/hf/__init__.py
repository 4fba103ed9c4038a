"""Hugging Face transformers integration through `AttentionInterface` and `AttentionMaskInterface`.

    attnopt.hf.register("window:64+sinks:4")
    model = AutoModel.from_pretrained(path, attn_implementation="attnopt")

    interface.py  the registered attention function and the per-module state it reads
    sites.py      a site described from an attention-interface call
    record.py     recording every call of an exact run (verification inputs)
    install.py    attaching verified site modules (compile's transformers path)
    register.py   `register(policy)`: plan each module on its first call, unverified
    target.py     the transformers mechanism of `attnopt.compile`
"""

from __future__ import annotations

from attnopt.hf.interface import (
    IMPL_EAGER,
    IMPL_SDPA,
    attention_forward,
    is_hf_model,
    switch,
)
from attnopt.hf.register import register

__all__ = ["register", "is_hf_model", "switch", "attention_forward", "IMPL_SDPA", "IMPL_EAGER"]
