"""Graph-path models compiled at batch 1 run at any batch and length the model allows (issue 18, 2 and 9).

A batch-1 example is captured at batch 2 (torch.export fixes every size-1 dim), so batch and
length stay symbolic; a dim the model itself fixes is reported at compile and named, with the size
it was captured for, by a one-line error on a call with another size (also after pickling, and
the same for export_onnx). Meta-device models are refused before capture in one line.

Sizes are pairwise distinct: C=24 channels, H=3 heads, D=8 head dim; example length 40.
"""

from __future__ import annotations

import importlib.util
import io
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnopt
from attnopt.ir.errors import CaptureError, SpecializedShapeError
from attnopt.passes.capture import capture_export
from attnopt.targets.graph import picklable_graph_module

C, H, D, N = 24, 3, 8, 40
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _custom_model():
    spec = importlib.util.spec_from_file_location("custom_model_example", EXAMPLES / "custom_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.TinyLM(layers=2, dim=32).eval()


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


# ---- examples/custom_model.py at batch 1 ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm():
    return _custom_model()


def test_custom_model_compiled_at_batch_1_is_exact_at_batch_3_and_another_length(tiny_lm):
    opt = attnopt.compile(tiny_lm, "exact", example_inputs=(_randn(1, N, 32),))
    assert any("x (*, *, 32)" in n for n in opt.attnopt_report.notes)  # batch and length stay symbolic
    for b, n in ((3, N), (3, 23), (1, 57)):
        x = _randn(b, n, 32, seed=b + n)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), tiny_lm(x), rtol=0, atol=1e-6)


def _band_forward(lm, x, window):
    """TinyLM by hand with every attention restricted to the causal band i - W < j <= i."""
    n = x.shape[1]
    i = torch.arange(n)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    for block in lm.blocks:
        b, _, c = x.shape
        d = c // block.heads
        q, k, v = (f(x).view(b, n, block.heads, d).transpose(1, 2) for f in (block.q, block.k, block.v))
        scores = ((q * d**-0.5) @ k.transpose(-2, -1)).masked_fill(~keep, float("-inf"))
        x = x + block.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))
    return lm.norm(x)


def test_custom_model_window_at_batch_1_is_the_band_by_hand_at_batch_3(tiny_lm):
    opt = attnopt.compile(tiny_lm, "window:8", example_inputs=(_randn(1, N, 32),), tolerance=0.99,
                          e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 2
    x = _randn(3, 29, 32, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), _band_forward(tiny_lm, x, 8), rtol=0, atol=2e-6)
        assert (opt(x) - tiny_lm(x)).abs().max() > 1e-2  # the band changes something at 29 tokens


# ---- a hand-written attention module, rewritten: the same form by hand at the new shape ------------


class HandBlock(nn.Module):
    """Bidirectional self-attention spelled with a fused projection, chunk and an explicit softmax."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.out = nn.Linear(C, C)

    def heads(self, x):
        b, n, _ = x.shape
        return [t.reshape(b, n, H, D).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1)]

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.heads(x)
        p = F.softmax(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(D), dim=-1)
        return x + self.out(torch.matmul(p, v).transpose(1, 2).reshape(b, n, C))


class HandNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([HandBlock(), HandBlock()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_hand_written_module_rewritten_at_batch_1_runs_its_form_at_batch_3():
    torch.manual_seed(0)
    net = HandNet().eval()
    opt = attnopt.compile(net, "linear", example_inputs=(_randn(1, N, C),), tolerance=0.99, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 2
    sites = [opt.graph_module.get_submodule(f"attnopt_site_{i}") for i in range(2)]
    x = _randn(3, 31, C, seed=5)
    with torch.no_grad():
        h = x
        for block, site in zip(net.blocks, sites):  # the site modules by hand, at the new shape
            q, k, v = block.heads(h)
            h = h + block.out(site(q, k, v, None).transpose(1, 2).reshape(3, 31, C))
        torch.testing.assert_close(opt(x), h, rtol=0, atol=2e-6)
        assert (opt(x) - net(x)).abs().max() > 1e-3  # linear attention is not the original


# ---- a transformers model forced through the graph path ------------------------------------------


def test_falcon_through_the_graph_path_at_batch_1_is_exact_at_batch_3():
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(vocab_size=50, hidden_size=C, num_hidden_layers=2, num_attention_heads=H,
                                       new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                                       bias=False, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    ids = torch.randint(1, 50, (1, 11), generator=torch.Generator().manual_seed(1))
    opt = attnopt.compile(model, "exact", example_inputs=((ids,), {"use_cache": False}), method="graph")
    assert len(opt.attnopt_report.sites) == 2
    for b, n in ((3, 11), (3, 17), (1, 6)):
        other = torch.randint(1, 50, (b, n), generator=torch.Generator().manual_seed(b * n))
        with torch.no_grad():
            torch.testing.assert_close(opt(other, use_cache=False).logits, model(other, use_cache=False).logits,
                                       rtol=0, atol=1e-6)
    with pytest.raises(attnopt.ir.errors.SpecializedInputError) as err:  # use_cache is frozen: say so
        opt(ids, use_cache=True)
    assert "captured with use_cache=False" in _one_line(err)


# ---- a dim the model fixes -----------------------------------------------------------------------


class OneSequence(nn.Module):
    """Written for one sequence at a time: its reshapes say batch 1 (and with `length`, that length)."""

    def __init__(self, length=None):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.length = length

    def forward(self, x):
        n = self.length or x.shape[1]
        q, k, v = self.qkv(x).view(1, n, 3, H, D).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, n, C)


@pytest.fixture(scope="module")
def one_sequence():
    torch.manual_seed(0)
    net = OneSequence().eval()
    return net, attnopt.compile(net, "exact", example_inputs=(_randn(1, N, C),))


def test_a_batch_the_model_fixes_is_reported_and_named_by_one_line_after_pickling_too(one_sequence):
    net, opt = one_sequence
    notes = opt.attnopt_report.notes
    assert any(n.startswith("the batch size stays fixed at 1") and "does not trace at batch 2" in n for n in notes)
    assert any("x (1, *, 24)" in n for n in notes)
    x = _randn(1, 23, C, seed=2)  # another length still runs
    with torch.no_grad():
        torch.testing.assert_close(opt(x), net(x), rtol=0, atol=1e-6)
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    for model in (opt, torch.load(buffer, weights_only=False)):
        with pytest.raises(SpecializedShapeError) as err:
            model(_randn(3, N, C))
        assert _one_line(err).startswith("this compiled OneSequence was captured with input 'x' dim 0 (the batch "
                                         "size) fixed at 1 (the model does not trace at batch 2: RuntimeError: shape")
        assert "this call has 3 there; call it with 1 there" in str(err.value)


class BranchesOnBatchOne(nn.Module):
    def forward(self, x):
        return x * 2 if x.shape[0] == 1 else x * 3


def test_a_model_that_branches_on_batch_one_keeps_its_batch_fixed():
    # Captured at batch 2 it would take the other branch at batch 1: the check against the model
    # at the example catches that, and the batch stays fixed.
    x = _randn(1, 5, 4)
    captured = capture_export(BranchesOnBatchOne().eval(), (x,))
    assert any("computes something else at batch 1" in n for n in captured.notes)
    torch.testing.assert_close(captured.graph_module(x), x * 2, rtol=0, atol=0)
    with pytest.raises(SpecializedShapeError, match="input 'x' dim 0 .* fixed at 1"):
        captured.graph_module(_randn(2, 5, 4))


def test_a_model_in_training_mode_is_not_run_to_check_the_batch():
    # inspect() captures the user's own model: running it in training mode would move its
    # BatchNorm statistics, so the batch-2 capture is not checked there and the batch stays fixed.
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(5))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    captured = capture_export(net, (_randn(1, 5, 4),))
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert any("the model is in training mode" in n for n in captured.notes)


class StaticLengthOnly(nn.Module):
    """Code that needs a concrete length (as some models' mask builders do): every-dim dynamic
    export fails, batch-only dynamic export works."""

    def forward(self, x):
        if not isinstance(x.shape[1], int):
            raise RuntimeError("this model needs a concrete length")
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)


def test_when_every_dim_cannot_be_dynamic_the_batch_still_is():
    x = _randn(1, N, D)
    captured = capture_export(StaticLengthOnly().eval(), (x,))
    assert captured.notes[0].startswith("dynamic export of every dim failed (RuntimeError: this model needs a "
                                        "concrete length): captured with only the batch dynamic")
    # torch leaves Dynamo's dim markings on the inputs of a failed dynamic export: not on the user's
    assert not [key for key in vars(x) if "dynamo" in key]
    x3 = _randn(3, N, D, seed=1)
    torch.testing.assert_close(captured.graph_module(x3), F.scaled_dot_product_attention(x3, x3, x3, is_causal=True))
    with pytest.raises(SpecializedShapeError, match="input 'x' dim 1 fixed at 40, and this call has 41 there"):
        captured.graph_module(_randn(1, N + 1, D))


class LongOnly(nn.Module):
    """SDPA over q, k, v that share their batch and length; a branch that needs more than 4 tokens."""

    def forward(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v)
        return out if q.shape[2] > 4 else out * 0


def test_dims_the_graph_ties_or_bounds_are_named_even_after_pickling():
    q, k, v = (_randn(2, H, 9, D, seed=s) for s in (1, 2, 3))
    gm = capture_export(LongOnly().eval(), (q, k, v)).graph_module
    buffer = io.BytesIO()
    torch.save(picklable_graph_module(gm), buffer)  # without export's own guard function (it cannot be pickled)
    buffer.seek(0)
    for module in (gm, torch.load(buffer, weights_only=False)):
        torch.testing.assert_close(module(q[:1], k[:1], v[:1]), F.scaled_dot_product_attention(q[:1], k[:1], v[:1]))
        with pytest.raises(SpecializedShapeError, match="input 'k' dim 0 equal to input 'q' dim 0 .* has 3 and 2"):
            module(q, torch.cat([k, k[:1]]), v)
        with pytest.raises(SpecializedShapeError, match="input 'q' dim 2 of size >= 5 .* this call has 3 there"):
            module(q[:, :, :3], k[:, :, :3], v[:, :, :3])


def test_export_onnx_runs_at_batch_3_and_fixes_only_what_the_model_fixes(tiny_lm, tmp_path):
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    def ort_run(path, x):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])

    opt = attnopt.compile(tiny_lm, "linear", example_inputs=(_randn(1, N, 32),), tolerance=0.99, e2e_tolerance=None)
    result = attnopt.export_onnx(opt, tmp_path / "lm.onnx", (_randn(1, N, 32),), baseline=False)
    assert [p["batch"] for p in result.parity] == [1, 2]
    x = _randn(3, 53, 32, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(ort_run(tmp_path / "lm.onnx", x), opt(x), rtol=0, atol=2e-5)

    # Batch and length fixed by the model: exported and checked at those only (not a failed export).
    torch.manual_seed(0)
    fixed = attnopt.compile(OneSequence(length=N).eval(), "exact", example_inputs=(_randn(1, N, C),))
    with pytest.raises(SpecializedShapeError, match="input 'x' dim 1 fixed at 40"):
        fixed(_randn(1, 17, C))
    result = attnopt.export_onnx(fixed, tmp_path / "one.onnx", (_randn(1, N, C),), baseline=False)
    assert [(p["batch"], p["length"]) for p in result.parity] == [(1, N)]
    x = _randn(1, N, C, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(ort_run(tmp_path / "one.onnx", x), fixed(x), rtol=0, atol=2e-5)


# ---- models that cannot run ----------------------------------------------------------------------


def test_a_meta_device_model_is_refused_before_capture_in_one_line():
    net = HandNet().to("meta")
    with pytest.raises(CaptureError) as err:
        capture_export(net, (_randn(1, N, C),))
    assert _one_line(err).startswith("HandNet has 8 of its 8 parameters/buffers on the meta device (e.g. "
                                     "'blocks.0.qkv.weight')")
    with pytest.raises(CaptureError, match="example inputs are on the meta device"):
        capture_export(HandNet(), (torch.empty(1, N, C, device="meta"),))
