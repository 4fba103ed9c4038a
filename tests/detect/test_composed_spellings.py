"""Composed spellings from issue 8: mixed-rank bmm chains, GQA repeats in any order, split scales,
in-place score ops, SDPA backend variants and heads folded into the batch.

Sizes are pairwise distinct (B=5, H=6, Hkv=2, N=7, D=8, Dv=9) so a swapped dim cannot pass. Every
positive case asserts the exact site count, B/H/Hkv, the scale to 1e-6, the mask and that the site
rebuilt from its own nodes reproduces the graph's output; every counter-example asserts no site
and one near miss with its code.
"""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnopt.inspection import inspect
from attnopt.ir.masks import ADDITIVE_HIDE_BELOW
from attnopt.passes.matchers import SdpaMatcher
from zoo_models import site_output_error

B, H, HKV, N, D, DV = 5, 6, 2, 7, 8, 9
GROUPS = H // HKV
assert len({B, H, HKV, N, D, DV}) == 6


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


Q_BHND = _randn(B, H, N, D, seed=1)
K_BHND = _randn(B, H, N, D, seed=2)
V_BHND = _randn(B, H, N, DV, seed=3)
V_BHND_D = _randn(B, H, N, D, seed=9)  # flash attention wants Dv == D
Q_BNHD = _randn(B, N, H, D, seed=4)
K_BNHkvD = _randn(B, N, HKV, D, seed=5)
V_BNHkvD = _randn(B, N, HKV, DV, seed=6)
K_BHkvND = _randn(B, HKV, N, D, seed=7)
V_BHkvND = _randn(B, HKV, N, DV, seed=8)


def padding_B11N() -> torch.Tensor:
    """Additive: the last two keys of batch 0 hidden."""
    m = torch.zeros(B, 1, 1, N)
    m[0, ..., -2:] = torch.finfo(torch.float32).min
    return m


def one_site(module, *args):
    inspection = inspect(module, *args, dynamic=False)
    assert len(inspection.sites) == 1, [(m.code, m.reason) for m in inspection.near_misses]
    assert inspection.near_misses == [], [(m.code, m.reason) for m in inspection.near_misses]
    site = inspection.sites[0]
    assert site_output_error(inspection, site) < 1e-4
    return site


def one_miss(module, *args):
    inspection = inspect(module, *args, dynamic=False)
    assert inspection.sites == [], [s.id for s in inspection.sites]
    assert len(inspection.near_misses) == 1, [(m.code, m.reason) for m in inspection.near_misses]
    return inspection.near_misses[0]


def repeat_kv(x_BHkvND, groups):
    b, hkv, n, d = x_BHkvND.shape
    return x_BHkvND[:, :, None, :, :].expand(b, hkv, groups, n, d).reshape(b, hkv * groups, n, d)


# ---- 1. mixed-rank bmm chains ---------------------------------------------------------------------

class MixedRank(nn.Module):
    """`kind` says where the chain is rank 3 ([B*H, N, D] bmm) and where rank 4."""

    def __init__(self, kind: str, gqa: bool = False):
        super().__init__()
        self.kind, self.gqa = kind, gqa

    def forward(self, q, k, v, mask=None):
        if self.gqa:
            k, v = repeat_kv(k, GROUPS), repeat_kv(v, GROUPS)
        b, h, n, d = q.shape  # sizes read from the inputs, so a dynamic capture keeps them related
        dv = v.shape[-1]
        flat = lambda x: x.reshape(b * h, x.shape[-2], x.shape[-1])  # noqa: E731
        if self.kind == "bmm_scores":  # Inductor's pattern: bmm q·kᵀ viewed to 4-D, 4-D softmax and P·V
            s = torch.bmm(flat(q) * D**-0.5, flat(k).transpose(1, 2)).view(b, h, n, n)
        elif self.kind == "bmm_scores_flat_key_t":  # kᵀ flattened from [B, H, D, N]
            s = torch.bmm(flat(q), k.transpose(-1, -2).reshape(b * h, d, n)).view(b, h, n, n) * 0.3
        else:  # "bmm_values": 4-D scores and softmax, P·V as a bmm on [B*H, ..] viewed back
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        if mask is not None:
            s = s + mask
        p = s.softmax(-1)
        if self.kind == "bmm_values":
            return torch.bmm(p.view(b * h, n, n), flat(v)).view(b, h, n, dv)
        return p @ v


MIXED_SCALES = {"bmm_scores": D**-0.5, "bmm_scores_flat_key_t": 0.3, "bmm_values": D**-0.5}


@pytest.mark.parametrize("kind", sorted(MIXED_SCALES))
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padding"])
def test_mixed_rank_chain_is_one_rank4_site(kind, gqa, masked):
    k, v = (K_BHkvND, V_BHkvND) if gqa else (K_BHND, V_BHND)
    args = (Q_BHND, k, v) + ((padding_B11N(),) if masked else ())
    site = one_site(MixedRank(kind, gqa), *args)
    assert site.nodes.rank == 4
    assert (site.batch, site.heads, site.kv_heads) == (B, H, HKV if gqa else H)
    assert (site.q_len, site.kv_len, site.head_dim, site.v_head_dim) == (N, N, D, DV)
    assert site.scale == pytest.approx(MIXED_SCALES[kind], abs=1e-6)
    assert site.mask.kind == ("padding" if masked else "none")
    assert "rank:mixed" in site.spelling


class MaskOnFlatScores(nn.Module):
    """The mask is added to the [B*H, N, N] scores: a rank-4 site has no [B, H] reading of it."""

    def forward(self, q, k, v, mask):
        flat = lambda x: x.reshape(B * H, N, x.shape[-1])  # noqa: E731
        s = torch.bmm(flat(q), flat(k).transpose(1, 2)) + mask.expand(B, H, N, N).reshape(B * H, N, N)
        return s.view(B, H, N, N).softmax(-1) @ v


class FlatPvNeverViewed(nn.Module):
    def forward(self, q, k, v):
        p = ((q @ k.transpose(-1, -2)) * 0.3).softmax(-1)
        return torch.bmm(p.view(B * H, N, N), v.reshape(B * H, N, DV))


class ValuesFlattenedHeadsFirst(nn.Module):
    """v flattened from [H, B, N, Dv]: its rank-3 batch is not the probabilities' [B*H]."""

    def forward(self, q, k, v):
        p = ((q @ k.transpose(-1, -2)) * 0.3).softmax(-1)
        return torch.bmm(p.view(B * H, N, N), v.transpose(0, 1).reshape(B * H, N, DV)).view(B, H, N, DV)


class RealRank3Batch(nn.Module):
    """q, k, v arrive as [G, N, D] with no [B, H] split anywhere: the 4-D view of the scores has
    no heads to lift q and k to, so a rank-4 site cannot be claimed."""

    def forward(self, q3, k3, v4):
        s = torch.bmm(q3, k3.transpose(1, 2)).view(B, H, N, N) * 0.3
        return s.softmax(-1) @ v4


def test_mixed_rank_counter_examples():
    miss = one_miss(MaskOnFlatScores(), Q_BHND, K_BHND, V_BHND, padding_B11N())
    assert miss.code == "mixed_rank" and "[B*H, Nq, Nk]" in miss.reason
    miss = one_miss(FlatPvNeverViewed(), Q_BHND, K_BHND, V_BHND)
    assert miss.code == "no_value_matmul" and "never viewed" in miss.reason
    miss = one_miss(ValuesFlattenedHeadsFirst(), Q_BHND, K_BHND, V_BHND)
    assert miss.code == "shape"
    q3, k3 = Q_BHND.reshape(B * H, N, D).clone(), K_BHND.reshape(B * H, N, D).clone()
    miss = one_miss(RealRank3Batch(), q3, k3, V_BHND)
    assert miss.code == "mixed_rank" and "query" in miss.reason


# ---- 2. GQA kv-head count, whatever the order of repeat, transposes, .mT and casts --------------

def _k_BHND(k_BNHkvD):  # the usual [B, N, Hkv, D] -> [B, Hkv, N, D]
    return k_BNHkvD.transpose(1, 2)


GQA_SPELLINGS = {
    "repeat_interleave_after_transpose": lambda x: _k_BHND(x).repeat_interleave(GROUPS, 1),
    "repeat_interleave_before_transpose": lambda x: x.repeat_interleave(GROUPS, 2).transpose(1, 2),
    "repeat_kv_after_transpose": lambda x: repeat_kv(_k_BHND(x), GROUPS),
    "expand_reshape_before_transpose": lambda x: x[:, :, :, None, :]
    .expand(B, N, HKV, GROUPS, x.shape[-1])
    .reshape(B, N, H, x.shape[-1])
    .transpose(1, 2),
    "cast_repeat_cast": lambda x: _k_BHND(x).double().repeat_interleave(GROUPS, 1).float(),
    "repeat_then_cast": lambda x: _k_BHND(x).repeat_interleave(GROUPS, 1).to(torch.float32),
    "permute_then_repeat_dim_minus3": lambda x: x.permute(0, 2, 1, 3).repeat_interleave(GROUPS, dim=-3),
    "mT_repeat_mT": lambda x: _k_BHND(x).mT.repeat_interleave(GROUPS, 1).mT,
    "contiguous_repeat_kv": lambda x: repeat_kv(_k_BHND(x).contiguous(), GROUPS),
    "expand_flatten": lambda x: _k_BHND(x)[:, :, None].expand(B, HKV, GROUPS, N, x.shape[-1]).flatten(1, 2),
    "expand_flatten_before_transpose": lambda x: x[:, :, :, None]
    .expand(B, N, HKV, GROUPS, x.shape[-1])
    .flatten(2, 3)
    .transpose(1, 2),
    "unsqueeze_expand_minus1": lambda x: _k_BHND(x)
    .unsqueeze(2)
    .expand(-1, -1, GROUPS, -1, -1)
    .reshape(B, -1, N, x.shape[-1]),
    "half_round_trip": lambda x: _k_BHND(x).half().repeat_interleave(GROUPS, 1).float(),
}
KEY_TRANSPOSES = {"transpose": lambda k: k.transpose(-2, -1), "mT": lambda k: k.mT}


class GqaSpelled(nn.Module):
    def __init__(self, gqa: str, key_t: str, sdpa: bool = False):
        super().__init__()
        self.gqa, self.key_t, self.sdpa = gqa, key_t, sdpa

    def forward(self, q_BNHD, k_BNHkvD, v_BNHkvD):
        q = q_BNHD.transpose(1, 2)
        k, v = GQA_SPELLINGS[self.gqa](k_BNHkvD), GQA_SPELLINGS[self.gqa](v_BNHkvD)
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, scale=0.25)
        return ((q @ KEY_TRANSPOSES[self.key_t](k)) * 0.25).softmax(-1) @ v


@pytest.mark.parametrize("key_t", sorted(KEY_TRANSPOSES))
@pytest.mark.parametrize("gqa", sorted(GQA_SPELLINGS))
def test_gqa_kv_heads_through_any_repeat_order(gqa, key_t):
    site = one_site(GqaSpelled(gqa, key_t), Q_BNHD, K_BNHkvD, V_BNHkvD)
    assert (site.batch, site.heads, site.kv_heads, site.gqa_groups) == (B, H, HKV, GROUPS)
    assert site.scale == pytest.approx(0.25, abs=1e-6)
    assert (site.head_dim, site.v_head_dim, site.mask.kind) == (D, DV, "none")


@pytest.mark.parametrize("gqa", sorted(GQA_SPELLINGS))
def test_gqa_kv_heads_under_sdpa(gqa):
    site = one_site(GqaSpelled(gqa, "transpose", sdpa=True), Q_BNHD, K_BNHkvD, V_BNHkvD)
    assert (site.source, site.batch, site.heads, site.kv_heads) == ("sdpa", B, H, HKV)
    assert site.scale == pytest.approx(0.25, abs=1e-6)


def test_gqa_repeat_before_transpose_keeps_repeated_nodes():
    """No [B, Hkv, N, D] node exists when the repeat precedes the head transpose: the nodes hold H
    heads and say so (kv_repeated), so a consumer never takes them for Hkv heads."""
    site = one_site(GqaSpelled("repeat_interleave_before_transpose", "transpose"), Q_BNHD, K_BNHkvD, V_BNHkvD)
    assert (site.kv_heads, site.nodes.kv_repeated) == (HKV, GROUPS)
    direct = one_site(GqaSpelled("repeat_kv_after_transpose", "transpose"), Q_BNHD, K_BNHkvD, V_BNHkvD)
    assert (direct.kv_heads, direct.nodes.kv_repeated) == (HKV, 1)


class TiledHeads(nn.Module):
    """`repeat` tiles heads (h reads kv head h % Hkv), and so does a new axis BEFORE Hkv: not GQA's
    grouping (h // R). The kv-head count stays the nodes' own H."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, q_BNHD, k_BNHkvD, v_BNHkvD):
        def tile(x):
            x = x.transpose(1, 2)
            if self.how == "repeat":
                return x.repeat(1, GROUPS, 1, 1)
            b, hkv, n, d = x.shape
            return x[:, None].expand(b, GROUPS, hkv, n, d).reshape(b, GROUPS * hkv, n, d)

        q = q_BNHD.transpose(1, 2)
        return ((q @ tile(k_BNHkvD).transpose(-1, -2)) * 0.25).softmax(-1) @ tile(v_BNHkvD)


@pytest.mark.parametrize("how", ["repeat", "axis_before_hkv"])
def test_tiled_heads_are_not_counted_as_gqa(how):
    site = one_site(TiledHeads(how), Q_BNHD, K_BNHkvD, V_BNHkvD)
    assert (site.heads, site.kv_heads, site.nodes.kv_repeated) == (H, H, 1)


class KeysAndValuesRepeatedDifferently(nn.Module):
    """k repeated 3x from 2 heads, v 6x from 1 head: no single kv-head count, so no site claims one."""

    def forward(self, q, k_BHkvND, v_B1ND):
        k = k_BHkvND.repeat_interleave(GROUPS, 1)
        v = v_B1ND.repeat_interleave(H, 1)
        return ((q @ k.transpose(-1, -2)) * 0.25).softmax(-1) @ v


def test_disagreeing_repeats_claim_no_kv_heads():
    miss = one_miss(KeysAndValuesRepeatedDifferently(), Q_BHND, K_BHkvND, V_BHkvND[:, :1])
    assert miss.code == "gqa" and "3x" in miss.reason and "6x" in miss.reason


# ---- 3. split scale -------------------------------------------------------------------------------

SPLIT_SCALES = {
    "on_q_and_k": lambda q, k: (q * D**-0.25) @ (k * D**-0.25).transpose(-1, -2),
    "on_q_and_key_t": lambda q, k: (q * D**-0.25) @ (k.transpose(-1, -2) * D**-0.25),
    "on_q_and_key_mT": lambda q, k: (q * D**-0.25) @ (k * D**-0.25).mT,
    "div_both": lambda q, k: (q / D**0.25) @ (k / D**0.25).mT,
    "uneven_split": lambda q, k: (q * 0.5) @ (k.mT * (2 * D**-0.5)),
    "three_factors": lambda q, k: ((q * 0.5) @ (k.mT * 0.5)) * (4 * D**-0.5),
}


class SplitScale(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k_BHkvND, v_BHkvND):
        k, v = repeat_kv(k_BHkvND, GROUPS), repeat_kv(v_BHkvND, GROUPS)
        return SPLIT_SCALES[self.spelling](q, k).softmax(-1) @ v


@pytest.mark.parametrize("spelling", sorted(SPLIT_SCALES))
def test_split_scale_folds_into_one_site_scale(spelling):
    site = one_site(SplitScale(spelling), Q_BHND, K_BHkvND, V_BHkvND)
    assert site.scale == pytest.approx(D**-0.5, abs=1e-6)
    assert site.folded_scale == 1.0
    assert (site.heads, site.kv_heads) == (H, HKV)


class ScaledBeforeHeadSplit(nn.Module):
    """q is scaled in [B, N, H*D] before its head split (OPT, Whisper): no unscaled [B, H, N, D]
    node exists, so that part stays in the query node and is reported as folded_scale."""

    def __init__(self, sdpa: bool):
        super().__init__()
        self.sdpa = sdpa

    def forward(self, x_BNX, k):
        q = (x_BNX * D**-0.25).view(B, N, H, D).transpose(1, 2)
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, k, scale=D**-0.25)
        return ((q @ k.transpose(-1, -2)) * D**-0.25).softmax(-1) @ k


@pytest.mark.parametrize("sdpa", [False, True], ids=["explicit", "sdpa"])
def test_scale_before_head_split_is_reported_as_folded(sdpa):
    site = one_site(ScaledBeforeHeadSplit(sdpa), Q_BNHD.reshape(B, N, H * D), K_BHND)
    assert site.scale == pytest.approx(D**-0.25, abs=1e-6)
    assert site.folded_scale == pytest.approx(D**-0.25, abs=1e-6)
    assert site.scale * site.folded_scale == pytest.approx(D**-0.5, abs=1e-6)


# ---- 4. in-place score ops and 9. one masking threshold -----------------------------------------

class InPlace(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v, mask):
        s = q @ k.transpose(-1, -2)
        if self.spelling == "mul_":
            s *= 0.3
        else:
            s.div_(D**0.5)
        if mask.dtype == torch.bool:
            s.masked_fill_(mask, float("-inf"))
        else:
            s += mask
        return s.softmax(-1) @ v


@pytest.mark.parametrize("mask_kind", ["additive_", "masked_fill_"])
@pytest.mark.parametrize("spelling", ["mul_", "div_"])
def test_inplace_score_ops_read_like_out_of_place(spelling, mask_kind):
    causal_hide = torch.ones(N, N, dtype=torch.bool).triu(1)
    if mask_kind == "masked_fill_":

        class Built(InPlace):
            def forward(self, q, k, v):
                return super().forward(q, k, v, torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1))

        site = one_site(Built(spelling), Q_BHND, K_BHND, V_BHND)
        assert (site.mask.kind, site.mask.form) == ("causal", "masked_fill")
    else:
        site = one_site(InPlace(spelling), Q_BHND, K_BHND, V_BHND, padding_B11N())
        assert (site.mask.kind, site.mask.form) == ("padding", "additive")
    assert causal_hide.sum() > 0
    assert site.scale == pytest.approx(0.3 if spelling == "mul_" else D**-0.5, abs=1e-6)
    assert "inplace:" + spelling in site.spelling
    assert (site.batch, site.heads, site.kv_heads) == (B, H, H)


class CausalAt(nn.Module):
    """A causal mask built from triu, spelled as masked_fill or as an additive term, with a fill value."""

    def __init__(self, spelling: str, value: float):
        super().__init__()
        self.spelling, self.value = spelling, value

    def forward(self, q, k, v):
        s = (q @ k.transpose(-1, -2)) * 0.3
        hide = torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1)
        if self.spelling == "masked_fill":
            s = s.masked_fill(hide, self.value)
        else:
            s = s + torch.zeros(N, N, device=q.device).masked_fill(hide, self.value)
        return s.softmax(-1) @ v


@pytest.mark.parametrize("spelling", ["masked_fill", "additive"])
def test_minus_5000_masks_the_key_in_both_spellings(spelling):
    assert -5000.0 <= ADDITIVE_HIDE_BELOW
    site = one_site(CausalAt(spelling, -5000.0), Q_BHND, K_BHND, V_BHND)
    assert (site.mask.kind, site.causal, site.mask.form) == ("causal", True, spelling)
    assert site.scale == pytest.approx(0.3, abs=1e-6)


def test_minus_500_masks_the_key_in_neither_spelling():
    """-500 is a finite bias (exp(-500) is not 0 in fp64): a masked_fill of it is no mask, and the
    same additive term is an arbitrary bias, never causal."""
    miss = one_miss(CausalAt("masked_fill", -500.0), Q_BHND, K_BHND, V_BHND)
    assert miss.code == "mask_value"
    site = one_site(CausalAt("additive", -500.0), Q_BHND, K_BHND, V_BHND)
    assert site.mask.arbitrary and not site.mask.padding


def test_one_masking_constant():
    from attnopt.passes import canonicalize, mask_proof, mask_reading
    from attnopt.ir import masks

    assert masks.ADDITIVE_HIDE_BELOW == -1e3
    for module in (canonicalize, mask_proof, mask_reading):
        assert module.ADDITIVE_HIDE_BELOW is masks.ADDITIVE_HIDE_BELOW
        assert not hasattr(module, "MASKING_VALUE") and not hasattr(module, "HIDDEN_BELOW")


# ---- 6. backend-specific SDPA variants ------------------------------------------------------------

class FlashForCpu(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, *mask):
        kw = dict(self.kw, **({"attn_mask": mask[0]} if mask else {}))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, **kw)[0]


@pytest.mark.parametrize(
    "kw, scale, kind",
    [({}, D**-0.5, "none"), ({"is_causal": True}, D**-0.5, "causal"), ({"scale": 0.3}, 0.3, "none")],
    ids=["default", "causal", "scale"],
)
def test_flash_for_cpu_reads_as_sdpa(kw, scale, kind):
    site = one_site(FlashForCpu(**kw), Q_BHND, K_BHND, V_BHND_D)
    assert (site.source, site.batch, site.heads, site.kv_heads) == ("sdpa", B, H, H)
    assert site.scale == pytest.approx(scale, abs=1e-6)
    assert site.mask.kind == kind
    assert site.nodes.output.startswith("getitem")


def test_flash_for_cpu_keyword_mask():
    site = one_site(FlashForCpu(scale=0.25), Q_BHND, K_BHND, V_BHND_D, padding_B11N())
    assert (site.mask.kind, site.mask.form, site.scale) == ("padding", "additive", 0.25)


class FlashLogsumexpUsed(nn.Module):
    def forward(self, q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        return out, lse


def test_variant_whose_logsumexp_is_used_is_a_near_miss():
    miss = one_miss(FlashLogsumexpUsed(), Q_BHND, K_BHND, V_BHND_D)
    assert miss.code == "sdpa_variant" and "element 1" in miss.reason


def _variant_graph(op, args_fn, kwargs):
    """A graph calling a CUDA-only SDPA variant, with example values to read shapes from (the
    matcher is structural; the numeric check needs the device)."""
    g = torch.fx.Graph()
    q, k, v = (g.placeholder(n) for n in "qkv")
    for node, t in zip((q, k, v), (Q_BHND, K_BHND, V_BHND)):
        node.meta["val"] = t
    mask = g.placeholder("mask")
    mask.meta["val"] = padding_B11N()
    call = g.call_function(op, args_fn(q, k, v, mask), kwargs)
    out = g.call_function(operator.getitem, (call, 0))
    g.output(out)
    return call, out, (q, k, v, mask)


CUDA_VARIANTS = {
    "flash": (torch.ops.aten._scaled_dot_product_flash_attention.default,
              lambda q, k, v, m: (q, k, v, 0.0, True), None),
    "efficient": (torch.ops.aten._scaled_dot_product_efficient_attention.default,
                  lambda q, k, v, m: (q, k, v, m, False, 0.0, False), "mask"),
    "cudnn": (torch.ops.aten._scaled_dot_product_cudnn_attention.default,
              lambda q, k, v, m: (q, k, v, m, False, 0.0, True, False), "mask"),
}


@pytest.mark.parametrize("variant", sorted(CUDA_VARIANTS))
def test_cuda_sdpa_variants_bind_their_own_argument_lists(variant):
    op, args_fn, mask_name = CUDA_VARIANTS[variant]
    call, out, (q, k, v, mask) = _variant_graph(op, args_fn, {"scale": 0.3})
    got = SdpaMatcher().match(call)
    assert not hasattr(got, "code"), got
    assert (got.query, got.key, got.value, got.output) == (q, k, v, out)
    assert got.sdpa_mask is (mask if mask_name else None)
    assert got.is_causal == (variant != "efficient")
    assert got.sdpa_scale == 0.3 and got.rank == 4


# ---- 7. rank-3 sites: heads recovered from the graph ----------------------------------------------

class Rank3(nn.Module):
    def __init__(self, gqa: bool):
        super().__init__()
        self.gqa = gqa

    def forward(self, q, k, v):
        if self.gqa:
            k, v = k.repeat_interleave(GROUPS, 1), v.repeat_interleave(GROUPS, 1)
        flat = lambda x: x.reshape(B * H, N, x.shape[-1])  # noqa: E731
        p = (torch.bmm(flat(q), flat(k).transpose(1, 2)) * 0.3).softmax(-1)
        return torch.bmm(p, flat(v))


@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_rank3_site_recovers_heads_and_kv_heads(gqa):
    k, v = (K_BHkvND, V_BHkvND) if gqa else (K_BHND, V_BHND)
    site = one_site(Rank3(gqa), Q_BHND, k, v)
    assert site.nodes.rank == 3
    assert (site.batch, site.heads, site.kv_heads) == (B, H, HKV if gqa else H)
    assert site.nodes.kv_repeated == (GROUPS if gqa else 1)
    assert site.scale == pytest.approx(0.3, abs=1e-6)


class Rank3Inputs(nn.Module):
    def forward(self, q3, k3, v3):
        return (torch.bmm(q3, k3.transpose(1, 2)) * 0.3).softmax(-1) @ v3


def test_rank3_site_without_a_head_split_claims_no_heads():
    """A genuine [G, N, D] batch with no [B, H] split in the graph: one head per batch entry."""
    flat = lambda x: x.reshape(B * H, N, x.shape[-1]).clone()  # noqa: E731
    site = one_site(Rank3Inputs(), flat(Q_BHND), flat(K_BHND), flat(V_BHND))
    assert (site.batch, site.heads, site.kv_heads) == (B * H, 1, 1)


# ---- the sites above are safe to splice: an exact rewrite from their nodes matches on new inputs ---

SPLICED = {
    "mixed_bmm_scores_gqa_padding": lambda: (MixedRank("bmm_scores", True), (Q_BHND, K_BHkvND, V_BHkvND, padding_B11N())),
    "mixed_bmm_values_padding": lambda: (MixedRank("bmm_values"), (Q_BHND, K_BHND, V_BHND, padding_B11N())),
    "mixed_flat_key_t": lambda: (MixedRank("bmm_scores_flat_key_t"), (Q_BHND, K_BHND, V_BHND)),
    "gqa_repeat_before_transpose_mT": lambda: (GqaSpelled("repeat_interleave_before_transpose", "mT"),
                                               (Q_BNHD, K_BNHkvD, V_BNHkvD)),
    "gqa_expand_before_transpose_sdpa": lambda: (GqaSpelled("expand_reshape_before_transpose", "transpose", True),
                                                 (Q_BNHD, K_BNHkvD, V_BNHkvD)),
    "inplace_mul_add": lambda: (InPlace("mul_"), (Q_BHND, K_BHND, V_BHND, padding_B11N())),
    "rank3_gqa": lambda: (Rank3(True), (Q_BHND, K_BHkvND, V_BHkvND)),
    "flash_for_cpu": lambda: (FlashForCpu(scale=0.3), (Q_BHND, K_BHND, V_BHND_D)),
    "split_three_factors": lambda: (SplitScale("three_factors"), (Q_BHND, K_BHkvND, V_BHkvND)),
    "scaled_before_head_split": lambda: (ScaledBeforeHeadSplit(False), (Q_BNHD.reshape(B, N, H * D), K_BHND)),
}


@pytest.mark.parametrize("case", sorted(SPLICED))
def test_site_spliced_as_exact_matches_the_model_on_new_inputs(case):
    from attnopt import forms
    from attnopt.forms.common.base import BuildContext
    from attnopt.passes.splice import splice_graph

    module, args = SPLICED[case]()
    inspection = inspect(module, *args)  # dynamic, as attnopt.compile captures
    [site] = inspection.sites
    gm = inspection.captured.graph_module
    splice_graph(gm, [site], {site.id: forms.get("exact").build(site, {}, BuildContext())})
    assert sum(1 for n in gm.graph.nodes if n.op == "call_module" and str(n.target).startswith("attnopt_site")) == 1
    gen = torch.Generator().manual_seed(11)
    fresh = tuple(a if a.dtype == torch.bool or a.shape[1] == 1 else torch.randn(a.shape, generator=gen) for a in args)
    with torch.no_grad():
        assert (gm(*fresh) - module(*fresh)).abs().max() < 1e-5


def test_in_place_write_outside_the_chain_is_a_near_miss():
    """A graph where the softmax reads the scores node that an add_ mutates in place (the FX view of
    `s = q@kᵀ * c; s.add_(m); softmax(s)` with the write not threaded through): taking the chain
    without the add_ would drop the mask, so it must be a near miss, never a site."""
    from attnopt.passes.capture import capture_export
    from attnopt.passes.detect import detect

    captured = capture_export(InPlace("mul_"), (Q_BHND, K_BHND, V_BHND, padding_B11N()), dynamic=False)
    graph = captured.graph_module.graph
    add_ = next(n for n in graph.nodes if n.target is torch.ops.aten.add_.Tensor)
    softmax = next(n for n in graph.nodes if "softmax" in str(n.target))
    softmax.replace_input_with(add_, add_.args[0])
    captured.graph_module.recompile()
    result = detect(captured)
    assert result.sites == []
    assert [m.code for m in result.near_misses] == ["mutated_in_place"]
    assert "add_" in result.near_misses[0].reason


class MqaExpanded(nn.Module):
    """One key/value head expanded over all query heads (multi-query attention), before or after
    the head transpose."""

    def __init__(self, before_transpose: bool):
        super().__init__()
        self.before = before_transpose

    def forward(self, q, k_BN1D, v_BN1D):
        if self.before:
            k, v = (x.expand(B, N, H, x.shape[-1]).transpose(1, 2) for x in (k_BN1D, v_BN1D))
        else:
            k, v = (x.transpose(1, 2).expand(B, H, N, x.shape[-1]) for x in (k_BN1D, v_BN1D))
        return ((q @ k.transpose(-1, -2)) * 0.25).softmax(-1) @ v


@pytest.mark.parametrize("before", [True, False], ids=["expand_then_transpose", "transpose_then_expand"])
def test_mqa_by_expand_has_one_kv_head(before):
    site = one_site(MqaExpanded(before), Q_BHND, K_BNHkvD[:, :, :1], V_BNHkvD[:, :, :1])
    assert (site.batch, site.heads, site.kv_heads) == (B, H, 1)
    assert site.scale == pytest.approx(0.25, abs=1e-6)


def test_a_chain_whose_replay_fails_is_a_near_miss_not_a_crash(monkeypatch):
    """Defence in depth: with the mixed-rank frame check switched off, the [B*H, N, N] mask no
    longer broadcasts in the 4-D replay; that must be a `numeric` near miss, never an exception
    that takes the other sites down with it, and never a site."""
    from attnopt.passes import operands

    monkeypatch.setattr(operands, "_frame_disagrees", lambda *args: "")
    miss = one_miss(MaskOnFlatScores(), Q_BHND, K_BHND, V_BHND, padding_B11N())
    assert miss.code == "numeric" and "replaying the matched chain" in miss.reason


# ---- everything composed: GQA spelling x scale x mask x rank x cast x in-place -------------------

COMPOSED_SCALES = {
    "mul": lambda q, k: (q @ k.mT) * 0.3,
    "div": lambda q, k: (q @ k.mT) / (1 / 0.3),
    "split": lambda q, k: (q * 0.3**0.5) @ (k * 0.3**0.5).mT,
    "on_query": lambda q, k: (q * 0.3) @ k.transpose(-1, -2),
}


class Composed(nn.Module):
    def __init__(self, gqa, scale, mask, rank, cast, inplace):
        super().__init__()
        self.gqa, self.scale, self.mask, self.rank, self.cast, self.inplace = gqa, scale, mask, rank, cast, inplace

    def forward(self, q_BNHD, k_BNHkvD, v_BNHkvD, padding):
        q = q_BNHD.transpose(1, 2)
        k, v = GQA_SPELLINGS[self.gqa](k_BNHkvD), GQA_SPELLINGS[self.gqa](v_BNHkvD)
        b, h, n, d = q.shape
        if self.rank == "bmm_scores":
            s = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2)).view(b, h, n, n) * 0.3
        else:
            s = COMPOSED_SCALES[self.scale](q, k)
        if self.cast:  # Qwen-style: scores and softmax in a wider dtype
            s = s.double()
        if self.mask == "padding":
            if self.inplace:
                s += padding.to(s.dtype)
            else:
                s = s + padding.to(s.dtype)
        elif self.mask == "causal":
            hide = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            s = s.masked_fill_(hide, -5000.0) if self.inplace else s.masked_fill(hide, float("-inf"))
        p = s.softmax(-1)
        if self.cast:
            p = p.float()
        if self.rank == "bmm_values":
            dv = v.shape[-1]
            return torch.bmm(p.reshape(b * h, n, n), v.reshape(b * h, n, dv)).view(b, h, n, dv)
        return p @ v


def _composed_sample(count: int, seed: int) -> list[tuple]:
    import itertools
    import random

    grid = list(itertools.product(sorted(GQA_SPELLINGS), sorted(COMPOSED_SCALES), ("none", "padding", "causal"),
                                  ("4d", "bmm_scores", "bmm_values"), (False, True), (False, True)))
    return random.Random(seed).sample(grid, count)


@pytest.mark.parametrize("recipe", _composed_sample(40, seed=8), ids=lambda r: "-".join(map(str, r)))
def test_composed_spelling_is_one_correct_splicable_site(recipe):
    from attnopt import forms
    from attnopt.forms.common.base import BuildContext
    from attnopt.passes.splice import splice_graph

    module = Composed(*recipe)
    args = (Q_BNHD, K_BNHkvD, V_BNHkvD, padding_B11N())
    inspection = inspect(module, *args, dynamic=False)
    assert len(inspection.sites) == 1, [(m.code, m.reason) for m in inspection.near_misses]
    [site] = inspection.sites
    assert (site.batch, site.heads, site.kv_heads, site.nodes.rank) == (B, H, HKV, 4)
    assert site.scale * site.folded_scale == pytest.approx(0.3, abs=1e-6)
    assert site.mask.kind == {"none": "none", "padding": "padding", "causal": "causal"}[recipe[2]]
    gm = inspection.captured.graph_module
    splice_graph(gm, [site], {site.id: forms.get("exact").build(site, {}, BuildContext())})
    gen = torch.Generator().manual_seed(12)
    fresh = tuple(torch.randn(a.shape, generator=gen) for a in args[:3]) + (args[3],)
    with torch.no_grad():
        assert (gm(*fresh) - module(*fresh)).abs().max() < 1e-4


class QueryScaledInPlace(nn.Module):
    """`q *= c` mutates q: the unscaled q no longer exists when the matmul runs, so the factor stays
    in the query node and is reported as folded_scale, never stripped (that would apply it twice)."""

    def forward(self, q_BNHD, k, v):
        q = q_BNHD.transpose(1, 2).contiguous()
        q *= D**-0.25
        return ((q @ k.transpose(-1, -2)) * D**-0.25).softmax(-1) @ v


def test_query_scaled_in_place_is_reported_as_folded():
    site = one_site(QueryScaledInPlace(), Q_BNHD, K_BHND, V_BHND)
    assert site.scale == pytest.approx(D**-0.25, abs=1e-6)
    assert site.folded_scale == pytest.approx(D**-0.25, abs=1e-6)
