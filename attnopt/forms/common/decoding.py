"""What a rewritten causal site carries from one call to the next instead of its KV cache.

`SiteModule.decode(q, k, v, keep, state)` takes the NEW tokens (the last Nq columns of the sequence)
and the state of everything before them, and returns (out, state advanced by the new tokens). The
form declares its own part (`form_state`: linear (S, z), decayed (S, z), a window cache, ...);
this module holds the part every form shares -- the real-token count per row, and the exact prefix
kept while some row is still inside `min_seq_len` -- and the generic batch operations a cache needs
(beam reordering, batch selection and repetition, bytes held).

Letters: B batch, Hkv key/value heads, N columns (tokens of the batch tensor, pads included).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor


@dataclass
class ExactPrefix:
    """Every column's k, v and keep flag, kept while some row has fewer real tokens than
    `min_seq_len`: those rows still attend exactly (bounded by min_seq_len + the row's padding)."""

    k_BHkvND: Tensor
    v_BHkvND: Tensor
    keep_BN: Tensor


@dataclass
class DecodeState:
    """A site's decode state: the form's own part plus what all forms share (batch first everywhere)."""

    form: str
    form_state: Any
    real_B: Tensor  # long: real tokens absorbed per row
    columns: int  # columns absorbed (pads included)
    prefix: Optional[ExactPrefix] = None


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """`obj` with `fn` applied to every tensor inside it (dataclasses, tuples, lists, dicts)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj)})
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {key: map_tensors(x, fn) for key, x in obj.items()}
    return obj


def state_nbytes(obj: Any) -> int:
    """Bytes held by the tensors inside `obj`."""
    total = 0

    def count(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    map_tensors(obj, count)
    return total


def index_batch(state: DecodeState, index_B: Tensor) -> DecodeState:
    """The state of the rows `index_B` (beam reordering, `batch_select_indices`)."""
    return map_tensors(state, lambda t: t.index_select(0, index_B.to(t.device)))


def repeat_batch(state: DecodeState, repeats: int) -> DecodeState:
    """Every row repeated `repeats` times in place (`batch_repeat_interleave`, e.g. num_return_sequences)."""
    return map_tensors(state, lambda t: t.repeat_interleave(repeats, dim=0))


def to_device(state: DecodeState, device) -> DecodeState:
    return map_tensors(state, lambda t: t.to(device, non_blocking=True))


def real_positions(real_before_B: Tensor, keep_BN: Tensor) -> Tensor:
    """Long [B, N]: each new column's index among its row's real tokens (a pad gets its predecessor's)."""
    return real_before_B[:, None] + keep_BN.long().cumsum(-1) - 1


def exact_on_prefix(q: Tensor, prefix: ExactPrefix, scale: float, all_kept: bool = False) -> Tensor:
    """Causal softmax attention of the last Nq columns over every column of `prefix` (padding hidden);
    a query that sees no key (a pad row) gets 0 rather than NaN, so nothing downstream turns NaN.
    `all_kept`: the caller knows no column is padding (then the data is not asked)."""
    Nq, Nk = q.shape[2], prefix.k_BHkvND.shape[2]
    gqa = prefix.k_BHkvND.shape[1] != q.shape[1]
    if Nq == Nk and (all_kept or bool(prefix.keep_BN.all())):  # a prefill without padding: SDPA's fused causal kernel
        return torch.nn.functional.scaled_dot_product_attention(
            q, prefix.k_BHkvND.to(q.dtype), prefix.v_BHkvND.to(q.dtype), is_causal=True, scale=scale, enable_gqa=gqa)
    col_q = (Nk - Nq) + torch.arange(Nq, device=q.device)
    visible = (torch.arange(Nk, device=q.device)[None, :] <= col_q[:, None])[None] & prefix.keep_BN[:, None, :]
    visible = visible[:, None]  # [B, 1, Nq, Nk]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, prefix.k_BHkvND.to(q.dtype), prefix.v_BHkvND.to(q.dtype), attn_mask=visible, scale=scale,
        enable_gqa=prefix.k_BHkvND.shape[1] != q.shape[1])
    return torch.where(visible.any(-1, keepdim=True), out, 0.0)


def extend_prefix(prefix: Optional[ExactPrefix], k: Tensor, v: Tensor, keep_BN: Tensor) -> ExactPrefix:
    if prefix is None:
        return ExactPrefix(k, v, keep_BN)
    return ExactPrefix(torch.cat([prefix.k_BHkvND, k], dim=2), torch.cat([prefix.v_BHkvND, v], dim=2),
                       torch.cat([prefix.keep_BN, keep_BN], dim=1))


def kv_cache_bytes(kv_heads: int, head_dim: int, v_head_dim: int, context: int, element_bytes: int) -> int:
    """Bytes of one row's K and V cache for one site at this context length."""
    return kv_heads * context * (head_dim + v_head_dim) * element_bytes
