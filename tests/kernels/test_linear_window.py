"""linear_window_attention against the formula written out row by row, in fp64.

The oracle below builds each query's window and linear key sets as Python lists and its own φ
(elu, relu, FAVOR+ and hedgehog from the module's weights; taylor's kernel in closed form), then
evaluates the unshifted formula directly. It shares nothing with the kernel but the feature-map weights.

Letters: B batch, H query heads, Hkv kv heads, Nq/Nk lengths, D head dim, Dv value dim, W window,
S sinks, β the per-head linear weight.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnopt.forms.linear_window.reference as linear_window_module
from attnopt.kernels.feature_maps import make_feature_map
from attnopt.forms.linear_window.reference import linear_window_attention, linear_window_attention_reference
from attnopt.forms.window.reference import window_attention
from kernel_testing import MaxNumel, assert_exports_as_one_node
from kernel_testing import sdpa_inputs as _inputs
from oracles import linear_window_oracle as _oracle

F64 = torch.float64


def _fmap(name, D, H):
    fm = make_feature_map(name, D, H, seed=3).to(F64)
    if name == "hedgehog":  # off the identity init, so heads really differ
        with torch.no_grad():
            g = torch.Generator().manual_seed(4)
            fm.weight_HDP.add_(0.4 * torch.randn(fm.weight_HDP.shape, generator=g, dtype=F64))
    return fm


def _assert_rel(out, ref, tol=1e-9):
    err = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= tol * scale, f"max abs err {err:.3e} vs ref scale {scale:.3e}"


def _mask(kind, B, Nk):
    """left: per-row left padding; right: per-row right padding; rows: a different pattern per row."""
    km = torch.ones(B, Nk, dtype=torch.bool)
    for b in range(B):
        if kind == "left":
            km[b, : 2 + 3 * b] = False
        elif kind == "right":
            km[b, Nk - 1 - 2 * b :] = False
        elif kind == "rows":
            km[b] = torch.rand(Nk, generator=torch.Generator().manual_seed(b)) > 0.3
            km[b, b] = False
    return None if kind == "none" else km


# Pairwise-distinct dims (B, H, Hkv, Nq, Nk, D, Dv); block 4 and chunk 3 divide none of the lengths.
DECODE = (2, 6, 3, 11, 13, 4, 5)  # Nq < Nk: bottom-right queries
SELF = (3, 4, 1, 17, 17, 5, 2)  # Nq = Nk, MQA (the one repeated dim: self-attention needs it)

CASES = [  # (window, sinks, per-head β, padding)
    pytest.param(3, 0, False, "none", id="W3"),
    pytest.param(2, 3, True, "none", id="W2-S3-beta"),
    pytest.param(4, 2, True, "left", id="W4-S2-beta-left"),
    pytest.param(3, 2, False, "right", id="W3-S2-right"),
    pytest.param(2, 4, True, "rows", id="W2-S4-beta-rows"),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("name", ["elu", "relu", "hedgehog", "favor", "taylor"])
@pytest.mark.parametrize("window,sinks,per_head_beta,padding", CASES)
def test_matches_the_formula_row_by_row(name, causal, window, sinks, per_head_beta, padding):
    B, H, Hkv, Nq, Nk, D, Dv = DECODE if causal else SELF
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=window * 10 + sinks)
    fm = _fmap(name, D, H)
    beta = torch.linspace(0.3, 2.0, H, dtype=F64) if per_head_beta else 0.7
    km = _mask(padding, B, Nk)
    kw = dict(window=window, causal=causal, sinks=sinks, key_mask=km)
    out = linear_window_attention(q, k, v, feature_map=fm, linear_weight=beta, block_size=4, chunk_size=3, **kw)
    assert out.shape == (B, H, Nq, Dv) and out.dtype == F64
    _assert_rel(out, _oracle(q, k, v, name=name, fmap=fm, beta=beta, **kw))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_other_shapes_and_default_blocks(causal):
    # The other shape per mode, decode Nq = 1, and Nq > Nk (causal: the first queries sit before
    # key 0 and see nothing); default block and chunk sizes.
    shapes = [(SELF if causal else DECODE, 3), ((3, 4, 2, 1, 9, 5, 6), 2), ((2, 3, 1, 9, 5, 4, 6), 2)]
    for (B, H, Hkv, Nq, Nk, D, Dv), window in shapes:
        fm = _fmap("hedgehog", D, H)
        q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=Nk)
        km = _mask("rows", B, Nk)
        beta = torch.linspace(1.5, 0.2, H, dtype=F64)
        kw = dict(window=window, causal=causal, sinks=2, key_mask=km)
        out = linear_window_attention(q, k, v, feature_map=fm, linear_weight=beta, **kw)
        _assert_rel(out, _oracle(q, k, v, name="hedgehog", fmap=fm, beta=beta, **kw))


@pytest.mark.parametrize("per_step", [1, 300])
def test_many_small_window_steps(per_step):
    # The public sizes all fit one step of the window part; a tiny budget gives one query block
    # per step (1) or a few (300), so edge and interior steps and sinks left of the band all occur.
    B, H, Hkv, Nq, Nk, D, Dv = DECODE
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=17)
    km = _mask("rows", B, Nk)
    beta = torch.linspace(0.2, 1.7, H, dtype=F64)
    for causal in (True, False):
        kw = dict(window=3, causal=causal, sinks=2, key_mask=km)
        out = linear_window_module._forward(
            q, k, v, km, 3, causal, 2, 1 / math.sqrt(D), "elu", None, beta, 2, 3, scores_per_step=per_step
        )
        _assert_rel(out, _oracle(q, k, v, name="elu", beta=beta, **kw))


def test_module_reference_agrees_with_the_oracle():
    q, k, v = _inputs(2, 6, 3, 11, 13, 4, 5, seed=5)
    fm = _fmap("favor", 4, 6)
    km = _mask("left", 2, 13)
    for causal in (True, False):
        kw = dict(window=3, causal=causal, sinks=2, key_mask=km)
        ref = linear_window_attention_reference(q, k, v, feature_map=fm, linear_weight=0.5, **kw)
        _assert_rel(ref, _oracle(q, k, v, name="favor", fmap=fm, beta=0.5, **kw))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_left_padded_row_equals_the_row_unpadded(causal):
    B, H, Hkv, N, D, Dv = 2, 6, 2, 14, 4, 3
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=6)
    km = torch.ones(B, N, dtype=torch.bool)
    km[1, :5] = False
    fm = _fmap("hedgehog", D, H)
    kw = dict(window=3, causal=causal, sinks=2, feature_map=fm, linear_weight=torch.linspace(0.5, 1.5, H, dtype=F64))
    out = linear_window_attention(q, k, v, key_mask=km, block_size=4, chunk_size=3, **kw)
    alone = linear_window_attention(q[1:, :, 5:], k[1:, :, 5:], v[1:, :, 5:], block_size=4, chunk_size=3, **kw)
    assert (out[1:, :, 5:] - alone).abs().max().item() <= 1e-12
    assert (out[:1] - linear_window_attention(q[:1], k[:1], v[:1], **kw)).abs().max().item() <= 1e-12


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_window_covering_everything_is_softmax_attention(causal):
    q, k, v = _inputs(2, 6, 3, 12, 12, 4, 5, seed=7)
    out = linear_window_attention(q, k, v, window=12, causal=causal, feature_map="favor", block_size=5)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    _assert_rel(out, ref, tol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_zero_beta_is_window_attention(causal):
    q, k, v = _inputs(3, 4, 2, 9, 13, 3, 5, seed=8)
    km = _mask("rows", 3, 13)
    kw = dict(window=3, causal=causal, sinks=2, key_mask=km)
    beta = torch.zeros(4, dtype=F64)
    out = linear_window_attention(q, k, v, feature_map="elu", linear_weight=beta, block_size=2, **kw)
    assert (out - window_attention(q, k, v, **kw)).abs().max().item() <= 1e-12
    # and β > 0 does change it: the linear part is really there
    assert (linear_window_attention(q, k, v, **kw) - out).abs().max().item() > 1e-2


def test_all_masked_rows_are_zero_with_finite_gradients():
    q, k, v = _inputs(2, 4, 2, 7, 7, 3, 2, seed=9)
    beta = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=F64, requires_grad=True)
    fm = _fmap("hedgehog", 3, 4)
    km = torch.ones(2, 7, dtype=torch.bool)
    km[1] = False
    km[0, :4] = False
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    for causal in (True, False):
        out = linear_window_attention(
            *leaves, window=2, causal=causal, sinks=1, feature_map=fm, linear_weight=beta, key_mask=km
        )
        assert torch.isfinite(out).all() and torch.all(out[1] == 0)
        if causal:  # row 0: queries 0..3 come before every real key
            assert torch.all(out[0, :, :4] == 0) and out[0, :, 4:].abs().min() > 0
        grads = torch.autograd.grad(out.sin().sum(), [*leaves, beta, fm.weight_HDP])
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.all(grads[1][1] == 0) and torch.all(grads[2][1] == 0)


def test_gradcheck_q_k_v_beta_and_hedgehog_weight():
    # GQA, left and right padding, a sink, keys in the window and in both linear scans (W=2 < N).
    q, k, v = _inputs(2, 4, 2, 5, 7, 2, 3, seed=10)
    w = _fmap("hedgehog", 2, 4).weight_HDP.detach().clone().requires_grad_(True)
    beta = torch.tensor([0.3, 1.2, 0.8, 2.0], dtype=F64, requires_grad=True)
    km = torch.tensor([[False, True, True, True, True, True, True], [True] * 5 + [False] * 2])
    leaves = [t.requires_grad_(True) for t in (q, k, v)] + [beta, w]

    def fn(q_, k_, v_, beta_, w_):
        return torch.ops.attnopt.linear_window_attention(
            q_, k_, v_, km, 2, causal, 1, 0.6, "hedgehog", w_, beta_, 3, 2
        )

    for causal in (True, False):  # fast mode: random directions, so one backward, not one per output
        assert torch.autograd.gradcheck(fn, leaves, fast_mode=True)


def test_gradients_reach_tensor_beta_and_hedgehog_weight_via_public_api():
    q, k, v = _inputs(1, 2, 1, 9, 9, 3, 2, seed=11)
    beta = torch.ones(2, dtype=F64, requires_grad=True)
    fm = _fmap("hedgehog", 3, 2)
    out = linear_window_attention(q, k, v, window=2, causal=True, feature_map=fm, linear_weight=beta)
    out.square().sum().backward()
    assert beta.grad is not None and beta.grad.abs().min() > 0
    assert fm.weight_HDP.grad is not None and fm.weight_HDP.grad.abs().sum() > 0


def test_half_precision_keeps_dtype_and_computes_in_fp32():
    q, k, v = _inputs(1, 2, 2, 30, 30, 8, 8, seed=12)
    ref = linear_window_attention(q, k, v, window=6, causal=True, sinks=1, feature_map="favor")
    for dtype in (torch.float16, torch.bfloat16):
        lo = (t.to(dtype) for t in (q, k, v))
        out = linear_window_attention(*lo, window=6, causal=True, sinks=1, feature_map="favor")
        assert out.dtype == dtype and (out.double() - ref).abs().max().item() < 3e-2


def test_favor_fp32_with_large_stabilisers_matches_fp64():
    # |q|, |k| ~ 30: FAVOR+ exponents reach -280, so e^{c_q + c_k} underflows fp32. Queries 9..12
    # have an empty window (keys 8..12 padded) and live on the linear part alone; their common
    # factor must be taken as 1 there, not underflow to a 0/0 row.
    q, k, v = _inputs(1, 2, 1, 16, 16, 8, 3, seed=16)
    q, k = q * 10, k * 10
    km = torch.ones(1, 16, dtype=torch.bool)
    km[0, 8:13] = False
    fm = _fmap("favor", 8, 2)
    kw = dict(window=2, causal=True, key_mask=km)
    ref = _oracle(q, k, v, name="favor", fmap=fm, **kw)
    assert ref[0, :, 9:13].abs().amax(-1).min() > 0.1  # the linear-only rows carry real values
    out = linear_window_attention(q.float(), k.float(), v.float(), feature_map=fm.float(), **kw)
    assert out.dtype == torch.float32
    _assert_rel(out.double(), ref, tol=1e-5)


def test_export_keeps_one_op_node():
    fm = make_feature_map("hedgehog", 4, 2)

    def fn(q, k, v):
        return linear_window_attention(q, k, v, window=3, causal=True, sinks=1, feature_map=fm) * 2.0

    op = torch.ops.attnopt.linear_window_attention.default
    assert_exports_as_one_node(fn, op, _inputs(1, 2, 1, 8, 8, 4, 3, seed=13))


# Schema, fake-tensor and autograd-registration checks. opcheck's AOT-dispatch trace of the
# recompute backward also passes (for both cases) but takes 8-20 s here, over this file's budget.
@pytest.mark.parametrize("name,masked,sinks", [("elu", False, 0), ("hedgehog", True, 1)])
def test_opcheck(name, masked, sinks):
    q, k, v = (t.float().requires_grad_(True) for t in _inputs(1, 4, 2, 5, 7, 3, 2, seed=14))
    w = make_feature_map(name, 3, 4).op_weight()
    w = None if w is None else w.detach().clone().requires_grad_(True)
    beta = torch.tensor([0.5, 1.0, 1.5, 0.0], requires_grad=True)
    km = torch.tensor([[True, False, True, True, True, False, True]]) if masked else None
    args = (q, k, v, km, 2, True, sinks, 0.5, name, w, beta, 2, 3)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    result = torch.library.opcheck(torch.ops.attnopt.linear_window_attention.default, args, test_utils=utils)
    assert set(result) == set(utils) and set(result.values()) == {"SUCCESS"}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_never_materialises_n_by_n(causal):
    # The probe runs on the op's plain-PyTorch body: a dispatch mode sees a custom op as one call
    # (only its output), so probing the public call would pass even with an N x N inside.
    B, H, N, D, W, S, Bq, C = 1, 2, 2048, 4, 32, 4, 32, 64
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, H, H, N, N, D, D, seed=15))
    beta = torch.ones(H, dtype=F64, requires_grad=True)
    with MaxNumel() as probe:
        out = linear_window_module._forward(q, k, v, None, W, causal, S, 0.5, "elu", None, beta, Bq, C)
        out.sin().sum().backward()
    assert torch.isfinite(q.grad).all() and beta.grad.abs().min() > 0
    band_scores = B * H * N * (Bq + (W - 1 if causal else 2 * W - 2))  # every block against its band
    assert probe.max_numel >= band_scores  # the probe does see inside
    assert probe.max_numel <= max(band_scores + B * H * N * S, B * H * N * C)  # O(N·(W + S + C))
    assert probe.max_numel < B * H * N * N // 16


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(window=0), ValueError, "window must be >= 1"),
        (dict(window=2.0), TypeError, "window must be an int"),
        (dict(window=2, sinks=-1), ValueError, "sinks must be >= 0"),
        (dict(window=2, linear_weight=-0.5), ValueError, r"linear_weight \(β\) must be finite and >= 0"),
        (dict(window=2, linear_weight=float("nan")), ValueError, r"must be finite and >= 0"),
        (dict(window=2, linear_weight=torch.tensor([1.0, -1.0], dtype=F64)), ValueError, "finite and >= 0 per head"),
        (dict(window=2, linear_weight=torch.ones(3, dtype=F64)), ValueError, r"shape \[H\] = \(2,\)"),
        (dict(window=2, linear_weight=torch.ones(2, 1, dtype=F64)), ValueError, r"shape \[H\]"),
        (dict(window=2, linear_weight="1"), TypeError, "number or a tensor"),
        (dict(window=2, key_mask=torch.ones(1, 5, dtype=torch.bool)), ValueError, r"key_mask must have shape"),
        (dict(window=2, key_mask=torch.ones(1, 4)), TypeError, "key_mask must be a bool tensor"),
        (dict(window=2, feature_map="cosine"), ValueError, "unknown feature map 'cosine'"),
        (dict(window=2, scale=0.0), ValueError, "scale must be a finite number > 0"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, exc, words):
    q, k, v = _inputs(1, 2, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(exc, match=words):
        linear_window_attention(q, k, v, causal=True, **kwargs)


def test_bad_shapes_raise_clear_errors():
    q, k, v = _inputs(1, 3, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(ValueError, match="linear_window_attention: query heads H=3 must be a multiple"):
        linear_window_attention(q, k, v, window=2, causal=True)
    q, k, v = _inputs(1, 2, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(ValueError, match="4-D"):
        linear_window_attention(q[0], k, v, window=2, causal=True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        linear_window_attention(q, k, v, window=2, causal=1)
