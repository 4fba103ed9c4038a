"""How a transformers model's attention reaches attnopt's attention function: its route.

    attention-interface  the modules call ALL_ATTENTION_FUNCTIONS (Llama, GPT-2, ..., and T5, BART,
                         Whisper, whose class flag `_supports_attention_backend` says False): the
                         model is switched to attnopt's registered implementation name
    module               the modules compute attention inline (Falcon, BLOOM, GPT-Neo): each one's
                         core is handed to the attention function per instance, and the model's
                         `_attn_implementation` is never changed (these models branch on it)
        sdpa-intercept   Falcon: its inline F.scaled_dot_product_attention call, caught by a
                         TorchFunctionMode the module's forward enters for that call only
        forward-replace  BLOOM: a copy of its forward whose baddbmm/softmax/bmm core is the
                         attention function (ALiBi arrives as `position_bias`, so sites stay exact)
        core-method      GPT-Neo: its `_attn(query, key, value, attention_mask)` method

Either way the module's projections, positions and cache updates are the model's own, so the model
keeps generate() and its cache protocol. A routed module's exact attention is its own computation,
unchanged (ModuleState.original).

A compiled model that generates also derives `position_ids` from the attention mask on calls that
give a mask and no positions, exactly as generate() does (`derive_positions`): a left-padded row
then equals the row alone for every form, not only for softmax attention, which sees relative
positions only. Encoders and padding-offset position tables keep their own (`_takes_position_ids`).
"""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attnopt.hf.interface import ModuleState, attention_forward, implementation_for, switch

INTERFACE = "attention-interface"
MODULE = "module"
ROUTE_ATTR = "_attnopt_route"  # on the top-level model: the Route it took


@dataclass
class Route:
    """What `route(model)` did: the mechanism, and how each attention module was reached."""

    kind: str  # INTERFACE or MODULE
    modules: dict = field(default_factory=dict)  # module path -> "sdpa-intercept" | "forward-replace" | "core-method"
    positions: bool = False  # calls with a mask and no position_ids get generate()'s positions
    hooks: list = field(default_factory=list)

    def install_of(self, module_path: str) -> str:
        return self.modules.get(module_path, self.kind)


# -- which models


def _pretrained_model_class():
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    return PreTrainedModel


def calls_interface(cls: type) -> bool:
    """Whether a transformers model class's attention modules call the attention interface.

    The class flag `_supports_attention_backend` is about serving backends and is False for T5,
    BART and Whisper, which do call it; transformers itself decides with the source of the
    modeling file (`_can_set_attn_implementation`), which this follows, requiring the call.
    """
    if getattr(cls, "_supports_attention_backend", False):
        return True
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return False
    try:
        return "ALL_ATTENTION_FUNCTIONS.get_interface(" in inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        return False


def route_kind(model: nn.Module) -> Optional[str]:
    """INTERFACE or MODULE for a transformers model attnopt can rewrite in place; None otherwise."""
    base = _pretrained_model_class()
    if base is None or not isinstance(model, base):
        return None
    if calls_interface(type(model)):
        return INTERFACE
    if any(_module_route(m) is not None for m in model.modules()):
        return MODULE
    return None


def is_hf_model(model: nn.Module) -> bool:
    return route_kind(model) is not None


# -- module routes


@dataclass(frozen=True)
class ModuleRoute:
    """How one attention class is reached: `apply(module)` patches the instance, `exact` is its
    own attention in the attention function's signature."""

    install: str
    apply: Callable
    exact: Callable
    applies: Callable = lambda module: True


def _module_route(module: nn.Module) -> Optional[ModuleRoute]:
    route = MODULE_ROUTES.get((type(module).__module__, type(module).__name__))
    return route if route is not None and route.applies(module) else None


def _with_forward(fn: Callable) -> Callable:
    def apply(module: nn.Module) -> None:
        module.forward = types.MethodType(fn, module)  # per instance; a deep copy rebinds it to the copy
    return apply


class _SdpaToSite(TorchFunctionMode):
    """For one Falcon attention call: its F.scaled_dot_product_attention goes to the attention function."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        flag = bool(kwargs.get("is_causal", False))
        # Falcon always builds its mask; the module's own is_causal (None here) proves causality.
        out, _ = attention_forward(self.module, q, k, v, mask, dropout=kwargs.get("dropout_p", 0.0),
                                   scaling=kwargs.get("scale"), is_causal=True if flag else None, sdpa_is_causal=flag)
        return out.transpose(1, 2)


def _falcon_forward(self, *args, **kwargs):
    with _SdpaToSite(self):
        return type(self).forward(self, *args, **kwargs)


def _falcon_exact(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  sdpa_is_causal=False, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         is_causal=sdpa_is_causal, scale=scaling)
    return out.transpose(1, 2), None


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    """transformers' BloomAttention.forward with its core handed to the attention function."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    batch_size, q_length, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    handed: dict = {}
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx, kwargs=handed)
    out, probs = attention_forward(self, query, key, value, attention_mask, dropout=self.attention_dropout.p,
                                   scaling=self.inv_norm_factor, position_bias=alibi, **handed)
    context = out.reshape(batch_size, q_length, self.hidden_size)
    if self.pretraining_tp > 1 and self.slow_but_exact:
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            output = output + F.linear(context[:, :, int(i * slices): int((i + 1) * slices)],
                                       self.dense.weight[:, int(i * slices): int((i + 1) * slices)])
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), probs


def _bloom_exact(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                 position_bias=None, **kwargs):
    """BLOOM's own core: ALiBi (position_bias [B·H, 1, Nk]) + scaled q kᵀ, mask, fp32 softmax, bmm."""
    B, H, Nq, D = query.shape
    scores = position_bias.baddbmm(batch1=query.reshape(B * H, Nq, D),
                                   batch2=key.reshape(B * H, -1, D).transpose(-1, -2),
                                   beta=module.beta, alpha=module.inv_norm_factor)
    weights = scores.view(B, H, Nq, -1)
    if attention_mask is not None:
        weights = weights + attention_mask
    probs = module.attention_dropout(F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype))
    context = torch.bmm(probs.view(B * H, Nq, -1), value.reshape(B * H, -1, D))
    return context.view(B, H, Nq, D).transpose(1, 2), probs


_BLOOM_SIGNATURE = ["self", "hidden_states", "residual", "alibi", "attention_mask", "layer_past", "use_cache",
                    "output_attentions", "kwargs"]


def _bloom_applies(module: nn.Module) -> bool:
    # The copy above is of transformers' 5.x BloomAttention; another version keeps the graph path.
    return list(inspect.signature(type(module).forward).parameters) == _BLOOM_SIGNATURE and all(
        hasattr(module, a) for a in ("_reshape", "query_key_value", "inv_norm_factor", "beta", "layer_idx"))


def _neo_attn(self, query, key, value, attention_mask=None):
    """GPT-Neo's `_attn`, through the attention function: the site sees the causal / local band
    of the module's `bias` buffer folded into the additive mask (unscaled scores, as GPT-Neo)."""
    nq, nk = query.shape[-2], key.shape[-2]
    band = self.bias[:, :, nk - nq: nk, :nk]
    base = torch.zeros((), dtype=query.dtype, device=query.device) if attention_mask is None else attention_mask
    mask = torch.where(band, base, torch.tensor(torch.finfo(base.dtype).min, dtype=base.dtype, device=query.device))
    out, weights = attention_forward(self, query, key, value, mask, scaling=1.0, neo_mask=attention_mask)
    return out.transpose(1, 2), weights


def _neo_exact(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, neo_mask=None,
               **kwargs):
    out, weights = type(module)._attn(module, query, key, value, neo_mask)
    return out.transpose(1, 2), weights


def _neo_apply(module: nn.Module) -> None:
    module._attn = types.MethodType(_neo_attn, module)


MODULE_ROUTES = {
    ("transformers.models.falcon.modeling_falcon", "FalconAttention"): ModuleRoute(
        "sdpa-intercept", _with_forward(_falcon_forward), _falcon_exact,
        # Falcon calls SDPA only under "sdpa"; under another implementation it is not routed.
        applies=lambda m: getattr(m.config, "_attn_implementation", None) == "sdpa"),
    ("transformers.models.bloom.modeling_bloom", "BloomAttention"): ModuleRoute(
        "forward-replace", _with_forward(_bloom_forward), _bloom_exact, applies=_bloom_applies),
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPTNeoSelfAttention"): ModuleRoute(
        "core-method", _neo_apply, _neo_exact),
}


def _unpatch(module: nn.Module) -> None:
    for name in ("forward", "_attn"):
        module.__dict__.pop(name, None)


# -- routing a model


def route(model: nn.Module) -> Route:
    """Point `model`'s attention at attnopt's function (idempotent); the Route it took."""
    done = model.__dict__.get(ROUTE_ATTR)
    if done is not None:
        return done
    kind = route_kind(model)
    if kind is None:
        raise ValueError(f"{type(model).__name__} does not call the transformers attention interface and has no "
                         "attention module attnopt can route; compile it with method='graph'")
    result = Route(kind)
    if kind == INTERFACE:
        switch(model, implementation_for(model))
    else:
        for path, m in model.named_modules():
            how = _module_route(m)
            if how is not None:
                how.apply(m)
                m.__dict__.setdefault("_attnopt_state", ModuleState()).original = how.exact
                result.modules[path] = how.install
    if _takes_position_ids(model):
        result.positions = True
        result.hooks.append(model.register_forward_pre_hook(derive_positions, with_kwargs=True))
    model.__dict__[ROUTE_ATTR] = result
    return result


def keep_routes_of(model: nn.Module, paths: set) -> None:
    """Undo the module routes of every module outside `paths` (those with no site module): they
    run the model's own code again, untouched."""
    result = model.__dict__.get(ROUTE_ATTR)
    if result is None or result.kind != MODULE:
        return
    for path in result.modules:
        if path not in paths:
            _unpatch(model.get_submodule(path))
    for path in paths:
        m = model.get_submodule(path)
        how = _module_route(m)
        if how is not None and path in result.modules and not any(n in m.__dict__ for n in ("forward", "_attn")):
            how.apply(m)


def reached(model: nn.Module) -> Optional[Route]:
    return model.__dict__.get(ROUTE_ATTR)


# -- positions


def position_limit(model: nn.Module) -> Optional[int]:
    """The most tokens the model can embed: its config's limit, less the positions a padding-offset
    position table (RoBERTa's, XLM-R's: positions start after padding_idx) never uses; None when
    the config states none."""
    cfg = getattr(model, "config", None)
    limit = next((getattr(cfg, n) for n in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx",
                                            "max_sequence_length") if isinstance(getattr(cfg, n, None), int)), None)
    if limit is None or limit <= 0:
        return None
    for name, m in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(m, nn.Embedding) and m.padding_idx is not None:
            limit = min(limit, m.num_embeddings - m.padding_idx - 1)
    return limit


def _takes_position_ids(model: nn.Module) -> bool:
    """Whether the compiled model derives positions from the mask as generate() does: a model that
    generates and takes position_ids, and whose positions count from 0 (not RoBERTa's, which start
    after padding_idx and come from the tokens themselves)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False  # generate() derives no positions for them either
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        return False  # an encoder: its own positions (0 .. N−1, whatever the padding), as the original's
    if any(name.endswith("position_embeddings") and isinstance(m, nn.Embedding) and m.padding_idx is not None
           for name, m in model.named_modules()):
        return False
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def derive_positions(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: positions from the mask as generate() derives them, for the new tokens.

    `(mask.cumsum(-1) - 1)` with padding at 0 (transformers' _prepare_position_ids_for_generation),
    sliced to the last N columns when a cache holds the earlier ones.
    """
    mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is not None or not isinstance(mask, torch.Tensor) or mask.dim() != 2 or len(args) > 1:
        return None  # positions given, no 2-D padding mask, or arguments past input_ids given by position
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args and isinstance(args[0], torch.Tensor):
        tokens = args[0]
    cache = next((kwargs[n] for n in ("cache", "past_key_values") if kwargs.get(n) is not None), None)
    past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    # Only a mask over the past and the new tokens, one row per input row, says where each token is.
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2 or tokens.shape[0] != mask.shape[0] \
            or mask.shape[1] != past + tokens.shape[1]:
        return None
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, mask.shape[1] - tokens.shape[1]:]
    return args, {**kwargs, "position_ids": positions}
