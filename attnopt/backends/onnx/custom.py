"""The "custom" target: each site is one node in the `attnopt` domain plus a model-local function.

Node: domain "attnopt", op_type the op's name (`linear_attention`, `window_attention`,
`decay_attention`, `linear_window_attention`, `reuse_attention`, ...), inputs the op's tensor
arguments that are present (in schema order), attributes its non-tensor arguments under their
schema names plus `plugin_namespace="attnopt"` and `plugin_version`. That is how TensorRT's ONNX
parser binds a node to a plugin (op_type = plugin name, looked up in plugin_namespace at
plugin_version), and it is the name torch-tensorrt's generated plugin for `attnopt::<name>` has.

Function: the same (domain, name) with an `overload` per variant (the static sizes and options a
body depends on), whose body is the form's onnx-std lowering, so ONNX Runtime and any runtime
without a kernel of that name inline it and compute the same thing.
"""

from __future__ import annotations

import hashlib

import onnx_ir as ir
import onnxscript

from attnopt.kernels.onnx.functions import ATTNOPT_DOMAIN
from attnopt.kernels.onnx.lowering import OpLowering

PLUGIN_NAMESPACE = ATTNOPT_DOMAIN


def _attribute(value):
    """Op options as ONNX attributes: bools become ints (ONNX has no bool attribute)."""
    return int(value) if isinstance(value, bool) else value


def _name_every_value(graph) -> None:
    """A unique name for every value the body and its subgraphs (a Scan's body) compute: the tracer
    numbers values per graph it records into (both hold a `val_0`), and a function must be SSA.
    Values are referenced as objects, so names are labels; the body's output keeps its own."""
    keep = {id(v) for v in graph.outputs}
    for i, node in enumerate(ir.traversal.RecursiveGraphIterator(graph)):
        for j, value in enumerate(node.outputs):
            if id(value) not in keep:
                value.name = f"n{i}_{j}"
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                for k, value in enumerate(attr.value.inputs):
                    value.name = f"n{i}_in{k}"


def custom_domain_call(lowering: OpLowering, bound: dict, plugin_version: str):
    """Record the custom-domain node for one call; returns (its output, the function it calls)."""
    recorder = onnxscript.evaluator.default()
    tensors = {k: v for k, v in bound.items() if isinstance(v, ir.Value)}
    options = {k: v for k, v in bound.items() if not isinstance(v, ir.Value) and v is not None}
    signature = repr(sorted((k, [d if isinstance(d, int) else "?" for d in (v.shape or [])], str(v.dtype))
                            for k, v in tensors.items())) + repr(sorted(options.items()))
    overload = hashlib.sha1(signature.encode()).hexdigest()[:12]

    # Trace the onnx-std body into a fresh node list (and constant cache), so nothing is shared
    # with the model's graph.
    saved_nodes, saved_farm = recorder.nodes, recorder.constant_farm
    recorder.nodes, recorder.constant_farm = [], {}
    try:
        inputs = {}
        for k, v in tensors.items():
            fresh = type(v)(recorder.opset, name=k, shape=v.shape, type=v.type)
            inputs[k] = fresh
        body_out = lowering.by_target["onnx-std"](**{**bound, **inputs})
        body_nodes = recorder.nodes
    finally:
        recorder.nodes, recorder.constant_farm = saved_nodes, saved_farm
    body_out.name = "output"
    graph = ir.Graph(list(inputs.values()), [body_out], nodes=body_nodes, opset_imports={"": 18},
                     name=f"{lowering.name}_{overload}")
    _name_every_value(graph)
    function = ir.Function(ATTNOPT_DOMAIN, lowering.name, overload, graph=graph, attributes=[])

    first = next(iter(tensors.values()))
    output = type(first)(recorder.opset)
    output.dtype = first.dtype
    attributes = {k: _attribute(v) for k, v in options.items()}
    attributes.update(plugin_namespace=PLUGIN_NAMESPACE, plugin_version=plugin_version)
    node = ir.Node(ATTNOPT_DOMAIN, lowering.name, inputs=list(tensors.values()),
                   attributes=ir.convenience.convert_attributes(attributes), overload=overload, outputs=[output])
    recorder.nodes.append(node)
    return output, function
