"""The operands of an explicit chain: q, k, v and the output as a site reads them, found from the
matmul operands by seeing through scale factors, transposes / permutes, GQA repeats and (for a
mixed-rank chain) the [B*H, ..] views of [B, H, ..] tensors.

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D/Dv head dims.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

import torch.fx as fx

from attnopt.ir.site import NearMiss
from attnopt.passes import canonicalize as cz
from attnopt.passes.candidate import describe, near_miss
from attnopt.passes.canonicalize import Factor, Node, op_name, rank, shape
from attnopt.passes.chain import ProbabilitiesChain, ScoresChain


@dataclass(frozen=True)
class Operands:
    """q, k, v and the output of an explicit chain, with what was seen through to reach them."""

    query: Node  # [B, H, Nq, D] or [B*H, Nq, D]
    key: Node  # k [B, Hkv, Nk, D], or kᵀ [B, Hkv, D, Nk] when key_is_transposed
    value: Node  # [B, Hkv, Nk, Dv]
    output: Node  # [B, H, Nq, Dv]
    rank: int  # 4 once a mixed-rank chain is lifted
    key_is_transposed: bool
    qk_factors: tuple  # Factors on q, then on k, before the matmul
    groups: int  # GQA repeat seen through (H = Hkv * groups)
    kv_repeated: int  # heads the key / value nodes already repeat
    folded_factors: tuple  # factors inside the query / key nodes
    spelling: tuple
    members: tuple


@dataclass(frozen=True)
class _Query:
    node: Node
    factors: tuple
    members: tuple
    spelling: tuple


@dataclass(frozen=True)
class _Key:
    node: Node
    is_transposed: bool
    factors: tuple
    groups: int
    gqa_tag: str  # the spelling of the repeat that gave `groups`
    members: tuple
    spelling: tuple


def find_operands(softmax: Node, scores: ScoresChain, probs: ProbabilitiesChain) -> Union[Operands, NearMiss]:
    """q, kᵀ -> k, v and the output, seeing through scales, transposes and GQA repeats."""
    rq = scores.rank
    q = _read_query(scores.query_operand, rq)
    k = _read_key(softmax, q.node, scores.key_operand, scores.key_layout, rq)
    if isinstance(k, NearMiss):
        return k
    if probs.mixed and rq == 3:
        got = _lift_flat_qk(softmax, q, k)
        if isinstance(got, NearMiss):
            return got
        q, k = got
    spelling = list(q.spelling + k.spelling) + (["scale:on_key"] if k.factors else [])
    members = list(q.members + k.members)
    value = probs.value_operand
    if k.groups > 1:
        v_src, gv, v_rep, _ = cz.see_through_repeat_kv(value)
        if gv != k.groups:
            return near_miss(softmax, f"keys are repeated {k.groups}x for grouped-query attention but values "
                                      f"{gv}x", "gqa")
        value = v_src
        members += v_rep
        spelling.append(k.gqa_tag)
    output = probs.pv
    if probs.mixed:
        got = _lift_output(softmax, probs.pv, q.node, k.node, k.is_transposed, list(scores.steps + probs.steps))
        if isinstance(got, NearMiss):
            return got
        output, m = got
        members += m
        rq = 4
    kv_repeated = repeated_heads(k.node, value) if rq == 4 and k.groups == 1 else 1
    if kv_repeated > 1:
        spelling.append("gqa:repeated_before_layout")
    return Operands(query=q.node, key=k.node, value=value, output=output, rank=rq, key_is_transposed=k.is_transposed,
                    qk_factors=q.factors + k.factors, groups=k.groups, kv_repeated=kv_repeated,
                    folded_factors=tuple(folded_factors(q.node, k.node)), spelling=tuple(spelling),
                    members=tuple(members))


def _read_query(q_op: Node, rq: int) -> _Query:
    """q with its scale factors stripped (and tagged where they sit)."""
    query, factors, members = cz.strip_factors(q_op, "query")
    spelling = []
    if factors:
        spelling.append("scale:on_query")
    elif rq == 4 and cz.scale_folded_upstream(query) is not None:
        spelling.append("scale:folded_into_query")  # the site's scale excludes it (see canonicalize)
    if rq == 3 and op_name(query) in cz.RESHAPE_OPS and cz.strip_factors(query.args[0], "query")[1]:
        # q was scaled before being flattened to [B*H, N, D]: no unscaled rank-3 q exists in the
        # graph, so the scale stays inside `query` and the site's scale omits it
        spelling.append("scale:inside_flattened_query")
    return _Query(query, tuple(factors), tuple(members), tuple(spelling))


def _read_key(softmax: Node, query: Node, k_op: Node, key_layout: str, rq: int) -> Union[_Key, NearMiss]:
    """k from the matmul's second operand: factors, a repeat applied to kᵀ itself, the transpose."""
    key_t, factors, members = cz.strip_factors(k_op, "key")
    members, factors = list(members), list(factors)
    groups, gqa_tag = 1, ""
    if rq == 4:  # GQA repeat applied to kᵀ itself (k kept as [B, N, Hkv, D], permuted, repeated)
        key_t, groups, m, f, gqa_tag = _unrepeat_key(key_t)
        members += m
        factors += f
    if key_layout == "plain":  # einsum contracted k [.., Nk, D] directly
        got = (key_t, False, [], "qk:einsum")
    else:
        got = _key_from_transposed(softmax, query, key_t)
    if isinstance(got, NearMiss):
        return got
    key, key_is_transposed, layout_members, tag = got
    members += layout_members
    if not key_is_transposed:
        key, f, m = cz.strip_factors(key, "key")
        factors += f
        members += m
        if rq == 4 and groups == 1:
            key, groups, m, f, gqa_tag = _unrepeat_key(key)
            members += m
            factors += f
    return _Key(key, key_is_transposed, tuple(factors), groups, gqa_tag, tuple(members), (tag,))


def _lift_flat_qk(softmax: Node, q: _Query, k: _Key) -> Union[tuple[_Query, _Key], NearMiss]:
    """A rank-3 q·kᵀ under a 4-D softmax: q and k as the [B, H, ..] tensors their bmm operands view."""
    got = _lift_qk(softmax, q.node, k.node)
    if isinstance(got, NearMiss):
        return got
    query, key, f, m = got
    key, groups, m2, f2, gqa_tag = _unrepeat_key(key)
    q = dataclasses.replace(q, node=query, factors=q.factors + tuple(x for x in f if x.where == "query"),
                            spelling=tuple(t for t in q.spelling if t != "scale:inside_flattened_query"))
    k = dataclasses.replace(k, node=key, groups=groups, gqa_tag=gqa_tag,
                            factors=k.factors + tuple(x for x in f if x.where == "key") + tuple(f2),
                            members=k.members + tuple(m) + tuple(m2))
    return q, k


def _unrepeat_key(node: Node) -> tuple:
    """k seen through a repeat_kv (and any scale factors around it): (source, groups, members,
    factors, tag); (node, 1, [], [], tag) when nothing was repeated."""
    src, groups, rep, tag = cz.see_through_repeat_kv(node)
    if groups <= 1:
        return node, 1, [], [], tag
    src, factors, members = cz.strip_factors(src, "key")
    return src, groups, rep + members, factors, tag


def _lift_qk(softmax: Node, query: Node, key: Node):
    """q [B*H, Nq, D] and k (or kᵀ) [B*H, .., ..] of a bmm as the [B, H, .., ..] tensors they view,
    with the scale factors applied before the flattening: (q, k, factors, members) or a NearMiss."""
    got = []
    for role, node in (("query", query), ("key", key)):
        lifted = cz.unflatten_heads(node)
        if lifted is None:
            return near_miss(softmax, f"the softmax is 4-D but the {role} of the bmm q·kᵀ, "
                                      f"{list(shape(node) or ())}, is no view of a [B, H, N, D] tensor", "mixed_rank")
        base, factors, m = cz.strip_factors(lifted[0], role)
        got.append((base, factors, lifted[1] + m))
    (q4, fq, mq), (k4, fk, mk) = got
    return q4, k4, fq + fk, mq + mk


def _lift_output(softmax: Node, pv: Node, query: Node, key: Node, key_is_transposed: bool, steps: list):
    """The [B, H, Nq, Dv] node a mixed-rank chain's P·V is read as, after checking that every
    score / probability frame agrees with the lifted q·kᵀ: (output, members) or a NearMiss."""
    output, members = pv, []
    if rank(pv) == 3:
        lifted = cz.heads_view_of(pv)
        if lifted is None:
            return near_miss(softmax, "P·V is a bmm over [B*H, Nq, Dv] after a 4-D softmax, and its result "
                                      "is never viewed as [B, H, Nq, Dv]", "no_value_matmul")
        output, members = lifted
    bad = _frame_disagrees(query, key, key_is_transposed, steps)
    if bad:
        return near_miss(softmax, bad, "mixed_rank")
    return output, members


def _frame_disagrees(query: Node, key: Node, key_is_transposed: bool, steps: list) -> str:
    """For a mixed-rank chain lifted to 4-D: why a score or probability frame differs from the lifted
    [B, H, Nq, Nk] (empty when none does). A mask spelled on [B*H, Nq, Nk] has no [B, H] reading a
    rewrite could apply, and a 4-D frame split differently from q is not this attention."""
    qs, ks = shape(query), shape(key)
    nk = ks[-1] if key_is_transposed else ks[-2]
    frame = (qs[0], qs[1], qs[2], nk)
    flat = (qs[0] * qs[1], qs[2], nk)
    for kind, x in steps:
        node = x if kind == "reshape" else (x.applied_at if kind == "term" else None)
        s = shape(node) if node is not None else None
        if s is not None and not (len(s) == 4 and all(map(cz.same_dim, s, frame))
                                  or len(s) == 3 and all(map(cz.same_dim, s, flat))):
            return (f"{describe(node)} holds the scores as {list(s)}, which is neither the [B, H, Nq, Nk] = "
                    f"{list(frame)} of the lifted q·kᵀ nor its [B*H, Nq, Nk] view")
        if kind == "term" and rank(x.node) == 3:
            return (f"the mask {describe(x.node)} is spelled on [B*H, Nq, Nk] {list(shape(x.node) or ())}; "
                    "a rank-4 site has no [B, H] reading of it")
    return ""


def _key_from_transposed(softmax: Node, query: Node, key_t: Node):
    """Prove the kᵀ operand is the key with its last two axes swapped (pytorch#195320):
    (key, key_is_transposed, layout members, spelling tag) or a NearMiss."""
    base, perm, layout = cz.compose_layout(key_t)
    r = len(perm)
    ident = tuple(range(r))
    if perm == cz.swap_last_two(ident):
        return base, False, layout, "key:transpose"
    if perm == ident:
        name = op_name(base)
        if name in cz.RESHAPE_OPS and isinstance(base.args[0], fx.Node):
            src = base.args[0]
            if not cz.keeps_last_two(base, src):
                return near_miss(softmax, f"key is reshaped from {list(shape(src) or ())} to "
                                          f"{list(shape(base) or ())}, not transposed", "key_permuted",
                                 from_shape=str(shape(src)), to_shape=str(shape(base)))
        return key_t, True, [], "key:pretransposed"
    q_base, q_perm, _ = cz.compose_layout(query)
    outer = next((n for n in layout if cz.perm_of(n) is not None), None)  # the one nearest the matmul
    shown = tuple(cz.perm_of(outer)) if outer is not None else perm
    if len(q_perm) == r and perm == cz.swap_last_two(q_perm) and _same_role_sizes(q_base, base, q_perm):
        return key_t, True, layout, "key:permute"
    if cz.perm_of(key_t) == cz.swap_last_two(ident):
        # kᵀ is k.transpose(-2, -1) of a k whose own layout came from elsewhere (expanded or
        # repeated as [B, N, Hkv, D], then transposed): that k is the key, whatever its source
        return key_t.args[0], False, [key_t], "key:transpose"

    def text(p):
        return "(" + ",".join(str(d) for d in p) + ")"

    extra = "" if shown == perm else f" (in all {text(perm)} of its source)"
    return near_miss(softmax, f"key is permuted {text(shown)}{extra}, not transposed", "key_permuted",
                     perm=list(perm))


def _same_role_sizes(q_base: Node, k_base: Node, q_perm: tuple) -> bool:
    """q and k bases have the same size on every axis except tokens (Nq vs Nk) and heads (H vs Hkv)."""
    qs, ks = shape(q_base), shape(k_base)
    if qs is None or ks is None or len(qs) != len(ks):
        return False
    free_axes = {q_perm[-2], *q_perm[1:-2]}
    return all(cz.same_dim(a, b) for i, (a, b) in enumerate(zip(qs, ks)) if i not in free_axes)


def folded_factors(query: Node, key: Node) -> list[Factor]:
    """Scale factors already inside the query / key nodes (applied before their layout ops)."""
    found = [cz.scale_folded_upstream(query, where="query"), cz.scale_folded_upstream(key, where="key")]
    return [f for f in found if f is not None]


def repeated_heads(key: Node, value: Node) -> int:
    """The GQA repeat both k and v went through upstream (heads on axis 1 of both nodes); 1 when
    none or when they disagree (then no kv-head count is claimed beyond the nodes' own)."""
    rk, rv = cz.head_repeat(key, 1), cz.head_repeat(value, 1)
    return rk if rk == rv else 1
