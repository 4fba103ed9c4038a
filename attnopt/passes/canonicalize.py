"""A canonical *view* of ATen spellings, so one matcher covers them all.

Nothing here edits the graph (the rewrite pass needs the node names the detector reports); instead
each helper answers "what does this node mean, once its spelling is normalised": a cast, clone or
eval-mode dropout is transparent; `x * c`, `x / c` and `baddbmm(alpha=)` are scale factors; `+ m`,
`masked_fill` and `where` are mask terms (in-place `+=`, `mul_`, `div_`, `masked_fill_` alike);
`repeat_kv` / `repeat_interleave` are a GQA group count; chains of permute/transpose/`.mT` compose
into one axis permutation; a [B*H, N, D] view is lifted to the [B, H, N, D] tensor it flattens.

Letters: B batch, H query heads, Hkv key/value heads, N tokens, D head dim.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from attnopt.ir.masks import ADDITIVE_HIDE_BELOW

Node = fx.Node


def op_name(node: Any) -> Optional[str]:
    """'softmax', 'matmul', ... for an ATen call_function node; None for anything else."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    name = schema.name
    return name.split("::", 1)[1] if "::" in name else name


# In-place spellings the score chain may use (`scores += mask`, `scores.div_(d)`): export keeps them
# as `add_` / `div_` / ..., with the same arguments as the out-of-place op.
INPLACE_OPS = {"add_": "add", "mul_": "mul", "div_": "div", "masked_fill_": "masked_fill"}


def base_op(node: Any) -> Optional[str]:
    """op_name with an in-place op read as its out-of-place form (`add_` -> `add`)."""
    name = op_name(node)
    return INPLACE_OPS.get(name, name)


def is_inplace(node: Any) -> bool:
    return op_name(node) in INPLACE_OPS


def overload(node: Node) -> str:
    return getattr(node.target, "_overloadname", "")


def val(node: Any):
    """The FakeTensor / SymInt example recorded by export, or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node: Any) -> Optional[tuple]:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def rank(node: Any) -> Optional[int]:
    s = shape(node)
    return None if s is None else len(s)


def same_dim(a, b) -> bool:
    """Equality of two dims that may be SymInts, without adding guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return str(a) == str(b)


def same_shape(a: Any, b: Any) -> bool:
    sa, sb = shape(a), shape(b)
    return sa is not None and sb is not None and len(sa) == len(sb) and all(map(same_dim, sa, sb))


def real_users(node: Node) -> list[Node]:
    """Users that consume the value (export's `_assert_tensor_metadata` checks do not)."""
    return [u for u in node.users if not (op_name(u) or "").startswith("_assert")]


def live_users(node: Node) -> list[Node]:
    """Real users whose result reaches the graph output or a side effect.

    nn.MultiheadAttention's default need_weights=True head-averages the probabilities even when
    the caller drops them (SigLIP's pooling head takes `[0]`); export keeps that dead view/mean."""
    return [u for u in real_users(node) if not is_dead(u)]


def is_dead(node: Node, depth: int = 8) -> bool:
    """No path from `node` to the output or to an impure op (within `depth` steps; deeper: live)."""
    if node.op == "output" or node.is_impure():
        return False
    users = real_users(node)
    if not users:
        return True
    return depth > 0 and all(is_dead(u, depth - 1) for u in users)


SOFTMAX_OPS = {"softmax", "_softmax", "_safe_softmax"}
SDPA_OPS = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
}
MATMUL_OPS = {"matmul", "bmm"}
CAST_OPS = {"_to_copy", "to", "type_as"}
COPY_OPS = {"clone", "contiguous", "alias", "detach", "lift_fresh_copy"}
RESHAPE_OPS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten"}


def softmax_dim(node: Node) -> int:
    """The reduction axis of a softmax node, normalised to be non-negative."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    r = rank(node) or 0
    return dim + r if dim < 0 else dim


def is_cast(node: Node) -> bool:
    """A dtype/device conversion: the values are the same numbers (models upcast around softmax)."""
    return op_name(node) in CAST_OPS


def dropout_of(node: Node) -> Optional[tuple[float, bool]]:
    """(p, train) for a dropout node, else None."""
    name = op_name(node)
    if name == "dropout":
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return float(p), bool(train)
    if name == "native_dropout":
        p = node.args[1] if len(node.args) > 1 else 0.5
        train = node.args[2] if len(node.args) > 2 else True
        return float(p), bool(train)
    return None


def keeps_last_two(node: Node, src: Node) -> bool:
    """A reshape-like op whose output keeps the source's last two dims (no data moves between them)."""
    a, b = shape(node), shape(src)
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return False
    return same_dim(a[-1], b[-1]) and same_dim(a[-2], b[-2])


def is_value_transparent(node: Node) -> bool:
    """Ops that leave values and the last two axes untouched: casts, copies, eval dropout, views."""
    name = op_name(node)
    if name is None:
        return False
    if name in COPY_OPS or is_cast(node):
        return True
    d = dropout_of(node)
    if d is not None:
        return d[0] == 0.0 or not d[1]
    if name in RESHAPE_OPS or name == "expand":
        return keeps_last_two(node, node.args[0])
    return False


# ---- scalar factors -----------------------------------------------------------------------------

Scalar = Union[float, Node]  # a Python number, or a node holding a one-element tensor / SymFloat


def scalar_of(x: Any) -> Optional[Scalar]:
    """x as a scalar factor when it is one (number, 0-d / one-element tensor node), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node):
        v = val(x)
        if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.dtype == torch.bool:
            return x
        if isinstance(v, (torch.SymFloat, torch.SymInt)):
            return x
    return None


@dataclass(frozen=True)
class Factor:
    """One multiplicative piece of the scale: value (or node holding it), applied as mul or div."""

    value: Scalar
    divide: bool
    node: str  # the mul/div node that applies it
    where: str  # "scores", "query" or "key"

    def resolve(self, values: dict) -> float:
        v = self.value
        if isinstance(v, fx.Node):
            got = values[v.name]
            v = float(got.item()) if isinstance(got, torch.Tensor) else float(got)
        return 1.0 / v if self.divide else float(v)


def as_factor(node: Node, main: Node, where: str) -> Optional[Factor]:
    """If `node` multiplies/divides `main` by a scalar, return the factor (in-place forms too)."""
    name = base_op(node)
    if name not in ("mul", "div", "true_divide"):
        return None
    if name in ("div", "true_divide") and node.kwargs.get("rounding_mode") is not None:
        return None
    a = node.args[0]
    b = node.args[1] if len(node.args) > 1 else None
    if name == "mul":
        if a is main and scalar_of(b) is not None and b is not main:
            return Factor(scalar_of(b), False, node.name, where)
        if b is main and scalar_of(a) is not None and a is not main:
            return Factor(scalar_of(a), False, node.name, where)
        return None
    if a is main and scalar_of(b) is not None:
        return Factor(scalar_of(b), True, node.name, where)
    return None


def strip_factors(node: Node, where: str) -> tuple[Node, list[Factor], list[Node]]:
    """Walk back through scalar mul/div and value-preserving copies; return the unscaled tensor."""
    factors: list[Factor] = []
    members: list[Node] = []
    while True:
        name = op_name(node)
        if name in ("mul", "div", "true_divide"):
            inner = None
            for cand in node.args[:2]:
                if isinstance(cand, fx.Node) and not (shape(cand) is not None and len(shape(cand)) == 0):
                    f = as_factor(node, cand, where)
                    if f is not None and same_shape(cand, node):
                        inner = cand
                        factors.append(f)
                        break
            if inner is None:
                break
            members.append(node)
            node = inner
            continue
        if name in ("clone", "contiguous", "alias"):
            members.append(node)
            node = node.args[0]
            continue
        break
    return node, factors, members


def scale_folded_upstream(node: Node, depth: int = 8, where: str = "query") -> Optional[Factor]:
    """A scalar factor applied to `node`'s values before a head split / transpose (OPT and Whisper
    scale q right after its projection, in [B, N, H*D]): no unscaled [B, H, N, D] tensor exists,
    so the site's scale is relative to the already scaled node. Returned only to say so."""
    for _ in range(depth):
        name = base_op(node)  # `q *= c` too: never stripped (the input node is mutated), only reported
        if name in ("mul", "div", "true_divide"):
            for cand in node.args[:2]:
                if isinstance(cand, fx.Node) and same_shape(cand, node):
                    f = as_factor(node, cand, where)
                    if f is not None:
                        return f
            return None
        if name in RESHAPE_OPS or name in COPY_OPS or perm_of(node) is not None or is_cast(node):
            node = node.args[0]
            continue
        return None
    return None


# ---- layout: composite permutations --------------------------------------------------------------

def perm_of(node: Node) -> Optional[tuple[int, ...]]:
    """The axis permutation applied by a transpose/permute node (output axis i = input axis p[i])."""
    name = op_name(node)
    r = rank(node)
    if r is None:
        return None
    if name == "permute":
        dims = node.args[1]
        return tuple(d % r for d in dims)
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = node.args[1] % r, node.args[2] % r
        p = list(range(r))
        p[a], p[b] = p[b], p[a]
        return tuple(p)
    if name == "t" and r == 2:
        return (1, 0)
    if name == "mT" and r >= 2:  # Tensor.mT: the batched matrix transpose
        return tuple(range(r - 2)) + (r - 1, r - 2)
    return None


def compose_layout(node: Node) -> tuple[Node, tuple[int, ...], list[Node]]:
    """Follow transpose/permute (and value copies) back to a base tensor.

    Returns (base, perm, nodes) with node's axis i == base's axis perm[i].
    """
    r = rank(node)
    perm = tuple(range(r or 0))
    nodes: list[Node] = []
    while True:
        p = perm_of(node)
        if p is not None:
            perm = tuple(p[i] for i in perm)
            nodes.append(node)
            node = node.args[0]
            continue
        if op_name(node) in ("clone", "contiguous", "alias"):
            nodes.append(node)
            node = node.args[0]
            continue
        break
    return node, perm, nodes


def swap_last_two(perm: tuple[int, ...]) -> tuple[int, ...]:
    return perm[:-2] + (perm[-1], perm[-2])


# ---- heads folded into the batch: [B*H, X, Y] <-> [B, H, X, Y] -----------------------------------

_VIEW_OPS = ("view", "reshape", "_unsafe_view", "flatten", "unflatten")


def _merges_heads(big: Any, small: Any) -> bool:
    """`small` [G, X, Y] is `big` [B, H, X, Y] with its first two axes merged (G = B·H)."""
    b, s = shape(big), shape(small)
    return (b is not None and s is not None and len(b) == 4 and len(s) == 3 and same_dim(b[2], s[1])
            and same_dim(b[3], s[2]) and same_dim(b[0] * b[1], s[0]))


def unflatten_heads(node: Node, depth: int = 8) -> Optional[tuple[Node, list[Node]]]:
    """The [B, H, X, Y] tensor that a [B*H, X, Y] node is a row-major view of, and the views between;
    None when the graph holds no such tensor (the rank-3 batch is then not known to be heads)."""
    members: list[Node] = []
    cur = node
    for _ in range(depth):
        name = op_name(cur)
        if name in COPY_OPS:
            members.append(cur)
            cur = cur.args[0]
            continue
        if name in _VIEW_OPS and isinstance(cur.args[0], fx.Node):
            src = cur.args[0]
            members.append(cur)
            if _merges_heads(src, node):
                return src, members
            if same_shape(src, cur):
                cur = src
                continue
        return None
    return None


def heads_view_of(node: Node, depth: int = 8) -> Optional[tuple[Node, list[Node]]]:
    """The one [B, H, X, Y] view that a [B*H, X, Y] result is read through, and the nodes on the way."""
    members: list[Node] = []
    cur = node
    for _ in range(depth):
        users = live_users(cur)
        if len(users) != 1:
            return None
        u = users[0]
        name = op_name(u)
        if name in COPY_OPS:
            members.append(u)
            cur = u
            continue
        if name in _VIEW_OPS and _merges_heads(u, node):
            return u, members + [u]
        return None
    return None


# ---- GQA: repeat_kv / repeat_interleave ----------------------------------------------------------

def _walk_up(node: Node, passes, members: Optional[list] = None) -> Node:
    """The first node up the chain of first arguments from `node` that `passes` rejects; the nodes
    passed on the way join `members`."""
    while passes(node):
        if members is not None:
            members.append(node)
        node = node.args[0]
    return node


def _whole_slice(node: Node) -> bool:
    """A slice that keeps every element (`x[:, :, None]` traces as one around the unsqueeze)."""
    return op_name(node) == "slice" and same_shape(node, node.args[0])


def see_through_repeat_kv(node: Node) -> tuple[Node, int, list[Node], str]:
    """If `node` is a [B, H, N, D] tensor made by repeating [B, Hkv, N, D] heads, return the source.

    Spellings: HF `repeat_kv` (x[:, :, None].expand(B, Hkv, R, N, D).reshape(B, Hkv*R, N, D)) and
    `repeat_interleave(R, dim=1)`. Returns (source, R, nodes, tag); R == 1 when nothing repeats.
    """
    members: list[Node] = []
    cur = node
    name = op_name(cur)
    if name == "repeat_interleave" and overload(cur) == "self_int":
        reps = cur.args[1]
        dim = cur.args[2] if len(cur.args) > 2 else cur.kwargs.get("dim")
        r = rank(cur)
        if isinstance(reps, int) and dim is not None and r == 4 and dim % r == 1:
            return cur.args[0], reps, [cur], "gqa:repeat_interleave"
        return node, 1, [], ""
    if name not in ("view", "reshape", "_unsafe_view", "flatten"):  # flatten(1, 2) merges like reshape
        return node, 1, [], ""
    out_shape = shape(cur)
    members.append(cur)
    exp = _walk_up(cur.args[0], lambda n: op_name(n) in ("clone", "contiguous"), members)
    if op_name(exp) != "expand":
        return node, 1, [], ""
    members.append(exp)
    # the inserted axis: unsqueeze(2), or slicing + None indexing spelled as slice/unsqueeze chains
    uns = _walk_up(exp.args[0], _whole_slice, members)
    if op_name(uns) != "unsqueeze":
        return node, 1, [], ""
    members.append(uns)
    src = _walk_up(uns.args[0], _whole_slice, members)
    es, ss = shape(exp), shape(src)
    if out_shape is None or es is None or ss is None or len(ss) != 4 or len(es) != 5 or len(out_shape) != 4:
        return node, 1, [], ""
    if uns.args[1] % 5 != 2:
        return node, 1, [], ""
    reps = es[2]
    if not isinstance(reps, int):
        return node, 1, [], ""
    if not (same_dim(es[0], ss[0]) and same_dim(es[1], ss[1]) and same_dim(es[3], ss[2]) and same_dim(es[4], ss[3])):
        return node, 1, [], ""
    if not (same_dim(out_shape[2], ss[2]) and same_dim(out_shape[3], ss[3])):
        return node, 1, [], ""
    if isinstance(ss[1], int) and isinstance(out_shape[1], int) and out_shape[1] != ss[1] * reps:
        return node, 1, [], ""
    return src, reps, members, "gqa:repeat_kv"


def head_repeat(node: Node, axis: int = 1, depth: int = 24) -> int:
    """How many times each head of `node` (heads on `axis`) repeats one upstream head, seen through
    transposes, `.mT`, casts, copies and reshapes that keep the head axis whole; 1 when none.

    For a repeat applied before the head transpose (k kept as [B, N, Hkv, D], repeated on dim 2,
    then transposed) no [B, Hkv, N, D] node exists, but the kv-head count is still Hkv = H / R.
    Spellings: `repeat_interleave(R, dim)`, HF's `x[.., None, ..].expand(.., Hkv, R, ..).reshape`,
    and an `expand` of a single head (MQA). A tile (`repeat`, or an axis inserted before Hkv)
    groups heads differently and is not counted.
    """
    groups = 1
    for _ in range(depth):
        r = rank(node)
        if r is None:
            return groups
        axis %= r
        p = perm_of(node)
        if p is not None:
            axis = p[axis]
            node = node.args[0]
            continue
        name = op_name(node)
        if name in COPY_OPS or is_cast(node):
            node = node.args[0]
            continue
        if name == "repeat_interleave" and overload(node) == "self_int":
            reps = node.args[1]
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
            if not isinstance(reps, int) or dim is None or dim % r != axis:
                return groups
            groups *= reps
            node = node.args[0]
            continue
        if name == "expand":
            src_shape, out_shape = shape(node.args[0]), shape(node)
            if src_shape is None or len(src_shape) != r:
                return groups
            if same_dim(src_shape[axis], out_shape[axis]):  # broadcasts another axis, not heads
                node = node.args[0]
                continue
            if src_shape[axis] != 1 or not isinstance(out_shape[axis], int):
                return groups
            return groups * out_shape[axis]  # one head broadcast to all (multi-query attention)
        if name in ("view", "reshape", "_unsafe_view", "flatten"):
            merged = _merged_repeat(node, axis)
            if merged is None:
                return groups
            node, reps = merged
            groups *= reps
            continue
        return groups
    return groups


def _merged_repeat(node: Node, axis: int) -> Optional[tuple[Node, int]]:
    """A reshape merging an expanded (Hkv, R) pair into the head axis: (source, R), heads on the same
    axis of the source; None for any other reshape."""
    out_shape = shape(node)
    cur = _walk_up(node.args[0], lambda n: op_name(n) in COPY_OPS)
    if op_name(cur) != "expand":
        return None
    es = shape(cur)
    if es is None or out_shape is None or len(es) != len(out_shape) + 1:
        return None
    reps = es[axis + 1]
    if not isinstance(reps, int) or not isinstance(es[axis], int) or not isinstance(out_shape[axis], int):
        return None
    if es[axis] * reps != out_shape[axis] or not all(map(same_dim, es[:axis], out_shape[:axis])):
        return None
    if not all(map(same_dim, es[axis + 2:], out_shape[axis + 1:])):
        return None
    src = _walk_up(cur.args[0], _whole_slice)
    if op_name(src) != "unsqueeze" or src.args[1] % len(es) != axis + 1:
        return None  # the new axis must follow the kv-head axis: head h then reads kv head h // R
    return src.args[0], reps


# ---- mask terms ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class MaskTerm:
    """One way the scores are masked on the way to the softmax.

    kind: "additive" (scores + node), "masked_fill" (fill where node is True), "where_keep"
    (keep where node is True), "where_drop" (keep where node is False). `applied_at` is the node
    that applies the term; `fill` the fill value for masked_fill/where.
    """

    kind: str
    node: Node
    applied_at: Node
    fill: Optional[Any] = None

    @property
    def keep_when(self) -> str:
        return {"additive": "zero", "masked_fill": "false", "where_keep": "true", "where_drop": "false"}[self.kind]

    @property
    def form(self) -> str:
        return {"additive": "additive", "masked_fill": "masked_fill", "where_keep": "where",
                "where_drop": "where"}[self.kind]


def fill_value(x: Any) -> Optional[float]:
    """A masked_fill / where fill value as a float when it is a constant (number or full())."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, fx.Node):
        if op_name(x) in ("full", "scalar_tensor"):
            v = x.args[1] if op_name(x) == "full" else x.args[0]
            if isinstance(v, (int, float)):
                return float(v)
        if op_name(x) in ("lift_fresh_copy", "clone", "detach", "detach_", "alias", "_to_copy", "to") and x.args:
            return fill_value(x.args[0])
        if x.op == "get_attr":
            gm = x.graph.owning_module
            try:
                t = operator.attrgetter(x.target)(gm)
            except AttributeError:
                return None
            if isinstance(t, torch.Tensor) and t.numel() == 1:
                return float(t.item())
    return None


def is_masking_value(v: Optional[float]) -> bool:
    """A fill that hides the key: the same threshold as an additive mask entry (masks.py)."""
    return v is not None and (math.isinf(v) and v < 0 or v <= ADDITIVE_HIDE_BELOW)


# ---- einsum -------------------------------------------------------------------------------------

def einsum_roles(node: Node, role: str) -> tuple[bool, str]:
    """Read an einsum as q·kᵀ (role "qk") or P·V (role "pv"): (True, layout) or (False, reason).

    For "qk" the layout is "plain" when the key operand is [.., Nk, D], "transposed" when [.., D, Nk].
    """
    eq = node.args[0].replace(" ", "")
    ops = node.args[1]
    if "..." in eq or "->" not in eq or len(ops) != 2:
        return False, f"einsum '{eq}' is not a two-operand product with explicit axes"
    lhs, out = eq.split("->")
    x, y = lhs.split(",")
    if not (len(x) == len(y) == len(out)) or len(x) not in (3, 4):
        return False, f"einsum '{eq}' does not keep the rank of its operands"
    batch = out[:-2]
    if x[:-2] != batch or y[:-2] != batch:
        return False, f"einsum '{eq}' does not keep the batch/head axes in front"
    if role == "qk":
        qi, d = x[-2], x[-1]
        ki = out[-1]
        if out[-2] != qi or d in out or ki == qi:
            return False, f"einsum '{eq}' is not q·kᵀ over the last (head-dim) axis"
        if y[-2:] == ki + d:
            return True, "plain"
        if y[-2:] == d + ki:
            return True, "transposed"
        return False, f"einsum '{eq}' pairs the key axes in an unexpected order"
    qi, ki = x[-2], x[-1]
    if y[-2] != ki or out[-2] != qi or out[-1] != y[-1] or ki in out:
        return False, f"einsum '{eq}' does not contract the probabilities' key axis with the values' token axis"
    return True, "pv"
