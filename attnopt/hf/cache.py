"""Decode state through transformers' own cache: one cache layer per rewritten site, holding the
form's fixed-size state (attnopt.forms.common.decoding) instead of a growing KV cache.

`SiteCacheLayer` is a `transformers.cache_utils.CacheLayerMixin`. Its `update()` returns only the new
tokens' keys and values and hands the layer to this call's attention function
(`attnopt.hf.interface.hand_over`), which passes them, with the queries, to the site module's
`decode`; that reads and advances the state the layer holds. Everything else a cache does -- beam
reordering, batch selection and repetition, offloading, reset -- goes through the library's Cache,
which calls the layer's methods. All of it lives in the cache object, none on a module: threads
with caches of their own never meet.

Which layer a site gets is decided when the cache first reaches the model: a forward pre-hook on
the compiled model (outside any `torch.compile`d forward) swaps the empty layers that `generate()`
(or the user's `DynamicCache()`) made; a pre-hook on each such attention module does it for a
cache the model makes inside its forward. A layer that already holds tokens (a cache prefilled by
another model) is left alone: the site then recomputes over the full KV cache, which is correct
but not O(1). `make_cache(model)` builds the right layers up front for users who make caches.

Exact sites and the anchors reuse reads keep full K/V layers: softmax attention needs its keys. A
reuse site keeps its K/V in a `ReuseCacheLayer`, which also holds its anchor's block-selection
state and crops it with the keys. In a model with reuse sites every other empty `DynamicLayer`
becomes an `AppendingLayer` (the same K/V, appended instead of `torch.cat`-ed per token). A site under `min_seq_len` carries its
exact prefix inside the state until every row passes the threshold (see SiteModule.decode).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
import transformers.cache_utils as hf_cache
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer

from attnopt.forms.common.decoding import (
    index_batch,
    map_tensors,
    repeat_batch,
    state_nbytes,
    to_device,
)
from attnopt.forms.reuse.decoding import BlockSlab
from attnopt.hf.interface import hand_over, layer_index
from attnopt.ir.masks import key_keep

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # names across transformers versions and models
SITE = "attnopt_site"


class SiteCacheLayer(CacheLayerMixin):
    """The cache layer of one rewritten site: its decode state, O(1) or O(window) in the context."""

    # Not a sliding layer: a mask type's length comes from its first sliding layer (HF's own, holding
    # W - 1 keys) or, with none left, from layer 0; `attend` reads only the new tokens' columns of it.
    is_sliding = False
    is_compileable = False
    decodes = True  # the attention function decodes from this layer (attnopt.hf.interface)
    steps = False  # (ReuseCacheLayer's hot path)

    def __init__(self, site_module: nn.Module, refusal: str = "", **kwargs):
        super().__init__()
        self.site_module = site_module
        self.refusal = refusal or refusal_line([(None, site_module.form)])
        self._state = None
        # Tokens the in-place step absorbed that the state's per-row count (real_B) does not show
        # yet: every row of such a batch is real, so the count is added when the state is next read
        # (`state`), not per token and layer.
        self._lag = 0
        self.columns = 0
        # While every column so far lies inside the site's min_seq_len, the layer is a plain KV
        # cache and the site runs the model's own attention (`exact_now`): below its threshold a
        # site costs what the original does. The first call past it builds the state from those keys.
        self.exact_now = False
        self.kept = 0  # columns held as plain K/V in keys / values (0 once the state exists)
        # Whether a call of this sequence had padding among its new tokens: the in-place one-token
        # step (`SiteModule.decode_token`) serves only batches that never had any.
        self.padded = False
        self.stepper = None  # the site's token_stepper for the state held (kept while it is that state)
        # The model's own attention function for this site, resolved on the first exact call of the
        # sequence (attnopt.hf.interface reads it; the config is not read again every token).
        self.exact_fn = None

    @property
    def state(self):
        """The site's DecodeState (None before the first call past min_seq_len), counts up to date."""
        if self._lag:
            self._state.real_B.add_(self._lag)
            self._lag = 0
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state, self._lag = value, 0

    def __repr__(self):
        return f"SiteCacheLayer(form={self.site_module.form!r}, columns={self.columns}, bytes={self.nbytes})"

    @property
    def nbytes(self) -> int:
        kv = 0 if not self.kept else sum(t.numel() * t.element_size() for t in (self.keys, self.values))
        return state_nbytes(self.state) + kv

    @property
    def is_croppable(self) -> bool:
        # Assisted, prompt-lookup and speculative decoding ask this right after their prefill, before
        # any draft is verified: refuse there, in attnopt's words, instead of transformers' generic ones.
        raise ValueError(self.refusal)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Inside min_seq_len: every key so far, for the model's own attention. Past it: only the new
        tokens' keys, which `attend` absorbs into the state."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        Nq = key_states.shape[-2]
        self.exact_now = self._state is None and self.columns + Nq <= self._exact_limit()
        if self.exact_now:
            if self.kept and self.keys.shape[0] == key_states.shape[0]:
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            else:
                self.keys, self.values = key_states, value_states
            self.kept = self.columns = self.columns + Nq
            hand_over(self, kwargs, self.keys)
            return self.keys, self.values
        if not self.kept and (self.keys is None or self.keys.shape[0] != key_states.shape[0]):
            # Zero-length stand-ins for code that reads layer.keys / .values itself (Whisper's
            # generate() rebuilds the cache it returns from them; the state is not in it).
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.columns += Nq
        hand_over(self, kwargs, key_states)
        return key_states, value_states

    def _exact_limit(self) -> int:
        """Columns this layer may hold as a plain KV cache for the model's own attention: min_seq_len,
        and on a layer that slides its own window W at most W - 1. HF sizes such a layer's mask like
        its other sliding layers, which hold the last W - 1 keys; below W they hold every key, so the
        mask covers every kept column and shows each one's padding (the band hides none of them)."""
        site = self.site_module
        window = site.geometry.model_window
        return site.min_seq_len if window is None else min(site.min_seq_len, window - 1)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The site's output for the new tokens, [B, Nq, H, Dv] contiguous (what attention functions
        return); advances the state by them."""
        site = self.site_module
        Nq = key.shape[-2]
        keep = None
        if attention_mask is not None:  # HF builds it over every column so far; the new ones are last
            keep = key_keep(attention_mask, site.geometry.keep_when, query.shape[0], attention_mask.shape[-1])
            if keep is not None and bool(keep.all()):  # no padding: the faster unmasked kernels
                keep = None
        if keep is not None:
            self.padded = True
        if self.kept:  # the first call past min_seq_len: the state of every column kept so far
            key, value = torch.cat([self.keys, key], dim=-2), torch.cat([self.values, value], dim=-2)
            out, self.state = site.decode_from_keys(query, key, value, keep)
            self.kept = 0
            self.keys, self.values = key[..., :0, :], value[..., :0, :]
            return out.transpose(1, 2).contiguous()
        keep = None if keep is None else keep[:, -Nq:]
        state = self._state
        if (Nq == 1 and not self.padded and state is not None and state.prefix is None
                and not torch.compiler.is_compiling() and not torch.is_grad_enabled()):
            # The in-place step (no padding, past min_seq_len, one token, no autograd: it writes
            # into its buffers), made once per state.
            step = self.stepper
            if step is None or step.state is not state.form_state or step.q_dtype != query.dtype:
                step = self.stepper = site.token_stepper(state.form_state, query, key)
            if step is not None:
                out = step(query, key, value)  # [B, 1, H, Dv] already
                state.form_state = step.state
                self._lag += 1
                state.columns += 1
                return out
            stepped = site.decode_token(query, key, value, state.form_state)
            if stepped is not None:  # a form with a step of its own but no stepper
                out, state.form_state = stepped
                self._lag += 1
                state.columns += 1
                return out.transpose(1, 2).contiguous()
        out, self.state = site.decode(query, key, value, keep, self.state)
        return out.transpose(1, 2).contiguous()

    def get_seq_length(self) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.columns, self.kept, self.padded, self.exact_now = None, 0, 0, False, False
        self.stepper = self.exact_fn = None
        self.keys = self.values = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = index_batch(self.state, beam_idx)
        if self.keys is not None:
            self.keys, self.values = (t.index_select(0, beam_idx.to(t.device)) for t in (self.keys, self.values))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state = index_batch(self.state, torch.as_tensor(indices))
        if self.keys is not None:
            self.keys, self.values = self.keys[indices], self.values[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = repeat_batch(self.state, repeats)
        if self.keys is not None:
            self.keys, self.values = (t.repeat_interleave(repeats, 0) for t in (self.keys, self.values))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:  # crop(0) is a no-op transformers calls after every step of some decoders
            raise ValueError(self.refusal)

    def offload(self):
        if self.state is not None:
            self.state = to_device(self.state, "cpu")
        if self.kept:
            self.keys, self.values = self.keys.to("cpu", non_blocking=True), self.values.to("cpu", non_blocking=True)

    def prefetch(self):
        if getattr(self, "device", None) is None:
            return
        if self.state is not None:
            self.state = to_device(self.state, self.device)
        if self.kept:
            self.keys, self.values = (t.to(self.device, non_blocking=True) for t in (self.keys, self.values))


def refusal_line(layers: list) -> str:
    """The one line a state layer refuses to drop tokens with, naming the layers to keep exact."""
    named = [str(i) for i, _ in layers if i is not None]
    forms = sorted({f for _, f in layers})
    which = f"layers {', '.join(named)}" if named else "this layer"
    rule = f'{{"layers": "{",".join(named)}", "form": "exact"}}' if named else '{"form": "exact"}'
    return (f"attnopt: assisted, prompt-lookup and speculative decoding drop tokens from the cache, which the "
            f"fixed-size {'/'.join(forms)} decode state of {which} cannot; compile {which} as exact "
            f"(policy rule {rule}) to use them, or generate without them")


class AppendingLayer(DynamicLayer):
    """HF's DynamicLayer, appending each token into buffers with room to spare instead of
    `torch.cat`-ing the whole cache: at 8k columns the cat copies every key and value per token
    and per layer, more than a one-token SDPA over them costs (benchmarks/reuse_cpu.py, decode).
    Buffers grow by an eighth (256 columns at least) when full; keys/values are views of them, so
    HF's crop, reorder, select and repeat work unchanged (a replaced tensor is copied in again)."""

    decodes = False
    steps = False  # ReuseCacheLayer: `step` serves a decoding token inside a block (attnopt.hf.interface)
    site_module = None  # no site: a plain K/V layer (the attention function's checks read these)

    def __init__(self, **kwargs):
        super().__init__()
        self._room = None  # (keys, values) buffers with spare columns

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        room = self._room
        if room is None or room[0].data_ptr() != self.keys.data_ptr() or room[0].shape[:2] != key_states.shape[:2] \
                or room[0].shape[-2] < n + t or room[0].dtype != key_states.dtype \
                or room[0].device != key_states.device \
                or (room[0].is_inference() and not torch.is_inference_mode_enabled()):
            size = max(n + t + max(256, (n + t) // 8), 2 * t)
            room = tuple(x.new_empty(*x.shape[:-2], size, x.shape[-1]) for x in (key_states, value_states))
            if n:  # what the cache held (also after HF replaced its tensors: reorder, select, crop)
                room[0][..., :n, :].copy_(self.keys)
                room[1][..., :n, :].copy_(self.values)
            self._room = room
        room[0][..., n:n + t, :].copy_(key_states)
        room[1][..., n:n + t, :].copy_(value_states)
        self.keys, self.values = room[0][..., :n + t, :], room[1][..., :n + t, :]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._room = None


def append_layers(cache) -> int:
    """Swap every empty plain `DynamicLayer` of `cache` for an `AppendingLayer`; the count swapped.
    Layers already holding tokens, sliding or quantized layers, and site layers stay as they are."""
    layers = getattr(cache, "layers", None) or []
    swapped = 0
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layers[i] = AppendingLayer()
            swapped += 1
    return swapped


class ReuseCacheLayer(AppendingLayer):
    """HF's growing K/V of a reuse site (appended, not cat-ed: a decoding step reads only the
    selected blocks, so a whole-cache copy per token would cost more than the attention it saves),
    plus the block-selection state of its anchor (the last anchor queries and the blocks chosen so
    far, attnopt.forms.reuse.selection): reuse saves compute, not memory, so the keys stay. The
    state is cropped, reordered and repeated with the keys."""

    steps = True

    def __init__(self, site_module: nn.Module, **kwargs):
        super().__init__()
        self.site_module = site_module
        self.selection = None  # SelectionState after the tokens held (None before the first call)
        self.slab = BlockSlab()  # the current query block's listed blocks, gathered (decoding steps read them)
        self._new = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self._new = (key_states, value_states)  # the step's token, read by `step` when keys is self.keys
        hand_over(self, kwargs, keys)
        return keys, values

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, anchor_qk,
             made: Optional[dict] = None) -> Optional[torch.Tensor]:
        """The site's output [B, H, 1, Dv] for a one-token decoding step inside a block its slab serves,
        advancing the selection state; None elsewhere (the attention function then takes the path
        every other call takes; nothing has changed). `made`: the anchor's per-call selections, where
        the layers reading one state share the state after (so they share the next block's choice)."""
        held = self.selection
        if held is None or anchor_qk is None or query.shape[2] != 1 or query.requires_grad:
            return None
        new = self._new if key is self.keys and self._new[0].shape[-2] == 1 else None
        got = self.site_module.step(query, key, value, anchor_qk[0], anchor_qk[1], held, self.slab, new, made)
        if got is None:
            return None
        self.selection = got[1]
        return got[0]

    def crop(self, tokens_to_remove: int) -> None:
        before = self.get_seq_length()
        super().crop(tokens_to_remove)
        if self.selection is not None and before > self.get_seq_length():
            self.selection = self.selection.crop(before - self.get_seq_length(), self.site_module.rule)
        self.slab.clear()

    def reset(self) -> None:
        super().reset()
        self.selection = None
        self.slab.clear()

    def _map(self, fn) -> None:
        self.slab.clear()  # rows reordered, selected or repeated: gathered again at the next step
        if self.selection is not None:
            self.selection = map_tensors(self.selection, fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def offload(self):
        super().offload()
        self._map(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        super().prefetch()
        self._map(lambda t: t.to(self.device, non_blocking=True))


def decoding_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules whose site keeps a cache layer of its own (a decode state, or reuse's selection)."""
    out = []
    for m in model.modules():
        state = m.__dict__.get("_attnopt_state")
        if m._modules.get(SITE) is not None and state is not None and state.cache_role and layer_index(m) is not None:
            out.append(m)
    return out


def _find_cache(kwargs: dict):
    if kwargs.get("key_value_states") is not None:
        return None  # cross-attention: its cache is the encoder's, never a site's
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is not None:
            return getattr(cache, "self_attention_cache", cache)  # encoder-decoder caches wrap the decoder's
    return None


# The cache layers that hold only keys and values, every one or a sliding window's: the layers a
# site's own layer may replace (names across transformers 4.56-5.x).
_PLAIN_KV = tuple(c for c in (getattr(hf_cache, n, None) for n in (
    "DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer", "SlidingWindowLayer"))
    if c is not None)


# Layers sized up front (max_cache_len columns, and HF's masks with them): a site's layer replacing one
# would disagree with the exact layers' masks of the same kind, and a reuse selection cannot read them.
_FIXED_LENGTH = tuple(c for c in (getattr(hf_cache, n, None) for n in ("StaticLayer", "StaticSlidingWindowLayer"))
                      if c is not None)


def bind_layer(module: nn.Module, cache) -> Optional[CacheLayerMixin]:
    """The cache layer of `module`'s site in `cache`, swapped in for the empty layer the cache made."""
    site = module._modules.get(SITE)
    state = module.__dict__.get("_attnopt_state")
    layers = getattr(cache, "layers", None)
    idx = layer_index(module)
    if site is None or state is None or not state.cache_role or layers is None or idx is None:
        return None  # a site put back to exact keeps HF's layer
    if len(layers) <= idx:
        replicate = getattr(cache, "layer_class_to_replicate", None)
        if replicate is None:
            return None
        while len(layers) <= idx:
            layers.append(replicate())
    layer = layers[idx]
    if isinstance(layer, (SiteCacheLayer, ReuseCacheLayer)):
        if layer.site_module is not site:
            raise ValueError(f"attnopt: cache layer {idx} belongs to another compiled model's site; "
                             "make a new cache for each model (attnopt.hf.make_cache(model))")
        return layer
    if cache.get_seq_length(idx) > 0:  # prefilled by something else: keep its keys, recompute over them
        return None
    if type(layer) not in _PLAIN_KV + (AppendingLayer,):
        return None  # a layer that also keeps other state (conv, recurrent, an indexer) stays HF's own
    if isinstance(layer, _FIXED_LENGTH):
        what = ("reuses an anchor's block selection, which reads the keys decoded so far" if state.cache_role == "reuse"
                else f"decodes from its {site.form} state")
        raise ValueError(f"attnopt: layer {idx} {what}; a static cache ({type(layer).__name__}) sizes every layer and "
                         "mask to max_cache_len instead. Generate with the default dynamic cache (drop "
                         "cache_implementation='static')")
    if state.cache_role == "state":
        layers[idx] = SiteCacheLayer(site, state.crop_refusal)
    elif type(layer) in (DynamicLayer, AppendingLayer):  # reuse: HF's full K/V layer (reuse refuses a layer that slides a window)
        layers[idx] = ReuseCacheLayer(site)
    else:
        return None
    return layers[idx]


def bound_layer(layers, idx: Optional[int], module: nn.Module):
    """layers[idx] when it is already `module`'s site layer, else None (the per-token check of both hooks)."""
    layer = layers[idx] if layers is not None and idx is not None and idx < len(layers) else None
    site = module._modules.get(SITE)
    return layer if site is not None and getattr(layer, "site_module", None) is site else None


def watch_cache(module: nn.Module):
    """Forward pre-hook on the first attention module to decode from a cache: bind the layers of
    every module in its state's `stateful` (itself when empty) in a cache the model made inside its
    forward. One hooked module, not one per layer: a hook costs each call torch's slow path. (The
    compiled model's own pre-hook, `watch_model_cache`, has bound any cache it was given.)"""

    idx = layer_index(module)

    def hook(mod, args, kwargs):
        cache = _find_cache(kwargs)
        if cache is None:
            return
        if bound_layer(getattr(cache, "layers", None), idx, mod) is not None:
            return  # bound already (by the model's pre-hook): the common case, once per token
        for m in mod.__dict__["_attnopt_state"].stateful or (mod,):
            bind_layer(m, cache)

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def watch_model_cache(model: nn.Module):
    """Forward pre-hook on the compiled model: bind every site's layer in the cache it is given.

    It runs in Module.__call__, outside a `torch.compile`d forward, so the traced model finds its
    layers in place and takes no graph break for them.
    """

    indices: dict = {}  # id(module) -> its cache index (layer_index reads attributes; this runs every token)

    def hook(mod, args, kwargs):
        cache = _find_cache(kwargs)
        if cache is None:
            return
        layers = getattr(cache, "layers", None)
        stateful = mod.__dict__["_attnopt_state"].stateful
        for m in stateful:
            idx = indices.get(id(m), _UNSET)
            if idx is _UNSET:
                idx = indices[id(m)] = layer_index(m)
            layer = bound_layer(layers, idx, m)
            if layer is None:
                layer = bind_layer(m, cache)  # not bound yet (its first call with this cache)
            if isinstance(layer, SiteCacheLayer):  # decode leaves this to us under torch.compile
                # Read as `_state`: the `state` property would flush the in-place step's row count
                # every token; a state settle changes has an exact prefix, which that step never runs.
                held = layer._state
                if held is not None and held.prefix is not None:
                    settled = layer.site_module.settle(held)
                    if settled is not held:
                        layer.state = settled
        if not getattr(cache, "_attnopt_appends", False):  # once per cache, after the site layers are bound
            cache._attnopt_appends = True
            if _reuses(stateful):
                append_layers(cache)

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _reuses(modules) -> bool:
    """Whether any of these attention modules is a reuse site: its model decodes from appended K/V
    layers (eager, as reuse's own layers are), so its exact layers and anchors append too."""
    return any(m.__dict__["_attnopt_state"].cache_role == "reuse" for m in modules)


_UNSET = object()


def set_cache_roles(model: nn.Module, sites: list) -> int:
    """Mark each site module's attention module with the cache layer it keeps; the count marked.

    A decode state only for causal self-attention whose every call the site rewrites (a site whose
    calls carry a bias runs exact and needs HF's keys); never for cross-attention.
    """
    by_path = {s.module_path: s for s in sites}
    stateful = []
    marked = 0
    for path, m in model.named_modules():
        site, state = m._modules.get(SITE), m.__dict__.get("_attnopt_state")
        if state is None:
            continue
        state.cache_role, state.crop_refusal = None, ""
        s = by_path.get(path)
        if site is None or s is None or layer_index(m) is None or s.runtime_inputs:
            continue
        if getattr(site, "decodes", False) and s.q_len == s.kv_len and not state.store_qk:
            # (an anchor keeps HF's keys: the sites reusing it read them)
            state.cache_role = "state"
            stateful.append((m, layer_index(m), site.form))
        elif site.uses_anchor_qk:
            state.cache_role = "reuse"
        marked += state.cache_role is not None
    refusal = refusal_line([(i, f) for _, i, f in stateful])
    for m, _, _ in stateful:
        m.__dict__["_attnopt_state"].crop_refusal = refusal
    return marked


def make_cache(model: nn.Module) -> DynamicCache:
    """A DynamicCache for `model` whose layers already match every site's form (exact sites: HF's own)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if config is not None else None
    cache = DynamicCache(config=text) if text is not None else DynamicCache()
    modules = decoding_modules(model)
    for m in modules:
        bind_layer(m, cache)
    if _reuses(modules):
        append_layers(cache)
    cache._attnopt_appends = True
    return cache


def decode_state_bytes(cache) -> dict:
    """Bytes held per layer of a cache (SiteCacheLayer states and HF's own K/V tensors)."""
    out = {}
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if isinstance(layer, SiteCacheLayer):
            out[i] = layer.nbytes
        else:
            out[i] = sum(t.numel() * t.element_size() for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                         if isinstance(t, torch.Tensor))
    return out
