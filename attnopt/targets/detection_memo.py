"""What a transformers model's capture + detection found, kept for the next compile of the same model.

Compiling one model again with another policy (the usual way to compare policies) captured it again:
torch.export of the whole model, most of a small model's compile time and minutes for a large one.
Detection is pure data (sites by module path and graph node name, near misses), so it is kept here,
keyed by everything a static capture reads: the model class and config, every module's path and
class (and that class's `forward`, so a patched method misses), every parameter's and buffer's
shape and dtype, and the example inputs' shapes, dtypes, contents and plain values (a mask's values
set its sites' mask kinds). Weights are not in the key: a capture does not read them. A model with
forward hooks, or inputs holding anything else, are not kept.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import nn

from attnopt.ir.detection import Detection
from attnopt.ir.digest import tensors_digest

KEEP = 16  # detections kept, least recently used dropped first
_kept: "OrderedDict[tuple, Detection]" = OrderedDict()
_lock = threading.Lock()


def detection_key(model: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    """The key a detection of `model(*args, **kwargs)` is kept under; None (nothing kept) when an
    input is neither a tensor, a container of them, nor a plain value, when the config cannot be
    written out, or when any forward hook is registered."""
    inputs = _signature((tuple(args), dict(kwargs)))
    if inputs is None:
        return None
    config = getattr(model, "config", None)
    try:
        config_text = "" if config is None else config.to_json_string(use_diff=False)
    except Exception:  # a config that cannot say itself: nothing is kept
        return None
    named = list(model.named_modules())
    if any(m._forward_pre_hooks or m._forward_hooks for _, m in named) or _global_hooks():
        return None  # a hook may change what the capture sees, and its identity outlives it only by id
    modules = tuple((name, type(m).__module__, type(m).__qualname__, type(m).forward) for name, m in named)
    tensors = tuple((name, tuple(t.shape), str(t.dtype), t.device.type)
                    for name, t in [*model.named_parameters(), *model.named_buffers()])
    return (type(model).__module__, type(model).__qualname__, config_text,
            str(getattr(config, "_attn_implementation", None)), modules, tensors, inputs, torch.__version__)


def detected(model: nn.Module, args: tuple, kwargs: dict, detect: Callable[[], Detection]) -> Detection:
    """`detect()`, or a copy of what it returned for a model and inputs with the same key
    (`counts["reused"]` = 1 then, and no capture time)."""
    key = detection_key(model, args, kwargs)
    if key is not None:
        with _lock:
            hit = _kept.get(key)
            if hit is not None:
                _kept.move_to_end(key)
        if hit is not None:
            found = copy.deepcopy(hit)
            found.counts = {**found.counts, "seconds_capture": 0.0, "seconds_detect": 0.0, "reused": 1}
            return found
    found = detect()
    if key is not None:
        with _lock:
            _kept[key] = copy.deepcopy(found)
            while len(_kept) > KEEP:
                _kept.popitem(last=False)
    return found


def forget() -> None:
    """Drop every kept detection."""
    with _lock:
        _kept.clear()


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(getattr(torch_module, "_global_forward_hooks", None)
                or getattr(torch_module, "_global_forward_pre_hooks", None))


def _signature(value: Any):
    """Shapes, dtypes, contents and plain values of nested inputs; None for anything else. Contents
    too: a detection reads its example's masks (a padded example's mask kinds are not a clean one's)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.device.type, value.requires_grad,
                tensors_digest({"": value}))
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        items = [_signature(v) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, tuple(items))
    if isinstance(value, dict):
        items = [(k, _signature(v)) for k, v in value.items()]
        if any(not isinstance(k, str) or s is None for k, s in items):
            return None
        return ("dict", tuple(sorted(items)))
    return None
