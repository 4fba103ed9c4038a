"""The TensorRT path without TensorRT: the errors that say what to install, and the plugin
registration and compile calls it makes, against a fake of the torch-tensorrt API surface it uses
(dynamo.conversion.plugins.generate_plugin / generate_plugin_converter, dynamo.compile)."""

import importlib.machinery
import sys
import types

import pytest
import torch

from attnopt.backends import tensorrt as trt_path

OPS = ["attnopt::linear_attention", "attnopt::linear_window_attention", "attnopt::reuse_attention",
       "attnopt::decay_attention", "attnopt::window_attention", "attnopt::gated_linear_attention",
       "attnopt::gla_window_attention", "attnopt::gated_delta_attention"]


def _fake(monkeypatch, version="10.8.0"):
    """Install fake torch_tensorrt and tensorrt modules; returns the list of calls they saw."""
    calls = []
    plugins = types.SimpleNamespace(
        generate_plugin=lambda name: calls.append(("generate_plugin", name)),
        generate_plugin_converter=lambda name, **kw: calls.append(("generate_plugin_converter", name, kw)),
    )

    def dynamo_compile(program, **kw):
        calls.append(("compile", program, kw))
        return "engine"

    fake = types.ModuleType("torch_tensorrt")
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_tensorrt", None)  # torch's import scans read it
    fake.dynamo = types.SimpleNamespace(conversion=types.SimpleNamespace(plugins=plugins), compile=dynamo_compile)
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    monkeypatch.setitem(sys.modules, "torch_tensorrt", fake)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    return calls


def test_every_entry_point_says_what_to_install_without_torch_tensorrt(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch_tensorrt", None)
    for call in (trt_path.require, trt_path.register_plugins, lambda: trt_path.parse_onnx(tmp_path / "m.onnx"),
                 lambda: trt_path.compile(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))):
        with pytest.raises(trt_path.TensorRTUnavailable) as e:
            call()
        assert str(e.value) == ("attnopt's TensorRT path needs torch-tensorrt: pip install 'attnopt[tensorrt]' "
                                "(torch-tensorrt >= 2.6 with TensorRT >= 10.7, on a CUDA machine)")


def test_tensorrt_older_than_10_7_is_refused(monkeypatch):
    _fake(monkeypatch, version="10.6.1")
    with pytest.raises(trt_path.TensorRTUnavailable, match=r"TensorRT 10\.6\.1 is too old: generated plugins need >= 10\.7"):
        trt_path.register_plugins()


def test_plugins_and_converters_are_generated_for_every_form_op(monkeypatch):
    calls = _fake(monkeypatch)
    assert sorted(trt_path.plugin_ids()) == sorted(OPS)
    assert trt_path.register_plugins() == trt_path.plugin_ids()
    generated = [c[1] for c in calls if c[0] == "generate_plugin"]
    converters = [c for c in calls if c[0] == "generate_plugin_converter"]
    assert generated == [c[1] for c in converters] == trt_path.plugin_ids()
    assert all(c[2]["supports_dynamic_shapes"] is True for c in converters)

    # The validator leaves a call to PyTorch when an optional tensor is absent (no TRT plugin input
    # can be None): linear_attention's weight (arg 4) and key_mask (arg 8).
    validate = dict((c[1], c[2]["capability_validator"]) for c in converters)["attnopt::linear_attention"]
    t = torch.zeros(1)
    node = lambda weight, mask: types.SimpleNamespace(args=(t, t, t, "favor", weight, True, 0.1, 1e-6, mask, 64))
    assert validate(node(t, t)) is True
    assert validate(node(None, t)) is False and validate(node(t, None)) is False


def test_compile_exports_the_rewritten_model_with_attnopt_ops_for_torch_tensorrt(monkeypatch):
    calls = _fake(monkeypatch)
    import attnopt

    class A(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    g = torch.Generator().manual_seed(0)
    q, k = (0.05 * torch.randn(2, 4, 20, 8, generator=g) for _ in range(2))
    inputs = (q, k, torch.randn(2, 4, 20, 8, generator=g))
    opt = attnopt.compile(A(), "linear", example_inputs=inputs, tolerance=10.0, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 1
    assert trt_path.compile(opt, inputs) == "engine"
    [(_, program, kw)] = [c for c in calls if c[0] == "compile"]
    used = [str(n.target) for n in program.graph.nodes if n.op == "call_function" and n.users]
    assert used == ["attnopt.linear_attention.default"]  # the site's op is what feeds the output
    assert [t.shape for t in kw["arg_inputs"]] == [x.shape for x in inputs]
    assert [c[1] for c in calls if c[0] == "generate_plugin"] == trt_path.plugin_ids()  # registered before compiling
