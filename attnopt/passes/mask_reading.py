"""Read a candidate's mask: its values on the example run classified as causal / window / padding /
arbitrary (mask_proof), then downgraded wherever the graph's structure does not prove the pattern
holds for every input. Returns the site's `MaskInfo`.

Letters: B batch, H query heads, Nq/Nk query/key length.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.fx as fx

from attnopt.ir.masks import ADDITIVE_HIDE_BELOW
from attnopt.ir.site import MaskInfo, NearMiss
from attnopt.passes import canonicalize as cz
from attnopt.passes.candidate import Candidate
from attnopt.passes.mask_proof import (
    KeepPattern,
    StructureOracle,
    as_arbitrary,
    classify_bias,
    classify_keep,
)
from attnopt.passes.replay import replay_explicit


def _dims_of(node: fx.Node) -> Optional[tuple]:
    s = cz.shape(node)
    return None if s is None else tuple(d if isinstance(d, int) else str(d) for d in s)


def read_mask(c: Candidate, values: dict, oracle: StructureOracle, q_shape, k_shape) -> Union[MaskInfo, NearMiss]:
    """The site's mask, from its SDPA mask / is_causal or its explicit chain's mask terms."""
    if c.is_causal:
        return MaskInfo(form="is_causal", causal=True)
    q_len = getattr(c.query.meta.get("val"), "shape", q_shape)[-2]  # symbolic where the capture is
    k_val = getattr(c.key.meta.get("val"), "shape", None)
    kv_len = k_shape[-2] if k_val is None else (k_val[-1] if c.key_is_transposed else k_val[-2])
    if c.is_sdpa:
        if c.sdpa_mask is None:
            return MaskInfo()
        m = values[c.sdpa_mask.name]
        frame = tuple(q_shape[:-1]) + (k_shape[-2],)
        m_full = _unbroadcast(m.expand(frame)) if m.dim() <= len(frame) else m
        if m.dtype == torch.bool:
            pattern = classify_keep(_as_bhqk(m_full))
            form, keep_when = "bool", "true"
        else:
            pattern = classify_bias(_as_bhqk(m_full))
            form, keep_when = "additive", "zero"
        return _finish_mask(pattern, [c.sdpa_mask], form, keep_when, oracle, c.sdpa_mask, q_len, kv_len)
    terms = c.mask_terms
    if not terms:
        return MaskInfo()
    bias = replay_explicit(c, values, torch.zeros(q_shape, dtype=torch.float64),
                            torch.zeros(k_shape, dtype=torch.float64), None, zero_scores=True)
    pattern = classify_bias(_as_bhqk(bias))
    effective = [t for t in terms if not _no_effect(t, values)]
    if len(effective) > 1:
        # several terms (MPT: ALiBi added, then a causal masked_fill) have no single node a rewrite
        # could apply: arbitrary, but which keys they hide is still read; a causal / window claim
        # must then hold for every term that hides keys (an ALiBi bias built from positions must
        # not vouch for an input mask that happens to look causal)
        hiding = [t for t in effective if _hides_keys(t, values)] or effective
        return _finish_mask(as_arbitrary(pattern), [t.node for t in hiding],
                            "+".join(t.form for t in effective), "zero", oracle, None, q_len, kv_len,
                            why=f"it combines {len(effective)} mask terms ({'+'.join(t.form for t in effective)}) "
                                "that no one tensor holds")
    term = effective[0] if effective else terms[0]
    return _finish_mask(pattern, [term.node], term.form, term.keep_when, oracle, term.node, q_len, kv_len)


def _unbroadcast(x: torch.Tensor) -> torch.Tensor:
    """Keep one slice of every leading dim the mask only broadcasts over (stride 0): HF's
    [B, 1, N, N] mask expanded over heads is classified once, not once per head."""
    for dim in range(x.dim() - 2):
        if x.stride(dim) == 0 and x.shape[dim] > 1:
            x = x.narrow(dim, 0, 1)
    return x


def _as_bhqk(x: torch.Tensor) -> torch.Tensor:
    """Softmax-frame tensors to [B, H, Nq, Nk] ([B*H, Nq, Nk] becomes [B*H, 1, Nq, Nk])."""
    if x.dim() == 3:
        return x.unsqueeze(1)
    if x.dim() == 2:
        return x[None, None]
    return x


def _no_effect(term, values: dict) -> bool:
    t = values[term.node.name]
    if term.kind == "additive":
        return t.dtype != torch.bool and bool((t == 0).all())
    if term.kind == "masked_fill" or term.kind == "where_drop":
        return not bool(t.bool().any())
    return bool(t.bool().all())


def _hides_keys(term, values: dict) -> bool:
    t = values[term.node.name]
    if term.kind == "additive":
        return t.dtype == torch.bool or bool((t.double() <= ADDITIVE_HIDE_BELOW).any())
    return not _no_effect(term, values)


def _finish_mask(pattern: KeepPattern, nodes: list, form: str, keep_when: str, oracle: StructureOracle,
                 mask_node: Optional[fx.Node], q_len, kv_len, why: Optional[str] = None) -> MaskInfo:
    """MaskInfo from a numeric pattern, downgraded where the structure does not prove it.

    `nodes` are all mask tensors that fed the scores; `mask_node` the one a rewrite can apply
    (None when several terms combine and no single node holds the mask)."""
    from_positions, from_inputs = True, False
    for n in nodes:
        p, i = oracle.sources(n.name)
        from_positions &= p
        from_inputs |= i
    if (pattern.causal or pattern.window is not None) and not from_positions:
        # causal-looking on this example only: an input could carry anything next call
        pattern = KeepPattern(arbitrary=True)
        why = why or "it looks causal on the example, but an input decides it, not positions"
    if from_inputs and not pattern.arbitrary:
        # the example's pattern is the caller's choice this time (all-keep, say), not the model's
        why = oracle.caller_patterns([n.name for n in nodes], q_len, kv_len)
        pattern = as_arbitrary(pattern) if why else pattern
    padding = pattern.padding
    if from_inputs and not pattern.arbitrary and not padding:
        # an input-driven mask that keeps everything today may pad tomorrow
        padding = True
    return MaskInfo(
        form=form,
        causal=pattern.causal,
        window=pattern.window,
        padding=padding,
        arbitrary=pattern.arbitrary,
        node=mask_node.name if isinstance(mask_node, fx.Node) else None,
        keep_when=keep_when,
        shape=_dims_of(mask_node) if isinstance(mask_node, fx.Node) else None,
        why=why,
    )
