"""A compiled causal LM as one module with state tensors in and out: what the decode export traces.

    DecoderGraph(model, layout)(input_ids [B, T], attention_mask [B, P + T], position_ids [B, T], *pasts)
        -> (logits [B, T, V], *presents)

The model runs its own forward (embeddings, RoPE from position_ids, MLPs, head) with transformers'
attention interface pointed at `graph_attention` (implementation name "attnopt_graph", registered
with a mask function that hands the attention the 2-D padding mask as is: no [B, 1, N, N] mask is
ever built) and a `GraphCache` that only knows the past length P. Each attention call becomes its
site's step op (forms/<form>/step.py) on the new tokens, the mask and the site's past states.

`probe(model, batch)` runs the model once to see every attention call (its module, geometry and
what transformers passed) and plans the state tensors of each layer: a `Layout`. A rewritten site
with a dispatch threshold (min_seq_len = T: the compiled model runs exact attention for each row's
first T real tokens) also carries the exact prefix of forms/exact/step.py, so the graph computes
what the compiled model does at every length.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from attnopt.backends.onnx.packing import Packing, packable
from attnopt.forms.common.graph import StateSpec, StepGeometry, StepSite
from attnopt.forms.common.mixed_heads import graph_step_of
from attnopt.forms.exact.step import call_prefix, prefix_spec
from attnopt.hf.interface import attention_forward, switch
from attnopt.hf.routes import is_hf_model

IMPL = "attnopt_graph"
KEY_MASK_IMPL = "attnopt_keymask"
# Call options a step op cannot honour: the model's attention then stays as written.
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias", "attention_bias")

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("attnopt_graph_run", default=None)


class CannotGenerate(ValueError):
    """The model cannot be exported for decoding; the message names why and what to do."""


# ---------------------------------------------------------------- transformers hooks


def graph_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    run = _ACTIVE.get()
    if run is None:
        raise RuntimeError(f"attn_implementation {IMPL!r} runs only inside attnopt's decode export")
    return run.attend(module, query, key, value, attention_mask, scaling, kwargs)


def graph_mask(batch_size=None, q_length=None, kv_length=None, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask=None, **kwargs):
    """The padding mask [B, P + T] as the attention gets it (bool, True = real token)."""
    return attention_mask


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPL, graph_attention)
    AttentionMaskInterface.register(IMPL, graph_mask)
    AttentionInterface.register(KEY_MASK_IMPL, key_mask_attention)
    AttentionMaskInterface.register(KEY_MASK_IMPL, graph_mask)


# ---------------------------------------------------------------- prefill export: padding masks only


def key_mask_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """attnopt's attention function given the 2-D padding mask: a site that reads only key padding
    gets it as [B, 1, 1, Nk]; any other (exact, a site under a threshold) gets the [B, 1, Nq, Nk] mask
    transformers' sdpa mask would be, built here, inside that site. A query that sees no key (a
    left-padded row's padding) gets zeros, as torch's SDPA gives it; in the file it attends to every
    key and is then zeroed (ONNX's softmax of nothing but −inf would be NaN, and NaN spreads)."""
    sees = None
    if attention_mask is not None and attention_mask.dim() == 2:
        site = module._modules.get("attnopt_site")
        keep = attention_mask.bool()
        if site is not None and site.reads_padding_only and not site.min_seq_len:
            attention_mask = keep[:, None, None, :]
        else:
            visible = _sdpa_like_mask(keep, query.shape[-2], getattr(module, "is_causal", True),
                                      kwargs.get("sliding_window"))
            sees = visible.any(-1, keepdim=True)  # [B, 1, Nq, 1]
            attention_mask = visible | ~sees
    out, weights = attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if sees is not None:  # out: [B, Nq, H, Dv]
        out = out * sees[:, 0, :, :, None].to(out.dtype)
    return out, weights


def _sdpa_like_mask(keep_BN: torch.Tensor, Nq: int, causal: bool, window) -> torch.Tensor:
    """Bool [B, 1, Nq, Nk] as transformers' sdpa_mask builds it: padding, causality (bottom-right
    aligned) and the model's sliding window. A row may see nothing (transformers no longer lets it
    see everything on torch >= 2.5, whose SDPA returns zeros for it)."""
    Nk = keep_BN.shape[-1]
    visible = keep_BN[:, None, None, :].expand(-1, 1, Nq, Nk)
    if causal:
        q_pos = (Nk - Nq) + torch.arange(Nq, device=keep_BN.device)[:, None]
        k_pos = torch.arange(Nk, device=keep_BN.device)[None, :]
        band = k_pos <= q_pos
        if isinstance(window, int) and window > 0:
            band = band & (k_pos > q_pos - window)
        visible = visible & band
    return visible


@contextlib.contextmanager
def key_masks(model: nn.Module):
    """While exporting a transformers model's prefill file: attention gets padding masks (no N×N
    mask for the sites that read only padding); anything else is left as it is."""
    if not is_hf_model(model):
        yield
        return
    register()
    before = getattr(model.config, "_attn_implementation", None)
    switch(model, KEY_MASK_IMPL)
    try:
        yield
    finally:
        switch(model, before)


class GraphCache:
    """What transformers asks of a cache, for a graph whose states live outside it: only P is known.

    It has no `layers`: attnopt's own cache hook (attnopt.hf.cache) then leaves it alone."""

    is_compileable = False
    is_sliding = ()

    def __init__(self, past_length):
        self.past_length = past_length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states  # the step op reads the past from its own state inputs

    def get_seq_length(self, layer_idx: int = 0):
        return self.past_length

    def get_query_offset(self, layer_idx: int = 0):
        return self.past_length

    def get_mask_sizes(self, query_length, layer_idx: int = 0):
        return self.past_length + query_length, 0


@contextlib.contextmanager
def active(run):
    token = _ACTIVE.set(run)
    try:
        yield run
    finally:
        _ACTIVE.reset(token)


def call_model(model: nn.Module, input_ids, attention_mask, position_ids, past_length):
    """The model's forward with a GraphCache; returns its logits."""
    cache = GraphCache(past_length)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                **{name: cache})
    return out.logits


# ---------------------------------------------------------------- the plan


@dataclass
class LayerPlan:
    """One attention site of the graph: its layer index (the state names), step and state tensors."""

    layer: int
    path: str
    site_id: str
    form: str  # the step's form (an exact site the model slides a window over runs the window step)
    site: StepSite
    states: list  # the form's states, then the exact prefix's when `prefix_slots`
    prefix_slots: int = 0  # T: the first T real tokens of each row attend exactly (the site's min_seq_len)

    def names(self, spec: StateSpec) -> tuple[str, str]:
        return f"past_key_values.{self.layer}.{spec.name}", f"present.{self.layer}.{spec.name}"

    @property
    def step(self):
        return graph_step_of(self.site.module, self.form)  # a per-head site splits its heads (mixed_heads.py)

    def call(self, q, k, v, mask, pasts, **extra):
        """The site's step op, then the exact prefix over its output: (out, presents)."""
        n = len(self.states) - (1 if self.prefix_slots else 0)
        out, presents = self.step.call(self.site, q, k, v, mask, list(pasts[:n]), **extra)
        if self.prefix_slots:
            out, prefix = call_prefix(self.site, q, k, v, mask, out, pasts[n])
            presents = [*presents, prefix]
        return out, presents


@dataclass
class Layout:
    layers: list  # LayerPlan, in call order
    packing: Optional[Packing] = None  # set: the fixed-size layers' states travel packed (packing.py)

    def packed(self, plan: LayerPlan) -> bool:
        return self.packing is not None and packable(plan)

    def io_specs(self, plan: LayerPlan) -> list:
        """The state tensors a layer has in the graph's inputs and outputs (its own, or its packed pair)."""
        return self.packing.specs() if self.packed(plan) else plan.states

    def states(self) -> list:
        """(plan, spec, past name, present name) of every state input, in input order."""
        return [(p, s, *p.names(s)) for p in self.layers for s in self.io_specs(p)]

    def example_pasts(self, batch: int, past: int) -> list:
        return [spec.zeros(batch, past) for _, spec, _, _ in self.states()]


@dataclass
class _Call:
    module: nn.Module
    geometry: StepGeometry
    window: Optional[int]
    unsupported: list


class _Probe:
    def __init__(self):
        self.calls: list = []

    def attend(self, module, query, key, value, mask, scaling, kwargs):
        window = kwargs.get("sliding_window")
        window = int(window) if isinstance(window, int) and window > 0 else None
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        geometry = StepGeometry(query.shape[1], key.shape[1], query.shape[-1], value.shape[-1], scale, query.dtype)
        bad = [k for k in UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
        self.calls.append(_Call(module, geometry, window, bad))
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
        return out, None


def probe(model: nn.Module, report, batch: tuple) -> Layout:
    """Every attention call of one forward on `batch` (input_ids, attention_mask, position_ids), planned."""
    run = _Probe()
    ids, mask, pos = batch
    with active(run), torch.no_grad():
        call_model(model, ids, mask, pos, 0)
    paths = {id(m): name for name, m in model.named_modules()}
    site_ids = {r.site.module_path: r.site.id for r in report.sites}
    context = context_of(model)
    plans, seen = [], set()
    for c in run.calls:
        path = paths.get(id(c.module), "?")
        if id(c.module) in seen:
            raise CannotGenerate(f"attention module {path} runs twice in one forward; a decode graph keeps one state "
                                 "per attention module")
        seen.add(id(c.module))
        plans.append(_plan(c, path, site_ids.get(path, path), context))
    if not plans:
        raise CannotGenerate("the model called no attention through transformers' attention interface; a decode "
                             "graph needs its attention modules")
    return Layout(plans)


def context_of(model: nn.Module) -> Optional[int]:
    """The model's context length (max_position_embeddings), None when its config has none."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    n = getattr(cfg, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def prefix_slots(module: Optional[nn.Module], context: Optional[int]) -> int:
    """The exact prefix a rewritten site carries: its min_seq_len, capped at the model's context (a
    position past the context is no position the model was made for)."""
    T = int(getattr(module, "min_seq_len", 0) or 0) if module is not None else 0
    return min(T, context) if context else T


def _plan(c: _Call, path: str, site_id: str, context: Optional[int] = None) -> LayerPlan:
    layer = getattr(c.module, "layer_idx", None)
    if not isinstance(layer, int):
        raise CannotGenerate(f"attention module {path} has no layer_idx; the decode graph names its states by layer")
    if c.geometry.dtype != torch.float32:
        raise CannotGenerate(f"site {site_id} computes in {str(c.geometry.dtype).replace('torch.', '')}; the decode "
                             "export is checked in float32 on CPU: export model.float()")
    module = c.module._modules.get("attnopt_site")
    if module is not None and module.form == "exact":
        module = None
    if c.unsupported and module is None:
        raise CannotGenerate(f"site {site_id}: the model passes {', '.join(c.unsupported)} to its attention, which no "
                             "decode step honours; this model cannot be exported for decoding")
    form = module.form if module is not None else ("window" if c.window else "exact")
    if module is not None and not module.geometry.causal:
        raise CannotGenerate(f"site {site_id} ({form}) is bidirectional; decoding needs causal attention")
    step = graph_step_of(module, form)
    if step is None:
        raise CannotGenerate(f"site {site_id}: form {form!r} has no decode step for an exported graph; compile that "
                             "layer with another form (e.g. exact) to export it for decoding")
    state = c.module.__dict__.get("_attnopt_state")
    anchor = bool(state is not None and state.store_qk)
    if anchor and form not in ("exact", "reuse"):
        raise CannotGenerate(f"site {site_id} ({form}) is the anchor of a reuse site, which reads its anchor's keys "
                             "from a K cache; compile the anchor layer as exact")
    site = StepSite(module, c.geometry, c.window, anchor)
    why = step.why_not(site) if step.why_not is not None else None
    if why:
        raise CannotGenerate(f"site {site_id} ({form}): {why}")
    states, slots = step.states(site), prefix_slots(module, context)
    if slots:
        states = [*states, prefix_spec(site, slots)]
    return LayerPlan(layer, path, site_id, form, site, states, slots)


# ---------------------------------------------------------------- the traced module


class _Steps:
    def __init__(self, layout: Layout, pasts: tuple, paths: dict, record: Optional[list] = None):
        self.layout, self.paths, self.record = layout, paths, record
        self.by_path: dict = {}
        self.presents: dict = {}
        self.anchors: dict = {}  # id of an anchor's ModuleState -> (its new queries, its present keys), for reuse sites
        it = iter(pasts)
        for plan in layout.layers:
            io = [next(it) for _ in layout.io_specs(plan)]
            self.by_path[plan.path] = (plan, layout.packing.unpack(plan, *io) if layout.packed(plan) else io)

    def attend(self, module, query, key, value, mask, scaling, kwargs):
        plan, pasts = self.by_path[self.paths[id(module)]]
        state = module.__dict__.get("_attnopt_state")
        extra = {}
        if plan.step.needs_anchor:  # reuse: the anchor's q and keys, this layer's input
            extra = {"anchor": self.anchors[id(state.anchor)], "x": state.call.get("x")}
        out, presents = plan.call(query, key, value, mask, pasts, **extra)
        if state is not None and state.store_qk:
            self.anchors[id(state)] = (query, presents[0])  # an exact site's present keys: every column
        self.presents[plan.layer] = presents
        if self.record is not None:  # (plan, the call's tensors, its extras, its outputs): checks localise with them
            self.record.append((plan, (query, key, value, mask, *pasts), extra, (out, *presents)))
        return out.transpose(1, 2).contiguous(), None

    def ordered(self) -> list:
        """Every present, in output order (a packed layer's as its pair)."""
        out = []
        for plan in self.layout.layers:
            presents = self.presents[plan.layer]
            out += self.layout.packing.pack(plan, presents) if self.layout.packed(plan) else presents
        return out


class DecoderGraph(nn.Module):
    """(input_ids, attention_mask, position_ids, *pasts) -> (logits, *presents), the contract's order."""

    def __init__(self, model: nn.Module, layout: Layout):
        super().__init__()
        self.model = model
        self.layout = layout
        self.record: Optional[list] = None  # a list: every step call is appended to it (eager runs)
        self._paths = {id(m): name for name, m in model.named_modules()}

    def forward(self, input_ids, attention_mask, position_ids, *pasts):
        run = _Steps(self.layout, pasts, self._paths, self.record)
        with active(run):
            logits = call_model(self.model, input_ids, attention_mask.bool(), position_ids,
                                attention_mask.shape[1] - input_ids.shape[1])
        return (logits, *run.ordered())


@contextlib.contextmanager
def graph_copy(model: nn.Module):
    """A deep copy of the compiled model pointed at "attnopt_graph" (the user's model is not touched)."""
    register()
    twin = copy.deepcopy(model)
    switch(twin, IMPL)
    yield twin
