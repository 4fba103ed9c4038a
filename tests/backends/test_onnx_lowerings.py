"""Each form's ONNX lowering on its own, against the kernels' dense O(N²) reference formulas (not the
torch ops the lowerings replace): exported once at one length with dynamic batch and length, run
in ONNX Runtime at another length and batch, and (standard ops) in onnx.reference.

The cases are the variants the model tests do not reach: per-head and stabilised feature maps,
bidirectional bands with sinks, padded keys, GQA (reuse's block-sparse lowering: tests/forms/test_reuse_onnx.py).
"""

import numpy as np
import pytest
import torch

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from attnopt.forms.ssm import onnx as decay
from attnopt.forms.linear import onnx as linear
from attnopt.forms.linear_window import onnx as linear_window
from attnopt.forms.window import onnx as window  # noqa: E402
from attnopt.forms.ssm.reference import decay_attention, decay_attention_reference
from attnopt.kernels.feature_maps import make_feature_map
from attnopt.forms.linear.reference import linear_attention, linear_attention_reference
from attnopt.forms.linear_window.reference import linear_window_attention, linear_window_attention_reference
from attnopt.forms.window.reference import window_attention, window_attention_reference

H, HKV, D, DV = 4, 2, 16, 12


def _inputs(n, b, seed, dv=DV):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, n, generator=g) > 0.2
    keep[:, 0] = True
    return (torch.randn(b, H, n, D, generator=g), torch.randn(b, HKV, n, D, generator=g),
            torch.randn(b, HKV, n, dv, generator=g), keep)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), b.double().numpy()
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


class Op(torch.nn.Module):
    def __init__(self, call, oracle, weights=()):
        super().__init__()
        self.call, self.oracle = call, oracle
        self.weights = torch.nn.ModuleList(weights)

    def forward(self, q, k, v, keep):
        return self.call(q, k, v, keep)


def _check(module, lowering, target, dv=DV, reference=True):
    dims = torch.export.Dim("B"), torch.export.Dim("N")
    spec = ({0: dims[0], 2: dims[1]},) * 3 + ({0: dims[0], 1: dims[1]},)
    program = torch.export.export(module, _inputs(70, 2, 0, dv), dynamic_shapes=spec)
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False,
                                     custom_translation_table={lowering.torch_op(): lowering.by_target[target]})
    sess = ort.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for n, b in ((131, 3), (5, 1)):  # another length (three chunks), and one shorter than a block
        inputs = _inputs(n, b, n, dv)
        with torch.no_grad():
            want = module.oracle(*inputs)
        got = sess.run(None, {nm: t.numpy() for nm, t in zip(names, inputs)})[0]
        assert got.shape == tuple(want.shape) and _rel(got, want) <= 1e-4, (n, b, _rel(got, want))
    if reference:
        inputs = _inputs(9, 1, 9, dv)
        ref = ReferenceEvaluator(onnx_program.model_proto)
        got = ref.run(None, {nm: t.numpy() for nm, t in zip(ref.input_names, inputs)})[0]
        with torch.no_grad():
            assert _rel(got, module.oracle(*inputs)) <= 1e-4
    return onnx_program.model_proto


def test_linear_favor_bidirectional_and_taylor_causal_in_ort():
    fmap = make_feature_map("favor", D, H, seed=3)
    kw = dict(scale=0.25, eps=1e-6)
    m = Op(lambda q, k, v, keep: linear_attention(q, k, v, feature_map=fmap, causal=False, key_mask=keep, **kw),
           lambda q, k, v, keep: linear_attention_reference(q, k, v, feature_map=fmap, causal=False, key_mask=keep,
                                                            **kw), [fmap])
    _check(m, linear.LOWERING, "onnx-std")
    taylor = make_feature_map("taylor", D, H)
    m = Op(lambda q, k, v, keep: linear_attention(q, k, v, feature_map=taylor, causal=True, key_mask=keep, **kw),
           lambda q, k, v, keep: linear_attention_reference(q, k, v, feature_map=taylor, causal=True, key_mask=keep,
                                                            **kw))
    proto = _check(m, linear.LOWERING, "ort", reference=False)
    [node] = [n for n in proto.graph.node if n.op_type == "LinearAttention"]
    attrs = {a.name: a for a in node.attribute}
    assert attrs["update_rule"].s == b"linear" and attrs["scale"].f == 1.0  # never the gated_delta default
    assert (attrs["q_num_heads"].i, attrs["kv_num_heads"].i) == (H, HKV)  # GQA kept, keys not repeated


def test_window_bidirectional_band_with_sinks_and_padding():
    kw = dict(window=5, causal=False, sinks=3, scale=0.3)
    m = Op(lambda q, k, v, keep: window_attention(q, k, v, key_mask=keep, **kw),
           lambda q, k, v, keep: window_attention_reference(q, k, v, key_mask=keep, **kw))
    proto = _check(m, window.LOWERING, "ort", dv=D)  # bidirectional: ORT's GQA cannot, so the band
    assert {n.domain for n in proto.graph.node} == {""}


def test_causal_window_with_a_key_mask_runs_gqa_only_when_no_key_is_dropped():
    kw = dict(window=8, causal=True, sinks=0, scale=0.3)
    m = Op(lambda q, k, v, keep: window_attention(q, k, v, key_mask=keep, **kw),
           lambda q, k, v, keep: window_attention_reference(q, k, v, key_mask=keep, **kw))
    proto = _check(m, window.LOWERING, "ort", dv=D, reference=False)  # padded keys: the banded branch
    [branch] = [n for n in proto.graph.node if n.op_type == "If"]
    then = {n.op_type for a in branch.attribute if a.name == "then_branch" for n in a.g.node}
    assert "GroupQueryAttention" in then
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    q, k, v, keep = _inputs(90, 2, 7, D)
    keep = torch.ones_like(keep)  # nothing dropped: the GQA branch
    got = sess.run(None, {i.name: t.numpy() for i, t in zip(sess.get_inputs(), (q, k, v, keep))})[0]
    assert _rel(got, window_attention_reference(q, k, v, key_mask=keep, **kw)) <= 1e-4


@pytest.mark.parametrize("fmap_name,causal,sinks", [("favor", False, 2), ("hedgehog", True, 3)])
def test_linear_window_with_stabilised_and_per_head_maps(fmap_name, causal, sinks):
    fmap = make_feature_map(fmap_name, D, H, seed=1)
    beta = torch.tensor([0.5, 1.0, 2.0, 0.0])
    kw = dict(window=6, causal=causal, sinks=sinks, scale=0.25, feature_map=fmap, linear_weight=beta)
    m = Op(lambda q, k, v, keep: linear_window_attention(q, k, v, key_mask=keep, **kw),
           lambda q, k, v, keep: linear_window_attention_reference(q, k, v, key_mask=keep, **kw), [fmap])
    _check(m, linear_window.LOWERING, "onnx-std")


@pytest.mark.parametrize("target", ["ort", "onnx-std"])
def test_decay_with_padded_keys(target):
    holder = torch.nn.Module()  # γ as a buffer: a plain tensor constant would be value-checked while tracing
    holder.register_buffer("gamma", torch.tensor([0.9, 0.5, 0.99, 1.0]))
    kw = dict(feature_map="elu", normalize=True, eps=1e-6)
    m = Op(lambda q, k, v, keep: decay_attention(q, k, v, decay=holder.gamma, key_mask=keep, **kw),
           lambda q, k, v, keep: decay_attention_reference(q, k, v, decay=holder.gamma, key_mask=keep, **kw), [holder])
    proto = _check(m, decay.LOWERING, target, reference=target == "onnx-std")
    rules = [a.s for n in proto.graph.node if n.op_type == "LinearAttention" for a in n.attribute
             if a.name == "update_rule"]
    assert rules == ([b"gated"] if target == "ort" else [])


def _exact_below_oracle(q, k, v, keep, form_out, T, scale):
    """numpy: a query among its row's first T real tokens attends, by softmax, to the real tokens up to
    itself; every other query keeps the form's output."""
    q, k, v, keep, out = (np.asarray(x, np.float64) if x.dtype != bool else np.asarray(x)
                          for x in (q, k, v, keep, form_out))
    B, H, N, _ = q.shape
    G = H // k.shape[1]
    for b in range(B):
        real = np.flatnonzero(keep[b])
        for i in range(N):
            p = int(keep[b, :i + 1].sum()) - 1  # the query's real position (a pad: its predecessor's)
            if p >= T:
                continue
            seen = real[real <= i]
            for h in range(H):
                if not len(seen):
                    out[b, h, i] = 0.0
                    continue
                s = scale * k[b, h // G, seen] @ q[b, h, i]
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h // G, seen]
    return out


@pytest.mark.parametrize("target", ["ort", "onnx-std"])
def test_exact_prefix_step_over_calls_of_any_length(target):
    """The exact prefix of a site under min_seq_len = T, driven as a decode graph drives it: a prompt in two
    chunks then single tokens, left padding, T reached inside a chunk and while decoding (GQA 4/2)."""
    from attnopt.forms.exact import onnx as exact_onnx
    from attnopt.forms.exact import step as exact_step  # noqa: F401  (registers the op)

    T, scale = 7, 0.3

    class Prefix(torch.nn.Module):
        def forward(self, q, k, v, mask, prefix, form_out):
            return torch.ops.attnopt.exact_prefix_step(q, k, v, mask, prefix, form_out, scale)

    B, N = 2, 14
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g), torch.randn(B, HKV, N, DV,
                                                                                                          generator=g)
    form_out = torch.randn(B, H, N, DV, generator=g)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :4] = False  # row 1: 4 pads, its T-th real token comes 4 columns later
    example = tuple(t.clone() for t in (q[:, :, :3], k[:, :, :3], v[:, :, :3], keep[:, :5],
                                        torch.zeros(B, HKV, T, D + DV), form_out[:, :, :3]))
    Bd, Td, Nd = torch.export.Dim("B"), torch.export.Dim("T", min=1), torch.export.Dim("N", min=1)
    spec = ({0: Bd, 2: Td},) * 3 + ({0: Bd, 1: Nd}, {0: Bd}, {0: Bd, 2: Td})
    program = torch.export.export(Prefix(), example, dynamic_shapes=spec, strict=False)
    lowering = exact_onnx.PREFIX_LOWERING
    proto = torch.onnx.export(program, dynamo=True, verbose=False,
                              custom_translation_table={lowering.torch_op(): lowering.by_target[target]}).model_proto
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    want = _exact_below_oracle(q.numpy(), k.numpy(), v.numpy(), keep.numpy(), form_out.numpy(), T, scale)
    prefix = np.zeros((B, HKV, T, D + DV), np.float32)
    bounds = [0, 5, 9, *range(10, N + 1)]
    for a, b in zip(bounds, bounds[1:]):
        feeds = [t[:, :, a:b].numpy() for t in (q, k, v)] + [keep[:, :b].numpy(), prefix, form_out[:, :, a:b].numpy()]
        out, prefix = sess.run(None, dict(zip(names, feeds)))
        assert _rel(out, torch.as_tensor(want[:, :, a:b])) <= 1e-5, (a, b)
    real = [np.flatnonzero(keep[r].numpy())[:T] for r in range(B)]  # the slots: each row's first T real tokens
    for r in range(B):
        assert np.array_equal(prefix[r, :, :, :D], k[r][:, real[r]].numpy())
