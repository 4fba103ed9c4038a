"""Residual-reuse op: equals the explicit logits formula, the SVD init is exact when it should be, and
the op is a well-formed torch.library op (gradcheck, opcheck, one node under torch.export)."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnopt.forms.reuse.reference import (
    init_reuse_factors,
    reuse_attention,
    reuse_attention_reference,
    reuse_savings,
)
from oracles import reuse_oracle

# Pairwise-distinct sizes so a swapped axis cannot pass unnoticed.
B, H, N, D, C, DV = 2, 6, 11, 5, 7, 4
F64 = torch.float64


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _inputs(seed, Hkv_a, Hkv, rank, homogeneous, D=D):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    rows = C + 1 if homogeneous else C
    A = rnd(H, rows, rank) * 0.5
    B_ = rnd(H, rows, rank) * 0.5
    return rnd(B, H, N, D), rnd(B, Hkv_a, N, D), rnd(B, Hkv, N, DV), rnd(B, N, C), A, B_


def _padding_mask():
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, N - 4 :] = False  # right padding: every causal row still sees key 0
    return keep


@pytest.mark.parametrize("heads", [(6, 6), (3, 2), (1, 3)], ids=["mha", "gqa-3-2", "gqa-1-3"])
@pytest.mark.parametrize("rank,homogeneous", [(0, False), (3, False), (4, True)], ids=["r0", "r3", "r4-hom"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "pad"])
def test_op_equals_explicit_logits(heads, rank, homogeneous, causal, masked):
    Hkv_a, Hkv = heads
    q_a, k_a, v, x, A, B_ = _inputs(1, Hkv_a, Hkv, rank, homogeneous)
    key_mask = _padding_mask() if masked else None
    out = reuse_attention(q_a, k_a, v, x, A, B_, scale=0.37, causal=causal, key_mask=key_mask)
    ref = reuse_oracle(q_a, k_a, v, x, A, B_, scale=0.37, causal=causal, key_mask=key_mask)
    assert out.shape == (B, H, N, DV)
    assert _rel(out, ref) <= 1e-10
    if rank > 0:  # the residual must actually move the output, or the comparison above proves little
        plain = reuse_oracle(q_a, k_a, v, scale=0.37, causal=causal, key_mask=key_mask)
        assert _rel(plain, ref) > 1e-3


@pytest.mark.parametrize("Dv", [3, 8, 13], ids=["v-narrower", "v-equal", "v-wider"])
def test_value_head_dim_differs_from_concatenated_dim(Dv):
    # q' has D + r = 8 dims; the op pads the narrower side with zeros to keep SDPA on its fused kernel.
    q_a, k_a, _, x, A, B_ = _inputs(13, 3, 2, 3, True)
    v = torch.randn(B, 2, N, Dv, dtype=F64, generator=torch.Generator().manual_seed(14))
    out = reuse_attention(q_a, k_a, v, x, A, B_, scale=0.3, causal=True, key_mask=_padding_mask())
    ref = reuse_oracle(q_a, k_a, v, x, A, B_, scale=0.3, causal=True, key_mask=_padding_mask())
    assert out.shape == (B, H, N, Dv) and out.is_contiguous()
    assert _rel(out, ref) <= 1e-10
    module_ref = reuse_attention_reference(q_a, k_a, v, x, A, B_, scale=0.3, causal=True, key_mask=_padding_mask())
    assert _rel(module_ref, ref) <= 1e-10  # the module's own reference is used by verification


def test_rank0_spellings_agree_with_plain_sdpa():
    q_a, k_a, v, x, _, _ = _inputs(2, H, H, 0, False)
    empty = torch.empty(H, C, 0, dtype=F64)
    via_none = reuse_attention(q_a, k_a, v, scale=0.2, causal=True)
    via_empty = reuse_attention(q_a, k_a, v, x, empty, empty, scale=0.2, causal=True)
    sdpa = F.scaled_dot_product_attention(q_a, k_a, v, is_causal=True, scale=0.2)
    assert _rel(via_none, sdpa) <= 1e-12
    assert torch.equal(via_none, via_empty)


# ---------------------------------------------------------------------------------------------
# training-free initialisation
# ---------------------------------------------------------------------------------------------


class _Layer(torch.nn.Module):
    """Attention projections of one layer, nn.Linear with biases, GQA allowed."""

    def __init__(self, C, H, Hkv, D):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.q = torch.nn.Linear(C, H * D)
        self.k = torch.nn.Linear(C, Hkv * D)
        self.v = torch.nn.Linear(C, Hkv * D)

    def split(self, t, h):
        return t.unflatten(-1, (h, self.D)).transpose(1, 2)

    def qkv(self, x):
        return self.split(self.q(x), self.H), self.split(self.k(x), self.Hkv), self.split(self.v(x), self.Hkv)

    def attention(self, x, causal):
        q, k, v = self.qkv(x)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.D**-0.5, enable_gqa=True)


def _two_layers(seed, C, H, Hkv_l, Hkv_a, D):
    torch.manual_seed(seed)
    return _Layer(C, H, Hkv_l, D).double(), _Layer(C, H, Hkv_a, D).double()


def _factors(layer, anchor, rank):
    return init_reuse_factors(
        layer.q.weight, layer.q.bias, layer.k.weight, layer.k.bias,
        anchor.q.weight, anchor.q.bias, anchor.k.weight, anchor.k.bias,
        heads=layer.H, rank=rank,
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hkv_l,Hkv_a", [(4, 4), (2, 1)], ids=["mha", "gqa"])
def test_init_full_rank_reproduces_layer_exactly(causal, Hkv_l, Hkv_a):
    C_, H_, D_ = 9, 4, 6  # 2·D = 12 > C+1 = 10: full rank is C+1
    layer, anchor = _two_layers(3, C_, H_, Hkv_l, Hkv_a, D_)
    x = torch.randn(2, 13, C_, dtype=F64)
    with torch.no_grad():
        A, B_ = _factors(layer, anchor, rank=C_ + 1)
        q_a, k_a, _ = anchor.qkv(x)
        _, _, v_l = layer.qkv(x)
        out = reuse_attention(q_a, k_a, v_l, x, A, B_, scale=D_**-0.5, causal=causal)
        exact = layer.attention(x, causal)
        pure = reuse_attention(q_a, k_a, v_l, scale=D_**-0.5, causal=causal)
    assert A.shape == B_.shape == (H_, C_ + 1, C_ + 1)
    assert _rel(out, exact) <= 1e-8
    assert _rel(pure, exact) > 1e-2  # without the residual the layers really differ


def test_init_rank_2d_is_already_exact():
    # M_l − M_a has rank ≤ 2·D; with 2·D < C+1 that rank must already reproduce layer l.
    C_, H_, D_ = 16, 2, 3
    layer, anchor = _two_layers(4, C_, H_, H_, H_, D_)
    x = torch.randn(1, 10, C_, dtype=F64)
    with torch.no_grad():
        q_a, k_a, _ = anchor.qkv(x)
        _, _, v_l = layer.qkv(x)
        exact = layer.attention(x, True)
        errs = {}
        for r in (2 * D_ - 1, 2 * D_):
            A, B_ = _factors(layer, anchor, r)
            errs[r] = _rel(reuse_attention(q_a, k_a, v_l, x, A, B_, scale=D_**-0.5, causal=True), exact)
    assert errs[2 * D_] <= 1e-8
    assert errs[2 * D_ - 1] > 1e-6
    assert reuse_savings(C_, H_, H_, D_, 1, 10)["max_useful_rank"] == 2 * D_


def test_truncation_error_decreases_with_rank():
    C_, H_, D_, N_ = 12, 3, 8, 40  # full rank C+1 = 13 < 2·D
    layer, anchor = _two_layers(5, C_, H_, H_, H_, D_)
    x = torch.randn(1, N_, C_, dtype=F64)
    x_hat = torch.cat([x, torch.ones(1, N_, 1, dtype=F64)], dim=-1)
    fro = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    with torch.no_grad():
        q_a, k_a, _ = anchor.qkv(x)
        q_l, k_l, v_l = layer.qkv(x)
        # M_l − M_a built here independently of the init: per head, [Wq|bq]_hᵀ [Wk|bk]_h of l minus anchor's.
        hat = lambda lin: torch.cat([lin.weight, lin.bias[:, None]], 1).reshape(H_, D_, C_ + 1)  # noqa: E731
        residual = hat(layer.q).transpose(1, 2) @ hat(layer.k) - hat(anchor.q).transpose(1, 2) @ hat(anchor.k)
        sigma = torch.linalg.svdvals(residual)
        logits_l = q_l @ k_l.transpose(-1, -2)
        exact = layer.attention(x, False)
        mat_err, logit_err, out_err = [], [], []
        for r in range(0, C_ + 2):
            A, B_ = _factors(layer, anchor, r)
            mat_err.append(torch.linalg.matrix_norm(residual - A @ B_.transpose(-1, -2)).norm().item())
            # Eckart–Young: the Frobenius error of the rank-r truncation is the tail of the singular values.
            assert mat_err[-1] == pytest.approx(sigma[:, r:].norm().item(), rel=1e-9, abs=1e-10)
            logits = q_a @ k_a.transpose(-1, -2) + (x_hat @ A) @ (x_hat @ B_).transpose(-1, -2)
            logit_err.append(fro(logits, logits_l))
            out_err.append(fro(reuse_attention(q_a, k_a, v_l, x, A, B_, scale=D_**-0.5), exact))
    for errs in (mat_err, logit_err, out_err):
        assert all(a > b for a, b in zip(errs[:-1], errs[1:])), errs
    assert out_err[0] > 0.1 and out_err[-1] <= 1e-12


def _drifted_setup(kind):
    """Layers l and anchor whose inputs differ: x_l = affine(x_a) or x_a + tanh(affine(x_a))."""
    C_, H_, D_ = 10, 2, 8
    layer, anchor = _two_layers(21, C_, H_, H_, H_, D_)
    g = torch.Generator().manual_seed(3)
    W = torch.randn(C_, C_, generator=g, dtype=F64) / C_**0.5
    c = torch.randn(C_, generator=g, dtype=F64)
    drift = (lambda xa: xa @ W + c) if kind == "affine" else (lambda xa: xa + torch.tanh(xa @ W + c))  # noqa: E731
    x_a_cal = torch.randn(1, 64, C_, generator=g, dtype=F64)
    x_a = torch.randn(1, 24, C_, generator=g, dtype=F64)  # held-out tokens
    return layer, anchor, (x_a_cal, drift(x_a_cal)), x_a, drift(x_a)


def _held_out_error(layer, anchor, x_a, x_l, A, B_):
    with torch.no_grad():
        q_a, k_a, _ = anchor.qkv(x_a)
        _, _, v_l = layer.qkv(x_l)
        exact = layer.attention(x_l, True)
        out = reuse_attention(q_a, k_a, v_l, x_l, A, B_, scale=layer.D**-0.5, causal=True)
    return ((out - exact).norm() / exact.norm()).item()


def test_calibrated_init_is_exact_under_affine_input_drift():
    # x_a ≠ x_l, but x̂_a is a linear map of x̂_l: the weight-only fit cannot know it, the calibrated one can.
    layer, anchor, cal, x_a, x_l = _drifted_setup("affine")
    full = layer.q.in_features + 1
    weight_only = _held_out_error(layer, anchor, x_a, x_l, *_factors(layer, anchor, full))
    A, B_ = init_reuse_factors(
        layer.q.weight, layer.q.bias, layer.k.weight, layer.k.bias,
        anchor.q.weight, anchor.q.bias, anchor.k.weight, anchor.k.bias,
        heads=layer.H, rank=full, calibration=cal,
    )
    assert weight_only > 0.1
    assert _held_out_error(layer, anchor, x_a, x_l, A, B_) <= 1e-7


def test_calibrated_init_beats_weight_only_under_nonlinear_drift():
    layer, anchor, cal, x_a, x_l = _drifted_setup("tanh")
    weights = (layer.q.weight, layer.q.bias, layer.k.weight, layer.k.bias,
               anchor.q.weight, anchor.q.bias, anchor.k.weight, anchor.k.bias)
    x_hat = torch.cat([cal[1], torch.ones(*cal[1].shape[:-1], 1, dtype=F64)], -1)
    with torch.no_grad():
        q_a, k_a, _ = anchor.qkv(cal[0])
        q_l, k_l, _ = layer.qkv(cal[1])
        target = q_l @ k_l.transpose(-1, -2) - q_a @ k_a.transpose(-1, -2)
    for rank in (2, 4, 8, 11):
        plain = init_reuse_factors(*weights, heads=layer.H, rank=rank)
        calibrated = init_reuse_factors(*weights, heads=layer.H, rank=rank, calibration=cal)
        # On the calibration tokens the calibrated fit is the optimum of this very error: never worse.
        fit = lambda A, B_: ((x_hat @ A) @ (x_hat @ B_).transpose(-1, -2) - target).norm().item()  # noqa: E731
        assert fit(*calibrated) <= fit(*plain) * (1 + 1e-9)
        # On held-out tokens it should be clearly better too (measured ~0.5× or less at these seeds).
        assert _held_out_error(layer, anchor, x_a, x_l, *calibrated) < 0.8 * _held_out_error(layer, anchor, x_a, x_l, *plain)


def test_calibration_with_identical_inputs_matches_exactness():
    layer, anchor = _two_layers(3, 9, 4, 2, 1, 6)
    x = torch.randn(2, 13, 9, dtype=F64)
    weights = (layer.q.weight, layer.q.bias, layer.k.weight, layer.k.bias,
               anchor.q.weight, anchor.q.bias, anchor.k.weight, anchor.k.bias)
    A, B_ = init_reuse_factors(*weights, heads=4, rank=10, calibration=(x, x))
    assert _held_out_error(layer, anchor, x, x, A, B_) <= 1e-8


def test_init_is_deterministic_and_dtype_preserving():
    layer, anchor = _two_layers(6, 8, 2, 2, 2, 4)
    a1, b1 = _factors(layer, anchor, 5)
    a2, b2 = _factors(layer, anchor, 5)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    # sign convention: the largest-|.| entry of each left singular vector is positive
    U = a1 / a1.norm(dim=1, keepdim=True)
    assert (torch.gather(U, 1, U.abs().argmax(dim=1, keepdim=True)) > 0).all()
    a32, _ = init_reuse_factors(*(t.float() for t in (layer.q.weight, layer.q.bias, layer.k.weight, layer.k.bias,
                                                     anchor.q.weight, anchor.q.bias, anchor.k.weight, anchor.k.bias)),
                                heads=2, rank=5)
    assert a32.dtype == torch.float32
    assert _rel(a32.double(), a1) < 1e-5


def test_init_without_biases_has_zero_bias_row_effect():
    layer, anchor = _two_layers(7, 8, 2, 2, 2, 4)
    A, B_ = init_reuse_factors(layer.q.weight, None, layer.k.weight, None,
                               anchor.q.weight, None, anchor.k.weight, None, heads=2, rank=9)
    # no biases: the homogeneous row and column of M are zero, so A Bᵀ has a zero last row and column
    M = A @ B_.transpose(-1, -2)
    assert M[:, -1, :].abs().max() < 1e-12 and M[:, :, -1].abs().max() < 1e-12
    assert M[:, :-1, :-1].abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------
# op machinery
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 2])
def test_gradcheck(rank):
    g = torch.Generator().manual_seed(8)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=F64, requires_grad=True)  # noqa: E731
    q_a, k_a, v, x = rnd(1, 2, 4, 3), rnd(1, 1, 4, 3), rnd(1, 2, 4, 4), rnd(1, 4, 2)
    key_mask = torch.tensor([[True, True, False, True]])
    if rank == 0:
        fn = lambda q_a, k_a, v: reuse_attention(q_a, k_a, v, scale=0.5, causal=True, key_mask=key_mask)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q_a, k_a, v), fast_mode=True)
    else:
        A, B_ = rnd(2, 3, rank), rnd(2, 3, rank)  # C + 1 rows: the bias row gets a gradient too
        fn = lambda *t: reuse_attention(*t, scale=0.5, causal=True, key_mask=key_mask)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q_a, k_a, v, x, A, B_), fast_mode=True)


def test_opcheck():
    q_a, k_a, v, x, A, B_ = _inputs(9, 3, 2, 2, True)
    op = torch.ops.attnopt.reuse_attention.default
    for args in (
        (q_a, k_a, v, x, A, B_, 0.3, True, _padding_mask()),
        (q_a, k_a, v, None, None, None, 0.3, False, None),
    ):
        torch.library.opcheck(op, args)


def test_export_keeps_one_node():
    class Site(torch.nn.Module):
        def forward(self, q_a, k_a, v, x, A, B_):
            return reuse_attention(q_a, k_a, v, x, A, B_, scale=0.3, causal=True)

    args = _inputs(10, 3, 2, 3, True)
    ep = torch.export.export(Site(), args)
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [torch.ops.attnopt.reuse_attention.default]
    assert _rel(ep.module()(*args), Site()(*args)) <= 1e-12


def test_savings_numbers():
    s = reuse_savings(C=512, H=8, Hkv=8, D=64, r=8, N=1024)
    assert s["qk_proj_flops_original"] == 2 * 1024 * 512 * 16 * 64
    assert s["qk_proj_flops_reuse"] == 2 * 1024 * 512 * 2 * 8 * 8
    assert s["k_cache_elems_saved"] == 8 * 1024 * 64 - 8 * 1024 * 8
    assert s["logit_flops_extra"] == 2 * 8 * 1024 * 1024 * 8
    assert s["break_even_N"] == pytest.approx(512 * (16 * 64 - 2 * 8 * 8) / (8 * 8))
    at_break_even = reuse_savings(C=512, H=8, Hkv=8, D=64, r=8, N=int(s["break_even_N"]))
    assert at_break_even["net_flops_saved"] == 0
    assert reuse_savings(C=512, H=8, Hkv=2, D=64, r=0, N=4)["break_even_N"] == math.inf


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {**a, "q_anchor": a["q_anchor"][0]}, "4-D"),
        (lambda a: {**a, "k_anchor": a["k_anchor"][:, :, :, :2]}, "head dim"),
        (lambda a: {**a, "v": torch.randn(B, 4, N, DV, dtype=F64)}, "does not divide"),
        (lambda a: {**a, "A": a["A"][:, :, :1]}, "same shape"),
        (lambda a: {**a, "A": a["A"][:, :-2], "B_": a["B_"][:, :-2]}, "C \\+ 1"),
        (lambda a: {**a, "A": None}, "both residual factors"),
        (lambda a: {**a, "x": None}, "needs x"),
        (lambda a: {**a, "x": a["x"].float()}, "dtype"),
        (lambda a: {**a, "key_mask": torch.ones(B, N)}, "bool"),
        (lambda a: {**a, "key_mask": torch.ones(B, N + 1, dtype=torch.bool)}, r"\[B, N\]"),
        (lambda a: {**a, "scale": -1.0}, "scale"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, match):
    q_a, k_a, v, x, A, B_ = _inputs(11, 3, 2, 2, False)
    args = mutate(dict(q_anchor=q_a, k_anchor=k_a, v=v, x=x, A=A, B_=B_, key_mask=None, scale=0.3))
    with pytest.raises((ValueError, TypeError), match=match):
        reuse_attention(args.pop("q_anchor"), args.pop("k_anchor"), args.pop("v"), args.pop("x"),
                        args.pop("A"), args.pop("B_"), **args)


def test_init_bad_inputs_raise_clear_errors():
    layer, anchor = _two_layers(12, 8, 2, 2, 2, 4)
    w = (layer.q.weight, layer.q.bias, layer.k.weight, layer.k.bias,
         anchor.q.weight, anchor.q.bias, anchor.k.weight, anchor.k.bias)
    with pytest.raises(ValueError, match="rank must be"):
        init_reuse_factors(*w, heads=2, rank=10)
    with pytest.raises(ValueError, match="not divisible by heads"):
        init_reuse_factors(*w, heads=3, rank=2)
    with pytest.raises(ValueError, match="input channels"):
        init_reuse_factors(*w[:4], anchor.q.weight[:, :5], *w[5:], heads=2, rank=2)
    with pytest.raises(ValueError, match="bias of Wk_a"):
        init_reuse_factors(*w[:7], anchor.k.bias[:3], heads=2, rank=2)
    x = torch.randn(5, 8, dtype=F64)
    with pytest.raises(ValueError, match="pair"):
        init_reuse_factors(*w, heads=2, rank=2, calibration=x)
    with pytest.raises(ValueError, match="same tokens"):
        init_reuse_factors(*w, heads=2, rank=2, calibration=(x, x[:4]))
    with pytest.raises(ValueError, match="C = 8"):
        init_reuse_factors(*w, heads=2, rank=2, calibration=(x[:, :7], x[:, :7]))
