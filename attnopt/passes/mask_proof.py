"""Read what a site's mask means: numerically on the example inputs, then structurally.

The numeric read classifies the keep pattern (causal, sliding window, padding, bias); the
structural read requires causal / window claims to come from positions the graph itself builds
(arange, tril, triu, a constant buffer) -- a mask that is merely an input which happens to look
causal on this example is not called causal (TRT-LLM assumed that and was wrong).

Letters: B batch, H heads, Nq query length, Nk key length. Patterns are bottom-right aligned:
query i sits at key position i + (Nk - Nq).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import networkx as nx
import torch

from attnopt.ir.masks import ADDITIVE_HIDE_BELOW
from attnopt.passes.canonicalize import op_name

# Ops whose presence among a mask's ancestors shows the mask is built from positions.
POSITION_SOURCES = {"arange", "tril", "triu", "tril_indices", "triu_indices"}


_SHAPE_ONLY = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclass(frozen=True)
class KeepPattern:
    causal: bool = False
    window: Optional[int] = None
    padding: bool = False
    arbitrary: bool = False
    all_keep: bool = False


def classify_bias(bias: torch.Tensor) -> KeepPattern:
    """Classify an additive bias in the softmax frame ([B, H, Nq, Nk], [G, Nq, Nk] or [Nq, Nk]).

    A finite non-zero bias (ALiBi, relative positions) makes the mask arbitrary; which keys it
    hides is still read, so ALiBi on top of a causal mask stays causal (and arbitrary): a consumer
    that looks only at `causal` must never take such a site for bidirectional."""
    finite_nonzero = (bias > ADDITIVE_HIDE_BELOW) & (bias != 0)
    pattern = classify_keep(bias > ADDITIVE_HIDE_BELOW)
    if bool(finite_nonzero.any()):
        return as_arbitrary(pattern)
    return pattern


def as_arbitrary(pattern: KeepPattern) -> KeepPattern:
    """The same hidden-key pattern, marked arbitrary (only an exact rewrite honours the mask)."""
    return KeepPattern(causal=pattern.causal, window=pattern.window, padding=pattern.padding, arbitrary=True)


def classify_keep(keep: torch.Tensor) -> KeepPattern:
    """Causal / window / padding / arbitrary for a bool keep tensor."""
    while keep.dim() < 4:
        keep = keep.unsqueeze(0)
    if keep.dim() > 4:
        keep = keep.reshape(-1, 1, *keep.shape[-2:])
    b, h, nq, nk = keep.shape
    if bool(keep.all()):
        return KeepPattern(all_keep=True)
    offset = nk - nq
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    pad_BNk = keep.any(dim=2).any(dim=1)  # a key anyone sees
    pad_full = pad_BNk[:, None, None, :].expand(b, h, nq, nk)
    causal_band = j <= i + offset
    union = keep.any(dim=0).any(dim=0)
    if bool((union & ~causal_band).any()):
        if torch.equal(keep, pad_full):
            return KeepPattern(padding=True)
        return KeepPattern(arbitrary=True)
    if torch.equal(keep, causal_band & pad_full):  # causal over the real keys (a batch of one padded row too)
        return KeepPattern(causal=True, padding=not bool(pad_BNk.all()))
    w = int((union & causal_band).sum(-1).max())
    band = causal_band & (j > i + offset - w)
    if not torch.equal(keep, band & pad_full):
        return KeepPattern(arbitrary=True)
    full_rows = int((i + offset + 1).clamp(max=nk).max())
    window = w if w < full_rows else None
    return KeepPattern(causal=True, window=window, padding=not bool(pad_BNk.all()))


class StructureOracle:
    """Answers "does this mask come from positions / from inputs" on the fx graph, cached."""

    def __init__(self, graph):
        self.dag = nx.DiGraph()
        for node in graph.nodes:
            self.dag.add_node(node.name)
            for inp in node.all_input_nodes:
                if isinstance(inp.meta.get("val"), _SHAPE_ONLY):
                    continue  # a size read from a tensor carries no mask values
                self.dag.add_edge(inp.name, node.name)
        self.nodes = {n.name: n for n in graph.nodes}
        self._cache: dict[str, tuple[bool, bool]] = {}

    def sources(self, name: str) -> tuple[bool, bool]:
        """(built from positions or constants, depends on a graph input) for node `name`."""
        if name not in self._cache:
            anc = nx.ancestors(self.dag, name) | {name}
            from_positions = False
            from_inputs = False
            for a in anc:
                n = self.nodes[a]
                if n.op == "placeholder":
                    from_inputs = True
                elif n.op == "get_attr" and _holds_a_pattern(n):
                    from_positions = True  # a constant buffer (GPT-2's tril): the same on every call
                elif op_name(n) in POSITION_SOURCES:
                    from_positions = True
            if not from_inputs:
                from_positions = True  # built from constants only
            self._cache[name] = (from_positions, from_inputs)
        return self._cache[name]

    def caller_patterns(self, names: list, q_len, kv_len) -> Optional[str]:
        """Why the caller, not the graph, decides the pattern of masks `names` for queries of length
        `q_len` over `kv_len` keys: a mask with a query axis computed from an input shaped like one
        ([.., Nq, Nk]: it can hide keys per query); None when none is. (A float key mask that brings a
        bias at run time is read exactly: SiteModule.)"""
        for name in names:
            own = getattr(self.nodes[name].meta.get("val"), "shape", None)
            if own is None or len(own) < 2 or _same_size(own[-2], 1):
                continue  # no query axis: a key mask, whatever inputs it is read from
            for a in sorted(nx.ancestors(self.dag, name) | {name}):
                n = self.nodes[a]
                shape = getattr(n.meta.get("val"), "shape", None)
                if n.op == "placeholder" and shape is not None and len(shape) >= 2 and _same_size(shape[-2], q_len) \
                        and _same_size(shape[-1], kv_len) and not _same_size(shape[-2], 1):
                    return f"its mask is the input '{n.name}' with a query axis ({_dims(shape)}), which can hide keys per query"
        return None


def _holds_a_pattern(node) -> bool:
    """A buffer with more than one value can hold a mask's pattern (GPT-2's tril); a scalar (GPT-2's
    masked_bias) is a constant like a literal."""
    val = node.meta.get("val")
    if val is None and node.graph.owning_module is not None:
        try:
            val = operator.attrgetter(str(node.target))(node.graph.owning_module)
        except AttributeError:
            val = None
    return not isinstance(val, torch.Tensor) or val.numel() != 1


def symbolic(size) -> bool:
    """A dim the capture kept symbolic (a SymInt with no fixed value)."""
    return isinstance(size, torch.SymInt) and size.node.maybe_as_int() is None


def _same_size(a, b) -> bool:
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
            return a.node.expr == b.node.expr
        concrete = a if not isinstance(a, torch.SymInt) else b
        sym = b if concrete is a else a
        return sym.node.maybe_as_int() == concrete
    return int(a) == int(b)


def _dims(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
