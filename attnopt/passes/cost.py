"""Attention-only cost of a site under a rewrite form, at any sequence length.

Counts the score and aggregation work that the form changes -- not the q/k/v/o projections, which
every form keeps (`reuse` is the exception: it skips q/k projections, reported separately by
`reuse_projection_flops_saved` because it is not attention work and scales linearly).

Letters: B batch, H query heads, Nq query length, Nk key length, D head dim of q/k, Dv of v, M
feature count of a kernel feature map, W visible keys per query, C chunk length of causal linear
kernels. FLOPs are multiply-adds × 2. Key/value heads are counted as expanded to H, as the kernels
run them. Bytes are what a non-fused kernel moves: q/k/v/o reads and writes plus the largest
intermediate the form materialises (N×N scores for exact, the band for window, the state for
linear/ssm), all at the element size of `site.dtype`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from attnopt.passes.forms import form_spec
from attnopt.passes.records import Cost

# Causal linear/ssm kernels process the sequence in chunks of C: exact-style masked products inside
# a chunk, a carried state between chunks (the usual chunked-scan formulation).
CHUNK = 64

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


def feature_count(feature_map: str, num_features: int, D: int) -> int:
    """M, the length of φ(x) for a linear-attention feature map (defaults as documented in forms.py)."""
    if feature_map in ("elu", "relu", "identity"):
        return D
    if feature_map == "favor":
        return num_features or 2 * D
    if feature_map == "hedgehog":
        # softmax over [Wx, −Wx]: twice the projected width
        return 2 * (num_features or D)
    if feature_map == "taylor":
        return 1 + D + D * D  # 2nd-order Taylor expansion of exp(qᵀk): 1, x, x⊗x
    raise ValueError(f"unknown feature map {feature_map!r}; known: elu, relu, identity, favor, hedgehog, taylor")


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


def _io_elems(B: int, H: int, Nq: int, Nk: int, Dqk: int, Dv: int) -> int:
    """Elements of q, k, v read and o written (k/v counted at H heads, as the kernels expand them)."""
    return B * H * (Nq * Dqk + Nk * Dqk + Nk * Dv + Nq * Dv)


def site_cost(site: Any, form: str, params: Optional[Mapping] = None, seq_len: Optional[int] = None, *, batch: Optional[int] = None) -> Cost:
    """Attention-only FLOPs and bytes of `site` rewritten as `form` at query length `seq_len`.

    `params` may be partial (defaults are filled from the form table); for "exact" they are ignored,
    so a reverted site can pass its planned params unchanged. `seq_len` defaults to the
    captured q_len, which must then be an int. `batch` overrides a symbolic site.batch (default 1).
    """
    spec = form_spec(form)
    # Exact attention has no knobs: a reverted site passes its planned form's params, which do not apply.
    p = spec.validate({} if spec.name == "exact" else dict(params or {}))
    if seq_len is None:
        if not isinstance(site.q_len, int):
            raise ValueError(f"site {site.id}: q_len is symbolic ({site.q_len!r}); pass seq_len explicitly")
        seq_len = site.q_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    B, H = _batch(site, batch), site.heads
    D, Dv = site.head_dim, site.v_head_dim
    Nq, Nk = scaled_lengths(site, seq_len)
    elem = element_bytes(site.dtype)
    name = spec.name

    if name == "exact":
        flops = 2 * B * H * Nq * Nk * (D + Dv)
        elems = B * H * Nq * Nk + _io_elems(B, H, Nq, Nk, D, Dv)
    elif name == "reuse":
        # Softmax attention over the reused q/k plus a rank-r correction: still quadratic in N.
        Dqk = D + p["rank"]
        flops = 2 * B * H * Nq * Nk * (Dqk + Dv)
        elems = B * H * Nq * Nk + _io_elems(B, H, Nq, Nk, Dqk, Dv)
    elif name == "window":
        visible = p["window"] if site.causal else 2 * p["window"] - 1
        keys = min(visible + p["sinks"], Nk)
        flops = 2 * B * H * Nq * keys * (D + Dv)
        elems = B * H * Nq * keys + _io_elems(B, H, Nq, Nk, D, Dv)
    elif name in ("linear", "ssm"):
        fmap = p["feature_map"]
        M = feature_count(fmap, p.get("num_features", 0), D)
        # state S = Σ φ(k) vᵀ and normaliser z = Σ φ(k) over the keys, then φ(q)ᵀS and φ(q)ᵀz per query
        flops = 2 * B * H * M * (Dv + 1) * (Nq + Nk)
        if fmap in ("favor", "hedgehog"):
            # random / learned projection of q and k to the feature space
            flops += 2 * B * H * (Nq + Nk) * D * (M // 2 if fmap == "hedgehog" else M)
        causal = site.causal or name == "ssm"
        if causal:
            C = min(CHUNK, Nq)
            flops += 2 * B * H * Nq * C * (M + Dv)
        elems = B * H * M * (Dv + 1) + _io_elems(B, H, Nq, Nk, D, Dv)
    else:  # a form added to the table without a cost entry
        raise ValueError(f"no cost model for form {name!r}; add one in attnopt/passes/cost.py")
    return Cost(seq_len=seq_len, flops=float(flops), bytes=float(elems * elem))


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


def reuse_projection_flops_saved(site: Any, params: Optional[Mapping] = None, seq_len: Optional[int] = None, *, batch: Optional[int] = None) -> float:
    """FLOPs a `reuse` site saves outside attention: its own q and k projections, less the rank-r correction.

    The model width is taken as H·D (the usual hidden size); the correction adds rank-r q/k projections.
    """
    p = form_spec("reuse").validate(dict(params or {}))
    if seq_len is None:
        if not isinstance(site.q_len, int):
            raise ValueError(f"site {site.id}: q_len is symbolic ({site.q_len!r}); pass seq_len explicitly")
        seq_len = site.q_len
    B = _batch(site, batch)
    Nq, Nk = scaled_lengths(site, seq_len)
    width = site.heads * site.head_dim
    saved = 2 * B * width * (Nq * site.heads + Nk * site.kv_heads) * site.head_dim
    added = 2 * B * width * (Nq * site.heads + Nk * site.kv_heads) * p["rank"]
    return float(saved - added)
