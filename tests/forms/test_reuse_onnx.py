"""The reuse form's ONNX lowerings: the block-sparse softmax (gathers) and a prefill's whole op (the
anchor's selection, then the softmax), each exported once with dynamic batch and length, run in ONNX
Runtime and onnx.reference at other lengths and batches, against the fp64 oracle of
tests/kernels/test_reuse.py (written from the op's definition)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from attnopt.forms.reuse import onnx as lowering  # noqa: E402
from attnopt.forms.reuse.prefill import reuse_attention  # noqa: E402
from attnopt.forms.reuse.reference import block_sparse_attention  # noqa: E402
from attnopt.forms.reuse.selection import BlockRule, select_call  # noqa: E402

_spec = importlib.util.spec_from_file_location("kernel_tests", Path(__file__).resolve().parents[1] / "kernels/test_reuse.py")
kernel_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_tests)

H, HKV, D, DV, BLOCK = 4, 2, 8, 6, 4


def lists_of(n: int, b: int) -> torch.Tensor:
    """Per query: its own block, the one before and block 0 (distinct, −1 where none), in torch ops."""
    m = torch.arange(n) // BLOCK
    own, prev, first = m, torch.where(m >= 1, m - 1, -1), torch.where(m >= 2, 0, -1)
    return torch.stack([own, prev, first], dim=-1)[None].expand(b, n, 3)


class Sparse(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, keep):
        blocks = lists_of(q.shape[2], q.shape[0])
        return block_sparse_attention(q, k, v, blocks, block=BLOCK, causal=self.causal, scale=0.3, key_mask=keep)


def _inputs(n, b, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, n, generator=g) > 0.2
    keep[:, 0] = True
    return (torch.randn(b, H, n, D, generator=g), torch.randn(b, HKV, n, D, generator=g),
            torch.randn(b, HKV, n, DV, generator=g), keep)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), b.double().numpy()
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


@pytest.mark.parametrize("causal", [True, False])
def test_the_gather_lowering_equals_the_oracle(causal):
    module = Sparse(causal)
    dims = torch.export.Dim("B"), torch.export.Dim("N", min=2)
    spec = ({0: dims[0], 2: dims[1]},) * 3 + ({0: dims[0], 1: dims[1]},)
    program = torch.export.export(module, _inputs(19, 2, 0), dynamic_shapes=spec)
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count("attnopt.block_sparse_attention.default") == 1
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False, custom_translation_table={
        lowering.BLOCK_SPARSE_LOWERING.torch_op(): lowering.BLOCK_SPARSE_LOWERING.by_target["onnx-std"]})
    sess = ort.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    ref = ReferenceEvaluator(onnx_program.model_proto)
    for n, b in ((30, 3), (5, 1)):
        q, k, v, keep = _inputs(n, b, n)
        want = kernel_tests.oracle(q, k, v, lists_of(n, b), block=BLOCK, causal=causal, scale=0.3, key_mask=keep)
        got = sess.run(None, {nm: t.numpy() for nm, t in zip(names, (q, k, v, keep))})[0]
        assert got.shape == tuple(want.shape) and _rel(got, want) <= 1e-5, (n, b, _rel(got, want))
        if n == 5:
            got = ref.run(None, {nm: t.numpy() for nm, t in zip(ref.input_names, (q, k, v, keep))})[0]
            assert _rel(got, want) <= 1e-5


# ---------------------------------------------------------------- a prefill: selection and attention in one op


class Prefill(torch.nn.Module):
    """`attnopt::reuse_attention` under one rule: the anchor's q and k select, this layer's attend."""

    def __init__(self, causal: bool, mass=None, top_k: int = 2, probes: int = 3):
        super().__init__()
        self.causal, self.mass, self.top_k, self.probes = causal, mass, top_k, probes

    def rule(self) -> BlockRule:
        return BlockRule(block=BLOCK, top_k=self.top_k, window=1, sinks=1, probes=self.probes, causal=self.causal,
                         mass=self.mass)

    def forward(self, q, k, v, keep, q_a, k_a):
        r = self.rule()
        return reuse_attention(q, k, v, keep, q_a, k_a, r.block, r.top_k, r.window, r.sinks, r.probes, r.causal,
                               r.mass, 0.3, 0.45)


def _prefill_inputs(n: int, b: int, seed: int, padding: str):
    g = torch.Generator().manual_seed(seed)
    keep = torch.ones(b, n, dtype=torch.bool)
    if b > 1 and padding == "left":  # generate()'s batches: rows start at different columns
        keep[1, :5] = False
        keep[-1, :3] = False
    if b > 1 and padding == "right":  # a tokenizer's batches: rows end at different columns
        keep[1, n - 6:] = False
        keep[-1, n - 3:] = False
    return (torch.randn(b, H, n, D, generator=g), torch.randn(b, HKV, n, D, generator=g),
            torch.randn(b, HKV, n, DV, generator=g), keep,
            torch.randn(b, H, n, D, generator=g) * 2, torch.randn(b, HKV, n, D, generator=g) * 2)


def _chosen_blocks_are_a_choice(module, q_a, k_a, keep) -> bool:
    """Whether some query reads fewer blocks than it may see (the selection decides the result)."""
    sel, _ = select_call(q_a, k_a, keep, module.rule(), 0.45, None)
    listed = (sel.blocks_BQK >= 0).sum(-1)
    visible = (torch.arange(q_a.shape[2]) // BLOCK + 1) if module.causal else -(-q_a.shape[2] // BLOCK)
    return bool((listed < visible).any())


@pytest.mark.parametrize("causal, padding, mass, probes", [
    (True, "left", None, 3), (False, "right", None, 3), (True, "right", 0.7, BLOCK), (False, "left", 0.7, 2)])
def test_the_prefill_lowering_selects_and_attends_like_the_oracle(causal, padding, mass, probes):
    """The prefill op in standard ops (the anchor's bounds, the probes' mass, the choice, the gathered
    softmax), exported once at dynamic batch and length, against the fp64 oracle over the blocks
    PyTorch's selection lists: padded rows, GQA, lengths off the block grid, a mass threshold."""
    module = Prefill(causal, mass=mass, top_k=3 if mass else 2, probes=probes)
    dims = torch.export.Dim("B"), torch.export.Dim("N", min=2)
    spec = ({0: dims[0], 2: dims[1]},) * 3 + ({0: dims[0], 1: dims[1]},) + ({0: dims[0], 2: dims[1]},) * 2
    program = torch.export.export(module, _prefill_inputs(26, 2, 0, padding), dynamic_shapes=spec)
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count("attnopt.reuse_attention.default") == 1
    onnx_program = torch.onnx.export(program, dynamo=True, verbose=False, custom_translation_table={
        lowering.LOWERING.torch_op(): lowering.LOWERING.by_target["ort"]})
    proto = onnx_program.model_proto
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    ref = ReferenceEvaluator(proto)
    for n, b in ((43, 3), (30, 1), (9, 2)):  # 9: every block read (padded rows: exact attention's)
        q, k, v, keep, q_a, k_a = x = _prefill_inputs(n, b, n, padding)
        if n > 20:
            assert _chosen_blocks_are_a_choice(module, q_a, k_a, keep)
        if module.rule().reads_everything(n):  # every block read: exact attention (padded rows see the keys too)
            lists, offsets = torch.arange(-(-n // BLOCK)).expand(b, n, -1), None
        else:
            sel, _ = select_call(q_a, k_a, keep, module.rule(), 0.45, None)
            lists, offsets = sel.blocks_BQK, sel.offsets_B
        want = kernel_tests.oracle(q, k, v, lists, block=BLOCK, causal=causal, scale=0.3, key_mask=keep,
                                   offsets=offsets)
        got = sess.run(None, {nm: t.numpy() for nm, t in zip(names, x)})[0]
        assert got.shape == tuple(want.shape) and _rel(got, want) <= 1e-5, (n, b, _rel(got, want))
        if n == 9:
            got = ref.run(None, {nm: t.numpy() for nm, t in zip(ref.input_names, x)})[0]
            assert _rel(got, want) <= 1e-5
