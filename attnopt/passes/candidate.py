"""What a matcher hands the detector: a structurally matched `Candidate`, or a `NearMiss` that says
in words what stopped it, and the small helpers every rule uses to name nodes and modules.

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D head dim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch.fx as fx

from attnopt.ir.site import NearMiss
from attnopt.passes.canonicalize import SDPA_OPS, Factor, MaskTerm, Node, op_name


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

    @property
    def is_sdpa(self) -> bool:
        """Whether the anchor is an SDPA-family call (else an explicit softmax chain)."""
        return op_name(self.anchor) in SDPA_OPS


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


def near_miss(node: Node, reason: str, code: str, **details) -> NearMiss:
    """A NearMiss at `node` (the anchor a matcher started from), in `node`'s module."""
    path, _, _ = module_of(node)
    return NearMiss(node=node.name, module_path=path, reason=reason, code=code, details=details)


def candidate_miss(c: Candidate, reason: str, code: str, **details) -> NearMiss:
    """A NearMiss for a candidate that matched structurally but failed a later check."""
    return NearMiss(node=c.anchor.name, module_path=c.module_path, reason=reason, code=code, details=details)


def describe(node) -> str:
    """A node as a near-miss reason names it: `matmul (bmm_2)`, `the graph output`."""
    if isinstance(node, fx.Node):
        if node.op == "output":
            return "the graph output"
        return f"{op_name(node) or node.op} ({node.name})"
    return repr(node)


def unique(xs: list) -> list:
    """`xs` without repeats (nodes compared by name), first occurrence kept."""
    seen, out = set(), []
    for x in xs:
        key = x.name if isinstance(x, fx.Node) else x
        if key not in seen:
            seen.add(key)
            out.append(x)
    return out
