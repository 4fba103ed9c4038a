"""Softmax inside a sliding window, linear attention over every other allowed key, one normalisation.

The LoLCATs-style hybrid. For query i at position pᵢ = Nk − Nq + i (bottom-right aligned, as in
window.py) and query head h:

    oᵢ = (Σ_{j∈W(i)} e^{s·qᵢ·kⱼ} vⱼ + β_h Σ_{j∈L(i)} φ(qᵢ)·φ(kⱼ) vⱼ)
         / (Σ_{j∈W(i)} e^{s·qᵢ·kⱼ}    + β_h Σ_{j∈L(i)} φ(qᵢ)·φ(kⱼ))

* W(i), the window, counted as in window.py (including self): causal pᵢ − W < j ≤ pᵢ,
  bidirectional |pᵢ − j| < W; plus the S sinks, the first S keys of the row that `key_mask` keeps
  (causal: only sinks j ≤ pᵢ). Padded keys are never in W(i).
* L(i), every other allowed key: causal j ≤ pᵢ, bidirectional any; unpadded and not in W(i).
  A sink is in W(i) whenever it is allowed at all, so sinks are never in L(i): they are simply
  left out of the linear keys.

One normalisation (not softmax and linear attention mixed after normalising each) is what lets a
calibrated β_h trade window mass against the long-range mass per head; β_h = 0 is window attention.

Stability. Both sums are multiplied by e^{−mᵢ}, mᵢ the largest window logit of the row (detached:
the ratio does not depend on it), so the window terms are ≤ 1 and their sum ≥ 1. This is the exact
formula above, not LoLCATs' reweighting that leaves the linear sum unshifted. A row whose window is
empty (keys masked, or queries before key 0) uses mᵢ = 0; a row with no key at all gives 0, and its
gradients are finite. Limits: the linear term's factor e^{−mᵢ} (FAVOR+: e^{c − mᵢ}, below)
overflows fp32 when a row's window logits all lie below about −88, or the FAVOR+ stabilisers exceed
the window maximum by that much.

φ and its units. The feature maps are attnopt's (feature_maps.py), given by name or module as to
`linear_attention`, and φ gets the softmax scale s as its scale argument, as `linear_attention`
passes it (elu/relu ignore it; favor, hedgehog and taylor featurise s^½·x). The product
φ(qᵢ)·φ(kⱼ) enters in TRUE units. That matters for FAVOR+ only: `query_key_features` stabilises
each query row by its own max and every key of a (batch, kv head) by one constant c_k, and drops
the query constant because it cancels in a pure linear ratio. Here it would not cancel against
e^{s·q·k}: a per-row constant would reweight the linear part against the window part. So the
query side is stabilised here, keeping its constant c_q,ᵢ, and the linear sums (computed in
stabilised units, so nothing overflows there) are rescaled by e^{c_q,ᵢ + c_k − mᵢ} as one
per-row factor. In a row with an empty window that factor multiplies numerator and denominator
alike and nothing else, so it is taken as 1 there (same result, no overflow).

Cost: O(N·(W + S)·(D + Dv)) for the window part, blocked over queries exactly as window.py's band
(blocks of Bq queries against a band of Bq + W − 1 keys causal, Bq + 2W − 2 bidirectional, many
blocks per step); O(N·M·Dv + N·C·(M + Dv)) for the linear part, which is linear.py's causal chunked
scan run with a shifted diagonal: query i reads the prefix state of keys j ≤ pᵢ − W, and, when
bidirectional, the same scan over the reversed sequence gives the suffix j ≥ pᵢ + W. No Nq × Nk
tensor and no per-position [N, M, Dv] state. GQA: the window part multiplies each kv head's band
with its G query heads at once (k, v never repeated); the linear part featurises keys per kv head
(per query head only for per-head maps such as hedgehog, which then also repeats v).

Registered as `torch.ops.attnopt.linear_window_attention` (one node under torch.export; fake and
autograd via recompute, so the backward is O(N·W) too), differentiable in q, k, v, the feature
map's weight (FAVOR+ ω, hedgehog W) and β.

Letters: B batch, H query heads, Hkv key/value heads, G = H // Hkv, Hf the heads keys are
featurised on (Hkv, or H for per-head maps), Nq/Nk query/key length, D head dim of q and k, Dv
head dim of v, M feature count, W window, S sinks, Bq query block, L band length, C chunk size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt.forms.window.reference import (
    SCORES_PER_STEP,
    BandBlocks,
    BandStep,
    band_blocks,
    default_window_block_size,
    first_real_keys,
    sink_key_mask,
    sinks_outside_band,
    window_visibility_mask,
)
from attnopt.kernels.chunk_scan import causal_chunks, grouped_heads, state_times
from attnopt.kernels.dispatch import cuda_kernels
from attnopt.kernels.feature_maps import (
    FavorFeatureMap,
    FeatureMap,
    check_weight,
    query_key_features,
    resolve_feature_map,
)
from attnopt.kernels.layout import check_int, check_sdpa_inputs, compute_dtype, values_known
from attnopt.kernels.registration import prefill_op

__all__ = ["linear_window_attention", "linear_window_attention_reference", "linear_window_attention_op"]

_WHO = "linear_window_attention"


# ---- window part: banded softmax numerator, denominator and row max ----


@dataclass
class _SinkKeys:
    """Each row's sink keys, gathered once: positions [B, S], which exist [B, S], k [B, Hkv, D, S]
    and v [B, Hkv, S, Dv]. One [n·Bq·G, D] @ [D, S] product per kv head then scores a whole step
    (a broadcast over blocks would copy k_sink n times)."""

    j_BS: Tensor
    ok_BS: Tensor
    k_BHkvDS: Tensor
    v_BHkvSDv: Tensor


def _gather_sink_keys(k_BHkvND: Tensor, v_BHkvND: Tensor, key_mask_BN: Optional[Tensor], S: int, device) -> _SinkKeys:
    """The first S kept keys of each row, as `first_real_keys` finds them."""
    B, _, Nk, _ = k_BHkvND.shape
    j_BS, sink_ok_BS = first_real_keys(key_mask_BN, S, B, Nk, device)
    k_BHkvDS = torch.take_along_dim(k_BHkvND, j_BS[:, None, :, None], dim=2).transpose(-1, -2)
    v_BHkvSDv = torch.take_along_dim(v_BHkvND, j_BS[:, None, :, None], dim=2)
    return _SinkKeys(j_BS, sink_ok_BS, k_BHkvDS, v_BHkvSDv)


def _step_window_sums(
    s_B_Hkv_n_Bq_G_L: Tensor, v_band: Tensor, ss_B_Hkv_n_Bq_G_S: Optional[Tensor], sink_keys: Optional[_SinkKeys]
) -> tuple[Tensor, Tensor, Tensor]:
    """One step's shifted sums from its masked band (and sink) scores: numerator [B, Hkv, n, Bq, G, Dv],
    denominator and row max m [B, Hkv, n, Bq, G] (m = 0 where the window is empty, all its exps 0)."""
    B, Hkv, n, Bq, G, L = s_B_Hkv_n_Bq_G_L.shape
    with torch.no_grad():
        m = s_B_Hkv_n_Bq_G_L.amax(dim=-1)
        if ss_B_Hkv_n_Bq_G_S is not None:
            m = torch.maximum(m, ss_B_Hkv_n_Bq_G_S.amax(dim=-1))
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = s_B_Hkv_n_Bq_G_L.sub_(m[..., None]).exp_()
    num = torch.matmul(p.reshape(B, Hkv, n, Bq * G, L), v_band)
    den = p.sum(dim=-1)
    if ss_B_Hkv_n_Bq_G_S is not None:
        ps = ss_B_Hkv_n_Bq_G_S.sub_(m[..., None]).exp_()
        num = num + torch.matmul(ps.reshape(B, Hkv, n * Bq * G, ps.shape[-1]), sink_keys.v_BHkvSDv).reshape(num.shape)
        den = den + ps.sum(dim=-1)
    return num.reshape(B, Hkv, n, Bq, G, v_band.shape[-1]), den, m


def _step_sink_scores(
    blocks: BandBlocks, step: BandStep, q_blk: Tensor, sink_keys: _SinkKeys, causal: bool, G: int
) -> Tensor:
    """Sink scores [B, Hkv, n, Bq, G, S], -inf where a sink adds no column (counted once: not where
    the band already holds it)."""
    B, Hkv, _, _, D = q_blk.shape
    ok_B_n_Bq_S = sinks_outside_band(blocks, step, sink_keys.j_BS, sink_keys.ok_BS, causal, q_blk.device)
    ss = torch.matmul(q_blk.reshape(B, Hkv, step.n * blocks.Bq * G, D), sink_keys.k_BHkvDS)
    ss = ss.reshape(B, Hkv, step.n, blocks.Bq, G, blocks.S)
    ss.masked_fill_(~ok_B_n_Bq_S[:, None, :, :, None, :], float("-inf"))
    return ss


def _window_sums(
    q_BHND: Tensor,
    k_BHkvND: Tensor,
    v_BHkvND: Tensor,
    key_mask_BN: Optional[Tensor],
    window: int,
    causal: bool,
    sinks: int,
    block_size: int,
    scores_per_step: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Σ_{W(i)} e^{s·q·k − m} v [B, H, Nq, Dv], Σ_{W(i)} e^{s·q·k − m} [B, H, Nq], m [B, H, Nq]
    (0 where the window is empty) and whether it is non-empty [B, H, Nq]. q is already scaled by s.

    Same blocking as window.py (`band_blocks`): k, v and the key mask are padded once so every
    block's band is in range (pads count as masked), a step views n bands with `unfold` and scores
    [B, Hkv, n, Bq, G, L].
    """
    B, H, Nq, D = q_BHND.shape
    Hkv, Nk = k_BHkvND.shape[1], k_BHkvND.shape[2]
    G, device = H // Hkv, q_BHND.device
    blocks = band_blocks(Nq, Nk, window, causal, sinks, block_size)
    q_BHkvNGD = q_BHND.reshape(B, Hkv, G, Nq, D).transpose(2, 3)
    if blocks.nb * blocks.Bq > Nq:
        q_BHkvNGD = F.pad(q_BHkvNGD, (0, 0, 0, 0, 0, blocks.nb * blocks.Bq - Nq))
    k_pad, v_pad = blocks.pad_keys(k_BHkvND), blocks.pad_keys(v_BHkvND)
    keep_BN = torch.ones(B, Nk, dtype=torch.bool, device=device) if key_mask_BN is None else key_mask_BN
    keep_pad_BN = blocks.pad_key_mask(keep_BN)
    band_Bq_L = blocks.band_mask(device)
    sink_keys = _gather_sink_keys(k_BHkvND, v_BHkvND, key_mask_BN, blocks.S, device) if blocks.S > 0 else None
    nums, dens, maxs = [], [], []
    for step in blocks.steps(blocks.blocks_per_step(B * H, blocks.L + blocks.S, scores_per_step)):
        k_band, v_band = blocks.bands(k_pad, v_pad, step)
        seen_B_n_Bq_L = band_Bq_L & blocks.band_key_mask(keep_pad_BN, step)[:, :, None, :]
        q_blk = blocks.block_queries(q_BHkvNGD, step)
        s = torch.matmul(q_blk, k_band).reshape(B, Hkv, step.n, blocks.Bq, G, blocks.L)
        # In place, as in window.py: neither matmul nor masked_fill reads these scores in backward.
        s.masked_fill_(~seen_B_n_Bq_L[:, None, :, :, None, :], float("-inf"))
        ss = None if sink_keys is None else _step_sink_scores(blocks, step, q_blk, sink_keys, causal, G)
        num, den, m = _step_window_sums(s, v_band, ss, sink_keys)
        nums.append(num)
        dens.append(den)
        maxs.append(m)
    den_BHN = _per_query_head(dens, B, H, Nq)
    # den >= 1 exactly where the window holds a key (its max term is e^0); 0 where it is empty.
    return _per_query_head(nums, B, H, Nq), den_BHN, _per_query_head(maxs, B, H, Nq), den_BHN > 0


def _per_query_head(parts: list[Tensor], B: int, H: int, Nq: int) -> Tensor:
    """Concatenated step results [B, Hkv, nb, Bq, G, ...] as [B, H, Nq, ...] (padding rows dropped)."""
    x = torch.cat(parts, dim=2).flatten(2, 3)[:, :, :Nq]
    return x.transpose(2, 3).reshape(B, H, Nq, *x.shape[4:])


# ---- linear part: chunked prefix (and suffix) scans with a shifted diagonal ----


def _keys_up_to(phi_q: Tensor, phi_k: Tensor, v1: Tensor, d: int, chunk_size: int) -> Tensor:
    """φ(qᵢ)·Σ_{0 ≤ j ≤ i+d} φ(kⱼ) v1ⱼ for every query i: phi_q [B, Hf, G, Nq, M], phi_k [B, Hf, Nk, M],
    v1 [B, Hf, Nk, E] -> [B, Hf, G, Nq, E].

    linear.py's causal scan pairs query i with key i; here query i pairs with key i + d: keys before
    max(d, 0) are seen by every query (folded into one state), queries before −d see nothing, and
    keys past Nk are zeros (they add nothing).
    """
    B, Hf, G, Nq, M = phi_q.shape
    E = v1.shape[-1]
    Nk = min(phi_k.shape[2], Nq + d)  # the last query's last key is Nq − 1 + d
    if Nk <= 0:
        return phi_q.new_zeros(B, Hf, G, Nq, E)
    blind = max(0, -d)
    k0 = max(d, 0)
    fq = phi_q[:, :, :, blind:]
    L = Nq - blind
    fk, vv = phi_k[:, :, k0:Nk], v1[:, :, k0:Nk]
    if L > fk.shape[2]:
        fk = F.pad(fk, (0, 0, 0, L - fk.shape[2]))
        vv = F.pad(vv, (0, 0, 0, L - vv.shape[2]))
    out, _ = causal_chunks(fq, fk, vv, chunk_size)
    if k0 > 0:
        out = out + state_times(fq, (phi_k[:, :, :k0].transpose(-1, -2) @ v1[:, :, :k0])[:, :, None])
    if blind:
        out = torch.cat([phi_q.new_zeros(B, Hf, G, blind, E), out], dim=3)
    return out


def _features(
    name: str, q: Tensor, k: Tensor, scale: float, weight: Optional[Tensor], keep_BN: Tensor
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """φ(q) [B, H, Nq, M], φ(k) [B, Hf, Nk, M] (0 where keep is False) and, for FAVOR+, log c [B, H, Nq]
    with φ(q)·φ(k) in true units = (returned φ(q)·φ(k))·e^c; None for the other maps (true units)."""
    if name != "favor":
        phi_q, phi_k, _ = query_key_features(name, q, k, scale, weight, keep_BN)
        return phi_q, phi_k, None
    check_weight(name, weight, q.shape[-1])
    inv_sqrt_m = 1.0 / math.sqrt(weight.shape[1])
    # Stabilisers detached: e^{a−c}·e^{c} does not depend on c, so its gradient through c is zero.
    a_q = FavorFeatureMap.exponent(q, scale, weight)
    c_q = a_q.detach().amax(dim=-1)  # [B, H, Nq]
    phi_q = torch.exp(a_q - c_q[..., None]) * inv_sqrt_m
    a_k = FavorFeatureMap.exponent(k, scale, weight).masked_fill(~keep_BN[:, None, :, None], float("-inf"))
    c_k = a_k.detach().amax(dim=(-2, -1))  # [B, Hkv]: one constant per (batch, kv head), keys not reweighted
    c_k = torch.where(torch.isfinite(c_k), c_k, 0.0)  # no linear key: nothing to scale
    phi_k = torch.exp(a_k - c_k[..., None, None]) * inv_sqrt_m
    G = q.shape[1] // k.shape[1]
    return phi_q, phi_k, c_q + c_k.repeat_interleave(G, dim=1)[..., None]


def _forward(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], window: int, causal: bool, sinks: int,
             scale: float, feature_map: str, feature_weight: Optional[Tensor], linear_weight: Tensor, block_size: int,
             chunk_size: int, scores_per_step: int = SCORES_PER_STEP) -> Tensor:
    """The op's differentiable plain-PyTorch body; `linear_weight` is β [H]."""
    B, H, Nq, _ = q.shape
    Nk, Dv = k.shape[2], v.shape[3]
    cdt = compute_dtype(q.dtype)
    if Nq == 0 or Nk == 0:
        return q.new_zeros(B, H, Nq, Dv)
    q_c, k_c, v_c = q.to(cdt), k.to(cdt), v.to(cdt)
    num, den, m, window_seen = _window_sums(
        q_c * scale, k_c, v_c, key_mask, window, causal, sinks, block_size, scores_per_step
    )

    lin_keep_BN = ~sink_key_mask(key_mask, sinks, B, Nk, q.device)  # sinks belong to the window
    if key_mask is not None:
        lin_keep_BN = lin_keep_BN & key_mask
    weight = None if feature_weight is None else feature_weight.to(device=q.device, dtype=cdt)
    phi_q, phi_k, log_c = _features(feature_map, q_c, k_c, scale, weight, lin_keep_BN)
    phi_q, v_f, _ = grouped_heads(phi_q, phi_k, v_c)  # [B, Hf, G', Nq, M]; v per featurised head
    v1 = torch.cat([v_f, v_f.new_ones(*v_f.shape[:3], 1)], dim=-1)  # numerator and denominator at once
    off = Nk - Nq
    lin = _keys_up_to(phi_q, phi_k, v1, off - window, chunk_size)  # keys j <= p_i - W
    if not causal:  # keys j >= p_i + W: the same scan on the reversed sequence, where it is j' <= i' - W
        lin = lin + _keys_up_to(phi_q.flip(3), phi_k.flip(2), v1.flip(2), -window, chunk_size).flip(3)
    lin = lin.reshape(B, H, Nq, Dv + 1)

    log_factor = -m if log_c is None else log_c - m
    log_factor = torch.where(window_seen, log_factor, 0.0)  # empty window: the factor is common, use 1
    factor = linear_weight.to(device=q.device, dtype=cdt)[None, :, None] * torch.exp(log_factor)
    num = num + factor[..., None] * lin[..., :Dv]
    den = den + factor * lin[..., Dv]
    # den = 0 only where no key contributes (num = 0 there too): those rows are 0, not NaN.
    out = num / torch.where(den > 0, den, 1.0)[..., None]
    return out.to(q.dtype)


def _check_beta_values(linear_weight: Tensor, **_) -> None:
    # A value check, so inside the op and not in the wrapper: under torch.export β is a fake tensor.
    if values_known(linear_weight) and (not bool(torch.isfinite(linear_weight).all())
                                        or bool((linear_weight < 0).any())):
        raise ValueError(f"{_WHO}: linear_weight (β) must be finite and >= 0 per head, got {linear_weight.tolist()}")


# `attnopt::linear_window_attention`, one opaque node in captured graphs: `feature_weight` is FAVOR+
# ω [D, M], hedgehog W [H, D, P], else None; `linear_weight` β [H]. Gradients reach q, k, v, the
# feature map's weight and β (calibration learns both).
linear_window_attention_op = prefill_op("attnopt::linear_window_attention", _forward,
                                        differentiable=(0, 1, 2, 9, 10), check=_check_beta_values)


def _check_options(q, k, v, key_mask, window, causal, sinks, scale) -> tuple[int, int, float]:
    check_sdpa_inputs(_WHO, q, k, v, key_mask)
    if not isinstance(causal, bool):
        raise TypeError(f"{_WHO}: causal must be a bool, got {causal!r}")
    window = check_int(_WHO, "window", window, 1)
    sinks = check_int(_WHO, "sinks", sinks, 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{_WHO}: scale must be a finite number > 0, got {scale!r}")
    return window, sinks, float(scale)


def _beta_tensor(linear_weight, H: int, q: Tensor) -> Tensor:
    """β as [H]: a number is broadcast to every head; a tensor must be [H] (it may require grad)."""
    if isinstance(linear_weight, Tensor):
        if not linear_weight.is_floating_point() or tuple(linear_weight.shape) != (H,):
            raise ValueError(
                f"{_WHO}: linear_weight (β) tensor must be floating point with shape [H] = ({H},), "
                f"got {linear_weight.dtype} {tuple(linear_weight.shape)}"
            )
        return linear_weight
    if isinstance(linear_weight, bool) or not isinstance(linear_weight, (int, float)):
        raise TypeError(
            f"{_WHO}: linear_weight (β) must be a number or a tensor [H], got {type(linear_weight).__name__}"
        )
    if not (math.isfinite(linear_weight) and linear_weight >= 0):
        raise ValueError(f"{_WHO}: linear_weight (β) must be finite and >= 0, got {linear_weight}")
    return torch.full((H,), float(linear_weight), dtype=compute_dtype(q.dtype), device=q.device)


def linear_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    sinks: int = 0,
    causal: bool,
    feature_map: Union[str, FeatureMap] = "elu",
    scale: Optional[float] = None,
    linear_weight: Union[float, Tensor] = 1.0,
    key_mask: Optional[Tensor] = None,
    block_size: Optional[int] = None,
    chunk_size: int = 64,
) -> Tensor:
    """Softmax over the window W(i) (+ sinks) and β_h-weighted linear attention over the other allowed
    keys, in one normalisation (formula in the module docstring).

    q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] -> [B, H, Nq, Dv] in q's dtype (fp16/bf16
    compute in fp32). `window` counts keys including self (causal pᵢ − W < j ≤ pᵢ, bidirectional
    |pᵢ − j| < W); queries are bottom-right aligned. `sinks`: each row's first S kept keys join the
    window. `feature_map`: a name (elu, relu, favor, hedgehog, taylor) or a module from
    `make_feature_map`, as for `linear_attention`. `scale` (softmax s, default 1/√D) is also φ's
    scale. `linear_weight` β ≥ 0: a number or a tensor [H] (one per query head; gradients reach it
    when it requires grad). `key_mask` [B, Nk] bool, True = keep. A query with no key returns zeros.
    `block_size` (query block of the window part, default as window_attention) and `chunk_size`
    (chunk of the linear scan) do not change the result. Runs as one
    `torch.ops.attnopt.linear_window_attention` node; under torch.export pass favor/hedgehog as a
    module. Cost O(N·(W + S)·(D + Dv) + N·M·Dv + N·C·(M + Dv)) time, no Nq × Nk tensor.
    """
    window, sinks, scale = _check_options(q, k, v, key_mask, window, causal, sinks, scale)
    if block_size is None:
        block_size = default_window_block_size(window, causal)
    block_size = check_int(_WHO, "block_size", block_size, 1)
    chunk_size = check_int(_WHO, "chunk_size", chunk_size, 1)
    fmap = resolve_feature_map(feature_map, q.shape[-1], q.shape[1])
    beta = _beta_tensor(linear_weight, q.shape[1], q)
    tk = cuda_kernels(q, __package__)
    if tk is not None and tk.unsupported(q, feature_map=fmap, window=window, sinks=sinks, k=k) is None:
        return tk.linear_window_attention(q, k, v, window=window, sinks=sinks, causal=causal, feature_map=fmap,
                                          scale=scale, linear_weight=beta, key_mask=key_mask)
    return torch.ops.attnopt.linear_window_attention(
        q, k, v, key_mask, window, causal, sinks, scale, fmap.name, fmap.op_weight(), beta, block_size, chunk_size
    )


# ---- oracle ----


def linear_window_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: int,
    sinks: int = 0,
    causal: bool,
    feature_map: Union[str, FeatureMap] = "elu",
    scale: Optional[float] = None,
    linear_weight: Union[float, Tensor] = 1.0,
    key_mask: Optional[Tensor] = None,
) -> Tensor:
    """The formula with dense Nq × Nk window / linear sets and unstabilised φ (FAVOR+ in true units),
    shifted by the window max as the op is. O(Nq·Nk·(D + M + Dv)): tests and verification only."""
    window, sinks, scale = _check_options(q, k, v, key_mask, window, causal, sinks, scale)
    fmap = resolve_feature_map(feature_map, q.shape[-1], q.shape[1])
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    G = H // k.shape[1]
    out_dtype, cdt = q.dtype, compute_dtype(q.dtype)
    beta = _beta_tensor(linear_weight, H, q).to(cdt)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    in_window = window_visibility_mask(
        Nq, Nk, window=window, causal=causal, sinks=sinks, key_mask=key_mask, device=q.device
    )  # [B|1, 1, Nq, Nk]
    allowed = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.arange(Nk, device=q.device)[None, :] <= Nk - Nq + torch.arange(Nq, device=q.device)[:, None]
    in_linear = allowed & ~in_window
    if key_mask is not None:
        in_linear = in_linear & key_mask[:, None, None, :]
    weight = fmap.op_weight()
    weight = None if weight is None else weight.to(device=q.device, dtype=cdt)
    if fmap.name == "favor":
        phi_q, phi_k = FavorFeatureMap.features(q, scale, weight), FavorFeatureMap.features(k, scale, weight)
    else:
        phi_q, phi_k, _ = query_key_features(fmap.name, q, k, scale, weight)
    phi_k = phi_k.repeat_interleave(H // phi_k.shape[1], dim=1)
    logits = scale * (q @ k.repeat_interleave(G, dim=1).transpose(-1, -2))  # [B, H, Nq, Nk]
    m = logits.masked_fill(~in_window, float("-inf")).amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    weights = torch.where(in_window, torch.exp(logits - m), 0.0)
    kernel = beta[None, :, None, None] * (phi_q @ phi_k.transpose(-1, -2))  # φ(q)·φ(k), true units
    weights = weights + torch.where(in_linear, kernel, 0.0) * torch.exp(-m)
    den = weights.sum(dim=-1, keepdim=True)
    out = (weights @ v.repeat_interleave(G, dim=1)) / torch.where(den > 0, den, 1.0)
    return out.to(out_dtype)
