"""Decode state through transformers' own cache: one cache layer per rewritten site, holding the
form's fixed-size state (attnopt.forms.common.decoding) instead of a growing KV cache.

`SiteCacheLayer` is a `transformers.cache_utils.CacheLayerMixin`. Its `update()` returns only the new
tokens' keys and values; the registered attention function then hands them, with the queries, to
the site module's `decode`, which reads and advances the state the layer holds. Everything else a
cache does -- beam reordering, batch selection and repetition, offloading, reset -- goes through the
library's Cache, which calls the layer's methods.

Which layer a site gets is decided when the cache first reaches the site: a forward pre-hook on
each decoding attention module swaps the empty layer that `generate()` (or the user's
`DynamicCache()`) made for a `SiteCacheLayer`. A layer that already holds tokens (a cache prefilled
by another model) is left alone: the site then recomputes over the full KV cache, which is correct
but not O(1). `make_cache(model)` builds the right layers up front for users who make caches.

Exact sites, reuse sites and the anchors reuse reads keep HF's own layers: softmax attention needs
its keys. A site under `min_seq_len` carries its exact prefix inside the state until every row
passes the threshold (see SiteModule.decode).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import CacheLayerMixin, DynamicCache

from attnopt.forms.common.decoding import (
    index_batch,
    repeat_batch,
    state_nbytes,
    to_device,
)
from attnopt.hf.interface import ModuleState
from attnopt.ir.masks import key_keep

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # names across transformers versions and models


class SiteCacheLayer(CacheLayerMixin):
    """The cache layer of one rewritten site: its decode state, O(1) or O(window) in the context."""

    is_sliding = False  # masks are built full-length, as for every other full-attention layer
    is_compileable = False
    is_croppable = False

    def __init__(self, site_module: nn.Module, **kwargs):
        super().__init__()
        self.site_module = site_module
        self.state = None
        self.columns = 0

    def __repr__(self):
        return f"SiteCacheLayer(form={self.site_module.form!r}, columns={self.columns}, bytes={self.nbytes})"

    @property
    def nbytes(self) -> int:
        return state_nbytes(self.state)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Only the new tokens go on to the attention function; `attend` absorbs them into the state."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    # Under torch.compile the state step runs eagerly (one graph break per site): its shapes change
    # with the step count, which would otherwise recompile the model at every token.
    @torch.compiler.disable
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The site's output for the new tokens [B, H, Nq, Dv]; advances the state by them."""
        keep = None
        if attention_mask is not None:  # HF builds it over every column so far; the new ones are last
            g = self.site_module.geometry
            keep = key_keep(attention_mask, g.keep_when, query.shape[0], attention_mask.shape[-1])
            keep = None if keep is None else keep[:, -key.shape[-2]:]
            if keep is not None and bool(keep.all()):  # no padding among the new tokens: the faster unmasked kernels
                keep = None
        out, self.state = self.site_module.decode(query, key, value, keep, self.state)
        self.columns += key.shape[-2]
        return out

    def get_seq_length(self) -> int:
        return self.columns

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.state, self.columns = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            self.state = index_batch(self.state, beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.state is not None:
            self.state = index_batch(self.state, torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.state is not None:
            self.state = repeat_batch(self.state, repeats)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            f"attnopt: a {self.site_module.form} site keeps a fixed-size decode state, which cannot drop tokens "
            "(crop, assisted or speculative decoding); compile that layer as exact to use them"
        )

    def offload(self):
        if self.state is not None:
            self.state = to_device(self.state, "cpu")

    def prefetch(self):
        if self.state is not None and getattr(self, "device", None) is not None:
            self.state = to_device(self.state, self.device)


def decoding_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules whose site decodes from its own state (not reuse sites or their anchors)."""
    out = []
    for m in model.modules():
        site = m._modules.get("attnopt_site")
        state = m.__dict__.get("_attnopt_state")
        if site is None or state is None or state.store_qk or not getattr(site, "decodes", False):
            continue
        if isinstance(getattr(m, "layer_idx", None), int):
            out.append(m)
    return out


def _find_cache(kwargs: dict):
    for name in _CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is not None:
            return getattr(cache, "self_attention_cache", cache)  # encoder-decoder caches wrap the decoder's
    return None


def bind_layer(module: nn.Module, cache) -> Optional[SiteCacheLayer]:
    """The SiteCacheLayer of `module` in `cache`, swapped in for the empty layer the cache made."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None
    idx = module.layer_idx
    if len(layers) <= idx:
        replicate = getattr(cache, "layer_class_to_replicate", None)
        if replicate is None:
            return None
        while len(layers) <= idx:
            layers.append(replicate())
    layer = layers[idx]
    site = module._modules["attnopt_site"]
    if isinstance(layer, SiteCacheLayer):
        if layer.site_module is not site:
            raise ValueError(f"attnopt: cache layer {idx} belongs to another compiled model's site; "
                             "make a new cache for each model (attnopt.hf.make_cache(model))")
        return layer
    if cache.get_seq_length(idx) > 0:  # prefilled by something else: keep its keys, recompute over them
        return None
    layers[idx] = SiteCacheLayer(site)
    return layers[idx]


def watch_cache(module: nn.Module):
    """Forward pre-hook: point the module's state at its SiteCacheLayer for this call (or None)."""
    module.__dict__.setdefault("_attnopt_state", ModuleState())

    @torch.compiler.disable
    def hook(mod, args, kwargs):
        # The state is read from the module called, not captured: a deep copy of the model copies
        # its hooks by reference, and must not write into the original's state.
        cache = _find_cache(kwargs)
        site = mod._modules.get("attnopt_site")
        decodes = site is not None and getattr(site, "decodes", False)  # a site put back to exact has none
        mod.__dict__["_attnopt_state"].cache_layer = bind_layer(mod, cache) if decodes and cache is not None else None

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def make_cache(model: nn.Module) -> DynamicCache:
    """A DynamicCache for `model` whose layers already match every site's form (exact sites: HF's own)."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if config is not None else None
    cache = DynamicCache(config=text) if text is not None else DynamicCache()
    for m in decoding_modules(model):
        bind_layer(m, cache)
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
