"""reuse: a layer reads only the key blocks its anchor found, with its own q, k and v.

Anchor layers compute exact attention; the layers that reuse one attend, block-sparse, to the blocks
its attention mass picked (selection.py: sinks, a local window and the top_k blocks by the anchor's
probe queries), O(N·K·b) per layer instead of O(N²). The anchor's selection is the pattern already
found; the reused layer's own scores on those blocks are the residual. Which layers anchor: given
(`anchor`), every E layers (`every`), or measured on the example or calibration data (plan.py: the
share of a layer's attention rows whose target an earlier layer's blocks hold), first and last
layers exact.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

import torch

from attnopt.forms.common.base import CostAt, Form, Param, SiteModule, io_elements, no_arbitrary_mask
from attnopt.forms.reuse.plan import measured_plan, plan_report
from attnopt.forms.reuse.prefill import exact_under_keep, reuse_attention
from attnopt.forms.reuse.reference import block_sparse_attention
from attnopt.forms.reuse.selection import BlockRule, Selection, SelectionState, in_block_step, probe_cost, select_call
from attnopt.ir.errors import KeptByPlan, PolicyError, SiteUnsupported
from attnopt.ir.masks import key_keep, site_key_keep
from attnopt.ir.site import AttentionSite

REUSE_PARAMS = {
    "top_k": Param(int, 16, minimum=0, doc="key blocks each query block reads by the anchor's attention mass"),
    "block": Param(int, 64, minimum=1, doc="positions per key and query block"),
    "window": Param(int, 1, minimum=0, doc="blocks before the query's own (causal; each side otherwise) always read"),
    "sinks": Param(int, 1, minimum=0, doc="leading blocks always read"),
    "probes": Param((int, type(None)), None, minimum=1,
                    doc="anchor queries just before a block whose attention chooses its blocks (null: one block)"),
    "mass": Param((float, type(None)), None, above=0.0, maximum=1.0,
                  doc="stop choosing once the blocks read hold this share of the probes' mass (null: top_k)"),
    "anchor": Param((int, type(None)), None, doc="the layer whose selection is read (negative: layers back); "
                                                  "null: every or measured"),
    "every": Param((int, type(None)), None, minimum=1, doc="an anchor every E layers (0, E, 2E, ...); null: measured"),
    "overlap": Param(float, 0.95, minimum=0.0, maximum=1.0,
                     doc="measured plan: least share of a layer's attention rows (its worst head) where no block "
                         "the anchor leaves out holds 30% of the row's mass"),
}


def rule_of(params: Mapping[str, Any], causal: bool, exact_below: int = 0) -> BlockRule:
    probes = params["block"] if params["probes"] is None else params["probes"]
    return BlockRule(block=params["block"], top_k=params["top_k"], window=params["window"], sinks=params["sinks"],
                     probes=probes, causal=bool(causal), mass=params["mass"], exact_below=int(exact_below))


def anchor_layer(site: AttentionSite, params: Mapping[str, Any]) -> Optional[int]:
    """The anchor's layer a rule names (`anchor`, or the last multiple of `every`); None: measured."""
    if params["anchor"] is not None:
        a = params["anchor"]
        return site.layer + a if a < 0 else a
    if params["every"] is not None:
        return site.layer - site.layer % params["every"]
    return None


def same_sequence(a: AttentionSite, b: AttentionSite) -> bool:
    """Whether b's attention runs over a's positions (a selection of one applies to the other)."""
    return str(a.q_len) == str(b.q_len) and str(a.kv_len) == str(b.kv_len) and a.causal == b.causal


def can_anchor(site: AttentionSite) -> bool:
    """Whether `site` can select for later layers: not one whose model slides its own window (its KV
    cache then holds only the window, so decoding could not read the blocks it selects)."""
    return site.window is None


def find_site(site: AttentionSite, sites: Sequence[AttentionSite], layer: int) -> Optional[AttentionSite]:
    return next((s for s in sites if s.layer == layer and same_sequence(site, s)), None)


class ReusedSite(SiteModule):
    """Block-sparse attention of this layer's q, k, v over the blocks its anchor selects.

    Called with `anchor=`: the anchor's (q, k) of the same call (a prefill; the selection is made
    here), or a `Selection` the mechanism made (decoding keeps the selection state in the cache).
    """

    form = "reuse"
    uses_anchor_qk = True
    reads_padding_only = True
    attend_output_is_fresh = True

    def __init__(self, site: AttentionSite, params: Mapping[str, Any], anchor: Optional[AttentionSite],
                 candidates: Mapping[int, tuple]):
        super().__init__(site, params)  # (sets min_seq_len, and so the rule)
        # layer -> (site id, scale, heads, head dim) of the sites this one may read
        self.anchor_candidates = dict(candidates)
        # The anchor's layer, saved with the module (a measured plan cannot be measured again at load),
        # and kept as a Python int too: graphs read it while tracing, where the buffer has no value.
        self.register_buffer("anchor_layer", torch.tensor(-1 if anchor is None else anchor.layer))
        self._anchor = -1 if anchor is None else anchor.layer

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "anchor_layer" in state_dict:
            self._anchor = int(state_dict[prefix + "anchor_layer"])

    @property
    def min_seq_len(self) -> int:
        return self._min_seq_len

    @min_seq_len.setter
    def min_seq_len(self, value: int) -> None:
        """Dispatch sets it after the build: the selection rule follows, leaving the positions below it
        unscored (they attend exactly)."""
        self._min_seq_len = int(value)
        self.rule = rule_of(self.params, self.geometry.causal, self._min_seq_len)

    @property
    def anchor_id(self) -> Optional[str]:  # type: ignore[override]
        return self.anchor_candidates.get(self._anchor, (None, None))[0]

    @anchor_id.setter
    def anchor_id(self, value) -> None:  # SiteModule.__init__ sets None; the buffer decides
        pass

    @property
    def anchor_scale(self) -> float:
        """The anchor's softmax scale: its probes' attention is the anchor's own."""
        return float(self.anchor_candidates.get(self._anchor, (None, self.geometry.scale))[1])

    @property
    def anchor_shape(self) -> Optional[tuple]:
        """(heads, head dim) of the anchor's queries (None while the anchor is unknown)."""
        got = self.anchor_candidates.get(self._anchor)
        return None if got is None else (got[2], got[3])

    def select(self, q_a: torch.Tensor, k_a: torch.Tensor, keep: Optional[torch.Tensor], state=None):
        """(Selection, state after) for the last Nq columns of a call: selection.select_call under this rule."""
        return select_call(q_a, k_a, keep, self.rule, self.anchor_scale, state)

    def select_for(self, q_a: torch.Tensor, k_a: torch.Tensor, mask: Optional[torch.Tensor], state=None):
        """`select` with the site's own mask (the mechanism's spelling) read for its key padding."""
        keep = key_keep(mask, self.geometry.keep_when, q_a.shape[0], k_a.shape[-2]) if mask is not None else None
        if keep is not None and bool(keep.all()):
            keep = None
        return self.select(q_a, k_a, keep, state)

    def forward(self, q, k, v, mask=None, x=None, anchor=None, slab=None):
        """`slab`: a decoding cache layer's BlockSlab (decoding.py), where a one-token step reads its blocks.
        Under min_seq_len = T the queries among each row's first T real tokens attend exactly (as
        SiteModule.forward does); the selection still advances, so decoding past T reads its lists."""
        g = self.geometry
        T = self.min_seq_len
        if (T and not g.causal and q.shape[-2] < T) or self.biased(mask):
            return self.exact(q, k, v, mask)
        folded = q.dim() == 3
        if folded:
            q, k, v = self.unfold_heads(q), self.unfold_heads(k), self.unfold_heads(v)
        if (slab is not None and not folded and isinstance(anchor, Selection) and q.shape[2] == 1 and anchor.dense
                and not q.requires_grad and not self.rule.reads_everything(k.shape[-2])
                and (not T or self._past_threshold(k.shape[-2], anchor.offsets_B))):
            # A decoding step whose keys are real from each row's offset on: the listed blocks' slab.
            out = slab.attend(q, k, v, anchor.blocks_BQK[:, 0], self.rule.block, g.scale, anchor.source,
                              anchor.offsets_B)
            if out is not None:
                return out
        keep = None
        if mask is not None:
            keep = site_key_keep(mask, g.keep_when, q, k.shape[-2], folded)
        mask4 = None if folded else mask
        out = self._by_threshold(q, k, v, keep, mask, folded, lambda: self._attend(q, k, v, keep, mask4, anchor))
        return out.reshape(-1, out.shape[-2], out.shape[-1]) if folded else out

    def step(self, q, k, v, q_a, k_a, held: SelectionState, slab, new: Optional[tuple] = None,
             made: Optional[dict] = None) -> Optional[tuple]:
        """The decoding hot path, (out, state after) or None where it does not apply: a one-token step
        inside a block whose list the slab already serves (so every check `forward` makes held at the
        block's first token, and holds for its rest), no padding. None leaves everything as it was.
        `new`: the newest column of k and v, [B, Hkv, 1, D], when the caller has it; `made`: a dict
        per call where the sites reading the same state share the state after."""
        key = ("step", id(held))
        got = None if made is None else made.get(key)
        if got is None:
            got = in_block_step(q_a, k_a.shape[2], self.rule, held)
            if got is None:
                return None
        out = slab.step(q, k, v, held.history_BMK, got[0], self.geometry.scale, new)
        if out is None:
            return None
        if made is not None:
            made[key] = got
        return out, got[1]

    def _past_threshold(self, Nk: int, offsets_B) -> bool:
        """Whether a one-token step's query is at or past min_seq_len in every row (position = its
        column less the row's leading padding)."""
        lead = 0 if offsets_B is None else int(offsets_B.max())
        return Nk - 1 - lead >= self.min_seq_len

    def _attend(self, q, k, v, keep, mask, anchor):
        g = self.geometry
        if torch.compiler.is_exporting() and isinstance(anchor, (tuple, list)) and len(anchor) == 2:
            # One node for the selection and the sparse softmax: its steps depend on the data (prefill.py).
            q_a, k_a = (self.unfold_heads(t) if t.dim() == 3 else t for t in anchor)
            r = self.rule
            return reuse_attention(q, k, v, keep, q_a, k_a, r.block, r.top_k, r.window, r.sinks, r.probes, r.causal,
                                   r.mass, float(g.scale), self.anchor_scale)
        if self.rule.reads_everything(k.shape[-2]):  # every block is read: exact attention, cheaper
            return self.exact(q, k, v, mask) if keep is None or mask is not None else exact_under_keep(
                q, k, v, keep, g.causal, g.scale)
        if isinstance(anchor, Selection):
            selection = anchor
        elif isinstance(anchor, (tuple, list)) and len(anchor) == 2:
            q_a, k_a = (self.unfold_heads(t) if t.dim() == 3 else t for t in anchor)
            selection, _ = self.select(q_a, k_a, keep)
        else:
            raise ValueError(f"site {g.site_id}: a reused layer needs anchor= (its anchor's q and k, or a Selection); "
                             "call the whole compiled model, not one of its layers")
        if selection.blocks_BQK.shape[1] != q.shape[2]:
            raise ValueError(f"site {g.site_id}: the anchor's selection covers {selection.blocks_BQK.shape[1]} queries, "
                             f"this call has {q.shape[2]}")
        return block_sparse_attention(q, k, v, selection.blocks_BQK, block=self.rule.block, causal=g.causal,
                                      scale=g.scale, key_mask=keep, offsets=selection.offsets_B)

    def timed_attend(self, q, k, v):
        """The op dispatch times against exact attention (passes/crossover.py): the selection made from
        this layer's own q and k, standing in for its anchor's (same cost; the anchor's is shared by the
        layers that read it, so this errs slow), then the block-sparse attention: every block scored,
        whatever min_seq_len is."""
        selection, _ = select_call(q, k, None, replace(self.rule, exact_below=0), self.anchor_scale, None)
        return self._attend(q, k, v, None, None, selection)

    def attend(self, q, k, v, keep, mask, x):  # SiteModule's contract; forward above takes the anchor
        raise ValueError(f"site {self.geometry.site_id}: a reused layer is called through forward(..., anchor=)")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, anchor={self.anchor_id!r}"


class ReuseForm(Form):
    name = "reuse"
    aliases = ("residual",)
    summary = ("attend only to the key blocks an earlier exact layer's attention selected (top_k by mass, sinks, "
               "window), O(N·K·b)")
    presets = ("reuse", "reuse:16", "reuse+block:64", "reuse+every:3")
    params = REUSE_PARAMS
    preset_arg = "top_k"
    default_tolerance = 0.8
    cost_rank = 3
    auto_params = {"anchor": -1}  # auto: read the previous layer's selection

    def check_params(self, params):
        if params["probes"] is not None and params["probes"] > params["block"]:
            raise PolicyError(f"form 'reuse': probes {params['probes']} > block {params['block']}; at most one block "
                              "of queries probes")
        if params["anchor"] is not None and params["every"] is not None:
            raise PolicyError("form 'reuse': give anchor or every, not both")

    def preset_rule(self, params):
        # First and last layers exact: the seed's observation, and what the measured plan assumes.
        anchor = params.get("anchor")
        first = 1
        if isinstance(anchor, int) and not isinstance(anchor, bool):
            first = max(1, -anchor if anchor < 0 else anchor + 1)
        return params, (first, -2)

    def unmatched_hint(self, params, layers):
        a = params.get("anchor")
        if isinstance(a, int) and not isinstance(a, bool) and (a >= layers - 2 or -a >= layers - 1):
            return (f"anchor {a} leaves no layer to reuse between it and the last layer, which stays exact "
                    f"(layers 0..{layers - 1}); give an anchor from 0 to {max(0, layers - 3)} or from -1 to "
                    f"-{max(1, layers - 2)}")
        return ""

    def check_site(self, site, params, sites):
        why = no_arbitrary_mask(site)
        if why:
            return why
        if site.window is not None:
            return (f"the model slides its own window ({site.window}) on this layer; its KV cache then holds only the "
                    "window, not the blocks an anchor selects")
        if str(site.q_len) != str(site.kv_len):
            return "a block selection needs self-attention (queries and keys at the same positions); this is cross-attention"
        layer = anchor_layer(site, params)
        if layer is None or layer == site.layer and params["every"] is not None:  # measured, or an anchor
            return None
        if layer < 0:
            return ("the first layer has no earlier layer to anchor it" if site.layer == 0 else
                    f"anchor {params['anchor']} reaches back to layer {layer}, before the first layer; "
                    f"give anchor from -1 to -{site.layer} for layer {site.layer}")
        if layer >= site.layer:
            return f"anchor layer {layer} is not an earlier layer than {site.layer}"
        anchor = find_site(site, sites, layer)
        if anchor is None:
            return f"no site at layer {layer} runs over the same positions (lengths and causality) to anchor it"
        if not can_anchor(anchor):
            return (f"anchor layer {layer} slides its own window ({anchor.window}): its KV cache holds only the window, "
                    "not the keys a selection reads; anchor on a full-attention layer (anchor:, or a measured plan)")
        return None

    def keeps_exact(self, site, params, sites):
        if params["every"] is not None and anchor_layer(site, params) == site.layer:
            return f"layer {site.layer} is an anchor (every {params['every']}): it attends exactly and selects blocks"
        return None

    def dispatch_threshold(self, site, crossover):
        # Causal, the threshold is per position: a reused row reads about the same keys wherever it is,
        # an exact row as many as its position. Over a whole input of N rows exact reads N²/2 keys, so
        # where the two cost the same at N, they cost the same per row at about position N/2.
        if not site.causal or crossover <= 0:
            return crossover, ""
        return crossover // 2, (f"; rows from position {crossover // 2} on (half the crossover: a reused row reads "
                                "a fixed number of keys, an exact row as many as its position)")

    def acts_at(self, site, params, q_len, kv_len):
        return not rule_of(params, site.causal).reads_everything(kv_len)

    def acting_length(self, site, params):
        # Twice the length up to which every block is read: most query blocks then choose.
        return 2 * rule_of(params, site.causal).slots * params["block"]

    def cost(self, site, params, B, Nq, Nk):
        rule = rule_of(params, site.causal)
        H, D, Dv = site.heads, site.head_dim, site.v_head_dim
        keys = min(Nk, rule.slots * rule.block)
        probes = 0.0 if rule.reads_everything(Nk) else probe_cost(rule, Nk) * H * D * 2 * Nq / max(Nk, 1)
        return CostAt(2 * B * H * Nq * keys * (D + Dv) + B * probes,
                      B * H * Nq * keys + io_elements(B, H, Nq, Nk, D, Dv))

    def build(self, site, params, context):
        candidates = {s.layer: (s.id, float(s.scale), s.heads, s.head_dim) for s in context.sites
                      if s.layer < site.layer and same_sequence(site, s) and can_anchor(s)}
        layer = anchor_layer(site, params)
        anchor = None
        kept = self.keeps_exact(site, params, context.sites)
        if kept is not None:
            raise KeptByPlan(kept)
        if layer is not None:
            anchor = find_site(site, context.sites, layer)
            if anchor is None:
                raise SiteUnsupported(f"no site at layer {layer} to anchor layer {site.layer}")
        elif context.calls:
            plan = measured_plan(context, params)
            anchor_id = plan.reuse.get(site.id)
            if anchor_id is None:  # an anchor, or a layer no earlier one serves: exact by the measured plan
                raise (KeptByPlan if site.id in plan.site_ids else SiteUnsupported)(plan.why_not(site.id))
            anchor = next(s for s in context.sites if s.id == anchor_id)
        # No calls: a saved model is being loaded; its anchor_layer buffer arrives with its tensors.
        return ReusedSite(site, params, anchor, candidates)

    def plan_report(self, context):
        return plan_report(context)

    def public_ops(self):
        return {"block_sparse_attention": block_sparse_attention, "select_blocks": select_call}


FORM = ReuseForm()
