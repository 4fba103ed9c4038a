"""attnopt.export_onnx on whole models: ORT parity at a length other than the export length, the
lowering each form chose, the op histograms, the custom-domain fallback, and the errors.

Every parity figure here is measured again by this file (its own ORT session, inputs of its own
length and batch), not only read from what export_onnx returned.
"""

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnopt

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from attnopt.kernels.onnx import lowering as lowering_module  # noqa: E402  (needs onnxscript)
from attnopt.ir.errors import ParityError  # noqa: E402
from attnopt.forms.linear.onnx import LOWERING as LINEAR  # noqa: E402

VOCAB = 97


def _ort_outputs(path, feeds):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: t.numpy() for n, t in zip(names, feeds)})


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


# ---------------------------------------------------------------- a Llama-style decoder, three forms


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    policy = {"name": "three forms", "rules": [
        {"form": "window", "params": {"window": 8}, "layers": [0, 0]},
        {"form": "linear", "layers": [1, 1]},
        {"form": "ssm", "layers": [2, 2]},
    ]}
    opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids}, tolerance=0.99, e2e_tolerance=None)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["window", "linear", "ssm"]
    return model, opt, ids


def test_llama_window_linear_ssm_match_torch_in_ort_at_another_length(llama, tmp_path):
    model, opt, ids = llama
    path = tmp_path / "llama.onnx"
    result = attnopt.export_onnx(opt, path, {"input_ids": ids}, target="ort", baseline=False)

    assert [(s["site"], s["form"], s["lowering"]) for s in result.sites] == [
        # no attention_mask input: the sites get no key mask (never a [B, 1, N, N] one), so GQA as is
        ("model.layers.0.self_attn#0", "window", "com.microsoft.GroupQueryAttention"),
        ("model.layers.1.self_attn#0", "linear", "com.microsoft.LinearAttention"),
        ("model.layers.2.self_attn#0", "ssm", "com.microsoft.LinearAttention"),
    ]
    assert result.ops_after["com.microsoft.LinearAttention"] == 2 and result.ops_before == {}
    assert [p["length"] for p in result.parity] == [40, 61]
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)
    assert opt.attnopt_report.exports[-1]["path"] == str(path)
    page = opt.attnopt_report.to_html()  # the page lists the export, its lowerings and its checks
    section = page[page.index("<h2>ONNX exports</h2>"):page.index("<h2>Near misses</h2>")]
    assert str(path) in section and "prefill file" in section and "linear: com.microsoft.LinearAttention" in section
    assert "onnxruntime-cpu at 61" in section

    # Our own run: batch 3 and a length the export never saw.
    ids_long = torch.randint(0, VOCAB, (3, 83), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = opt(input_ids=ids_long, use_cache=False).logits
        original = model(input_ids=ids_long, use_cache=False).logits
    got = _ort_outputs(path, [ids_long])[0]
    assert got.shape == (3, 83, VOCAB)
    assert _rel(got, want) <= 1e-4
    assert _rel(got, original) > 1e-2  # the file computes the rewrite, not the original model
    onnx.checker.check_model(onnx.load(path))


# ---------------------------------------------------------------- real MiniLM (bidirectional)


def test_minilm_window_and_linear_match_torch_at_another_length(minilm, tmp_path):
    model, tok = minilm
    from attnopt.samples import english_passages

    enc = dict(tok(english_passages()[:2], return_tensors="pt", truncation=True, max_length=32,
                   padding="max_length"))
    policy = {"name": "mixed", "rules": [{"form": "window", "params": {"window": 8, "sinks": 2}, "layers": [0, 2]},
                                         {"form": "linear", "layers": [3, 5]}]}
    # tolerance 10: keep every site rewritten whatever its drift (what is tested is the export)
    opt = attnopt.compile(model, policy, example_inputs=enc, tolerance=10.0, e2e_tolerance=None)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["window"] * 3 + ["linear"] * 3
    path = tmp_path / "minilm.onnx"
    result = attnopt.export_onnx(opt, path, enc, target="ort", baseline=False)
    assert [s["form"] for s in result.sites] == ["window"] * 3 + ["linear"] * 3
    assert all(s["lowering"] == "standard ops" for s in result.sites)  # bidirectional: MatMul form, bands
    assert [p["length"] for p in result.parity] == [32, 49]
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)
    # the file's inputs and output carry the model's names, as the tokenizer and the model give them
    proto = onnx.load(path)
    assert [i.name for i in proto.graph.input] == list(enc) and [o.name for o in proto.graph.output] == [
        "last_hidden_state"]

    long = dict(tok(english_passages()[2:4], return_tensors="pt", truncation=True, max_length=100,
                    padding="max_length"))
    with torch.no_grad():
        want = opt(**long).last_hidden_state
    got = _ort_outputs(path, [long[k] for k in enc])[0]
    assert got.shape == (2, 100, 384) and _rel(got, want) <= 1e-4


# ---------------------------------------------------------------- graph path: GQA, custom domain, errors

C, H = 64, 4


class CausalBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.o = nn.Linear(C, C)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, C // H).permute(2, 0, 3, 1, 4)
        return x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, C))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([CausalBlock(), CausalBlock()])
        self.head = nn.Linear(C, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _net_and_x():
    torch.manual_seed(0)
    return Net().eval(), torch.randn(2, 24, C, generator=torch.Generator().manual_seed(2))


def test_onnx_std_uses_standard_ops_only_and_passes_the_reference_evaluator(tmp_path):
    net, x = _net_and_x()
    policy = {"name": "two forms", "rules": [{"form": "window", "params": {"window": 8, "sinks": 2}, "layers": [0, 0]},
                                             {"form": "ssm", "layers": [1, 1]}]}
    opt = attnopt.compile(net, policy, example_inputs=(x,), tolerance=10.0, e2e_tolerance=None)
    path = tmp_path / "std.onnx"
    result = attnopt.export_onnx(opt, path, (x,), target="onnx-std", baseline=False)
    assert [(s["form"], s["lowering"]) for s in result.sites] == [("window", "standard ops"), ("ssm", "standard ops")]
    assert not any("." in op for op in result.ops_after)
    assert "Scan" in result.ops_after  # the ssm state carried across chunks
    assert [(p["runtime"], p["length"]) for p in result.parity] == [
        ("onnxruntime-cpu", 24), ("onnxruntime-cpu", 37), ("onnx.reference", 16)]
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)
    model_proto = onnx.load(path)
    assert {n.domain for n in model_proto.graph.node} == {""}
    assert [i.name for i in model_proto.graph.input] == ["x"] and [o.name for o in model_proto.graph.output] == [
        "output"]
    # Never a per-position state: no tensor in the graph has more than 5 dims ([B, H, nC, M, W]).
    inferred = onnx.shape_inference.infer_shapes(model_proto)
    ranks = [len(v.type.tensor_type.shape.dim) for v in inferred.graph.value_info if v.type.HasField("tensor_type")]
    assert max(ranks) <= 5
    x_other = torch.randn(3, 150, C, generator=torch.Generator().manual_seed(6))  # three ssm chunks
    with torch.no_grad():
        want = opt(x_other)
    assert _rel(_ort_outputs(path, [x_other])[0], want) <= 1e-4


@pytest.fixture(scope="module")
def net_linear():
    net, x = _net_and_x()
    return attnopt.compile(net, "linear", example_inputs=(x,), tolerance=0.99, e2e_tolerance=None), x


def test_causal_window_without_sinks_or_padding_is_ort_group_query_attention(tmp_path):
    net, x = _net_and_x()
    opt = attnopt.compile(net, "window:8", example_inputs=(x,), tolerance=0.99, e2e_tolerance=None)
    result = attnopt.export_onnx(opt, tmp_path / "w.onnx", (x,))
    assert [s["lowering"] for s in result.sites] == ["com.microsoft.GroupQueryAttention"] * 2
    assert not any("." in op for op in result.ops_before)  # the all-exact export: standard ops only
    assert result.ops_before["Softmax"] == 2 and "Softmax" not in result.ops_after
    assert result.ops_after["com.microsoft.GroupQueryAttention"] == 2
    assert opt.attnopt_report.exports[-1]["ops_before"] == result.ops_before
    gqa = [n for n in onnx.load(tmp_path / "w.onnx").graph.node if n.op_type == "GroupQueryAttention"]
    windows = [a.i for n in gqa for a in n.attribute if a.name == "local_window_size"]
    assert windows == [8, 8]  # ORT counts the window including self, as attnopt does
    x_other = torch.randn(1, 50, C, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = opt(x_other)
    assert _rel(_ort_outputs(tmp_path / "w.onnx", [x_other])[0], want) <= 1e-4


def test_custom_target_is_an_attnopt_domain_node_with_a_local_function(net_linear, tmp_path):
    opt, x = net_linear
    path = tmp_path / "custom.onnx"
    result = attnopt.export_onnx(opt, path, (x,), target="custom", opset=23, baseline=False)
    assert result.ops_after["attnopt.linear_attention"] == 2 and result.opset == 23
    proto = onnx.load(path)
    assert {i.domain: i.version for i in proto.opset_import}[""] == 23
    nodes = [n for n in proto.graph.node if n.domain == "attnopt"]
    assert [n.op_type for n in nodes] == ["linear_attention"] * 2
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_namespace"] == b"attnopt" and attrs["plugin_version"] == b"1"
    assert attrs["feature_map"] == b"elu" and attrs["causal"] == 1
    from attnopt.backends.tensorrt import plugin_ids

    # TensorRT's ONNX parser looks the node up as plugin_namespace::op_type: the generated plugin's id.
    assert f"{attrs['plugin_namespace'].decode()}::{nodes[0].op_type}" in plugin_ids()
    functions = {(f.domain, f.name, f.overload): f for f in proto.functions}
    assert set(functions) == {("attnopt", "linear_attention", nodes[0].overload)}  # both sites: one variant
    body = functions[("attnopt", "linear_attention", nodes[0].overload)]
    assert {n.domain for n in body.node} == {""} and "CumSum" in {n.op_type for n in body.node}
    assert {i.domain: i.version for i in body.opset_import}[""] == 23  # traced at the model's opset
    assert {p["runtime"] for p in result.parity} == {"onnxruntime-cpu", "onnx.reference"}
    with torch.no_grad():
        want = opt(x[:1, :30])
    assert _rel(_ort_outputs(path, [x[:1, :30]])[0], want) <= 1e-4  # ORT inlines the function


def test_custom_target_carries_scan_lowered_forms(tmp_path):
    # ssm and delta bodies hold a Scan whose subgraph the tracer named apart from the body: the
    # function must still be SSA (onnx.checker), and ORT must inline it to torch's output.
    net, x = _net_and_x()
    policy = {"rules": [{"form": "ssm", "layers": [0, 0]}, {"form": "delta", "params": {"fit_steps": 0}, "layers": [1, 1]}]}
    opt = attnopt.compile(net, policy, example_inputs=(x,), tolerance=10.0, e2e_tolerance=None)
    path = tmp_path / "scan.onnx"
    result = attnopt.export_onnx(opt, path, (x,), target="custom", baseline=False)
    assert [s["form"] for s in result.sites] == ["ssm", "delta"]
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)
    proto = onnx.load(path)
    assert [n.domain for n in proto.graph.node if n.domain == "attnopt"] == ["attnopt"] * 2
    assert all("Scan" in {n.op_type for n in f.node} for f in proto.functions)


def test_a_wrong_lowering_is_an_error_naming_the_site_and_form(net_linear, tmp_path, monkeypatch):
    opt, x = net_linear
    good = LINEAR.by_target["ort"]

    def off_by_a_little(*args, **kwargs):
        from onnxscript import opset18 as op

        out = good(*args, **kwargs)
        return op.Mul(out, op.CastLike(op.Constant(value_float=1.001), out))

    monkeypatch.setitem(LINEAR.by_target, "ort", off_by_a_little)
    path = tmp_path / "bad.onnx"
    with pytest.raises(ParityError, match=r"site layers\.0#0 \(linear\): ONNX Runtime output differs .* by relative "
                                          r"RMS 1\.0\de-03 > 0\.0001"):
        attnopt.export_onnx(opt, path, (x,), baseline=False)
    assert not path.exists()  # never a silently wrong file


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


def test_bad_inputs_get_one_line_errors(net_linear, tmp_path, monkeypatch):
    opt, x = net_linear
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "m.onnx", (x,), target="tensorrt")
    assert _one_line(e) == "unknown ONNX target 'tensorrt'; choose one of: ort, onnx-std, custom"
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "m.onnx", (x,), opset=12)
    assert "opset 12 is not supported; use 18..23" in _one_line(e)
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(_net_and_x()[0], tmp_path / "m.onnx", (x,))
    assert "was not compiled by attnopt" in _one_line(e) and "policy=" in str(e.value)
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "missing" / "m.onnx", (x,))
    assert "does not exist" in _one_line(e)
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path, (x,))
    assert "is a directory" in _one_line(e)
    for lengths in ([0], [-3], ["a"], [], 24):
        with pytest.raises(ValueError) as e:
            attnopt.export_onnx(opt, tmp_path / "m.onnx", (x,), check_lengths=lengths)
        assert "check_lengths must be a non-empty list of positive int sequence lengths" in _one_line(e)
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "m", (x,), decode=True, check_lengths=[24])
    assert "a decode folder checks a prompt and decoding steps of its own" in _one_line(e)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    with pytest.raises(ImportError) as e:
        attnopt.export_onnx(opt, tmp_path / "m.onnx", (x,))
    assert _one_line(e) == ("attnopt.export_onnx needs onnxruntime (to check every export against torch); install it "
                            "with pip install 'attnopt[onnx]'")
    assert lowering_module.TARGETS == ("ort", "onnx-std", "custom")


def test_a_site_with_a_run_time_exact_switch_is_refused(tmp_path):
    net, x = _net_and_x()
    policy = {"name": "late", "rules": [{"form": "linear", "params": {"min_seq_len": 16}}]}
    opt = attnopt.compile(net, policy, example_inputs=(x,), tolerance=0.99, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 2
    with pytest.raises(ValueError) as e:
        attnopt.export_onnx(opt, tmp_path / "m.onnx", (x,))
    assert "min_seq_len=16" in _one_line(e) and "layers.0#0 (linear)" in str(e.value)


def test_a_reuse_model_exports_one_prefill_file_equal_to_torch_on_a_left_padded_batch(llama, tmp_path):
    """reuse's anchor selection goes into the prefill file as standard ops (one node per site in
    PyTorch): ORT gives the reused model's logits, not the original's, on a batch as generate() pads it."""
    model, _, ids = llama
    opt = attnopt.compile(model, "reuse:1+block:4+anchor:-1+window:0+sinks:0", example_inputs={"input_ids": ids},
                          dispatch="off", tolerance=10.0, e2e_tolerance=None)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "reuse", "exact"]  # last: exact
    batch = torch.cat([ids, torch.roll(ids, 7, dims=1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0  # the second row starts 6 columns late
    inputs = {"input_ids": batch, "attention_mask": mask}
    path = tmp_path / "m.onnx"
    result = attnopt.export_onnx(opt, path, inputs, decode=False, baseline=False)
    assert [(s["site"], s["lowering"]) for s in result.sites] == [("model.layers.1.self_attn#0", "standard ops")]
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)
    got = torch.from_numpy(_ort_outputs(path, [batch, mask])[0])
    with torch.no_grad():
        want, original = opt(**inputs).logits, model(**inputs).logits
    real = mask.bool()
    assert _rel(got[real], want[real]) <= 1e-4
    assert _rel(original[real], want[real]) > 1e-2  # the selection acts: the file is not the original


def test_a_graph_path_reuse_site_is_one_custom_node_whose_function_selects(tmp_path):
    """A reuse site of a plain nn.Module (the graph path) in the custom target: one `attnopt` node
    carrying the rule as attributes, its function the selection and softmax in standard ops, which
    ORT inlines and onnx.reference runs."""
    net, x = _net_and_x()
    policy = {"name": "reuse layer 1", "rules": [{"form": "reuse", "layers": [1, 1], "params": {
        "top_k": 1, "block": 4, "anchor": 0, "window": 0, "sinks": 0}}]}
    opt = attnopt.compile(net, policy, example_inputs=(x,), dispatch="off", tolerance=10.0, e2e_tolerance=None)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "reuse"]
    path = tmp_path / "custom.onnx"
    result = attnopt.export_onnx(opt, path, (x,), target="custom", baseline=False)
    assert [(s["site"], s["lowering"]) for s in result.sites] == [("layers.1#0", "attnopt.reuse_attention")]
    assert {p["runtime"] for p in result.parity} == {"onnxruntime-cpu", "onnx.reference"}
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)
    [node] = [n for n in onnx.load(path).graph.node if n.domain == "attnopt"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["block"], attrs["top_k"], attrs["window"], attrs["sinks"], attrs["causal"]) == (4, 1, 0, 0, 1)
    x_other = torch.randn(1, 45, C, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, original = opt(x_other), net(x_other)
    assert _rel(_ort_outputs(path, [x_other])[0], want) <= 1e-4 and _rel(original, want) > 1e-3


def test_a_reuse_lowering_that_differs_is_named_by_the_check(tmp_path, monkeypatch):
    """The check exports each site alone to name the one that differs: a reuse site alone gets its
    anchor's q and k, so its selection is exported with it and a wrong one is found there."""
    from attnopt.forms.reuse import onnx as reuse_onnx

    net, x = _net_and_x()
    policy = {"name": "reuse layer 1", "rules": [{"form": "reuse", "layers": [1, 1], "params": {
        "top_k": 1, "block": 4, "anchor": 0, "window": 0, "sinks": 0}}]}
    opt = attnopt.compile(net, policy, example_inputs=(x,), dispatch="off", tolerance=10.0, e2e_tolerance=None)
    good = reuse_onnx.select_prefill

    def one_probe_short(anchor_q, anchor_k, keep, rule, block, P, *args):  # the probes of one position fewer
        return good(anchor_q, anchor_k, keep, rule, block, P - 1, *args)

    monkeypatch.setattr(reuse_onnx, "select_prefill", one_probe_short)
    with pytest.raises(ParityError) as e:
        attnopt.export_onnx(opt, tmp_path / "m.onnx", (x,), baseline=False)
    said = _one_line(e)
    assert "site layers.1#0 (reuse): ONNX Runtime output differs from torch" in said, said
    assert not (tmp_path / "m.onnx").exists()


def test_minilm_with_reuse_layers_exports_and_matches_torch_on_a_right_padded_batch(minilm, tmp_path):
    """The bidirectional selection (the block's own probes, a window each side) in the prefill file of
    a real encoder: ORT equals torch at another length, padded as a tokenizer pads."""
    model, tok = minilm
    from attnopt.samples import english_passages

    def batch(n: int) -> dict:
        texts = [english_passages()[0], english_passages()[1][:60]]  # the second row is short: padding
        return dict(tok(texts, return_tensors="pt", truncation=True, max_length=n, padding="max_length"))

    enc = batch(64)
    opt = attnopt.compile(model, "reuse:2+block:8+every:2", example_inputs=enc, dispatch="off", tolerance=10.0,
                          e2e_tolerance=None)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "reuse"] * 2 + ["exact"] * 2
    path = tmp_path / "minilm.onnx"
    result = attnopt.export_onnx(opt, path, enc, baseline=False)
    assert [s["form"] for s in result.sites] == ["reuse", "reuse"]
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)
    other = batch(104)
    assert int(other["attention_mask"][1].sum()) < 50
    got = torch.from_numpy(_ort_outputs(path, [other[k] for k in enc])[0])
    with torch.no_grad():
        want, original = opt(**other).last_hidden_state, model(**other).last_hidden_state
    real = other["attention_mask"].bool()
    assert _rel(got[real], want[real]) <= 1e-4
    assert _rel(original[real], want[real]) > 1e-3  # 13 blocks, 6 read per query block: the selection acts
    short = batch(20)  # 3 blocks: every one read, so exact attention, padded rows included (an If in the file)
    assert int(short["attention_mask"][1].sum()) < 20
    with torch.no_grad():
        want = opt(**short).last_hidden_state
    assert _rel(_ort_outputs(path, [short[k] for k in enc])[0], want) <= 1e-4


class MaskedSdpaNet(nn.Module):
    """Causal SDPA under a boolean causal-and-padding mask built from a keep input [B, N]."""

    def __init__(self, layers=3, c=32):
        super().__init__()
        self.qkv = nn.ModuleList([nn.Linear(c, 3 * c) for _ in range(layers)])

    def forward(self, x, keep):
        B, N, C = x.shape
        mask = torch.ones(N, N, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :].bool()
        for qkv in self.qkv:
            q, k, v = qkv(x).view(B, N, 3, 4, C // 4).permute(2, 0, 3, 1, 4)
            x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, N, C)
        return x


def test_a_left_padded_example_exports_and_its_padded_rows_are_torchs_zeros(tmp_path):
    # torch's SDPA gives a query that sees no key zeros; the file must too, or a padded example's
    # own parity check fails on rows no one reads (and the file differs from torch there). The
    # first and last layers stay exact SDPA; the middle one is reuse's own op.
    torch.manual_seed(0)
    net = MaskedSdpaNet().eval()
    x, keep = torch.randn(2, 48, 32), torch.ones(2, 48, dtype=torch.long)
    keep[1, :5] = 0
    opt = attnopt.compile(net, "reuse:1+block:8+anchor:-1+window:0+sinks:0", example_inputs=(x, keep), dispatch="off",
                          tolerance=10.0, e2e_tolerance=None)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "reuse", "exact"]
    attnopt.export_onnx(opt, tmp_path / "m.onnx", (x, keep), baseline=False)
    x2, keep2 = torch.randn(3, 61, 32), torch.ones(3, 61, dtype=torch.long)
    keep2[0, :9], keep2[2, :1] = 0, 0
    got = _ort_outputs(tmp_path / "m.onnx", (x2, keep2))[0]
    with torch.no_grad():
        want = opt(x2, keep2).numpy()
    assert _rel(got, want) < 1e-5
    np.testing.assert_allclose(got[~keep2.bool().numpy()], want[~keep2.bool().numpy()], atol=1e-5)


def test_an_image_model_exports_and_is_checked_at_its_own_size_and_another_batch(tmp_path):
    # pixel_values [B, 3, H, W] has no sequence dim: the checks must not tile its channels.
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       intermediate_size=48, image_size=32, patch_size=8)).eval()
    example = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    opt = attnopt.compile(vit, "linear", example_inputs=example, dispatch="off", tolerance=10.0, e2e_tolerance=None)
    result = attnopt.export_onnx(opt, tmp_path / "vit.onnx", example_inputs=example, baseline=False)
    assert [(p["runtime"], p["batch"], p["length"]) for p in result.parity] == [
        ("onnxruntime-cpu", 1, None), ("onnxruntime-cpu", 2, None)]
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)


def test_policy_compiles_an_original_model_first(tmp_path):
    net, x = _net_and_x()
    result = attnopt.export_onnx(net, tmp_path / "p.onnx", (x,), policy="ssm", baseline=False, check_lengths=[24, 9])
    assert [s["lowering"] for s in result.sites] == ["com.microsoft.LinearAttention"] * 2
    assert [p["length"] for p in result.parity] == [24, 9] and all(p["rel_rms"] <= 1e-4 for p in result.parity)
    assert not hasattr(net, "attnopt_report")  # the user's model is untouched


def test_cli_export_writes_a_checked_file_and_reports_bad_options(tmp_path, capsys):
    from attnopt.cli import main

    factory = tmp_path / "f.py"
    factory.write_text(
        "import torch\nfrom torch import nn\n"
        "class A(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.qkv = nn.Linear(16, 48)\n"
        "    def forward(self, x):\n"
        "        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)\n"
        "        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    a = A()\n"
        "    with torch.no_grad():\n"
        "        a.qkv.weight[:32] *= 0.02  # near-uniform softmax: linear attention stays close\n"
        "    return a, (torch.randn(2, 20, 16),)\n")
    out = tmp_path / "a.onnx"
    assert main(["export", f"{factory}:make", "--policy", "linear", "--out", str(out), "--json"]) == 0
    import json

    record = json.loads(capsys.readouterr().out)
    assert record["sites"][0]["lowering"] == "com.microsoft.LinearAttention" and out.exists()
    assert main(["export", f"{factory}:make", "--target", "trt", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnopt export: bad option: unknown ONNX target 'trt'") and err.count("\n") == 1
    assert main(["export", f"{factory}:make", "--out", str(tmp_path / "no" / "a.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_export_ships_the_model_directorys_tokenizer(tmp_path, monkeypatch, capsys):
    # A decode folder needs the tokenizer for `attnopt generate`; recall_lm's (byte-level, no pad or
    # eos token) also tokenizes the example passages instead of falling back to raw bytes.
    from pathlib import Path

    from attnopt.backends.onnx import export as export_module
    from attnopt.cli import main

    seen = {}

    def fake_export(opt, out, example, **options):
        seen.update(options)
        raise ValueError("stopped by the test")

    monkeypatch.setattr(export_module, "export_onnx", fake_export)
    recall_lm = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "recall_lm"
    assert main(["export", str(recall_lm), "--policy", "exact", "--out", str(tmp_path / "dir"), "--seq-len",
                 "16"]) == 3
    assert seen["tokenizer"] is not None and seen["tokenizer"]("ab")["input_ids"]
    assert "UTF-8 bytes as token ids" not in capsys.readouterr().err


def test_a_measured_dispatch_threshold_is_left_out_of_the_file_and_said_so(tmp_path):
    # Automatic dispatch (on by default) gives every site a measured min_seq_len: a torch-side speed
    # switch, so the file runs the form at every length and the export record says which it dropped.
    from attnopt.passes.crossover import Threshold

    net, x = _net_and_x()
    opt = attnopt.compile(net, "linear", example_inputs=(x,), tolerance=0.99, e2e_tolerance=None, dispatch="off")
    for r in opt.attnopt_report.sites:
        r.threshold = Threshold(r.site.id, "linear", 16, "measured", "timed for this test")
        r.outcome.params["min_seq_len"] = 16
    for m in opt.modules():
        if hasattr(m, "decode_step"):
            m.min_seq_len = 16
    with torch.no_grad():
        switched = opt(x)
    result = attnopt.export_onnx(opt, tmp_path / "m.onnx", (x,), baseline=False, check_lengths=[24, 9])
    assert result.dispatch_dropped == {r.site.id: 16 for r in opt.attnopt_report.sites}
    assert all(p["rel_rms"] <= 1e-4 for p in result.parity)  # against the form at every length
    with torch.no_grad():
        assert torch.equal(opt(x), switched)  # the compiled model keeps its thresholds
