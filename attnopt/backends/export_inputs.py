"""What every exporter (ONNX, TensorRT) starts from: a compiled model, its example tensors, and a
module that takes tensors only and returns the tensor the file should produce."""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch import nn

from attnopt.compiler import compile as attnopt_compile
from attnopt.ir.batch import as_batch
from attnopt.targets import target_of


def compiled_for_export(model: nn.Module, policy: Any, example_inputs: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"export_onnx takes an nn.Module, got {type(model).__name__}")
    compiled = getattr(model, "attnopt_report", None) is not None
    if compiled and policy is not None:
        raise ValueError("the model is already compiled by attnopt; drop policy= (it exports as compiled)")
    if compiled:
        return model
    if policy is None:
        raise ValueError("the model was not compiled by attnopt (it has no .attnopt_report) and no policy= was "
                         "given; pass the model attnopt.compile returned, or policy='linear' (any policy) to compile it")
    if example_inputs is None:
        raise ValueError("export_onnx(policy=...) compiles the model first and needs example_inputs=")
    return attnopt_compile(model, policy, example_inputs=example_inputs)


def example_args(opt: nn.Module, example_inputs: Any) -> tuple[tuple, dict]:
    if example_inputs is not None:
        args, kwargs = as_batch(example_inputs, "example_inputs")
    else:
        args, kwargs = target_of(opt).default_example()
    bad = [type(a).__name__ for a in args if not isinstance(a, torch.Tensor)]
    if bad:
        raise TypeError(f"export_onnx positional example_inputs must be tensors (they become the file's inputs), "
                        f"got {bad}; pass options such as use_cache=False as keywords")
    return tuple(args), dict(kwargs)


class TensorForward(nn.Module):
    """Tensors in (positional, then the tensor keywords), tensors out; keyword options that are not
    tensors (use_cache=False) are fixed. Transformers models give their first output, without a cache."""

    def __init__(self, model: nn.Module, kwargs: dict):
        super().__init__()
        self.model = model
        self.names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.options = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        self.output_name: Optional[str] = None  # the model output's name, once called (logits, ...)
        if "use_cache" in inspect.signature(model.forward).parameters:
            self.options.setdefault("use_cache", False)

    def forward(self, *flat):
        n_args = len(flat) - len(self.names)
        out = self.model(*flat[:n_args], **dict(zip(self.names, flat[n_args:])), **self.options)
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, dict):  # a transformers ModelOutput: logits / last_hidden_state first
            self.output_name = next(iter(out.keys()))
            return out[self.output_name]
        return out


def dynamic_shapes(flat: tuple):
    auto = torch.export.Dim.AUTO  # one spec for TensorForward's *flat
    return (tuple({0: auto, 1: auto} if t.dim() >= 2 else ({0: auto} if t.dim() == 1 else None) for t in flat),)
