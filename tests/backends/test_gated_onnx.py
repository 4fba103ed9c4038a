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
F64 = torch.float64
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


# ---------------------------------------------------------------- gla+window's decode step alone

STEP_W = 4
STEP_CHUNKS = (2, 3, 4, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22)  # a first chunk all pads for the last row,
# single tokens inside and past the window, a chunk of 9 (> W: keys leave the buffer inside the call)


class _GlaWindowStep(torch.nn.Module):
    """The step op on given tensors, with β and the window as constants."""

    def __init__(self, sinks):
        super().__init__()
        self.sinks = sinks
        self.register_buffer("beta", torch.tensor([0.5, 1.0, 1.5, 2.0]))

    def forward(self, q, k, v, phi_q, phi_k, g, mask, buffer, slots, gated, keys):
        return torch.ops.attnopt.gla_window_step(q, k, v, phi_q, phi_k, g, mask, buffer, slots, gated, keys,
                                                 self.beta.to(q.dtype), STEP_W, self.sinks, 0.4)


def _step_zeros(b, sinks, dtype):
    """Zero states as the decode graph starts them: buffer, slots, gated S ‖ z, buffered features."""
    return [torch.zeros(b, HKV, sinks + STEP_W - 1, D + DV, dtype=dtype), torch.zeros(b, 1, sinks + STEP_W, dtype=torch.long),
            torch.zeros(b, HKV, D, DV + 1, dtype=dtype), torch.zeros(b, HKV, STEP_W - 1, D, dtype=dtype)]


def _step_tensors(q, k, v, keep, per_channel):
    """The step's per-token inputs: q, k, v, φ(q), φ(k) (elu + 1), log-gates."""
    return [q, k, v, F.elu(q) + 1.0, F.elu(k) + 1.0, _gates(k, per_channel)]


def _chunked(run, tensors, keep, states):
    """The outputs of `run(*chunk inputs, mask so far, *states)` over STEP_CHUNKS, concatenated, and the last states."""
    outs, bounds = [], [0, *STEP_CHUNKS, keep.shape[1]]
    for a, b in zip(bounds, bounds[1:]):
        out, *states = run(*[t[:, :, a:b] for t in tensors], keep[:, :b], *states)
        outs.append(np.asarray(out))
    return np.concatenate(outs, axis=2), states


@pytest.mark.parametrize("target", ["ort", "onnx-std"])
@pytest.mark.parametrize("per_channel, sinks", [(True, 2), (False, 0), (False, 1)], ids=["channel-sinks2", "head",
                                                                                         "head-sinks1"])
def test_gla_window_step_lowering_in_chunks(target, per_channel, sinks):
    """The exported step, fed a padded sequence in chunks of 1 to 9 tokens, gives the fp64 token oracle's
    output, and the states it carries are those of the torch step op (itself checked against the oracle)."""
    from attnopt.forms.gla_window import step  # noqa: F401  (registers the op)

    module = _GlaWindowStep(sinks)
    B, T, P = torch.export.Dim("B"), torch.export.Dim("T"), torch.export.Dim("total", min=1)
    q, k, v, keep = _inputs(5, 2, 1)
    example = (*[t[:, :, 2:].contiguous() for t in _step_tensors(q, k, v, keep, per_channel)], keep,
               *_step_zeros(2, sinks, torch.float32))
    spec = ({0: B, 2: T},) * 6 + ({0: B, 1: P},) + ({0: B},) * 4
    program = torch.export.export(module, example, dynamic_shapes=spec)
    proto = torch.onnx.export(program, dynamo=True, verbose=False, custom_translation_table={
        gla_window_onnx.DECODE_LOWERING.torch_op(): gla_window_onnx.DECODE_LOWERING.by_target[target]}).model_proto
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    assert target == "onnx-std" or _rule(proto) == "gated"

    q, k, v, keep = _inputs(31, 3, 5)
    tensors = _step_tensors(q, k, v, keep, per_channel)
    beta = module.beta.double()
    want = gla_window_oracle(*[t.double() for t in tensors], window=STEP_W, sinks=sinks, scale=0.4, beta=beta,
                             key_mask=keep)
    real = keep[:, None, :, None].expand(want.shape)  # pad rows' outputs are never read

    module.double()

    def torch_step(*args):
        with torch.no_grad():
            return module(*args)

    eager, eager_states = _chunked(torch_step, [t.double() for t in tensors], keep, _step_zeros(3, sinks, F64))
    assert _rel(eager * real.numpy(), want * real) <= 1e-12

    def ort_step(*args):
        return sess.run(None, {n: a.numpy() if isinstance(a, torch.Tensor) else a for n, a in zip(names, args)})

    got, got_states = _chunked(ort_step, tensors, keep, [s.numpy() for s in _step_zeros(3, sinks, torch.float32)])
    assert got.shape == tuple(want.shape) and _rel(got * real.numpy(), want * real) <= 1e-5
    for mine, theirs in zip(got_states, eager_states):  # buffer, slots (exact), gated S ‖ z, buffered features
        assert mine.shape == tuple(theirs.shape)
        assert np.array_equal(mine, theirs.numpy()) if mine.dtype == np.int64 else _rel(mine, theirs) <= 1e-5


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_key_gates_export_exactly_at_strong_decays(gate):
    """The gated forms' log-gates logsigmoid(k P + b) / 16 in ONNX Runtime equal fp64 ones from
    pre-activations far below −18 (where ORT's Sigmoid is 0: Log(Sigmoid) would give −inf) and above 0."""
    from attnopt.forms.gla.form import GATE_NORMALIZER, GATE_PRE_LIMIT, KeyGates

    class Gates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gates = KeyGates(D, HKV, "elu", 0, 0, gate)
            with torch.no_grad():
                self.gates.gate_bias_HkvG[0].fill_(-48.0)  # a bias fitted to a short look-back (decay 0.05)

        def forward(self, k):
            return self.gates.log_gates(k)

    module = Gates()
    k = torch.randn(2, HKV, 64, D, generator=torch.Generator().manual_seed(4)) * 8.0
    program = torch.export.export(module, (k,), dynamic_shapes=({0: torch.export.Dim("B"), 2: torch.export.Dim("N")},))
    proto = torch.onnx.export(program, dynamo=True, verbose=False).model_proto
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: k.numpy()})[0]
    x = module.gates.pre_activation(k.double())
    assert float(x.min()) < -40.0 and float(x.max()) > 5.0  # the range the docstring names
    want = F.logsigmoid(x.clamp(-GATE_PRE_LIMIT, GATE_PRE_LIMIT)) / GATE_NORMALIZER  # the form bounds x (finite gates)
    want = want if gate == "channel" else want[..., 0]
    assert np.isfinite(got).all() and np.abs(got - want.numpy()).max() <= 1e-6
    assert (module(k) - want).abs().max() <= 1e-6  # torch's own formula is logsigmoid too
