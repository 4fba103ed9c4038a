"""Plain data that the detection pass hands to the planner, the rewrite pass and the report.

Letters used in names and comments: B batch, H query heads, Hkv key/value heads, Nq query length,
Nk key length, D head dim of q and k, Dv head dim of v. Layout is SDPA's [B, H, N, D] unless a name
says otherwise.

Nothing here holds a torch object: graph nodes are referred to by name so that a site can be
serialised into the report and looked up again in the graph it came from.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

# A dimension is an int when static, or the printed SymInt (e.g. "s41") when captured dynamic.
Dim = Union[int, str]


@dataclass(frozen=True)
class MaskInfo:
    """What a site's mask does, as proven from its construction or checked numerically.

    `form` says how the model spells it; the booleans say what it means. `causal` and `window` are
    True/set only when proven (an `is_causal=True` flag, a recognised causal construction, or a
    numeric check of the mask values on the example inputs) -- never assumed from an additive mask.
    """

    form: str = "none"  # "none" | "is_causal" | "additive" | "bool" | "masked_fill" | "where"
    causal: bool = False  # key j hidden from query i when j > i (after the Nk - Nq offset)
    window: Optional[int] = None  # keys visible incl. self: causal i-W < j <= i; else |i-j| < W
    padding: bool = False  # a per-(batch, key) keep pattern constant over queries and heads
    arbitrary: bool = False  # anything else (biases, ALiBi, per-query patterns): only exact honours it
    node: Optional[str] = None  # graph node that holds the runtime mask tensor (None: no tensor)
    keep_when: str = "zero"  # how to read `node`: "zero" (additive: 0 keeps), "true", "false"
    shape: Optional[tuple] = None  # shape of the mask tensor as captured
    why: Optional[str] = None  # why an arbitrary mask is arbitrary, where a reading decided it

    @property
    def kind(self) -> str:
        """One short word for tables: none, causal, padding, causal+padding, window, ..., arbitrary."""
        if self.arbitrary:
            return "arbitrary"
        parts = []
        if self.window is not None:
            parts.append(f"window{self.window}")
        elif self.causal:
            parts.append("causal")
        if self.padding:
            parts.append("padding")
        return "+".join(parts) or "none"


@dataclass(frozen=True)
class SiteNodes:
    """Where a site lives in its graph, by node name, so a rewrite can rebuild it.

    The rewrite computes softmax(scale * q kᵀ + mask) v from these tensors and replaces `output`.
    """

    query: str  # q as [B, H, Nq, D] (rank 4) or [B*H, Nq, D] (rank 3)
    key: str  # k as [B, Hkv, Nk, D]; if `key_is_transposed`, the node holds kᵀ [B, Hkv, D, Nk]
    value: str  # v as [B, Hkv, Nk, Dv]
    output: str  # the node whose value is the attention output [B, H, Nq, Dv]
    key_is_transposed: bool = False
    mask: Optional[str] = None  # same as MaskInfo.node
    members: tuple = ()  # every node of the matched chain (removed by a rewrite when dead)
    rank: int = 4  # 3 for bmm spellings over [B*H, N, D]
    # > 1 when `key` / `value` already hold each kv head repeated kv_repeated times, i.e. H heads
    # (rank 3: B*H rows): the graph repeats before its head transpose or before flattening, so no
    # [B, Hkv, N, D] node exists. 1 when the nodes hold kv_heads heads.
    kv_repeated: int = 1


@dataclass(frozen=True)
class AttentionSite:
    """One attention computation found in a captured graph."""

    id: str  # stable: "<module_path>#<k>" (k counts sites within that module), or "graph#<k>"
    module_path: str  # from nn_module_stack, e.g. "encoder.layer.3.attention.self"; "" at top level
    module_type: str  # class name of the innermost module, e.g. "BertSelfAttention"
    layer: int  # order along the residual stream: longest chain of earlier sites feeding this one
    source: str  # "sdpa" | "explicit" | "mha" (an SDPA inside nn.MultiheadAttention)
    batch: Dim
    heads: int
    kv_heads: int  # < heads for GQA/MQA, recovered through repeat_kv / repeat_interleave / enable_gqa
    q_len: Dim
    kv_len: Dim
    head_dim: int
    v_head_dim: int
    scale: float  # the factor applied to q kᵀ before softmax
    causal: bool  # == mask.causal (proven only)
    mask: MaskInfo
    window: Optional[int]  # == mask.window
    dropout_p: float
    dtype: str  # e.g. "float32"
    nodes: SiteNodes
    spelling: tuple = ()  # tags of the alternatives that matched, e.g. ("scale:div", "mask:masked_fill")
    softcap: Optional[float] = None  # logits pass through softcap·tanh(s/softcap) first (Gemma-2)
    # Factors of the scores (other than the mask) whose value the graph reads at run time, e.g.
    # ("scale",) when the scale is a forward argument: `scale` then holds only the example's value,
    # so such a site must be kept exact (a rewrite would freeze it). `runtime_reason` says why.
    runtime_inputs: tuple = ()
    runtime_reason: str = ""
    # A factor the graph applies to q or k before splitting heads (OPT and Whisper scale the
    # [B, N, H*D] projection) or in place (`q *= c`): no unscaled [B, H, N, D] node exists, so it
    # stays inside the query / key nodes and `scale` excludes it. The model's full scale on q kᵀ
    # is scale * folded_scale; a rewrite uses `scale` alone, with the nodes as they are.
    folded_scale: float = 1.0

    @property
    def gqa_groups(self) -> int:
        return self.heads // self.kv_heads if self.kv_heads else 1

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mask"]["kind"] = self.mask.kind
        return d


@dataclass(frozen=True)
class NearMiss:
    """Something that looked like attention but was not taken, with a reason a user can act on."""

    node: str  # the softmax (or candidate) node name
    module_path: str
    reason: str  # plain words, e.g. "softmax over dim 1, not the key axis (dim -1)"
    code: str  # short machine tag: "softmax_axis", "weights_reused", "key_permuted", "numeric", ...
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
