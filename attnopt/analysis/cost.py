"""Attention-only cost of a site under a rewrite form, at any sequence length.

Counts the score and aggregation work that the form changes -- not the q/k/v/o projections, which
every form keeps.

Letters: B batch, H query heads, Nq query length, Nk key length, D head dim of q/k, Dv of v, M
feature count of a kernel feature map, W visible keys per query, C chunk length of causal linear
kernels. FLOPs are multiply-adds × 2. Key/value heads are counted as expanded to H, as the kernels
run them. Bytes are what a non-fused kernel moves: q/k/v/o reads and writes plus the largest
intermediate the form materialises (N×N scores for exact, the band for window, the state for
linear/ssm), all at the element size of `site.dtype`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from attnopt import forms
from attnopt.forms.common.mixed_heads import site_cost as form_cost
from attnopt.forms.linear.form import feature_count  # noqa: F401  (re-exported: the cost model's M)
from attnopt.ir.outcomes import Cost

ELEMENT_BYTES = {
    "float64": 8, "double": 8, "complex64": 8,
    "float32": 4, "float": 4, "tf32": 4, "int32": 4,
    "float16": 2, "half": 2, "bfloat16": 2, "int16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "int8": 1, "uint8": 1,
}


def element_bytes(dtype: str) -> int:
    """Bytes per element of a dtype written as "float32" or "torch.float32"."""
    name = str(dtype).removeprefix("torch.")
    if name not in ELEMENT_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} for the cost model; known: {', '.join(sorted(ELEMENT_BYTES))}")
    return ELEMENT_BYTES[name]


def scaled_lengths(site: Any, seq_len: int) -> tuple[int, int]:
    """(Nq, Nk) of `site` run at query length `seq_len`.

    Self-attention (q_len == kv_len at capture, or the same symbol) scales both; cross-attention and
    cached decoding (q_len != kv_len) scale only the query and keep the captured key length.
    """
    if site.q_len == site.kv_len or not isinstance(site.kv_len, int):
        # A symbolic kv_len that differs from q_len cannot be sized: treat it as following the input.
        return seq_len, seq_len
    return seq_len, site.kv_len


def _batch(site: Any, batch: Optional[int]) -> int:
    if batch is not None:
        return batch
    return site.batch if isinstance(site.batch, int) else 1


def site_cost(site: Any, form: str, params: Optional[Mapping] = None, seq_len: Optional[int] = None, *, batch: Optional[int] = None) -> Cost:
    """Attention-only FLOPs and bytes of `site` rewritten as `form` at query length `seq_len`.

    `params` may be partial (defaults are filled from the form table); for "exact" they are ignored,
    so a reverted site can pass its planned params unchanged. `seq_len` defaults to the
    captured q_len, which must then be an int. `batch` overrides a symbolic site.batch (default 1).
    """
    spec = forms.get(form)
    # Exact attention has no knobs: a reverted site passes its planned form's params, which do not apply.
    p = spec.validate({} if spec.name == "exact" else dict(params or {}))
    if seq_len is None:
        if not isinstance(site.q_len, int):
            raise ValueError(f"site {site.id}: q_len is symbolic ({site.q_len!r}); pass seq_len explicitly")
        seq_len = site.q_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    Nq, Nk = scaled_lengths(site, seq_len)
    if Nq < (p.get("min_seq_len") or 0):  # the site dispatches to exact attention below min_seq_len
        spec, p = forms.get("exact"), {}
    c = form_cost(spec, site, p, _batch(site, batch), Nq, Nk)  # a per-head site's exact heads costed exact
    return Cost(seq_len=seq_len, flops=float(c.flops), bytes=float(c.elements * element_bytes(site.dtype)))


def cost_curve(
    site: Any,
    form: str,
    params: Optional[Mapping] = None,
    multipliers: Sequence[int] = (1, 4, 16),
    *,
    example_len: Optional[int] = None,
    batch: Optional[int] = None,
) -> list[Cost]:
    """`site_cost` at the example length × each multiplier.

    The example length is site.q_len, or `example_len` when given (required when q_len is symbolic).
    """
    base = example_len if example_len is not None else site.q_len
    if isinstance(base, bool) or not isinstance(base, int):
        raise ValueError(
            f"site {site.id}: q_len is symbolic ({site.q_len!r}); pass example_len= the length of the example input"
        )
    return [site_cost(site, form, params, base * m, batch=batch) for m in multipliers]
