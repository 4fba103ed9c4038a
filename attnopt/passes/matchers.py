"""Attention matchers: one rich rule for explicit softmax chains, one for SDPA calls (and its
backend-specific variants).

Each rule has `anchors` (the ops it starts from), `match` (walk the graph through the canonical
view of `canonicalize`, tagging which alternative of each part matched) and leaves the numeric
check (`numeric_check`) to the detector, which runs the graph once for all candidates. `match`
returns either a `Candidate` or a `NearMiss` that says, in words, what stopped it. The explicit
rule is three steps: the scores chain and the probabilities chain (`chain`), then the operands
(`operands`).

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D head dim.
"""

from __future__ import annotations

import operator
from typing import Optional, Union

import torch.fx as fx

from attnopt.ir.site import NearMiss
from attnopt.passes import canonicalize as cz
from attnopt.passes.candidate import Candidate, describe, module_of, near_miss, unique
from attnopt.passes.canonicalize import Node, op_name, rank, shape
from attnopt.passes.chain import probabilities_chain, reaches_qk, scores_chain
from attnopt.passes.operands import find_operands, folded_factors, repeated_heads

# ---- explicit chains ----------------------------------------------------------------------------

class ExplicitChainMatcher:
    """softmax(scale · q kᵀ + mask) @ v spelled out with matmul / bmm / baddbmm."""

    anchors = cz.SOFTMAX_OPS

    def match(self, softmax: Node) -> Union[Candidate, NearMiss]:
        scores = scores_chain(softmax)  # softmax input back to q·kᵀ
        if isinstance(scores, NearMiss):
            return scores
        probs = probabilities_chain(softmax, scores.rank)  # softmax output on to P·V
        if isinstance(probs, NearMiss):
            return probs
        ops = find_operands(softmax, scores, probs)  # q, k, v and the output
        if isinstance(ops, NearMiss):
            return ops
        path, mtype, in_mha = module_of(softmax)
        return Candidate(
            anchor=softmax, source="mha" if in_mha else "explicit", query=ops.query, key=ops.key,
            value=ops.value, output=ops.output, rank=ops.rank, key_is_transposed=ops.key_is_transposed,
            qk_factors=list(ops.qk_factors), score_steps=list(scores.steps),
            # a mixed-rank chain's probability views only go between [B*H, ..] and [B, H, ..]:
            # nothing to replay once it is read in 4-D
            prob_steps=[] if probs.mixed else list(probs.steps),
            groups=ops.groups, kv_repeated=ops.kv_repeated, folded_factors=list(ops.folded_factors),
            dropout_p=probs.dropout_p,
            members=unique([*scores.members, *probs.members, *ops.members]),
            spelling=unique([*scores.spelling, *probs.spelling, *ops.spelling]),
            module_path=path, module_type=mtype,
        )


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
    outs = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    firsts = [u for u in outs if u.args[1] == 0]
    others = [u for u in outs if u.args[1] != 0 and cz.live_users(u)]
    if others:
        return (f"its element {others[0].args[1]} (the log-sum-exp or RNG state) is used by "
                f"{describe(cz.live_users(others[0])[0])}, which a rewrite cannot provide")
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
            return near_miss(node, f"{op_name(node)}: {output}", "sdpa_variant")
        q, k, v = a["query"], a["key"], a["value"]
        r = rank(q)
        if r not in (3, 4) or rank(k) != r or rank(v) != r:
            return near_miss(node, f"SDPA on rank-{r} tensors; only [B, H, N, D] or [B*H, N, D] are read",
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
        kv_repeated = repeated_heads(k, v) if r == 4 and groups == 1 and not enable_gqa else 1
        if kv_repeated > 1:
            spelling.append("gqa:repeated_before_layout")
        mask = a.get("attn_mask")
        is_causal = bool(a.get("is_causal", False))
        if is_causal:
            spelling.append("mask:is_causal")
            nq, nk = shape(q)[-2], shape(k)[-2]
            if isinstance(nq, int) and isinstance(nk, int) and nq != nk:
                # SDPA aligns is_causal top-left; MaskInfo.causal means bottom-right
                return near_miss(node, f"is_causal=True with {nq} queries and {nk} keys is aligned top-left, "
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
            groups=groups, kv_repeated=kv_repeated, folded_factors=folded_factors(q, k), enable_gqa=enable_gqa,
            dropout_p=float(a.get("dropout_p", 0.0) or 0.0),
            members=members, spelling=spelling, module_path=path, module_type=mtype,
        )


class LogSoftmaxMatcher:
    """log_softmax over q·kᵀ is never attention; it is reported so the user sees why."""

    anchors = {"log_softmax", "_log_softmax"}

    def match(self, node: Node) -> Optional[NearMiss]:
        if not reaches_qk(node.args[0]):
            return None
        return near_miss(node, "log_softmax over q·kᵀ gives log-probabilities, not attention weights",
                         "log_softmax")
