"""Attention matchers: one rich rule for explicit softmax chains, one for SDPA calls (and its
backend-specific variants).

Each rule has `anchors` (the ops it starts from), `match` (walk the graph through the canonical
view of `canonicalize`, tagging which alternative of each part matched) and leaves the numeric
`check` to the detector, which runs the graph once for all candidates. `match` returns either a
`Candidate` or a `NearMiss` that says, in words, what stopped it.

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch.fx as fx

from attnopt.ir.site import NearMiss
from attnopt.passes import canonicalize as cz
from attnopt.passes.canonicalize import Factor, MaskTerm, Node, op_name, rank, shape


@dataclass
class Candidate:
    """A structurally matched attention, before the numeric check.

    `score_steps` replays, in forward order, what happens between q·kᵀ and the softmax input:
    ("scale", Factor) | ("term", MaskTerm) | ("reshape", Node). `prob_steps` does the same between
    the softmax output and the left operand of P·V (only reshapes matter for values).
    """

    anchor: Node  # the softmax or SDPA node
    source: str  # "explicit" | "sdpa" | "mha"
    query: Node
    key: Node
    value: Node
    output: Node
    rank: int
    key_is_transposed: bool = False
    qk_factors: list = field(default_factory=list)  # Factors on q or k before the matmul
    score_steps: list = field(default_factory=list)
    prob_steps: list = field(default_factory=list)
    sdpa_scale: Optional[Union[float, Node]] = None  # SDPA's scale= (None: 1/sqrt(D))
    sdpa_mask: Optional[Node] = None
    is_causal: bool = False
    groups: int = 1  # GQA repetition factor that was seen through (H = Hkv * groups)
    # kv heads the key/value NODES already repeat (the graph repeats before its head transpose, so no
    # [B, Hkv, N, D] node exists): the site's kv_heads is H / kv_repeated though k, v hold H heads
    kv_repeated: int = 1
    # scalar factors applied to q or k before a head split / transpose: inside the query / key
    # nodes (no unscaled [B, H, N, D] node exists), so excluded from the site's scale
    folded_factors: list = field(default_factory=list)
    enable_gqa: bool = False
    dropout_p: float = 0.0
    members: list = field(default_factory=list)
    spelling: list = field(default_factory=list)
    module_path: str = ""
    module_type: str = ""

    @property
    def mask_terms(self) -> list[MaskTerm]:
        return [s[1] for s in self.score_steps if s[0] == "term"]

    def factors(self) -> list[Factor]:
        return list(self.qk_factors) + [s[1] for s in self.score_steps if s[0] == "scale"]


def module_of(node: Node) -> tuple[str, str, bool]:
    """(dotted module path, innermost class name, inside nn.MultiheadAttention) from nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = list(stack.values())
    if not entries:
        return "", "", False
    path, typ = entries[-1]
    in_mha = any(_type_name(t) == "MultiheadAttention" for _, t in entries)
    if in_mha:
        for p, t in reversed(entries):
            if _type_name(t) == "MultiheadAttention":
                path, typ = p, t
                break
    return clean_module_path(path), _type_name(typ), in_mha


def _type_name(t) -> str:
    name = t.__name__ if isinstance(t, type) else str(t)
    return name.rstrip("'>").split(".")[-1]


def clean_module_path(path: str) -> str:
    """`L['self'].encoder.layer[0]` / `getattr(L['self'].layers, '0')` -> `encoder.layer.0`."""
    import re

    p = path
    p = re.sub(r"^L\[['\"][^'\"]*['\"]\]\.?", "", p)  # Dynamo's root: L['self'], L['fn'], ...
    # getattr(X, 'name') -> X.name (possibly nested)
    while "getattr(" in p:
        new = re.sub(r"getattr\(([^(),]*),\s*['\"]([^'\"]+)['\"]\)", r"\1.\2", p)
        if new == p:
            break
        p = new
    p = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", p)
    p = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", p)
    p = p.replace("..", ".").strip(".")
    return p


def _miss(node: Node, reason: str, code: str, **details) -> NearMiss:
    path, _, _ = module_of(node)
    return NearMiss(node=node.name, module_path=path, reason=reason, code=code, details=details)


def _describe(node) -> str:
    if isinstance(node, fx.Node):
        if node.op == "output":
            return "the graph output"
        return f"{op_name(node) or node.op} ({node.name})"
    return repr(node)


# ---- explicit chains ----------------------------------------------------------------------------

_SCORE_WALK_LIMIT = 64


def reaches_qk(node: Node, depth: int = 12) -> bool:
    """Whether `node` is q·kᵀ seen through scale factors, masks, casts and views."""
    for _ in range(depth):
        if not isinstance(node, fx.Node):
            return False
        name = cz.base_op(node)
        if name in cz.MATMUL_OPS or name == "baddbmm" or name == "einsum":
            return True
        if cz.is_value_transparent(node) or name in cz.CAST_OPS or name == "tanh":
            node = node.args[0]
            continue
        if name in ("mul", "div", "true_divide"):
            inner = [a for a in node.args[:2] if isinstance(a, fx.Node) and cz.as_factor(node, a, "scores")]
            if not inner:
                return False
            node = inner[0]
            continue
        if name == "add":
            return any(reaches_qk(a, depth - 1) for a in node.args[:2] if isinstance(a, fx.Node))
        if name == "masked_fill":
            node = node.args[0]
            continue
        if name == "where":
            return any(reaches_qk(a, depth - 1) for a in node.args[1:3] if isinstance(a, fx.Node))
        return False
    return False


def _unrepeat_key(node: Node) -> tuple:
    """k seen through a repeat_kv (and any scale factors around it): (source, groups, members,
    factors, tag); (node, 1, [], [], "") when nothing was repeated."""
    src, groups, rep, tag = cz.see_through_repeat_kv(node)
    if groups <= 1:
        return node, 1, [], [], tag
    src, factors, members = cz.strip_factors(src, "key")
    return src, groups, rep + members, factors, tag


class ExplicitChainMatcher:
    """softmax(scale · q kᵀ + mask) @ v spelled out with matmul / bmm / baddbmm."""

    anchors = cz.SOFTMAX_OPS

    def match(self, softmax: Node) -> Union[Candidate, NearMiss]:
        r = rank(softmax)
        dim_arg = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim", -1)
        if r is None or r < 2:
            return _miss(softmax, "softmax of a tensor with fewer than 2 dims cannot be attention", "no_score_matmul")
        if cz.softmax_dim(softmax) != r - 1:
            return _miss(softmax, f"softmax over dim {dim_arg}, not the key axis (dim -1)", "softmax_axis",
                         dim=dim_arg)
        spelling: list[str] = []
        members: list[Node] = [softmax]

        # --- backward: from the softmax input down to q·kᵀ
        steps_back: list = []
        cur = softmax.args[0]
        qk = None
        baddbmm_term = None
        for _ in range(_SCORE_WALK_LIMIT):
            name = cz.base_op(cur)  # `scores += mask` and `scores.div_(d)` read as their out-of-place forms
            if cz.is_inplace(cur):
                spelling.append("inplace:" + op_name(cur))
            if name in cz.MATMUL_OPS:
                qk = cur
                break
            if name in ("baddbmm", "einsum"):
                qk = cur
                break
            if name in cz.CAST_OPS or name in cz.COPY_OPS:
                if name in cz.CAST_OPS:
                    spelling.append("cast:scores")
                members.append(cur)
                cur = cur.args[0]
                continue
            if cz.is_value_transparent(cur):  # views that keep [.., Nq, Nk], eval dropout
                members.append(cur)
                if name in cz.RESHAPE_OPS or name == "expand":
                    steps_back.append(("reshape", cur))
                cur = cur.args[0]
                continue
            if name in ("mul", "div", "true_divide"):
                f = None
                for a in cur.args[:2]:
                    if isinstance(a, fx.Node) and cz.same_shape(a, cur):
                        f = cz.as_factor(cur, a, "scores")
                        if f is not None:
                            inner = a
                            break
                if f is None:
                    return _miss(softmax, f"the softmax input is scaled by a tensor ({_describe(cur)}), "
                                          "not by a scalar", "no_score_matmul")
                spelling.append("scale:div" if f.divide else "scale:mul")
                steps_back.append(("scale", f))
                members.append(cur)
                cur = inner
                continue
            if name == "add":
                a, b = cur.args[0], cur.args[1]
                alpha = cur.kwargs.get("alpha", 1)
                if alpha != 1:
                    return _miss(softmax, f"{_describe(cur)} adds with alpha={alpha}", "no_score_matmul")
                if not isinstance(b, fx.Node) or not isinstance(a, fx.Node):
                    # adding a constant shifts every logit equally: softmax does not see it
                    members.append(cur)
                    cur = a if isinstance(a, fx.Node) else b
                    continue
                if reaches_qk(a):
                    scores_side, term = a, b
                elif reaches_qk(b):
                    scores_side, term = b, a
                    spelling.append("mask:commuted")
                else:
                    return _miss(softmax, "neither operand of the add before the softmax is q·kᵀ "
                                          f"({_describe(cur)})", "no_score_matmul")
                steps_back.append(("term", MaskTerm("additive", term, cur)))
                members.append(cur)
                cur = scores_side
                continue
            if name == "masked_fill":
                fv = cz.fill_value(cur.args[2])
                if not cz.is_masking_value(fv):
                    return _miss(softmax, f"masked_fill writes {fv!r} into the scores, not a masking value "
                                          "(-inf or a large negative number)", "mask_value")
                steps_back.append(("term", MaskTerm("masked_fill", cur.args[1], cur, fv)))
                members.append(cur)
                cur = cur.args[0]
                continue
            if name == "where":
                cond, a, b = cur.args[0], cur.args[1], cur.args[2]
                fa, fb = cz.fill_value(a), cz.fill_value(b)
                if isinstance(a, fx.Node) and cz.is_masking_value(fb) and reaches_qk(a):
                    steps_back.append(("term", MaskTerm("where_keep", cond, cur, fb)))
                    cur = a
                elif isinstance(b, fx.Node) and cz.is_masking_value(fa) and reaches_qk(b):
                    steps_back.append(("term", MaskTerm("where_drop", cond, cur, fa)))
                    cur = b
                else:
                    return _miss(softmax, f"{_describe(cur)} selects between the scores and something that is "
                                          "not a masking value", "mask_value")
                members.append(cur)
                continue
            if name == "tanh":
                return _miss(softmax, "the attention logits are soft-capped with tanh before the softmax "
                                      "(logit softcapping), which softmax(scale·q·kᵀ + mask)·v cannot express",
                             "logit_softcap")
            if name in ("linear", "addmm", "mm") and _has_weight_operand(cur):
                # classifier heads and MoE routers (Mixtral, OLMoE, Qwen2-MoE gates) end here
                return _miss(softmax, f"the softmax input is a projection x·W with a weight ({_describe(cur)}), "
                                      "as in a classifier or an MoE router, not q·kᵀ of two activations",
                             "no_score_matmul")
            return _miss(softmax, "the softmax input is not a product q·kᵀ of two activations: it comes from "
                                  f"{_describe(cur)}", "no_score_matmul")
        if qk is None:
            return _miss(softmax, "no q·kᵀ matmul found before the softmax", "no_score_matmul")
        members.append(qk)
        if op_name(qk) == "baddbmm":
            beta = qk.kwargs.get("beta", 1)
            alpha = qk.kwargs.get("alpha", 1)
            if beta not in (0, 1):
                return _miss(softmax, f"baddbmm with beta={beta} scales the added term", "mask_value")
            spelling.append("qk:baddbmm")
            # beta·bias + alpha·(q·kᵀ): alpha scales the product only, so in forward order the scale
            # comes before the bias (BLOOM adds ALiBi this way); steps_back is in reverse order
            if beta == 1:
                baddbmm_term = MaskTerm("additive", qk.args[0], qk)
                steps_back.append(("term", baddbmm_term))
            if alpha != 1:
                steps_back.append(("scale", Factor(float(alpha), False, qk.name, "scores")))
        else:
            spelling.append(f"qk:{op_name(qk)}")
        key_layout = "transposed"  # the second operand holds kᵀ [.., D, Nk]
        if op_name(qk) == "einsum":
            ok, got = cz.einsum_roles(qk, "qk")
            if not ok:
                return _miss(softmax, got, "no_score_matmul")
            q_op, k_op = qk.args[1][0], qk.args[1][1]
            key_layout = got
        elif op_name(qk) == "baddbmm":
            q_op, k_op = qk.args[1], qk.args[2]
        else:
            q_op, k_op = qk.args[0], qk.args[1]
        for operand in (q_op, k_op):
            base, _, _ = cz.compose_layout(operand)
            if isinstance(base, fx.Node) and base.op == "get_attr":
                return _miss(softmax, f"the scores are x·W with a weight ({base.target}), not q·kᵀ of two "
                                      "activations", "no_score_matmul")
        rq, rk = rank(q_op), rank(k_op)
        if rq not in (3, 4) or rk != rq:
            return _miss(softmax, f"q·kᵀ operands have ranks {rq} and {rk}; attention needs both 3-D "
                                  "[B*H, N, D] or both 4-D [B, H, N, D]", "no_score_matmul")

        # --- forward: from the softmax output to P·V
        prob_steps: list = []
        dropout_p = 0.0
        cur = softmax
        pv = None
        for _ in range(_SCORE_WALK_LIMIT):
            users = cz.live_users(cur)
            if len(users) != 1:
                others = [u for u in users if not (op_name(u) in cz.MATMUL_OPS and u.args[0] is cur)]
                if not users:
                    return _miss(softmax, "the attention probabilities are not used", "no_value_matmul")
                other = others[0] if others else users[1]
                return self._weights_reused(softmax, other)
            u = users[0]
            if u.op == "output":
                return self._weights_reused(softmax, u)
            name = op_name(u)
            if name in cz.MATMUL_OPS:
                if u.args[0] is not cur:
                    return _miss(softmax, f"the probabilities are the right operand of {_describe(u)}, "
                                          "not P·V", "no_value_matmul")
                pv = u
                break
            if name == "einsum":
                ok, got = cz.einsum_roles(u, "pv")
                if not ok or u.args[1][0] is not cur:
                    return _miss(softmax, got if not ok else
                                 f"the probabilities are the second operand of {_describe(u)}", "no_value_matmul")
                pv = u
                break
            d = cz.dropout_of(u)
            if d is not None:
                p, train = d
                if train and p > 0:
                    dropout_p = p
                    spelling.append("dropout:train")
                members.append(u)
                cur = u
                continue
            if name in cz.CAST_OPS or name in cz.COPY_OPS:
                members.append(u)
                cur = u
                continue
            if (name in cz.RESHAPE_OPS or name == "expand") and cz.keeps_last_two(u, cur):
                prob_steps.append(("reshape", u))
                members.append(u)
                cur = u
                continue
            return _miss(softmax, f"the probabilities feed {_describe(u)}, not a matmul with the values",
                         "no_value_matmul")
        if pv is None:
            return _miss(softmax, "no P·V matmul found after the softmax", "no_value_matmul")
        members.append(pv)
        v_op = pv.args[1][1] if op_name(pv) == "einsum" else pv.args[1]
        # Mixed ranks (q·kᵀ as a bmm over [B*H, N, D] viewed to 4-D for the softmax, or P·V as a bmm
        # after a 4-D softmax) are read as rank 4 by lifting each [B*H, ..] operand to the
        # [B, H, ..] tensor it views; they must agree on that split (checked below)
        mixed = rank(v_op) != rq
        if mixed:
            if {rank(v_op), rq} != {3, 4}:
                return _miss(softmax, f"P·V multiplies by a rank-{rank(v_op)} tensor; expected rank {rq}",
                             "no_value_matmul")
            if rank(v_op) == 3:
                lifted = cz.unflatten_heads(v_op)
                if lifted is None:
                    return _miss(softmax, f"P·V multiplies a rank-{rq} softmax by a rank-3 tensor "
                                          f"{list(shape(v_op) or ())} that is no view of a [B, H, Nk, Dv] "
                                          "tensor", "no_value_matmul")
                v_op = lifted[0]
                members += lifted[1]
            spelling.append("rank:mixed")

        # --- operands: q, kᵀ -> k, v, seeing through scales, transposes and GQA repeats
        query, q_factors, q_members = cz.strip_factors(q_op, "query")
        if q_factors:
            spelling.append("scale:on_query")
        elif rq == 4 and cz.scale_folded_upstream(query) is not None:
            spelling.append("scale:folded_into_query")  # the site's scale excludes it (see canonicalize)
        if rq == 3 and op_name(query) in cz.RESHAPE_OPS and cz.strip_factors(query.args[0], "query")[1]:
            # q was scaled before being flattened to [B*H, N, D]: no unscaled rank-3 q exists in the
            # graph, so the scale stays inside `query` and the site's scale omits it
            spelling.append("scale:inside_flattened_query")
        key_t, k_factors, k_members = cz.strip_factors(k_op, "key")
        members += q_members + k_members
        groups = 1
        gqa_tag = ""
        if rq == 4:  # GQA repeat applied to kᵀ itself (k kept as [B, N, Hkv, D], permuted, repeated)
            key_t, groups, m, f, gqa_tag = _unrepeat_key(key_t)
            members += m
            k_factors += f
        if key_layout == "plain":  # einsum contracted k [.., Nk, D] directly
            got = (key_t, False, [], "qk:einsum")
        else:
            got = self._key_from_transposed(softmax, query, key_t)
        if isinstance(got, NearMiss):
            return got
        key, key_is_transposed, layout_members, tag = got
        spelling.append(tag)
        members += layout_members
        if not key_is_transposed:
            key, f, m = cz.strip_factors(key, "key")
            k_factors += f
            members += m
            if rq == 4 and groups == 1:
                key, groups, m, f, gqa_tag = _unrepeat_key(key)
                members += m
                k_factors += f
        if mixed and rq == 3:
            got = self._lift_qk(softmax, query, key)
            if isinstance(got, NearMiss):
                return got
            query, key, f, m = got
            q_factors += [x for x in f if x.where == "query"]
            k_factors += [x for x in f if x.where == "key"]
            members += m
            key, groups, m, f, gqa_tag = _unrepeat_key(key)
            members += m
            k_factors += f
            spelling = [t for t in spelling if t != "scale:inside_flattened_query"]
        if k_factors:
            spelling.append("scale:on_key")
        value = v_op
        if groups > 1:
            v_src, gv, v_rep, _ = cz.see_through_repeat_kv(value)
            if gv != groups:
                return _miss(softmax, f"keys are repeated {groups}x for grouped-query attention but values "
                                      f"{gv}x", "gqa")
            value = v_src
            members += v_rep
            spelling.append(gqa_tag)
        output = pv
        steps = list(reversed(steps_back))
        if mixed:
            got = self._lift_output(softmax, pv, query, key, key_is_transposed, steps + prob_steps)
            if isinstance(got, NearMiss):
                return got
            output, m = got
            members += m
            prob_steps = []  # views between [B*H, ..] and [B, H, ..] only: nothing to replay in 4-D
            rq = 4
        kv_repeated = _repeated_heads(key, value) if rq == 4 and groups == 1 else 1
        if kv_repeated > 1:
            spelling.append("gqa:repeated_before_layout")
        folded = _folded_factors(query, key)
        path, mtype, in_mha = module_of(softmax)
        return Candidate(
            anchor=softmax, source="mha" if in_mha else "explicit", query=query, key=key, value=value,
            output=output, rank=rq, key_is_transposed=key_is_transposed, qk_factors=q_factors + k_factors,
            score_steps=steps, prob_steps=prob_steps, groups=groups, kv_repeated=kv_repeated,
            folded_factors=folded, dropout_p=dropout_p,
            members=_unique(members), spelling=_unique(spelling), module_path=path, module_type=mtype,
        )

    @staticmethod
    def _lift_qk(softmax: Node, query: Node, key: Node):
        """q [B*H, Nq, D] and k (or kᵀ) [B*H, .., ..] of a bmm as the [B, H, .., ..] tensors they view,
        with the scale factors applied before the flattening: (q, k, factors, members) or a NearMiss."""
        got = []
        for role, node in (("query", query), ("key", key)):
            lifted = cz.unflatten_heads(node)
            if lifted is None:
                return _miss(softmax, f"the softmax is 4-D but the {role} of the bmm q·kᵀ, "
                                      f"{list(shape(node) or ())}, is no view of a [B, H, N, D] tensor", "mixed_rank")
            base, factors, m = cz.strip_factors(lifted[0], role)
            got.append((base, factors, lifted[1] + m))
        (q4, fq, mq), (k4, fk, mk) = got
        return q4, k4, fq + fk, mq + mk

    @staticmethod
    def _lift_output(softmax: Node, pv: Node, query: Node, key: Node, key_is_transposed: bool, steps: list):
        """The [B, H, Nq, Dv] node a mixed-rank chain's P·V is read as, after checking that every
        score / probability frame agrees with the lifted q·kᵀ: (output, members) or a NearMiss."""
        output, members = pv, []
        if rank(pv) == 3:
            lifted = cz.heads_view_of(pv)
            if lifted is None:
                return _miss(softmax, "P·V is a bmm over [B*H, Nq, Dv] after a 4-D softmax, and its result "
                                      "is never viewed as [B, H, Nq, Dv]", "no_value_matmul")
            output, members = lifted
        bad = _frame_disagrees(query, key, key_is_transposed, steps)
        if bad:
            return _miss(softmax, bad, "mixed_rank")
        return output, members

    @staticmethod
    def _weights_reused(softmax: Node, user: Node) -> NearMiss:
        _, _, in_mha = module_of(softmax)
        what = "returned" if user.op == "output" else f"used by {_describe(user)}"
        hint = " (call nn.MultiheadAttention with need_weights=False)" if in_mha else ""
        return _miss(softmax, f"attention weights are also {what}, so the chain cannot be replaced{hint}",
                     "weights_reused", user=user.name)

    @staticmethod
    def _key_from_transposed(softmax: Node, query: Node, key_t: Node):
        """Prove the kᵀ operand is the key with its last two axes swapped (pytorch#195320)."""
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
                    return _miss(softmax, f"key is reshaped from {list(shape(src) or ())} to "
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
        return _miss(softmax, f"key is permuted {text(shown)}{extra}, not transposed", "key_permuted",
                     perm=list(perm))


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
            return (f"{_describe(node)} holds the scores as {list(s)}, which is neither the [B, H, Nq, Nk] = "
                    f"{list(frame)} of the lifted q·kᵀ nor its [B*H, Nq, Nk] view")
        if kind == "term" and rank(x.node) == 3:
            return (f"the mask {_describe(x.node)} is spelled on [B*H, Nq, Nk] {list(shape(x.node) or ())}; "
                    "a rank-4 site has no [B, H] reading of it")
    return ""


def _folded_factors(query: Node, key: Node) -> list[Factor]:
    """Scale factors already inside the query / key nodes (applied before their layout ops)."""
    found = [cz.scale_folded_upstream(query, where="query"), cz.scale_folded_upstream(key, where="key")]
    return [f for f in found if f is not None]


def _repeated_heads(key: Node, value: Node) -> int:
    """The GQA repeat both k and v went through upstream (heads on axis 1 of both nodes); 1 when
    none or when they disagree (then no kv-head count is claimed beyond the nodes' own)."""
    rk, rv = cz.head_repeat(key, 1), cz.head_repeat(value, 1)
    return rk if rk == rv else 1


def _has_weight_operand(node: Node) -> bool:
    """Whether a linear / mm node multiplies by a stored parameter (possibly transposed or cast)."""
    for a in node.args[:3]:
        base, _, _ = cz.compose_layout(a) if isinstance(a, fx.Node) and rank(a) is not None else (a, (), [])
        while isinstance(base, fx.Node) and cz.is_cast(base):
            base = base.args[0]
        if isinstance(base, fx.Node) and base.op == "get_attr":
            return True
    return False


def _same_role_sizes(q_base: Node, k_base: Node, q_perm: tuple) -> bool:
    """q and k bases have the same size on every axis except tokens (Nq vs Nk) and heads (H vs Hkv)."""
    qs, ks = shape(q_base), shape(k_base)
    if qs is None or ks is None or len(qs) != len(ks):
        return False
    free_axes = {q_perm[-2], *q_perm[1:-2]}
    return all(cz.same_dim(a, b) for i, (a, b) in enumerate(zip(qs, ks)) if i not in free_axes)


def _unique(xs: list) -> list:
    seen, out = set(), []
    for x in xs:
        key = x.name if isinstance(x, fx.Node) else x
        if key not in seen:
            seen.add(key)
            out.append(x)
    return out


# ---- SDPA calls ---------------------------------------------------------------------------------

def sdpa_arguments(node: Node) -> dict:
    """SDPA-family arguments by name, defaults filled in from the op's schema.

    The backend variants differ: `_scaled_dot_product_flash_attention_for_cpu` takes attn_mask as
    a keyword, `_efficient` / `_cudnn` call it attn_bias (a positional slot before
    compute_log_sumexp), `_flash` takes none; all return a tuple whose element 0 is the output.
    The mask is returned under "attn_mask" whatever the op calls it.
    """
    schema = node.target._schema
    got: dict = {}
    for arg, value in zip(schema.arguments, node.args):
        got[arg.name] = value
    for arg in schema.arguments:
        if arg.name in node.kwargs:
            got[arg.name] = node.kwargs[arg.name]
        elif arg.name not in got and arg.has_default_value():
            got[arg.name] = arg.default_value
    if "attn_bias" in got:
        got["attn_mask"] = got.pop("attn_bias")
    return got


def _sdpa_output(node: Node) -> Union[Node, str]:
    """The node holding an SDPA-family op's attention output: the op itself, or for a backend
    variant the `getitem(node, 0)` of its tuple; a string says why there is none to replace."""
    if op_name(node) == "scaled_dot_product_attention":
        return node
    import operator

    outs = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    firsts = [u for u in outs if u.args[1] == 0]
    others = [u for u in outs if u.args[1] != 0 and cz.live_users(u)]
    if others:
        return (f"its element {others[0].args[1]} (the log-sum-exp or RNG state) is used by "
                f"{_describe(cz.live_users(others[0])[0])}, which a rewrite cannot provide")
    if len(firsts) != 1:
        return "its output is not read through one getitem(·, 0)"
    return firsts[0]


class SdpaMatcher:
    """`aten.scaled_dot_product_attention` (also what nn.MultiheadAttention lowers to) and the
    backend-specific variants a graph captured after SDPA dispatch holds instead."""

    anchors = cz.SDPA_OPS

    def match(self, node: Node) -> Union[Candidate, NearMiss]:
        a = sdpa_arguments(node)
        output = _sdpa_output(node)
        if isinstance(output, str):
            return _miss(node, f"{op_name(node)}: {output}", "sdpa_variant")
        q, k, v = a["query"], a["key"], a["value"]
        r = rank(q)
        if r not in (3, 4) or rank(k) != r or rank(v) != r:
            return _miss(node, f"SDPA on rank-{r} tensors; only [B, H, N, D] or [B*H, N, D] are read",
                         "sdpa_rank")
        spelling = ["sdpa"] if output is node else ["sdpa", "sdpa:" + op_name(node)]
        members = [node] if output is node else [node, output]
        groups = 1
        enable_gqa = bool(a.get("enable_gqa", False))
        if enable_gqa:
            spelling.append("gqa:enable_gqa")
        elif r == 4:
            k_src, gk, k_rep, tag = cz.see_through_repeat_kv(k)
            v_src, gv, v_rep, _ = cz.see_through_repeat_kv(v)
            if gk > 1 and gk == gv:
                k, v, groups = k_src, v_src, gk
                members += k_rep + v_rep
                spelling.append(tag)
        kv_repeated = _repeated_heads(k, v) if r == 4 and groups == 1 and not enable_gqa else 1
        if kv_repeated > 1:
            spelling.append("gqa:repeated_before_layout")
        mask = a.get("attn_mask")
        is_causal = bool(a.get("is_causal", False))
        if is_causal:
            spelling.append("mask:is_causal")
            nq, nk = shape(q)[-2], shape(k)[-2]
            if isinstance(nq, int) and isinstance(nk, int) and nq != nk:
                # SDPA aligns is_causal top-left; MaskInfo.causal means bottom-right
                return _miss(node, f"is_causal=True with {nq} queries and {nk} keys is aligned top-left, "
                                   "which differs from the usual bottom-right causal mask", "causal_alignment")
        path, mtype, in_mha = module_of(node)
        scale = a.get("scale")
        if scale is not None:
            spelling.append("scale:arg")
        if cz.scale_folded_upstream(q) is not None:
            spelling.append("scale:folded_into_query")  # the site's scale excludes it (see canonicalize)
        return Candidate(
            anchor=node, source="mha" if in_mha else "sdpa", query=q, key=k, value=v, output=output, rank=r,
            sdpa_scale=scale, sdpa_mask=mask if isinstance(mask, fx.Node) else None, is_causal=is_causal,
            groups=groups, kv_repeated=kv_repeated, folded_factors=_folded_factors(q, k), enable_gqa=enable_gqa,
            dropout_p=float(a.get("dropout_p", 0.0) or 0.0),
            members=members, spelling=spelling, module_path=path, module_type=mtype,
        )


class LogSoftmaxMatcher:
    """log_softmax over q·kᵀ is never attention; it is reported so the user sees why."""

    anchors = {"log_softmax", "_log_softmax"}

    def match(self, node: Node) -> Optional[NearMiss]:
        if not reaches_qk(node.args[0]):
            return None
        return _miss(node, "log_softmax over q·kᵀ gives log-probabilities, not attention weights",
                     "log_softmax")
