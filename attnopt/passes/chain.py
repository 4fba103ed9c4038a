"""The two walks of an explicit softmax chain, out from its softmax: down the *scores chain* to
q·kᵀ, and up the *probabilities chain* to P·V. Each walk records what it saw through, so the
numeric check can replay it, and the spelling tags that say which alternative matched.

Letters: B batch, H query heads, Nq/Nk query/key length, D/Dv head dims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch.fx as fx

from attnopt.ir.site import NearMiss
from attnopt.passes import canonicalize as cz
from attnopt.passes.candidate import describe, module_of, near_miss
from attnopt.passes.canonicalize import Factor, MaskTerm, Node, op_name, rank, shape

WALK_LIMIT = 64  # nodes either walk goes through before giving up


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


# ---- scores chain: softmax input -> q·kᵀ ---------------------------------------------------------

@dataclass(frozen=True)
class ScoresChain:
    """q·kᵀ and, in forward order, what happens between it and the softmax input."""

    qk: Node  # the matmul / bmm / baddbmm / einsum
    query_operand: Node  # q as the matmul reads it: [B*H, Nq, D] or [B, H, Nq, D]
    key_operand: Node  # kᵀ [.., D, Nk] (key_layout "transposed") or k [.., Nk, D] ("plain")
    key_layout: str
    rank: int  # of the q·kᵀ operands: 3 or 4
    steps: tuple  # ("scale", Factor) | ("term", MaskTerm) | ("reshape", Node), forward order
    spelling: tuple
    members: tuple  # the softmax, every node walked through, q·kᵀ


@dataclass(frozen=True)
class _Down:
    """One node of the scores chain seen through: where to go next and what it contributed."""

    next: object
    step: Optional[tuple] = None
    tags: tuple = ()
    member: object = None  # the node recorded as a chain member (None: the node seen through)


def scores_chain(softmax: Node) -> Union[ScoresChain, NearMiss]:
    """Walk back from the softmax input to q·kᵀ, then read the product's operands."""
    axis = _softmax_axis_miss(softmax)
    if axis is not None:
        return axis
    steps_back: list = []  # reverse order
    spelling: list[str] = []
    members: list[Node] = [softmax]
    cur = softmax.args[0]
    for _ in range(WALK_LIMIT):
        name = cz.base_op(cur)  # `scores += mask` and `scores.div_(d)` read as their out-of-place forms
        if cz.is_inplace(cur):
            spelling.append("inplace:" + op_name(cur))
        if name in cz.MATMUL_OPS or name in ("baddbmm", "einsum"):
            return _read_qk(softmax, cur, steps_back, spelling, members)
        got = _step_down(softmax, cur, name)
        if isinstance(got, NearMiss):
            return got
        spelling += got.tags
        members.append(cur if got.member is None else got.member)
        if got.step is not None:
            steps_back.append(got.step)
        cur = got.next
    return near_miss(softmax, "no q·kᵀ matmul found before the softmax", "no_score_matmul")


def _softmax_axis_miss(softmax: Node) -> Optional[NearMiss]:
    r = rank(softmax)
    dim_arg = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim", -1)
    if r is None or r < 2:
        return near_miss(softmax, "softmax of a tensor with fewer than 2 dims cannot be attention",
                         "no_score_matmul")
    if cz.softmax_dim(softmax) != r - 1:
        return near_miss(softmax, f"softmax over dim {dim_arg}, not the key axis (dim -1)", "softmax_axis",
                         dim=dim_arg)
    return None


def _step_down(softmax: Node, cur, name: Optional[str]) -> Union[_Down, NearMiss]:
    """See through one node between q·kᵀ and the softmax, or say why it is no part of the chain."""
    if name in cz.CAST_OPS or name in cz.COPY_OPS:
        return _Down(cur.args[0], tags=("cast:scores",) if name in cz.CAST_OPS else ())
    if cz.is_value_transparent(cur):  # views that keep [.., Nq, Nk], eval dropout
        return _Down(cur.args[0], step=("reshape", cur) if name in cz.RESHAPE_OPS or name == "expand" else None)
    if name in ("mul", "div", "true_divide"):
        return _down_scale(softmax, cur)
    if name == "add":
        return _down_add(softmax, cur)
    if name == "masked_fill":
        fv = cz.fill_value(cur.args[2])
        if not cz.is_masking_value(fv):
            return near_miss(softmax, f"masked_fill writes {fv!r} into the scores, not a masking value "
                                      "(-inf or a large negative number)", "mask_value")
        return _Down(cur.args[0], step=("term", MaskTerm("masked_fill", cur.args[1], cur, fv)))
    if name == "where":
        return _down_where(softmax, cur)
    return _not_scores(softmax, cur, name)


def _down_scale(softmax: Node, cur: Node) -> Union[_Down, NearMiss]:
    """scores · c or scores / c: a scale factor (a tensor of the scores' shape is not one)."""
    for a in cur.args[:2]:
        if isinstance(a, fx.Node) and cz.same_shape(a, cur):
            f = cz.as_factor(cur, a, "scores")
            if f is not None:
                return _Down(a, step=("scale", f), tags=("scale:div" if f.divide else "scale:mul",))
    return near_miss(softmax, f"the softmax input is scaled by a tensor ({describe(cur)}), not by a scalar",
                     "no_score_matmul")


def _down_add(softmax: Node, cur: Node) -> Union[_Down, NearMiss]:
    """scores + mask (either order); adding a constant shifts every logit equally and is skipped."""
    a, b = cur.args[0], cur.args[1]
    alpha = cur.kwargs.get("alpha", 1)
    if alpha != 1:
        return near_miss(softmax, f"{describe(cur)} adds with alpha={alpha}", "no_score_matmul")
    if not isinstance(b, fx.Node) or not isinstance(a, fx.Node):
        return _Down(a if isinstance(a, fx.Node) else b)
    if reaches_qk(a):
        scores_side, term, tags = a, b, ()
    elif reaches_qk(b):
        scores_side, term, tags = b, a, ("mask:commuted",)
    else:
        return near_miss(softmax, f"neither operand of the add before the softmax is q·kᵀ ({describe(cur)})",
                         "no_score_matmul")
    return _Down(scores_side, step=("term", MaskTerm("additive", term, cur)), tags=tags)


def _down_where(softmax: Node, cur: Node) -> Union[_Down, NearMiss]:
    """where(cond, scores, -inf) keeps where cond; where(cond, -inf, scores) drops where cond.
    The scores side, not the where node, is recorded as the member (as the walk always has)."""
    cond, a, b = cur.args[0], cur.args[1], cur.args[2]
    fa, fb = cz.fill_value(a), cz.fill_value(b)
    if isinstance(a, fx.Node) and cz.is_masking_value(fb) and reaches_qk(a):
        return _Down(a, step=("term", MaskTerm("where_keep", cond, cur, fb)), member=a)
    if isinstance(b, fx.Node) and cz.is_masking_value(fa) and reaches_qk(b):
        return _Down(b, step=("term", MaskTerm("where_drop", cond, cur, fa)), member=b)
    return near_miss(softmax, f"{describe(cur)} selects between the scores and something that is "
                              "not a masking value", "mask_value")


def _not_scores(softmax: Node, cur, name: Optional[str]) -> NearMiss:
    """Why the node the walk reached is no part of softmax(scale·q·kᵀ + mask)."""
    if name == "tanh":
        return near_miss(softmax, "the attention logits are soft-capped with tanh before the softmax "
                                  "(logit softcapping), which softmax(scale·q·kᵀ + mask)·v cannot express",
                         "logit_softcap")
    if name in ("linear", "addmm", "mm") and _has_weight_operand(cur):
        # classifier heads and MoE routers (Mixtral, OLMoE, Qwen2-MoE gates) end here
        return near_miss(softmax, f"the softmax input is a projection x·W with a weight ({describe(cur)}), "
                                  "as in a classifier or an MoE router, not q·kᵀ of two activations",
                         "no_score_matmul")
    return near_miss(softmax, "the softmax input is not a product q·kᵀ of two activations: it comes from "
                              f"{describe(cur)}", "no_score_matmul")


def _read_qk(softmax: Node, qk: Node, steps_back: list, spelling: list, members: list
             ) -> Union[ScoresChain, NearMiss]:
    """The q·kᵀ node itself: baddbmm's own bias and scale, einsum's roles, the two operands."""
    members = members + [qk]
    spelling, steps_back = list(spelling), list(steps_back)
    if op_name(qk) == "baddbmm":
        beta = qk.kwargs.get("beta", 1)
        alpha = qk.kwargs.get("alpha", 1)
        if beta not in (0, 1):
            return near_miss(softmax, f"baddbmm with beta={beta} scales the added term", "mask_value")
        spelling.append("qk:baddbmm")
        # beta·bias + alpha·(q·kᵀ): alpha scales the product only, so in forward order the scale
        # comes before the bias (BLOOM adds ALiBi this way); steps_back is in reverse order
        if beta == 1:
            steps_back.append(("term", MaskTerm("additive", qk.args[0], qk)))
        if alpha != 1:
            steps_back.append(("scale", Factor(float(alpha), False, qk.name, "scores")))
    else:
        spelling.append(f"qk:{op_name(qk)}")
    key_layout = "transposed"  # the second operand holds kᵀ [.., D, Nk]
    if op_name(qk) == "einsum":
        ok, got = cz.einsum_roles(qk, "qk")
        if not ok:
            return near_miss(softmax, got, "no_score_matmul")
        q_op, k_op = qk.args[1][0], qk.args[1][1]
        key_layout = got
    elif op_name(qk) == "baddbmm":
        q_op, k_op = qk.args[1], qk.args[2]
    else:
        q_op, k_op = qk.args[0], qk.args[1]
    for operand in (q_op, k_op):
        base, _, _ = cz.compose_layout(operand)
        if isinstance(base, fx.Node) and base.op == "get_attr":
            return near_miss(softmax, f"the scores are x·W with a weight ({base.target}), not q·kᵀ of two "
                                      "activations", "no_score_matmul")
    rq, rk = rank(q_op), rank(k_op)
    if rq not in (3, 4) or rk != rq:
        return near_miss(softmax, f"q·kᵀ operands have ranks {rq} and {rk}; attention needs both 3-D "
                                  "[B*H, N, D] or both 4-D [B, H, N, D]", "no_score_matmul")
    return ScoresChain(qk=qk, query_operand=q_op, key_operand=k_op, key_layout=key_layout, rank=rq,
                       steps=tuple(reversed(steps_back)), spelling=tuple(spelling), members=tuple(members))


def _has_weight_operand(node: Node) -> bool:
    """Whether a linear / mm node multiplies by a stored parameter (possibly transposed or cast)."""
    for a in node.args[:3]:
        base, _, _ = cz.compose_layout(a) if isinstance(a, fx.Node) and rank(a) is not None else (a, (), [])
        while isinstance(base, fx.Node) and cz.is_cast(base):
            base = base.args[0]
        if isinstance(base, fx.Node) and base.op == "get_attr":
            return True
    return False


# ---- probabilities chain: softmax output -> P·V -------------------------------------------------

@dataclass(frozen=True)
class ProbabilitiesChain:
    """P·V, its value operand, and what happens between the softmax output and P's operand."""

    pv: Node  # the matmul / bmm / einsum
    value_operand: Node  # v as P·V reads it; for a mixed-rank chain the [B, H, Nk, Dv] it views
    mixed: bool  # the value operand's rank differs from q·kᵀ's (one side a bmm over [B*H, ..])
    steps: tuple  # ("reshape", Node), forward order
    dropout_p: float
    spelling: tuple
    members: tuple  # every node walked through, P·V, the views lifting v


@dataclass(frozen=True)
class _Up:
    """One user of the probabilities seen through on the way to P·V."""

    next: Node
    step: Optional[tuple] = None
    tags: tuple = ()
    dropout_p: Optional[float] = None  # a training-mode dropout's p


def probabilities_chain(softmax: Node, qk_rank: int) -> Union[ProbabilitiesChain, NearMiss]:
    """Walk forward from the softmax output to the matmul with the values, then read v."""
    steps: list = []
    spelling: list[str] = []
    members: list[Node] = []
    dropout_p = 0.0
    cur = softmax
    for _ in range(WALK_LIMIT):
        u = _only_user(softmax, cur)
        if isinstance(u, NearMiss):
            return u
        pv = _pv_or_miss(softmax, cur, u)
        if isinstance(pv, NearMiss):
            return pv
        if pv is not None:
            return _read_pv(softmax, pv, qk_rank, steps, spelling, members + [pv], dropout_p)
        got = _step_up(softmax, cur, u)
        if isinstance(got, NearMiss):
            return got
        if got.dropout_p is not None:
            dropout_p = got.dropout_p
        spelling += got.tags
        members.append(u)
        if got.step is not None:
            steps.append(got.step)
        cur = got.next
    return near_miss(softmax, "no P·V matmul found after the softmax", "no_value_matmul")


def _only_user(softmax: Node, cur: Node) -> Union[Node, NearMiss]:
    """The probabilities' one live user; several (or the graph output) mean the weights are reused."""
    users = cz.live_users(cur)
    if len(users) != 1:
        others = [u for u in users if not (op_name(u) in cz.MATMUL_OPS and u.args[0] is cur)]
        if not users:
            return near_miss(softmax, "the attention probabilities are not used", "no_value_matmul")
        other = others[0] if others else users[1]
        return weights_reused(softmax, other)
    u = users[0]
    if u.op == "output":
        return weights_reused(softmax, u)
    return u


def weights_reused(softmax: Node, user: Node) -> NearMiss:
    """The attention weights are read by more than P·V: replacing the chain would lose them."""
    _, _, in_mha = module_of(softmax)
    what = "returned" if user.op == "output" else f"used by {describe(user)}"
    hint = " (call nn.MultiheadAttention with need_weights=False)" if in_mha else ""
    return near_miss(softmax, f"attention weights are also {what}, so the chain cannot be replaced{hint}",
                     "weights_reused", user=user.name)


def _pv_or_miss(softmax: Node, cur: Node, u: Node) -> Union[Node, NearMiss, None]:
    """`u` when it is P·V with the probabilities on the left; a miss for any other matmul use."""
    name = op_name(u)
    if name in cz.MATMUL_OPS:
        if u.args[0] is not cur:
            return near_miss(softmax, f"the probabilities are the right operand of {describe(u)}, not P·V",
                             "no_value_matmul")
        return u
    if name == "einsum":
        ok, got = cz.einsum_roles(u, "pv")
        if not ok or u.args[1][0] is not cur:
            return near_miss(softmax, got if not ok else f"the probabilities are the second operand of "
                                                         f"{describe(u)}", "no_value_matmul")
        return u
    return None


def _step_up(softmax: Node, cur: Node, u: Node) -> Union[_Up, NearMiss]:
    """See through one user between the softmax and P·V: dropout, casts, copies, views."""
    name = op_name(u)
    d = cz.dropout_of(u)
    if d is not None:
        p, train = d
        if train and p > 0:
            return _Up(u, tags=("dropout:train",), dropout_p=p)
        return _Up(u)
    if name in cz.CAST_OPS or name in cz.COPY_OPS:
        return _Up(u)
    if (name in cz.RESHAPE_OPS or name == "expand") and cz.keeps_last_two(u, cur):
        return _Up(u, step=("reshape", u))
    return near_miss(softmax, f"the probabilities feed {describe(u)}, not a matmul with the values",
                     "no_value_matmul")


def _read_pv(softmax: Node, pv: Node, qk_rank: int, steps: list, spelling: list, members: list,
             dropout_p: float) -> Union[ProbabilitiesChain, NearMiss]:
    """P·V's value operand. Mixed ranks (q·kᵀ as a bmm over [B*H, N, D] viewed to 4-D for the
    softmax, or P·V as a bmm after a 4-D softmax) are read as rank 4 by lifting each [B*H, ..]
    operand to the [B, H, ..] tensor it views; they must agree on that split (operands checks)."""
    v_op = pv.args[1][1] if op_name(pv) == "einsum" else pv.args[1]
    spelling, members = list(spelling), list(members)
    mixed = rank(v_op) != qk_rank
    if mixed:
        if {rank(v_op), qk_rank} != {3, 4}:
            return near_miss(softmax, f"P·V multiplies by a rank-{rank(v_op)} tensor; expected rank {qk_rank}",
                             "no_value_matmul")
        if rank(v_op) == 3:
            lifted = cz.unflatten_heads(v_op)
            if lifted is None:
                return near_miss(softmax, f"P·V multiplies a rank-{qk_rank} softmax by a rank-3 tensor "
                                          f"{list(shape(v_op) or ())} that is no view of a [B, H, Nk, Dv] "
                                          "tensor", "no_value_matmul")
            v_op = lifted[0]
            members += lifted[1]
        spelling.append("rank:mixed")
    return ProbabilitiesChain(pv=pv, value_operand=v_op, mixed=mixed, steps=tuple(steps), dropout_p=dropout_p,
                              spelling=tuple(spelling), members=tuple(members))
