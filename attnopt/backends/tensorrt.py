"""TensorRT through torch-tensorrt, with attnopt's custom ops as TensorRT plugins generated from the ops.

Route: for each form's op (`attnopt::linear_attention`, ...) torch-tensorrt's
`torch_tensorrt.dynamo.conversion.plugins.generate_plugin` builds a TensorRT Quick Deployable
Plugin (its shape function from the op's fake kernel, its enqueue the op's own implementation)
and `generate_plugin_converter` registers the converter that puts that plugin in the network. QDP
needs TensorRT >= 10.7 (ahead-of-time plugins with Triton-compiled PTX need >= 10.9).

A TensorRT plugin has no absent inputs, so a call whose optional tensor (a feature-map weight, a
key mask) is None is left to PyTorch by the capability validator; torch-tensorrt then runs it
outside the engine. ONNX files from `export_onnx(target="custom")` name each site so TensorRT's
ONNX parser binds the same plugin: op_type = the op's name, attributes plugin_namespace="attnopt"
and plugin_version (see `attnopt.backends.onnx.custom`).

TensorRT cannot be installed where attnopt is built and tested; every entry point here raises
`TensorRTUnavailable` saying what to install, and none of this has run on TensorRT.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from attnopt import forms
from attnopt.backends.export_inputs import (
    TensorForward,
    compiled_for_export,
    dynamic_shapes,
    example_args,
)

MIN_TENSORRT = (10, 7)
INSTALL = "pip install 'attnopt[tensorrt]' (torch-tensorrt >= 2.6 with TensorRT >= 10.7, on a CUDA machine)"


class TensorRTUnavailable(ImportError):
    """torch-tensorrt or TensorRT is missing or too old; the message says what to install."""


def require() -> Any:
    """The torch_tensorrt module, checked: TensorRT >= 10.7 and its plugin generator present."""
    try:
        import torch_tensorrt
    except ImportError:
        raise TensorRTUnavailable(f"attnopt's TensorRT path needs torch-tensorrt: {INSTALL}") from None
    try:
        import tensorrt
    except ImportError:
        raise TensorRTUnavailable(f"attnopt's TensorRT path needs TensorRT itself: {INSTALL}") from None
    version = tuple(int(p) for p in str(getattr(tensorrt, "__version__", "0")).split(".")[:2] if p.isdigit())
    if version < MIN_TENSORRT:
        raise TensorRTUnavailable(f"TensorRT {getattr(tensorrt, '__version__', '?')} is too old: generated plugins "
                                  f"need >= {'.'.join(map(str, MIN_TENSORRT))}; {INSTALL}")
    plugins = getattr(getattr(getattr(torch_tensorrt, "dynamo", None), "conversion", None), "plugins", None)
    if plugins is None or not hasattr(plugins, "generate_plugin") or not hasattr(plugins, "generate_plugin_converter"):
        raise TensorRTUnavailable(f"this torch-tensorrt has no dynamo.conversion.plugins.generate_plugin; {INSTALL}")
    return torch_tensorrt


def _optional_tensor_positions(op_name: str) -> list[int]:
    namespace, name = op_name.split("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    return [i for i, a in enumerate(schema.arguments) if str(a.type) == "Optional[Tensor]"]


def capability_validator(op_name: str) -> Callable:
    """(node, settings) -> bool: the plugin serves a call only when every optional tensor is present."""
    positions = _optional_tensor_positions(op_name)

    def validate(node, settings=None) -> bool:
        return all(i < len(node.args) and node.args[i] is not None for i in positions)

    return validate


def plugin_ids() -> list[str]:
    """"namespace::name" of every attnopt op, one per form that adds one: the TensorRT plugin ids, and
    (split at "::") the plugin_namespace and op_type of the custom-domain ONNX nodes."""
    lowerings = [forms.get(n).onnx_lowering() for n in forms.names()]
    return [lowering.op for lowering in lowerings if lowering is not None]


def register_plugins(op_names: Optional[list] = None) -> list[str]:
    """Generate and register a TensorRT plugin and converter for each attnopt op; returns their ids."""
    torch_tensorrt = require()
    plugins = torch_tensorrt.dynamo.conversion.plugins
    op_names = plugin_ids() if op_names is None else op_names
    registered = []
    for op_name in op_names:
        plugins.generate_plugin(op_name)
        plugins.generate_plugin_converter(op_name, capability_validator=capability_validator(op_name),
                                          supports_dynamic_shapes=True)
        registered.append(op_name)
    return registered


def compile(model: nn.Module, example_inputs: Any, *, policy: Any = None, **settings) -> nn.Module:
    """A TensorRT module of a compiled model (or of `model` compiled with `policy`), attnopt ops as plugins.

    `settings` go to `torch_tensorrt.dynamo.compile` (e.g. enabled_precisions={torch.float16}).
    """
    torch_tensorrt = require()

    opt = compiled_for_export(model, policy, example_inputs)
    register_plugins()
    args, kwargs = example_args(opt, example_inputs)
    flat = tuple(args) + tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))
    program = torch.export.export(TensorForward(opt, kwargs), flat, dynamic_shapes=dynamic_shapes(flat), strict=False)
    return torch_tensorrt.dynamo.compile(program, arg_inputs=list(flat), **settings)


def parse_onnx(path) -> Any:
    """A TensorRT network parsed from an `export_onnx(target="custom")` file (plugins bound by name)."""
    require()
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejects {path}: {errors}")
    return network
