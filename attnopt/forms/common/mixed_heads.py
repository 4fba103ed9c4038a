"""Per-head sites: some KV-head groups stay exact softmax attention, the others take a cheap form.

DuoAttention and the retrieval-head studies find that a few heads do a model's long-range lookup;
keeping those exact and making the rest cheap keeps the lookup at a fraction of the KV cache. A
site with `exact_heads` (KV-head indices; each brings its G = H / Hkv query heads) is a
`MixedHeadsSite`: it splits q, k and v by KV group, runs the exact heads as plain softmax attention
and the others through an inner site module of the form, built for the reduced geometry (the
remaining KV heads and their query heads) -- so every form works unchanged -- and merges the
outputs in head order. Its decode state is the inner form's state plus the exact heads' own K/V.

    build_site(form, site, params, context)   the site module (mixed when params name exact heads)
    fit_site(form, module, calls)             the form's fit, on the module's own heads only
    site_cost / state_bytes                   the cost model and decode memory, exact heads counted exact
    MIXED_STEP                                the site in an exported decode graph (forms/common/graph.py)

Letters: B batch, H query heads, Hkv KV heads, He / Hc query heads kept exact / cheap, Ke / Kc KV
heads kept exact / cheap, G = H / Hkv, Nq / Nk query / key columns, D / Dv head dims.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from attnopt import forms
from attnopt.forms.common.base import HEAD_PARAMS, BuildContext, CostAt, Form, SiteGeometry, SiteModule
from attnopt.forms.common.decoding import kv_cache_bytes
from attnopt.forms.common.graph import GraphStep, StepSite
from attnopt.forms.ssm.form import decay_vector
from attnopt.ir.calls import SiteCall
from attnopt.ir.site import AttentionSite


# ---------------------------------------------------------------- geometry


@dataclass(frozen=True)
class HeadSplit:
    """Which query and KV heads are exact and which cheap (query head h belongs to KV head h // G, as
    transformers' repeat_kv and SDPA's enable_gqa lay them out)."""

    heads: int
    kv_heads: int
    exact_kv: tuple

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def cheap_kv(self) -> tuple:
        return tuple(j for j in range(self.kv_heads) if j not in self.exact_kv)

    def query_heads(self, kv: tuple) -> tuple:
        G = self.groups
        return tuple(h for j in kv for h in range(j * G, (j + 1) * G))

    @property
    def exact_q(self) -> tuple:
        return self.query_heads(self.exact_kv)

    @property
    def cheap_q(self) -> tuple:
        return self.query_heads(self.cheap_kv)

    def merge_order(self) -> list:
        """out_BHND = cat([exact heads, cheap heads], 1)[:, order]: each head's place in that cat."""
        placed = list(self.exact_q) + list(self.cheap_q)
        return [placed.index(h) for h in range(self.heads)]


def cheap_site(site: AttentionSite, split: HeadSplit) -> AttentionSite:
    """The site as its cheap heads alone see it: the remaining KV heads and their query heads."""
    return dataclasses.replace(site, heads=len(split.cheap_q), kv_heads=len(split.cheap_kv))


def inner_params(params: Mapping[str, Any], form: str = "", split: Optional[HeadSplit] = None) -> dict:
    """The inner form's parameters: no per-head keys, and no exact prefix of its own (the mixed site
    runs min_seq_len for all its heads, as any site does)."""
    out = {**{k: v for k, v in params.items() if k not in HEAD_PARAMS}, "min_seq_len": 0}
    if form == "ssm" and split is not None:
        # ssm's decays are a schedule over head indices (RetNet's 1 − 2^(−5−h)): each cheap head keeps
        # the decay it has in the whole site, not the one of its index among the cheap heads.
        decays = decay_vector(out["decay"], split.heads)
        out["decay"] = [float(decays[h]) for h in split.cheap_q]
    return out


# ---------------------------------------------------------------- exact heads


def visible_keys(geometry: SiteGeometry, keep: Optional[Tensor], Nq: int, Nk: int, device) -> Optional[Tensor]:
    """Bool [B or 1, 1, Nq, Nk]: causality (the queries are the last Nq columns), the model's own
    window, padding; None when every key is visible to every query."""
    g = geometry
    band = None
    if g.causal or g.model_window is not None:
        col_q = (Nk - Nq) + torch.arange(Nq, device=device)[:, None]
        col_k = torch.arange(Nk, device=device)[None, :]
        band = col_k <= col_q if g.causal else torch.ones(Nq, Nk, dtype=torch.bool, device=device)
        if g.model_window is not None:
            W = g.model_window
            band = band & (col_k > col_q - W) if g.causal else band & ((col_k - col_q).abs() < W)
        band = band[None, None]
    if keep is None:
        return band
    padding = keep[:, None, None, :]
    return padding if band is None else padding & band


def softmax_heads(geometry: SiteGeometry, q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor]) -> Tensor:
    """Softmax attention of these heads from the site's geometry and key padding alone (never its mask
    tensor, so a prefill, a decoding step and an exporter's padding-only mask agree); a query that
    sees no key (a pad row) gets 0."""
    g = geometry
    Nq, Nk = q.shape[2], k.shape[2]
    G = q.shape[1] // k.shape[1]
    if G > 1:  # repeated, not enable_gqa: the exporters lower repeat_interleave everywhere
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    k, v = k.to(q.dtype), v.to(q.dtype)
    static = isinstance(Nq, int) and isinstance(Nk, int)  # (traced with dynamic shapes: the mask, any length)
    if keep is None and g.model_window is None and static and (not g.causal or Nq == Nk or Nq == 1):
        # (one query, the last column, sees every key: no mask at all on the decoding step)
        return F.scaled_dot_product_attention(q, k, v, is_causal=g.causal and Nq == Nk > 1, scale=g.scale)
    visible = visible_keys(g, keep, Nq, Nk, q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=g.scale)
    return torch.where(visible.any(-1, keepdim=True), out, 0.0) if keep is not None else out


# ---------------------------------------------------------------- the site module


@dataclass
class MixedState:
    """A mixed site's decode state: the cheap heads' form state and the exact heads' K/V of every
    column so far, with each column's keep flag (pads included, hidden by it)."""

    inner: Any
    k_BKeND: Tensor
    v_BKeND: Tensor
    keep_BN: Tensor
    # No column was ever padding: the exact heads need no mask (a Python flag, so a decoding step
    # neither scans keep_BN nor branches on tensor data under torch.compile)
    all_kept: bool = False


class MixedHeadsSite(SiteModule):
    """A site whose `exact_heads` KV groups run exact softmax attention and the rest `inner`'s form."""

    attend_output_is_fresh = True

    def __init__(self, site: AttentionSite, params: Mapping[str, Any], inner: SiteModule):
        super().__init__(site, params)
        self.split = HeadSplit(site.heads, site.kv_heads, tuple(params["exact_heads"]))
        self.form = inner.form  # the site runs its form; its params say which heads stay exact
        inner.nested = True  # one site: Target.site_modules and the save list name the wrapper only
        self.inner = inner
        # The exporters give a [B, 1, 1, Nk] keep mask when every part reads only padding: the exact
        # heads derive causality and the model's window from the geometry, never from the mask.
        self.reads_padding_only = inner.reads_padding_only
        s = self.split
        for name, index in (("exact_q", s.exact_q), ("cheap_q", s.cheap_q), ("exact_kv", s.exact_kv),
                            ("cheap_kv", s.cheap_kv), ("order", s.merge_order())):
            self.register_buffer(f"{name}_index", torch.tensor(index, dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"site={self.geometry.site_id!r}, form={self.form!r}, exact KV heads {list(self.split.exact_kv)}"

    @property
    def exact_heads(self) -> list:
        return list(self.split.exact_kv)

    @property
    def decodes(self) -> bool:
        return self.geometry.causal and self.inner.decodes

    # -- splitting and merging

    def parts(self, q: Tensor, k: Tensor, v: Tensor) -> tuple:
        """(q, k, v) of the exact heads, then of the cheap heads."""
        return (q.index_select(1, self.exact_q_index), k.index_select(1, self.exact_kv_index),
                v.index_select(1, self.exact_kv_index), q.index_select(1, self.cheap_q_index),
                k.index_select(1, self.cheap_kv_index), v.index_select(1, self.cheap_kv_index))

    def merge(self, exact_out: Tensor, cheap_out: Tensor, dtype: torch.dtype, head_dim: int = 1) -> Tensor:
        both = torch.cat([exact_out.to(dtype), cheap_out.to(dtype)], dim=head_dim)
        return both.index_select(head_dim, self.order_index)

    def cheap_mask(self, mask: Optional[Tensor]) -> Optional[Tensor]:
        """The mask as the cheap heads' module sees it: a per-head mask keeps their heads."""
        if mask is not None and mask.dim() == 4 and mask.shape[1] == self.geometry.heads > 1:
            return mask.index_select(1, self.cheap_q_index)
        return mask

    # -- the exact heads

    def exact_part(self, q: Tensor, k: Tensor, v: Tensor, keep: Optional[Tensor]) -> Tensor:
        return softmax_heads(self.geometry, q, k, v, keep)

    # -- SiteModule's hooks

    def attend(self, q, k, v, keep, mask, x):
        q_e, k_e, v_e, q_c, k_c, v_c = self.parts(q, k, v)
        cheap = self.inner.attend(q_c, k_c, v_c, keep, self.cheap_mask(mask), x)
        return self.merge(self.exact_part(q_e, k_e, v_e, keep), cheap, q.dtype)

    def decode_step(self, q, k, v, keep, form_state):
        """The inner form's state for the cheap heads; the exact heads' K/V grows by the new columns."""
        q_e, k_e, v_e, q_c, k_c, v_c = self.parts(q, k, v)
        cheap, inner = self.inner.decode_step(q_c, k_c, v_c, keep, None if form_state is None else form_state.inner)
        keep_BN = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if keep is None else keep
        if form_state is not None:
            k_e = torch.cat([form_state.k_BKeND, k_e], dim=2)
            v_e = torch.cat([form_state.v_BKeND, v_e], dim=2)
            keep_BN = torch.cat([form_state.keep_BN, keep_BN], dim=1)
        # (`decode` hands every step after the prefill a keep tensor, all ones when nothing was padded:
        # asked outside torch.compile only, where a data-dependent branch would break the graph)
        fresh_kept = keep is None or (not torch.compiler.is_compiling() and bool(keep.all()))
        all_kept = fresh_kept and (form_state is None or form_state.all_kept)
        if all_kept and q_e.shape[2] == 1 and self.geometry.model_window is None:
            exact = grouped_step(self.geometry.scale, q_e, k_e, v_e)  # a decoding step: the cache read in place
        else:
            exact = self.exact_part(q_e, k_e, v_e, None if all_kept else keep_BN)
        return self.merge(exact, cheap, q.dtype), MixedState(inner, k_e, v_e, keep_BN, all_kept)

    def token_stepper(self, form_state, q, k):
        inner = self.inner.token_stepper(form_state.inner, q.index_select(1, self.cheap_q_index),
                                         k.index_select(1, self.cheap_kv_index))
        return None if inner is None else MixedStepper(self, form_state, inner, q.dtype)

    def graph_step(self) -> GraphStep:
        return MIXED_STEP


class MixedStepper:
    """The cache layer's one-token step (no padding, past min_seq_len): the inner form's in-place step
    for the cheap heads, one appended column and SDPA over the cached keys for the exact heads.
    Returns [B, 1, H, Dv]; `state` is the MixedState it advances."""

    def __init__(self, site: MixedHeadsSite, state: MixedState, inner, q_dtype):
        self.site, self.state, self.inner, self.q_dtype = site, state, inner, q_dtype

    def __call__(self, q, k, v):
        s, state = self.site, self.state
        q_e, k_e, v_e, q_c, k_c, v_c = s.parts(q, k, v)
        cheap = self.inner(q_c, k_c, v_c)  # [B, 1, Hc, Dv]
        state.inner = self.inner.state
        state.k_BKeND = torch.cat([state.k_BKeND, k_e.to(state.k_BKeND.dtype)], dim=2)
        state.v_BKeND = torch.cat([state.v_BKeND, v_e.to(state.v_BKeND.dtype)], dim=2)
        state.keep_BN = torch.cat([state.keep_BN, state.keep_BN.new_ones(state.keep_BN.shape[0], 1)], dim=1)
        if s.geometry.model_window is None:
            exact = grouped_step(s.geometry.scale, q_e, state.k_BKeND, state.v_BKeND).transpose(1, 2)
        else:  # the model's window needs the column count
            exact = s.exact_part(q_e, state.k_BKeND, state.v_BKeND, state.keep_BN).transpose(1, 2)
        return s.merge(exact, cheap, q.dtype, head_dim=2)


def grouped_step(scale: float, q_BHe1D: Tensor, k_BKeND: Tensor, v_BKeND: Tensor) -> Tensor:
    """Softmax attention of one query per head over every cached key, [B, He, 1, Dv]. Why not
    softmax_heads: its repeat_interleave copies the whole K/V cache G times on every step; here each
    KV head's G query heads are G query rows of one SDPA call over that head's keys (one query column
    sees every key, so no mask), which reads the cache in place."""
    B, He, _, D = q_BHe1D.shape
    Ke = k_BKeND.shape[1]
    q_BKeGD = q_BHe1D.reshape(B, Ke, He // Ke, D)
    out = F.scaled_dot_product_attention(q_BKeGD, k_BKeND.to(q_BHe1D.dtype), v_BKeND.to(q_BHe1D.dtype), scale=scale)
    return out.reshape(B, He, 1, out.shape[-1])


# ---------------------------------------------------------------- building, fitting, costing


def build_site(form: Form, site: AttentionSite, params: Mapping[str, Any], context: Optional[BuildContext]) -> SiteModule:
    """`form`'s site module for `site`: a MixedHeadsSite when `params` name exact heads, else the
    form's own. Every caller that builds a site module from saved or planned params goes through here."""
    heads = params.get("exact_heads")
    if not heads:
        return form.build(site, params, context)
    split = HeadSplit(site.heads, site.kv_heads, tuple(heads))
    inner = form.build(cheap_site(site, split), inner_params(params, form.name, split), context)
    return MixedHeadsSite(site, params, inner)


def fit_site(form: Form, module: SiteModule, calls: list):
    """`form.fit` on the module's own tensors: a mixed site's inner module on its cheap heads' calls."""
    if isinstance(module, MixedHeadsSite):
        return form.fit(module.inner, [cheap_call(module, c) for c in calls])
    return form.fit(module, calls)


def cheap_call(module: MixedHeadsSite, call: SiteCall) -> SiteCall:
    """A recorded call of the whole site as the cheap heads saw it (4-D, their heads only)."""
    q, k, v, out, mask = call.q, call.k, call.v, call.out, call.mask
    if q.dim() == 3:  # bmm spelling [B*H, N, D]
        q, k, v, out = (module.unfold_heads(t) for t in (q, k, v, out))
        if mask is not None and mask.dim() == 3 and mask.shape[0] == q.shape[0] * q.shape[1]:
            mask = mask.reshape(q.shape[0], q.shape[1], *mask.shape[1:])
    _, _, _, q_c, k_c, v_c = module.parts(q, k, v)
    return dataclasses.replace(call, q=q_c, k=k_c, v=v_c, out=out.index_select(1, module.cheap_q_index),
                               mask=module.cheap_mask(mask))


def _exact_only(site: AttentionSite, split: HeadSplit) -> AttentionSite:
    return dataclasses.replace(site, heads=len(split.exact_q), kv_heads=len(split.exact_kv))


def site_cost(form: Form, site: AttentionSite, params: Mapping[str, Any], B: int, Nq: int, Nk: int) -> CostAt:
    """`form.cost`, with a mixed site's exact heads costed as exact attention."""
    heads = params.get("exact_heads")
    if not heads:
        return form.cost(site, params, B, Nq, Nk)
    split = HeadSplit(site.heads, site.kv_heads, tuple(heads))
    cheap = form.cost(cheap_site(site, split), inner_params(params, form.name, split), B, Nq, Nk)
    exact = forms.get("exact").cost(_exact_only(site, split), {}, B, Nq, Nk)
    return CostAt(cheap.flops + exact.flops, cheap.elements + exact.elements)


def state_bytes(form: Form, site: AttentionSite, params: Mapping[str, Any], context: int, element_bytes: int) -> int:
    """`form.decode_state_bytes`, with a mixed site's exact heads holding their K/V cache."""
    heads = params.get("exact_heads")
    if not heads:
        return form.decode_state_bytes(site, params, context, element_bytes)
    split = HeadSplit(site.heads, site.kv_heads, tuple(heads))
    inner = {**inner_params(params, form.name, split), "min_seq_len": params.get("min_seq_len") or 0}
    cheap = form.decode_state_bytes(cheap_site(site, split), inner, context, element_bytes)
    D, Dv = site.head_dim, site.v_head_dim or site.head_dim
    exact = kv_cache_bytes(len(split.exact_kv), D, Dv, context, element_bytes)
    T = int(params.get("min_seq_len") or 0)
    if context < T:  # the cheap part's own exact prefix counted the exact heads already
        exact = 0
    return cheap + exact


def exact_heads_of(module) -> list:
    """The KV-head indices a site module keeps exact ([] for a module of one form)."""
    return list(module.split.exact_kv) if isinstance(module, MixedHeadsSite) else []


# ---------------------------------------------------------------- in an exported decode graph


def _inner_step_site(site: StepSite) -> StepSite:
    m: MixedHeadsSite = site.module
    g = site.geometry
    geometry = dataclasses.replace(g, heads=len(m.split.cheap_q), kv_heads=len(m.split.cheap_kv))
    return StepSite(m.inner, geometry, None, False)


def _exact_step_site(site: StepSite) -> StepSite:
    m: MixedHeadsSite = site.module
    geometry = dataclasses.replace(site.geometry, heads=len(m.split.exact_q), kv_heads=len(m.split.exact_kv),
                                   scale=float(m.geometry.scale))
    return StepSite(None, geometry, None, False)


def _inner_step(site: StepSite) -> GraphStep:
    return forms.get(site.module.inner.form).graph_step()


def _exact_step() -> GraphStep:
    return forms.get("exact").graph_step()


def _states(site: StepSite) -> list:
    """The cheap heads' form states, then the exact heads' growing key and value."""
    return [*_inner_step(site).states(_inner_step_site(site)), *_exact_step().states(_exact_step_site(site))]


def _call(site: StepSite, q, k, v, mask, pasts):
    m: MixedHeadsSite = site.module
    n = len(pasts) - 2
    q_e, k_e, v_e, q_c, k_c, v_c = m.parts(q, k, v)
    cheap, presents = _inner_step(site).call(_inner_step_site(site), q_c, k_c, v_c, mask, list(pasts[:n]))
    exact, kv = _exact_step().call(_exact_step_site(site), q_e, k_e, v_e, mask, list(pasts[n:]))
    return m.merge(exact, cheap, q.dtype), [*presents, *kv]


def _why_not(site: StepSite) -> Optional[str]:
    if site.module.geometry.model_window is not None:
        return ("its exact heads sit on a layer that slides the model's own window, and exact's decode step "
                "keeps every key; compile this layer without exact_heads to export it")
    inner = _inner_step(site)
    if inner is None:
        return f"form {site.module.inner.form!r} has no decode step for an exported graph"
    return inner.why_not(_inner_step_site(site)) if inner.why_not is not None else None


MIXED_STEP = GraphStep(states=_states, call=_call, why_not=_why_not)


def graph_step_of(module, form: str) -> Optional[GraphStep]:
    """How a site runs in an exported decode graph: a per-head site's MIXED_STEP, else `form`'s step."""
    if isinstance(module, MixedHeadsSite):
        return MIXED_STEP
    return forms.get(form).graph_step()


def step_forms(module, form: str) -> tuple:
    """The forms whose decode-step lowerings a site's graph step calls (a per-head site: its form and exact)."""
    return (form, "exact") if isinstance(module, MixedHeadsSite) else (form,)
