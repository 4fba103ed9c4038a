"""Hand-written attention spellings and look-alike counter-examples, as tiny nn.Modules.

Letters: B batch, H query heads, Hkv key/value heads, N tokens, M memory tokens (cross-attention),
D head dim, Dv value head dim. Tensors are [B, H, N, D] unless the name says otherwise. The sizes
are pairwise distinct (B=4, H=6, Hkv=3 or 2, N=11, M=5, D=8, Dv=12) so that a detector that mixes
two axes reports a wrong number. Every spelling carries a `Truth` written from its construction;
every counter-example names the near-miss codes a correct detector may give it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

B = 4  # not 2 or 3: never equal to a key/value head count
H = 6
HKV = 3
N = 11
M = 5  # memory length for cross-attention
D = 8
DV = 12  # a value head dim different from D (and from every other size)
HIDDEN = 48
SEED = 0
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Truth:
    """The one site a correct detector reports for a spelling (fields follow AttentionSite)."""

    source: str = "explicit"
    heads: int = H
    kv_heads: int = H
    q_len: int = N
    kv_len: int = N
    head_dim: int = D
    v_head_dim: int = D
    scale: float = D**-0.5
    causal: bool = False
    window: Optional[int] = None
    padding: bool = False
    arbitrary: bool = False
    mask_form: Optional[str] = None  # asserted when set
    rank: int = 4  # 3: bmm over [B*H, N, D]; batch and heads are then only known as a product
    dtype: str = "float32"
    # Also accepted for `scale` when the factor multiplies q or k before a reshape that the site's
    # rank-3 nodes come after: the nodes then already hold the scaled tensors and 1.0 is the honest
    # factor relative to them. `site_output_error` decides which one is consistent.
    folded_scales: tuple = ()


@dataclass(frozen=True)
class Spelling:
    """A module that computes attention one particular way, its inputs and its true site."""

    name: str
    module_cls: type
    truth: Truth
    inputs: Callable[[], tuple] = field(default=lambda: (hidden_states(),))

    def build(self) -> nn.Module:
        torch.manual_seed(SEED)
        return self.module_cls().eval()


@dataclass(frozen=True)
class CounterExample:
    """A module with a softmax that must not become a site, and the near-miss codes allowed for it."""

    name: str
    module_cls: type
    codes: frozenset
    why: str  # why it is not replaceable attention
    inputs: Callable[[], tuple] = field(default=lambda: (hidden_states(),))

    def build(self) -> nn.Module:
        torch.manual_seed(SEED)
        return self.module_cls().eval()


def hidden_states(n: int = N, seed: int = 1) -> torch.Tensor:
    """x [B, n, HIDDEN], seeded."""
    return torch.randn(B, n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def causal_additive_mask_NN(n: int = N) -> torch.Tensor:
    """A causal mask as an INPUT tensor: 0 on and below the diagonal, -inf above."""
    return torch.full((n, n), NEG_INF).triu(1)


def padding_keep_B11N() -> torch.Tensor:
    """Bool keep-mask [B, 1, 1, N]: the second sequence has its last 3 keys padded out."""
    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[1, ..., N - 3 :] = False
    return keep


# ---------------------------------------------------------------------------------------------
# Shared projections


class ProjectedAttention(nn.Module):
    """q, k, v and output projections around an `attend` that each spelling writes its own way."""

    kv_heads = H
    v_head_dim = D

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, H * D)
        self.k_proj = nn.Linear(HIDDEN, self.kv_heads * D)
        self.v_proj = nn.Linear(HIDDEN, self.kv_heads * self.v_head_dim)
        self.o_proj = nn.Linear(H * self.v_head_dim, HIDDEN)

    @staticmethod
    def split_heads(x_BNX: torch.Tensor, heads: int) -> torch.Tensor:
        b, n, _ = x_BNX.shape
        return x_BNX.view(b, n, heads, -1).transpose(1, 2)

    def qkv(self, x_BNX: torch.Tensor, memory_BMX: Optional[torch.Tensor] = None):
        kv_src = x_BNX if memory_BMX is None else memory_BMX
        q = self.split_heads(self.q_proj(x_BNX), H)
        k = self.split_heads(self.k_proj(kv_src), self.kv_heads)
        v = self.split_heads(self.v_proj(kv_src), self.kv_heads)
        return q, k, v

    def merge(self, out_BHNDv: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = out_BHNDv.shape
        return self.o_proj(out_BHNDv.transpose(1, 2).reshape(b, n, -1))

    def forward(self, x_BNX: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x_BNX)
        return self.merge(self.attend(q, k, v))

    def attend(self, q, k, v):  # pragma: no cover - each spelling overrides
        raise NotImplementedError


def _tril_keep_NN(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


# ---------------------------------------------------------------------------------------------
# Spellings of real attention


class DivSqrt(ProjectedAttention):
    def attend(self, q, k, v):
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        return s.softmax(dim=-1) @ v


class MulScale(ProjectedAttention):
    # a non-default constant, so a detector that assumes 1/sqrt(D) is caught
    def attend(self, q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) * 0.3
        return torch.matmul(F.softmax(s, dim=-1), v)


class ScaleOnQuery(ProjectedAttention):
    # scaling q before the matmul (as BART/Whisper do) is the same attention
    def attend(self, q, k, v):
        s = (q * 0.2) @ k.transpose(-2, -1)
        return F.softmax(s, dim=3) @ v


class SqrtSplit(ProjectedAttention):
    # D**-0.25 on each of q and k (as some Stable Diffusion code does): overall 1/sqrt(D)
    def attend(self, q, k, v):
        s = (q * D**-0.25) @ (k * D**-0.25).transpose(-2, -1)
        return s.softmax(-1) @ v


class SdpaScale(ProjectedAttention):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=0.15)


class SdpaCausal(ProjectedAttention):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SdpaBoolCausalBuilt(ProjectedAttention):
    # a causal keep-mask built inside forward from constants: causality is provable
    def attend(self, q, k, v):
        keep = _tril_keep_NN(q.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class SdpaGqa(ProjectedAttention):
    kv_heads = HKV

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


class SdpaPaddingInput(ProjectedAttention):
    """A per-(batch, key) bool keep-mask passed in: padding, not causal."""

    def forward(self, x_BNX, keep_B11N):
        q, k, v = self.qkv(x_BNX)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=keep_B11N))


class AdditiveMaskInput(ProjectedAttention):
    """An additive mask passed in as an input. It is causal on the example, but nothing proves it
    will be on the next call, so the site must not be reported causal."""

    def forward(self, x_BNX, mask_NN):
        q, k, v = self.qkv(x_BNX)
        s = q @ k.transpose(-2, -1) * D**-0.5 + mask_NN
        return self.merge(s.softmax(-1) @ v)


class MaskedFillTril(ProjectedAttention):
    def attend(self, q, k, v):
        n = q.shape[-2]
        s = q @ k.transpose(-2, -1) / math.sqrt(D)
        s = s.masked_fill(_tril_keep_NN(n, q.device) == 0, NEG_INF)
        return s.softmax(-1) @ v


class WhereCausal(ProjectedAttention):
    def attend(self, q, k, v):
        n = q.shape[-2]
        s = q @ k.transpose(-2, -1) * D**-0.5
        s = torch.where(_tril_keep_NN(n, q.device), s, torch.tensor(NEG_INF))
        return s.softmax(-1) @ v


class CommutedAdditiveCausal(ProjectedAttention):
    # mask + scores (mask first) with an additive causal mask built inside forward
    def attend(self, q, k, v):
        n = q.shape[-2]
        mask = torch.full((n, n), NEG_INF, device=q.device).triu(1)
        s = mask + q @ k.transpose(-2, -1) * D**-0.5
        return s.softmax(-1) @ v


WINDOW = 3


class SlidingWindowBuilt(ProjectedAttention):
    """Causal window of 3 keys incl. self (i-3 < j <= i), built from aranges as HF does."""

    def attend(self, q, k, v):
        n = q.shape[-2]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        keep = (j <= i) & (j > i - WINDOW)
        s = q @ k.transpose(-2, -1) * D**-0.5
        return s.masked_fill(~keep, NEG_INF).softmax(-1) @ v


def _flatten_heads(x_BHNX: torch.Tensor) -> torch.Tensor:
    b, h, n, x = x_BHNX.shape
    return x_BHNX.reshape(b * h, n, x)


class Baddbmm3d(ProjectedAttention):
    # nn.MultiheadAttention's need_weights path: baddbmm over [B*H, N, D] with the scale as alpha
    def attend(self, q, k, v):
        q3, k3, v3 = _flatten_heads(q), _flatten_heads(k), _flatten_heads(v)
        bias = torch.zeros(q3.shape[0], q3.shape[1], k3.shape[1])
        s = torch.baddbmm(bias, q3, k3.transpose(1, 2), alpha=0.25)
        out3 = torch.bmm(s.softmax(-1), v3)
        return out3.view(q.shape[0], H, q.shape[2], -1)


class Bmm3d(ProjectedAttention):
    def attend(self, q, k, v):
        q3, k3, v3 = _flatten_heads(q), _flatten_heads(k), _flatten_heads(v)
        s = torch.bmm(q3, k3.transpose(1, 2)) * D**-0.5
        out3 = torch.bmm(F.softmax(s, dim=-1), v3)
        return out3.view(q.shape[0], H, q.shape[2], -1)


class Float64Softmax(ProjectedAttention):
    # softmax computed in a wider dtype and cast back (Qwen/Gemma style upcast)
    def attend(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D**-0.5
        p = F.softmax(s.to(torch.float64), dim=-1).to(q.dtype)
        return p @ v


class DropoutInEval(ProjectedAttention):
    def __init__(self):
        super().__init__()
        self.attn_dropout = nn.Dropout(0.1)

    def attend(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D**-0.5
        p = F.dropout(s.softmax(-1), p=0.2, training=self.training)
        return self.attn_dropout(p) @ v


class Einsum(ProjectedAttention):
    def attend(self, q, k, v):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * D**-0.5
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


class RepeatInterleaveGqa(ProjectedAttention):
    kv_heads = HKV

    def attend(self, q, k, v):
        k = k.repeat_interleave(H // HKV, dim=1)
        v = v.repeat_interleave(H // HKV, dim=1)
        return (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1) @ v


def repeat_kv(x_BHkvND: torch.Tensor, groups: int) -> torch.Tensor:
    """HF's repeat_kv: expand a new group axis and fold it into heads."""
    b, hkv, n, d = x_BHkvND.shape
    return x_BHkvND[:, :, None, :, :].expand(b, hkv, groups, n, d).reshape(b, hkv * groups, n, d)


class RepeatKvGqa(ProjectedAttention):
    kv_heads = 2

    def attend(self, q, k, v):
        k, v = repeat_kv(k, H // 2), repeat_kv(v, H // 2)
        return (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1) @ v


class KeyBNHDPermuted(ProjectedAttention):
    """The key is kept as [B, N, H, D]; permute(0, 2, 3, 1) makes kᵀ [B, H, D, N]: correct."""

    def forward(self, x_BNX):
        b, n, _ = x_BNX.shape
        q = self.split_heads(self.q_proj(x_BNX), H)
        k_BNHD = self.k_proj(x_BNX).view(b, n, H, D)
        v = self.split_heads(self.v_proj(x_BNX), H)
        s = q @ k_BNHD.permute(0, 2, 3, 1) * D**-0.5
        return self.merge(s.softmax(-1) @ v)


class FusedQkvChunk(nn.Module):
    """One Linear makes q, k and v; chunk splits them (GPT-2 / Phi-3 style)."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, 3 * H * D)
        self.o_proj = nn.Linear(H * D, HIDDEN)

    def forward(self, x_BNX):
        b, n, _ = x_BNX.shape
        q, k, v = self.qkv_proj(x_BNX).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, H, D).transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-2, -1) * D**-0.5
        out = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, H * D)
        return self.o_proj(out)


class FusedQkvSplitGqa(nn.Module):
    """One Linear makes q (6 heads) and k, v (3 heads each); split with unequal sizes."""

    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, (H + 2 * HKV) * D)
        self.o_proj = nn.Linear(H * D, HIDDEN)

    def forward(self, x_BNX):
        b, n, _ = x_BNX.shape
        q, k, v = self.qkv_proj(x_BNX).split([H * D, HKV * D, HKV * D], dim=-1)
        q = q.view(b, n, H, D).transpose(1, 2)
        k = k.view(b, n, HKV, D).transpose(1, 2)
        v = v.view(b, n, HKV, D).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, H * D))


class CrossAttention(ProjectedAttention):
    """Queries from x (N tokens), keys and values from a memory of M tokens."""

    def forward(self, x_BNX, memory_BMX):
        q, k, v = self.qkv(x_BNX, memory_BMX)
        return self.merge((q @ k.transpose(-2, -1) * D**-0.5).softmax(-1) @ v)


class WideValues(ProjectedAttention):
    v_head_dim = DV

    def attend(self, q, k, v):
        return (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1) @ v


def _x_and_keep():
    return hidden_states(), padding_keep_B11N()


def _x_and_causal_input():
    return hidden_states(), causal_additive_mask_NN()


def _x_and_memory():
    return hidden_states(), hidden_states(M, seed=2)


SPELLINGS: list[Spelling] = [
    Spelling("div_sqrt", DivSqrt, Truth()),
    Spelling("mul_scale", MulScale, Truth(scale=0.3)),
    Spelling("scale_on_query", ScaleOnQuery, Truth(scale=0.2)),
    Spelling("sqrt_split", SqrtSplit, Truth()),
    Spelling("sdpa_scale", SdpaScale, Truth(source="sdpa", scale=0.15)),
    Spelling("sdpa_is_causal", SdpaCausal, Truth(source="sdpa", causal=True, mask_form="is_causal")),
    Spelling("sdpa_bool_causal_built", SdpaBoolCausalBuilt, Truth(source="sdpa", causal=True, mask_form="bool")),
    Spelling("sdpa_enable_gqa", SdpaGqa, Truth(source="sdpa", kv_heads=HKV)),
    Spelling(
        "sdpa_padding_input", SdpaPaddingInput, Truth(source="sdpa", padding=True, mask_form="bool"), _x_and_keep
    ),
    Spelling(
        "additive_mask_input",
        AdditiveMaskInput,
        Truth(causal=False, arbitrary=True, mask_form="additive"),
        _x_and_causal_input,
    ),
    Spelling("masked_fill_tril", MaskedFillTril, Truth(causal=True, mask_form="masked_fill")),
    Spelling("where_causal", WhereCausal, Truth(causal=True, mask_form="where")),
    Spelling("commuted_additive_causal", CommutedAdditiveCausal, Truth(causal=True, mask_form="additive")),
    Spelling("sliding_window_built", SlidingWindowBuilt, Truth(causal=True, window=WINDOW)),
    Spelling("baddbmm_3d", Baddbmm3d, Truth(scale=0.25, rank=3)),
    Spelling("bmm_3d", Bmm3d, Truth(rank=3)),
    Spelling("float64_softmax", Float64Softmax, Truth()),
    Spelling("dropout_in_eval", DropoutInEval, Truth()),
    Spelling("einsum", Einsum, Truth()),
    Spelling("repeat_interleave_gqa", RepeatInterleaveGqa, Truth(kv_heads=HKV)),
    Spelling("repeat_kv_gqa", RepeatKvGqa, Truth(kv_heads=2)),
    Spelling("key_BNHD_permuted", KeyBNHDPermuted, Truth()),
    Spelling("fused_qkv_chunk", FusedQkvChunk, Truth()),
    Spelling("fused_qkv_split_gqa", FusedQkvSplitGqa, Truth(source="sdpa", kv_heads=HKV, causal=True)),
    Spelling("cross_attention", CrossAttention, Truth(kv_len=M), _x_and_memory),
    Spelling("value_dim_differs", WideValues, Truth(v_head_dim=DV)),
]


def reference_output(spelling: Spelling, module: nn.Module, inputs: tuple) -> torch.Tensor:
    """The module's output recomputed with SDPA from the spelling's `Truth` alone.

    Agreement proves the truth table describes what the spelling computes, so a detector that
    disagrees with the table is wrong, not the table. Only for `ProjectedAttention` spellings.
    """
    truth = spelling.truth
    memory = inputs[1] if spelling.module_cls is CrossAttention else None
    q, k, v = module.qkv(inputs[0], memory)
    groups = truth.heads // truth.kv_heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    i = torch.arange(truth.q_len)[:, None]
    j = torch.arange(truth.kv_len)[None, :]
    keep = torch.ones(truth.q_len, truth.kv_len, dtype=torch.bool)
    if truth.causal:
        keep &= j <= i
    if truth.window is not None:
        keep &= j > i - truth.window
    mask = torch.zeros(truth.q_len, truth.kv_len).masked_fill(~keep, NEG_INF)
    if truth.padding:
        mask = mask.masked_fill(~inputs[1], NEG_INF)
    if truth.arbitrary:
        mask = mask + inputs[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=truth.scale)
    return module.merge(out)


def assert_site_matches(site, truth: Truth, batch: int = B) -> None:
    """Assert every attribute of an AttentionSite (captured with static shapes) equals `truth`.

    The message lists each differing attribute as (got, want).
    """
    got = {
        "source": site.source,
        "rank": site.nodes.rank,
        "lengths": (site.q_len, site.kv_len),
        "head_dims": (site.head_dim, site.v_head_dim),
        "causal": (site.causal, site.mask.causal),
        "window": (site.window, site.mask.window),
        "padding": site.mask.padding,
        "arbitrary": site.mask.arbitrary,
        "dropout_p": site.dropout_p,
        "dtype": site.dtype,
    }
    want = {
        "source": truth.source,
        "rank": truth.rank,
        "lengths": (truth.q_len, truth.kv_len),
        "head_dims": (truth.head_dim, truth.v_head_dim),
        "causal": (truth.causal, truth.causal),
        "window": (truth.window, truth.window),
        "padding": truth.padding,
        "arbitrary": truth.arbitrary,
        "dropout_p": 0.0,
        "dtype": truth.dtype,
    }
    if truth.rank == 3:
        # [B*H, N, D]: the split of the leading axis into batch and heads need not be recoverable
        got["batch*heads"] = site.batch * site.heads
        want["batch*heads"] = batch * truth.heads
        got["groups_divide"] = site.heads % site.kv_heads == 0
        want["groups_divide"] = True
    else:
        got["batch_heads_kv"] = (site.batch, site.heads, site.kv_heads)
        want["batch_heads_kv"] = (batch, truth.heads, truth.kv_heads)
    if truth.mask_form is not None:
        got["mask_form"], want["mask_form"] = site.mask.form, truth.mask_form
    diffs = {key: (got[key], want[key]) for key in want if got[key] != want[key]}
    if not any(math.isclose(site.scale, s, rel_tol=1e-5) for s in (truth.scale, *truth.folded_scales)):
        diffs["scale"] = (site.scale, (truth.scale, *truth.folded_scales))
    assert not diffs, f"site {site.id}: (got, want) {diffs}"


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps the values of the named nodes."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: set):
        super().__init__(gm)
        self.wanted = wanted
        self.kept: dict = {}

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.wanted:
            self.kept[n.name] = out
        return out


def site_output_error(inspection, site) -> float:
    """Max abs difference between the site's output node and softmax(scale q kᵀ + mask) v rebuilt
    from the site's own nodes and attributes, on the captured example inputs.

    This is what a rewrite will compute from the site, so a wrong scale, causality, window, GQA
    grouping or key orientation shows up as a large error here.
    """
    captured = inspection.captured
    nodes = site.nodes
    wanted = {nodes.query, nodes.key, nodes.value, nodes.output} | ({site.mask.node} if site.mask.node else set())
    recorder = _Recorder(captured.graph_module, wanted)
    with torch.no_grad():
        recorder.run(*captured.flat_inputs)
    values = recorder.kept
    q = values[nodes.query].double()
    k = values[nodes.key].double()
    k_t = k if nodes.key_is_transposed else k.transpose(-2, -1)
    v = values[nodes.value].double()
    head_axis = 1 if q.dim() == 4 else 0
    groups = q.shape[head_axis] // k_t.shape[head_axis]
    k_t = k_t.repeat_interleave(groups, dim=head_axis)
    v = v.repeat_interleave(groups, dim=head_axis)
    scores = (q @ k_t) * site.scale
    nq, nk = scores.shape[-2], scores.shape[-1]
    i = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if site.causal:
        keep &= j <= i
    if site.window is not None:
        keep &= (j > i - site.window) if site.causal else ((i - j).abs() < site.window)
    scores = scores.masked_fill(~keep, NEG_INF)
    if site.mask.node:
        mask = values[site.mask.node]
        if site.mask.keep_when == "zero":
            scores = scores + mask.double()
        elif site.mask.keep_when == "true":
            scores = scores.masked_fill(~mask.bool(), NEG_INF)
        else:
            scores = scores.masked_fill(mask.bool(), NEG_INF)
    rebuilt = scores.softmax(-1) @ v
    return (rebuilt - values[nodes.output].double().reshape(rebuilt.shape)).abs().max().item()


# ---------------------------------------------------------------------------------------------
# Counter-examples: a softmax that is not (replaceable) attention


CLASSES = 5
EXPERTS = 7


class ClassifierHead(nn.Module):
    """Softmax over class logits [B, C]: no keys, no values."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x_BNX):
        return self.head(x_BNX.mean(1)).softmax(-1)


class MoeRouter(nn.Module):
    """Router probabilities [B, N, E] feed topk and a weighted sum of expert outputs, not a matmul
    against values."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = nn.Linear(HIDDEN, EXPERTS * HIDDEN)

    def forward(self, x_BNX):
        b, n, _ = x_BNX.shape
        probs_BNE = self.router(x_BNX).softmax(-1)
        top_p, top_i = probs_BNE.topk(2, dim=-1)
        out_BNEX = self.experts(x_BNX).view(b, n, EXPERTS, HIDDEN)
        chosen = out_BNEX.gather(2, top_i[..., None].expand(b, n, 2, HIDDEN))
        return (chosen * top_p[..., None]).sum(2)


class SoftmaxOverHeads(ProjectedAttention):
    """Softmax over dim 1 (the head axis) of q kᵀ: normalises across heads, not keys."""

    def attend(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D**-0.5
        return s.softmax(dim=1) @ v


class SoftmaxOverQueries(ProjectedAttention):
    """Softmax over dim -2 (the query axis): with Nq == Nk the shapes still line up."""

    def attend(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D**-0.5
        return s.softmax(dim=-2) @ v


class KeyViewedNotTransposed(ProjectedAttention):
    """k [B, H, N, D] reshaped (a view, not a transpose) to [B, H, D, N]: the matmul runs with
    distinct sizes but pairs q with scrambled key entries."""

    def attend(self, q, k, v):
        b, h, n, d = k.shape
        s = q @ k.reshape(b, h, d, n) * D**-0.5
        return s.softmax(-1) @ v


SWAP_BH = 3  # batch and heads both 3: the one coincidence the wrong permute needs to run


class KeyBatchHeadSwapped(nn.Module):
    """kᵀ built with permute(1, 0, 3, 2): swaps batch and heads as well as transposing.

    With distinct B and H this permute cannot run at all, so B == H == 3 here and only here; N=11
    and D=8 stay distinct. Inductor's wildcard permute dims take this for a transpose.
    """

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, SWAP_BH * D)
        self.k_proj = nn.Linear(HIDDEN, SWAP_BH * D)
        self.v_proj = nn.Linear(HIDDEN, SWAP_BH * D)

    def forward(self, x_BNX):
        b, n, _ = x_BNX.shape
        q, k, v = (p(x_BNX).view(b, n, SWAP_BH, D).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        s = q @ k.permute(1, 0, 3, 2) * D**-0.5
        return (s.softmax(-1) @ v).sum()


def _x_batch_three():
    return (torch.randn(SWAP_BH, N, HIDDEN, generator=torch.Generator().manual_seed(4)),)


class WeightsReturned(ProjectedAttention):
    """Returns the attention probabilities too: the softmax output escapes the chain."""

    def forward(self, x_BNX):
        q, k, v = self.qkv(x_BNX)
        p = (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1)
        return self.merge(p @ v), p


class WeightsReusedTwice(ProjectedAttention):
    """The same probabilities aggregate v and then a second value tensor (shared attention)."""

    def forward(self, x_BNX):
        q, k, v = self.qkv(x_BNX)
        p = (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1)
        out = p @ v
        return self.merge(out) + self.merge(p @ torch.tanh(v))


class ContrastiveLoss(nn.Module):
    """InfoNCE: softmax(sim / tau) over a [B, B] similarity, then the diagonal; no value matmul."""

    def __init__(self):
        super().__init__()
        self.proj_a = nn.Linear(HIDDEN, D)
        self.proj_b = nn.Linear(HIDDEN, D)

    def forward(self, x_BNX):
        za = F.normalize(self.proj_a(x_BNX.mean(1)), dim=-1)
        zb = F.normalize(self.proj_b(x_BNX.amax(1)), dim=-1)
        p_BB = (za @ zb.T / 0.07).softmax(-1)
        return -p_BB.diagonal().log().mean()


class LogSoftmaxScores(ProjectedAttention):
    """log_softmax of q kᵀ aggregating v: not a probability-weighted sum."""

    def attend(self, q, k, v):
        s = q @ k.transpose(-2, -1) * D**-0.5
        return F.log_softmax(s, dim=-1) @ v


class ElementwiseValues(ProjectedAttention):
    """Probabilities [B, H, N, N] times values [B, H, N, D] elementwise (through a broadcast axis),
    then a max over keys: nothing contracts the key axis, so it is not a weighted sum of values."""

    def attend(self, q, k, v):
        p = (q @ k.transpose(-2, -1) * D**-0.5).softmax(-1)  # [B, H, N, N]
        gated = p[..., None] * v[:, :, None, :, :]  # [B, H, N, N, D]
        return gated.amax(3)


COUNTER_EXAMPLES: list[CounterExample] = [
    CounterExample(
        "classifier_head", ClassifierHead, frozenset({"no_value_matmul", "no_score_matmul"}), "logits, not q kᵀ"
    ),
    CounterExample("moe_router", MoeRouter, frozenset({"no_value_matmul", "no_score_matmul"}), "router probabilities"),
    CounterExample("softmax_over_heads", SoftmaxOverHeads, frozenset({"softmax_axis"}), "normalises over heads"),
    CounterExample("softmax_over_queries", SoftmaxOverQueries, frozenset({"softmax_axis"}), "normalises over queries"),
    CounterExample(
        "key_viewed_not_transposed", KeyViewedNotTransposed, frozenset({"key_permuted"}), "key reshaped, not transposed"
    ),
    CounterExample(
        "key_batch_head_swapped",
        KeyBatchHeadSwapped,
        frozenset({"key_permuted"}),
        "permute mixes batch and heads",
        _x_batch_three,
    ),
    CounterExample("weights_returned", WeightsReturned, frozenset({"weights_reused"}), "probabilities returned"),
    CounterExample("weights_reused_twice", WeightsReusedTwice, frozenset({"weights_reused"}), "probabilities reused"),
    CounterExample(
        "contrastive_loss",
        ContrastiveLoss,
        frozenset({"no_value_matmul", "no_score_matmul"}),
        "temperature softmax in a loss",
    ),
    CounterExample(
        "log_softmax_scores", LogSoftmaxScores, frozenset({"log_softmax", "not_softmax"}), "log-probabilities"
    ),
    CounterExample("elementwise_values", ElementwiseValues, frozenset({"no_value_matmul"}), "no matmul with values"),
]
