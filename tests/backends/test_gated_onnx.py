"""The gated ops' ONNX lowerings on their own, against the fp64 token oracles (not the torch ops):
exported once with dynamic batch and length, run in ONNX Runtime at another length and batch with
padded keys, and (standard ops) in onnx.reference; plus a compiled decoder exported end to end."""

import os
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from attnopt.forms.delta import onnx as delta_onnx  # noqa: E402
from attnopt.forms.delta.reference import gated_delta_attention  # noqa: E402
from attnopt.forms.gla import onnx as gla_onnx  # noqa: E402
from attnopt.forms.gla.reference import gated_linear_attention  # noqa: E402
from attnopt.forms.gla_window import onnx as gla_window_onnx  # noqa: E402
from attnopt.forms.gla_window.reference import gla_window_attention  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
from gated_oracles import delta_oracle, gla_oracle, gla_window_oracle  # noqa: E402

H, HKV, D, DV = 4, 2, 8, 6
GATE = torch.linspace(-1.0, 1.0, D * D).reshape(D, D)  # a fixed gate projection, so g depends on k


def _inputs(n, b, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, n, generator=g) > 0.2
    keep[:, -1] = True
    keep[-1, :2] = False  # a left-padded row
    return (torch.randn(b, H, n, D, generator=g), torch.randn(b, HKV, n, D, generator=g),
            torch.randn(b, HKV, n, DV, generator=g), keep)


def _gates(k, per_channel):
    g = F.logsigmoid(k @ GATE + 1.0)
    return g if per_channel else g.mean(-1)


class Op(torch.nn.Module):
    def __init__(self, call, oracle):
        super().__init__()
        self.call, self.oracle = call, oracle

    def forward(self, q, k, v, keep):
        return self.call(q, k, v, keep)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), b.double().numpy()
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def _check(module, lowering, target):
    dims = torch.export.Dim("B"), torch.export.Dim("N")
    spec = ({0: dims[0], 2: dims[1]},) * 3 + ({0: dims[0], 1: dims[1]},)
    program = torch.export.export(module, _inputs(30, 2, 0), dynamic_shapes=spec)
    proto = torch.onnx.export(program, dynamo=True, verbose=False,
                              custom_translation_table={lowering.torch_op(): lowering.by_target[target]}).model_proto
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for n, b in ((41, 3), (5, 2)):  # another length and batch, and one shorter than the window
        inputs = _inputs(n, b, n)
        want = module.oracle(*inputs)
        got = sess.run(None, {nm: t.numpy() for nm, t in zip(names, inputs)})[0]
        real = inputs[3][:, None, :, None].expand(want.shape).numpy()  # pad rows' outputs are never read
        assert got.shape == tuple(want.shape) and _rel(got * real, want * real) <= 1e-4, (n, b)
    if target == "onnx-std":
        inputs = _inputs(9, 1, 9)
        ref = ReferenceEvaluator(proto)
        got = ref.run(None, {nm: t.numpy() for nm, t in zip(ref.input_names, inputs)})[0]
        assert _rel(got, module.oracle(*inputs)) <= 1e-4
    return proto


def _rule(proto):
    [node] = [n for n in proto.graph.node if n.op_type == "LinearAttention"]
    attrs = {a.name: a for a in node.attribute}
    assert attrs["scale"].f == 1.0 and (attrs["q_num_heads"].i, attrs["kv_num_heads"].i) == (H, HKV)  # GQA kept
    return attrs["update_rule"].s.decode()


@pytest.mark.parametrize("target", ["ort", "onnx-std"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["channel", "head"])
def test_gated_linear_lowering(target, per_channel):
    kw = dict(feature_map="elu", normalize=True)
    m = Op(lambda q, k, v, keep: gated_linear_attention(q, k, v, _gates(k, per_channel), key_mask=keep, **kw),
           lambda q, k, v, keep: gla_oracle(q, k, v, _gates(k, per_channel), key_mask=keep, **kw)[0])
    proto = _check(m, gla_onnx.LOWERING, target)
    assert target == "onnx-std" or _rule(proto) == "gated"  # never the op's gated_delta default


@pytest.mark.parametrize("target", ["ort", "onnx-std"])
def test_gated_delta_lowering(target):
    def call(fn, q, k, v, keep):
        beta = torch.sigmoid(k[..., 0])
        return fn(q, F.normalize(k, dim=-1), v, _gates(k, False), beta, scale=0.7, key_mask=keep)

    m = Op(lambda *a: call(gated_delta_attention, *a), lambda *a: call(delta_oracle, *a)[0])
    proto = _check(m, delta_onnx.LOWERING, target)
    assert target == "onnx-std" or _rule(proto) == "gated_delta"


@pytest.mark.parametrize("target", ["ort", "onnx-std"])
@pytest.mark.parametrize("per_channel, sinks", [(True, 2), (False, 0)], ids=["channel-sinks", "head"])
def test_gla_window_lowering(target, per_channel, sinks):
    beta = torch.tensor([0.5, 1.0, 1.5, 2.0])

    def feats(q, k):
        return F.elu(q) + 1.0, F.elu(k) + 1.0, _gates(k, per_channel)

    kw = dict(window=4, sinks=sinks, scale=0.4)
    m = Op(lambda q, k, v, keep: gla_window_attention(q, k, v, *feats(q, k), linear_weight=beta, key_mask=keep, **kw),
           lambda q, k, v, keep: gla_window_oracle(q, k, v, *feats(q, k), beta=beta, key_mask=keep, **kw))
    proto = _check(m, gla_window_onnx.LOWERING, target)
    assert target == "onnx-std" or _rule(proto) == "gated"


@pytest.mark.parametrize("policy", ["gla+window:8+fit_steps:0"])  # the ops alone: the lowering tests above
def test_a_compiled_decoder_exports_and_matches_in_ort(tmp_path, policy):
    import attnopt

    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids}, tolerance=10.0, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 2
    rec = attnopt.export_onnx(opt, str(tmp_path / "model.onnx"), {"input_ids": ids}, target="ort", baseline=False)
    assert [s["lowering"] for s in rec.sites] == ["com.microsoft.LinearAttention"] * 2
    assert rec.parity and all(p["rel_rms"] <= 1e-4 for p in rec.parity)  # ORT against torch, at two lengths
