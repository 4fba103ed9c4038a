"""Generated attention: hypothesis composes spellings and checks each against its ground truth.

A recipe draws sizes (B, H, Hkv, N, D from disjoint sets, so they never coincide), a scale
spelling, a mask spelling, a layout, a GQA spelling, a float64 softmax round trip, dropout, and
sometimes a trap (softmax over the wrong axis, probabilities reused, key reshaped instead of
transposed). The model built from it is either one site whose attributes equal the recipe's truth,
or, for a trap, no site and one near miss with the trap's code -- never a wrong site.

The recipe's truth is itself checked: the module's output equals SDPA computed from the truth.

The 200 recipes are drawn once, deterministically, at collection; each is one test case. By default
a fixed-seed sample of 40 runs, chosen so that every value of every spelling field appears in it
(the `sampled` marker, tests/conftest.py); `pytest --full` runs all 200.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from attnopt.inspection import inspect
from zoo_models import NEG_INF, Truth, assert_site_matches, repeat_kv, site_output_error

EXAMPLES = 200
SAMPLE = 40  # run by default; all EXAMPLES under --full

# Disjoint value sets: no two of B, H, Hkv, N, D can be equal in any drawn recipe.
BATCHES = (2, 3, 5)
HEADS = (4, 6)
LENGTHS = (7, 9, 11, 13)
HEAD_DIMS = (8, 10, 12)
SCALES = (0.1, 0.25, 0.3, 0.5)

SDPA_SCALES = ("sdpa_default", "sdpa_scale")
EXPLICIT_SCALES = ("div_sqrt", "mul", "on_query", "split")
SDPA_MASKS = ("none", "is_causal", "bool_tril", "bool_window", "input_additive", "input_padding")
EXPLICIT_MASKS = (
    "none",
    "masked_fill_tril",
    "where_tril",
    "additive_built",
    "additive_built_commuted",
    "masked_fill_window",
    "input_additive",
    "input_padding",
)
# masks whose truth is "causal", and the form MaskInfo must name for each spelling
CAUSAL_MASKS = {"is_causal", "bool_tril", "bool_window", "masked_fill_tril", "where_tril", "additive_built",
                "additive_built_commuted", "masked_fill_window"}
WINDOW_MASKS = {"bool_window", "masked_fill_window"}
MASK_FORMS = {
    "none": "none",
    "is_causal": "is_causal",
    "bool_tril": "bool",
    "bool_window": "bool",
    "input_padding": None,  # "bool" under SDPA, "masked_fill" in an explicit chain: set below
    "input_additive": "additive",
    "masked_fill_tril": "masked_fill",
    "masked_fill_window": "masked_fill",
    "where_tril": "where",
    "additive_built": "additive",
    "additive_built_commuted": "additive",
}
TRAP_CODES = {"wrong_axis": "softmax_axis", "weights_reused": "weights_reused", "key_view": "key_permuted"}


@dataclass(frozen=True)
class Recipe:
    """One drawn spelling of attention (or of a trap that looks like it)."""

    batch: int
    heads: int
    kv_heads: int
    length: int
    head_dim: int
    scale_form: str
    scale: float  # the true overall factor on q kᵀ
    mask: str
    window: Optional[int]
    layout: str  # "BHND" | "key_BNHD" (k kept as [B, N, Hkv, D], permuted to kᵀ) | "bmm3d"
    gqa: str  # "none" | "repeat_interleave" | "repeat_kv" | "enable_gqa"
    cast: bool  # softmax in float64, cast back
    dropout: bool  # dropout on the probabilities (eval mode: off)
    trap: str  # "none" | "wrong_axis" | "weights_reused" | "key_view"
    wrong_dim: int = -2  # for the wrong_axis trap

    @property
    def sdpa(self) -> bool:
        return self.scale_form in SDPA_SCALES

    def truth(self) -> Truth:
        form = MASK_FORMS[self.mask]
        if self.mask == "input_padding":
            form = "bool" if self.sdpa else "masked_fill"
        return Truth(
            source="sdpa" if self.sdpa else "explicit",
            heads=self.heads,
            kv_heads=self.kv_heads,
            q_len=self.length,
            kv_len=self.length,
            head_dim=self.head_dim,
            v_head_dim=self.head_dim,
            scale=self.scale,
            causal=self.mask in CAUSAL_MASKS,
            window=self.window if self.mask in WINDOW_MASKS else None,
            padding=self.mask == "input_padding",
            arbitrary=self.mask == "input_additive",
            mask_form=form,
            rank=3 if self.layout == "bmm3d" else 4,
            folded_scales=(1.0,) if self.layout == "bmm3d" and self.scale_form in ("on_query", "split") else (),
        )


@st.composite
def recipes(draw) -> Recipe:
    batch = draw(st.sampled_from(BATCHES))
    heads = draw(st.sampled_from(HEADS))
    length = draw(st.sampled_from(LENGTHS))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    sdpa = draw(st.booleans())
    traps = ("none", "none", "none", "wrong_axis", "weights_reused", "key_view")  # about one in four is a trap
    trap = "none" if sdpa else draw(st.sampled_from(traps))
    scale_form = draw(st.sampled_from(SDPA_SCALES if sdpa else EXPLICIT_SCALES))
    default_scale = scale_form in ("sdpa_default", "div_sqrt")
    scale = head_dim**-0.5 if default_scale else draw(st.sampled_from(SCALES))
    layout = "BHND" if sdpa or trap == "key_view" else draw(st.sampled_from(("BHND", "key_BNHD", "bmm3d")))
    masks = SDPA_MASKS if sdpa else EXPLICIT_MASKS
    if layout == "bmm3d":  # a [B, 1, 1, N] padding mask does not broadcast over [B*H, N, N]
        masks = tuple(m for m in masks if m != "input_padding")
    mask = draw(st.sampled_from(masks))
    window = draw(st.integers(2, 5)) if mask in WINDOW_MASKS else None
    gqa = draw(st.sampled_from(("none", "repeat_interleave", "repeat_kv") + (("enable_gqa",) if sdpa else ())))
    groups_ok = [h for h in range(1, heads) if heads % h == 0 and h != batch]
    kv_heads = heads if gqa == "none" else draw(st.sampled_from(groups_ok))
    return Recipe(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        length=length,
        head_dim=head_dim,
        scale_form=scale_form,
        scale=scale,
        mask=mask,
        window=window,
        layout=layout,
        gqa=gqa,
        cast=False if sdpa else draw(st.booleans()),
        dropout=draw(st.booleans()),
        trap=trap,
        wrong_dim=draw(st.sampled_from((1, -2))),
    )


def _causal_keep_NN(n: int, window: Optional[int]) -> torch.Tensor:
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    keep = j <= i
    if window is not None:
        keep = keep & (j > i - window)
    return keep


class GeneratedAttention(nn.Module):
    """Projections plus attention spelled exactly as the recipe says."""

    def __init__(self, recipe: Recipe):
        super().__init__()
        self.recipe = recipe
        r = recipe
        hidden = r.heads * r.head_dim
        self.q_proj = nn.Linear(hidden, r.heads * r.head_dim)
        self.k_proj = nn.Linear(hidden, r.kv_heads * r.head_dim)
        self.v_proj = nn.Linear(hidden, r.kv_heads * r.head_dim)
        self.o_proj = nn.Linear(r.heads * r.head_dim, hidden)

    def _expand_heads(self, x_BHkvXY: torch.Tensor) -> torch.Tensor:
        groups = self.recipe.heads // self.recipe.kv_heads
        if self.recipe.gqa == "repeat_interleave":
            return x_BHkvXY.repeat_interleave(groups, dim=1)
        if self.recipe.gqa == "repeat_kv":
            return repeat_kv(x_BHkvXY, groups)
        return x_BHkvXY

    def forward(self, x_BNX: torch.Tensor, mask: Optional[torch.Tensor] = None):
        r = self.recipe
        b, n, _ = x_BNX.shape
        q = self.q_proj(x_BNX).view(b, n, r.heads, r.head_dim).transpose(1, 2)
        k_BNHkvD = self.k_proj(x_BNX).view(b, n, r.kv_heads, r.head_dim)
        v = self.v_proj(x_BNX).view(b, n, r.kv_heads, r.head_dim).transpose(1, 2)
        if r.sdpa:
            out = self._sdpa(q, k_BNHkvD.transpose(1, 2), v, mask)
        else:
            out, probs = self._explicit(q, k_BNHkvD, v, mask)
        y = self.o_proj(out.transpose(1, 2).reshape(b, n, r.heads * r.head_dim))
        return (y, probs) if r.trap == "weights_reused" else y

    def _sdpa(self, q, k, v, mask):
        r = self.recipe
        n = q.shape[-2]
        attn_mask = None
        if r.mask in ("bool_tril", "bool_window"):
            attn_mask = _causal_keep_NN(n, r.window)
        elif r.mask in ("input_padding", "input_additive"):
            attn_mask = mask
        if r.gqa != "enable_gqa":
            k, v = self._expand_heads(k), self._expand_heads(v)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=0.1 if (r.dropout and self.training) else 0.0,
            is_causal=r.mask == "is_causal",
            scale=r.scale if r.scale_form == "sdpa_scale" else None,
            enable_gqa=r.gqa == "enable_gqa",
        )

    def _explicit(self, q, k_BNHkvD, v, mask):
        r = self.recipe
        b, n = q.shape[0], q.shape[2]
        if r.layout == "key_BNHD":
            k_t = k_BNHkvD.permute(0, 2, 3, 1)
        elif r.trap == "key_view":
            k_t = k_BNHkvD.transpose(1, 2).reshape(b, r.kv_heads, r.head_dim, n)  # a view, not kᵀ
        else:
            k_t = k_BNHkvD.transpose(1, 2).transpose(-2, -1)
        k_t, v = self._expand_heads(k_t), self._expand_heads(v)
        if r.scale_form == "on_query":
            q = q * r.scale
        elif r.scale_form == "split":
            q, k_t = q * math.sqrt(r.scale), k_t * math.sqrt(r.scale)
        if r.layout == "bmm3d":
            q = q.reshape(b * r.heads, n, r.head_dim)
            k_t = k_t.reshape(b * r.heads, r.head_dim, n)
            v = v.reshape(b * r.heads, n, r.head_dim)
            scores = torch.bmm(q, k_t)
        else:
            scores = q @ k_t
        if r.scale_form == "div_sqrt":
            scores = scores / math.sqrt(r.head_dim)
        elif r.scale_form == "mul":
            scores = scores * r.scale
        scores = self._mask(scores, mask)
        if r.cast:
            scores = scores.to(torch.float64)
        probs = F.softmax(scores, dim=r.wrong_dim if r.trap == "wrong_axis" else -1)
        if r.cast:
            probs = probs.to(torch.float32)
        if r.dropout:
            probs = F.dropout(probs, p=0.1, training=self.training)
        out = torch.bmm(probs, v) if r.layout == "bmm3d" else probs @ v
        return out.reshape(b, r.heads, n, r.head_dim), probs

    def _mask(self, scores, mask):
        r = self.recipe
        n = scores.shape[-1]
        if r.mask in ("masked_fill_tril", "masked_fill_window"):
            return scores.masked_fill(~_causal_keep_NN(n, r.window), NEG_INF)
        if r.mask == "where_tril":
            return torch.where(_causal_keep_NN(n, None), scores, torch.tensor(NEG_INF))
        if r.mask in ("additive_built", "additive_built_commuted"):
            additive = torch.full((n, n), NEG_INF).triu(1)
            return additive + scores if r.mask == "additive_built_commuted" else scores + additive
        if r.mask == "input_padding":
            return scores.masked_fill(~mask, NEG_INF)
        if r.mask == "input_additive":
            return scores + mask
        return scores


def build(recipe: Recipe, seed: int = 0) -> tuple[nn.Module, tuple]:
    """The seeded module in eval mode and its inputs (x, plus the mask when it is an input)."""
    torch.manual_seed(seed)
    module = GeneratedAttention(recipe).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(recipe.batch, recipe.length, recipe.heads * recipe.head_dim, generator=gen)
    if recipe.mask == "input_additive":
        # causal on this example on purpose: an input must still not be called causal
        return module, (x, torch.full((recipe.length, recipe.length), NEG_INF).triu(1))
    if recipe.mask == "input_padding":
        keep = torch.ones(recipe.batch, 1, 1, recipe.length, dtype=torch.bool)
        keep[-1, ..., recipe.length - 2 :] = False
        return module, (x, keep)
    return module, (x,)


def reference(recipe: Recipe, module: GeneratedAttention, inputs: tuple) -> torch.Tensor:
    """The output recomputed with SDPA from the recipe's truth alone."""
    truth = recipe.truth()
    x = inputs[0]
    b, n, _ = x.shape
    q = module.q_proj(x).view(b, n, truth.heads, truth.head_dim).transpose(1, 2)
    k = module.k_proj(x).view(b, n, truth.kv_heads, truth.head_dim).transpose(1, 2)
    v = module.v_proj(x).view(b, n, truth.kv_heads, truth.head_dim).transpose(1, 2)
    groups = truth.heads // truth.kv_heads
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    keep = _causal_keep_NN(n, truth.window) if truth.causal else torch.ones(n, n, dtype=torch.bool)
    mask = torch.zeros(n, n).masked_fill(~keep, NEG_INF)
    if truth.padding:
        mask = mask.masked_fill(~inputs[1], NEG_INF)
    if truth.arbitrary:
        mask = mask + inputs[1]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=truth.scale)
    return module.o_proj(out.transpose(1, 2).reshape(b, n, -1))


def check_recipe(recipe: Recipe) -> None:
    module, inputs = build(recipe)
    if recipe.trap == "none":
        with torch.no_grad():
            torch.testing.assert_close(module(*inputs), reference(recipe, module, inputs), msg=repr(recipe))
    inspection = inspect(module, *inputs, dynamic=False)
    if recipe.trap != "none":
        assert inspection.sites == [], f"trap taken as a site: {recipe}"
        assert [m.code for m in inspection.near_misses] == [TRAP_CODES[recipe.trap]], recipe
        assert inspection.near_misses[0].reason
        return
    assert len(inspection.sites) == 1, (recipe, [(m.code, m.reason) for m in inspection.near_misses])
    assert inspection.near_misses == [], recipe
    try:
        assert_site_matches(inspection.sites[0], recipe.truth(), batch=recipe.batch)
    except AssertionError as err:
        raise AssertionError(f"{recipe}\n{inspection.sites[0]}") from err
    error = site_output_error(inspection, inspection.sites[0])
    assert error < 1e-4, f"site rebuilt from its nodes is off by {error:.3g}: {recipe}"


def drawn_recipes(n: int = EXAMPLES) -> list:
    """The first n recipes hypothesis draws, derandomized: the same list on every run and worker."""
    drawn = []

    @settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(recipes())
    def draw(recipe):
        drawn.append(recipe)

    draw()
    return drawn[:n]


def spelling_tags(recipe: Recipe) -> set:
    """The families a sample must cover: every field's value, and mask and GQA per source (SDPA and
    an explicit chain spell "none", the input masks and repeat_kv differently)."""
    tags = {f"{f.name}={value}" for f, value in zip(fields(Recipe), astuple(recipe))}
    source = "sdpa" if recipe.sdpa else "explicit"
    return tags | {f"{source}/mask={recipe.mask}", f"{source}/gqa={recipe.gqa}", f"{source}/layout={recipe.layout}"}


def _case_id(recipe: Recipe) -> str:
    return "-".join((recipe.scale_form, recipe.mask, recipe.layout, recipe.gqa, recipe.trap))


RECIPES = drawn_recipes()


def test_drawn_recipes_cover_every_spelling():
    """The draw itself: 200 recipes, traps really exercised, every mask spelling present."""
    assert len(RECIPES) == EXAMPLES
    assert sum(r.trap != "none" for r in RECIPES) >= 20
    assert {r.mask for r in RECIPES} == set(SDPA_MASKS) | set(EXPLICIT_MASKS)
    assert {r.scale_form for r in RECIPES} == set(SDPA_SCALES) | set(EXPLICIT_SCALES)
    assert {r.trap for r in RECIPES} == {"none"} | set(TRAP_CODES)


def test_the_default_sample_covers_every_family_of_the_draw(covering_sample):
    """40 recipes, and every tag any of the 200 carries is carried by one of them."""
    tag_sets = [spelling_tags(r) for r in RECIPES]
    sample = covering_sample(tag_sets, SAMPLE, seed=0)
    assert len(sample) == SAMPLE and len(set(sample)) == SAMPLE
    assert set().union(*(tag_sets[i] for i in sample)) == set().union(*tag_sets)
    assert covering_sample(tag_sets, SAMPLE, seed=0) == sample  # fixed


@pytest.mark.sampled(SAMPLE, seed=0, tags=lambda params: spelling_tags(params["recipe"]))
@pytest.mark.parametrize("recipe", RECIPES, ids=[f"{i:03d}-{_case_id(r)}" for i, r in enumerate(RECIPES)])
def test_generated_spelling(recipe):
    """A drawn model is a correct site or, for a trap, exactly the expected near miss."""
    check_recipe(recipe)


def test_ground_truth_reference_detects_a_wrong_scale():
    """The self-check can fail: a recipe whose stated scale is off no longer matches its module."""
    recipe = Recipe(3, 6, 2, 11, 8, "mul", 0.25, "masked_fill_tril", None, "BHND", "repeat_kv", False, False, "none")
    module, inputs = build(recipe)
    wrong = Recipe(3, 6, 2, 11, 8, "mul", 0.3, "masked_fill_tril", None, "BHND", "repeat_kv", False, False, "none")
    with torch.no_grad():
        torch.testing.assert_close(module(*inputs), reference(recipe, module, inputs))
        assert (module(*inputs) - reference(wrong, module, inputs)).abs().max() > 1e-4
