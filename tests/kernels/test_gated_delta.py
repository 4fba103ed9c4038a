"""gated_delta_attention (Gated DeltaNet, chunked WY/UT form) against the token-by-token fp64
recurrence S_t = exp(g_t)(I − β_t k_t k_tᵀ)S_{t−1} + β_t k_t v_tᵀ in gated_oracles.py.

Letters: B batch, H query heads, Hkv kv heads, N length, D head dim, Dv value dim, C chunk.
"""

import pytest
import torch
import torch.nn.functional as F
from gated_oracles import delta_oracle
from kernel_testing import MaxNumel, assert_exports_as_one_node
from kernel_testing import sdpa_inputs as _inputs

import attnopt.forms.delta.reference as gd
from attnopt.forms.delta.reference import (
    gated_delta_attention,
    gated_delta_attention_step,
    init_gated_delta_state,
)

F64 = torch.float64


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def _problem(B, H, Hkv, Nq, Nk, D, Dv, seed, normalize_keys=True, shift=2.0):
    """q, k (L2-normalised unless asked otherwise: the form's convention), v, g = logsigmoid(·) and
    β = sigmoid(·) in (0, 1)."""
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed)
    if normalize_keys:
        k = F.normalize(k, dim=-1)
    gen = torch.Generator().manual_seed(seed + 1)
    g = F.logsigmoid(torch.randn(B, Hkv, Nk, dtype=F64, generator=gen) + shift)
    beta = torch.sigmoid(torch.randn(B, Hkv, Nk, dtype=F64, generator=gen))
    return q, k, v, g, beta


def _mask(B, N, seed, p=0.3):
    return torch.rand(B, N, generator=torch.Generator().manual_seed(seed)) > p


SHAPES = [(2, 6, 3, 13, 19, 4, 5), (3, 6, 2, 17, 17, 5, 7)]  # pairwise distinct; G = 2, 3; Nq < Nk


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Nq{}Nk{}".format(*s))
def test_matches_token_recurrence(shape):
    B, H, Hkv, Nq, Nk, D, Dv = shape
    q, k, v, g, beta = _problem(B, H, Hkv, Nq, Nk, D, Dv, seed=Nk + H)
    km = _mask(B, Nk, seed=Dv)
    ref, _ = delta_oracle(q, k, v, g, beta, scale=0.43, key_mask=km)
    for C in (1, 3, 4, 64):
        out = gated_delta_attention(q, k, v, g, beta, scale=0.43, key_mask=km, chunk_size=C)
        assert out.shape == (B, H, Nq, Dv) and out.dtype == F64
        assert _rel(out, ref) <= 1e-9, C
    # default scale 1/sqrt(D)
    assert _rel(gated_delta_attention(q, k, v, g, beta, key_mask=km), delta_oracle(q, k, v, g, beta, key_mask=km)[0]) <= 1e-9


def test_long_sequence_and_keys_used_as_given():
    # N = 150 over several chunk sizes; keys NOT normalised (norms up to ~1.3, β < 1 keeps the
    # recurrence contracting): the op must not normalise them itself.
    B, H, Hkv, N, D, Dv = 1, 4, 2, 150, 3, 2
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=3, normalize_keys=False)
    k = 0.75 * k
    km = _mask(B, N, seed=4, p=0.1)
    ref, S_ref = delta_oracle(q, k, v, g, beta, key_mask=km)
    for C in (2, 20, 64, 150):
        out, S = gated_delta_attention(q, k, v, g, beta, key_mask=km, chunk_size=C, state=init_gated_delta_state(B, Hkv, D, Dv, dtype=F64))
        assert _rel(out, ref) <= 1e-9 and _rel(S, S_ref) <= 1e-9, C
    assert _rel(gated_delta_attention(q, F.normalize(k, dim=-1), v, g, beta, key_mask=km), ref) > 1e-2


def test_fp32_matches_oracle():
    B, H, Hkv, N, D, Dv = 2, 6, 3, 90, 8, 6
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=5)
    ref, _ = delta_oracle(q, k, v, g, beta)
    out = gated_delta_attention(*(t.float() for t in (q, k, v, g, beta)))
    assert out.dtype == torch.float32 and _rel(out, ref) <= 1e-5


def test_strong_gates_stay_finite_and_exact():
    B, H, Hkv, N, D, Dv = 1, 2, 1, 70, 3, 4
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=6, shift=0.0)
    g = 10.0 * g
    g[:, :, 5:30] *= 1e-3
    ref, S_ref = delta_oracle(q, k, v, g, beta)
    for dtype, tol in ((F64, 1e-12), (torch.float32, 2e-5)):
        out, S = gated_delta_attention(*(t.to(dtype) for t in (q, k, v, g, beta)), chunk_size=32,
                                       state=init_gated_delta_state(B, Hkv, D, Dv, dtype=dtype))
        assert torch.isfinite(out).all() and _rel(out, ref) <= tol and _rel(S, S_ref) <= tol, dtype


def test_left_padding_equals_the_row_alone():
    B, H, Hkv, N, D, Dv = 3, 4, 2, 21, 3, 5
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=7)
    pads = [0, 5, 13]
    km = torch.ones(B, N, dtype=torch.bool)
    for b, p in enumerate(pads):
        km[b, :p] = False
        g[b, :, :p] = -7.0  # garbage in the padding: a strong gate, a full write, a huge key
        beta[b, :, :p] = 1.0
        k[b, :, :p] = 50.0
    out, S = gated_delta_attention(q, k, v, g, beta, key_mask=km, chunk_size=4, state=init_gated_delta_state(B, Hkv, D, Dv, dtype=F64))
    for b, p in enumerate(pads):
        sl = slice(b, b + 1)
        alone, S1 = gated_delta_attention(q[sl, :, p:], k[sl, :, p:], v[sl, :, p:], g[sl, :, p:], beta[sl, :, p:],
                                          chunk_size=4, state=init_gated_delta_state(1, Hkv, D, Dv, dtype=F64))
        assert _rel(out[sl, :, p:], alone) <= 1e-12 and _rel(S[sl], S1) <= 1e-12, b


def test_masked_keys_leave_the_state_unchanged():
    B, H, Hkv, N, D, Dv = 2, 4, 2, 11, 3, 4
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=8)
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64)
    out, S = gated_delta_attention(q, k, v, g, beta, key_mask=torch.zeros(B, N, dtype=torch.bool), state=S0, chunk_size=4)
    assert _rel(S, S0) <= 1e-15
    assert _rel(out, (q @ S0.repeat_interleave(2, 1)) / D**0.5) <= 1e-12  # every query reads S0
    km = torch.ones(B, N, dtype=torch.bool)
    km[:, [3, 4, 8]] = False
    keep = km[0]
    a = gated_delta_attention(q, k, v, g, beta, key_mask=km, chunk_size=3)
    b = gated_delta_attention(q[:, :, keep], k[:, :, keep], v[:, :, keep], g[:, :, keep], beta[:, :, keep], chunk_size=3)
    assert _rel(a[:, :, keep], b) <= 1e-12


def test_step_with_a_masked_token_leaves_that_row_alone():
    """One decode step whose new token is masked in one row: that row's state comes back unchanged (not
    even decayed) and its output reads the carried state, as the fp64 oracle says; the other rows step."""
    B, H, Hkv, D, Dv = 3, 6, 3, 4, 5
    q, k, v, g, beta = _problem(B, H, Hkv, 1, 1, D, Dv, seed=34, shift=-1.0)
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64, generator=torch.Generator().manual_seed(35))
    km = torch.tensor([[True], [False], [True]])
    out, S = gated_delta_attention_step(q, k, v, g, beta, S0.clone(), scale=0.7, key_mask=km)
    ref, S_ref = delta_oracle(q, k, v, g, beta, scale=0.7, key_mask=km, S0=S0)
    assert torch.equal(S[1], S0[1])
    assert _rel(out, ref) <= 1e-12 and _rel(S, S_ref) <= 1e-12
    assert _rel(S[0], S0[0]) > 0.1 and _rel(S[2], S0[2]) > 0.1  # the kept rows did step


def test_beta_zero_writes_nothing():
    B, H, Hkv, N, D, Dv = 2, 6, 3, 13, 4, 5
    q, k, v, g, _ = _problem(B, H, Hkv, N, N, D, Dv, seed=9)
    zero = torch.zeros(B, Hkv, N, dtype=F64)
    out = gated_delta_attention(q, k, v, g, zero, chunk_size=4)
    assert torch.equal(out, torch.zeros_like(out))  # zero state, nothing written
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64)
    out, S = gated_delta_attention(q, k, v, torch.zeros_like(g), zero, state=S0, chunk_size=4)
    assert _rel(S, S0) <= 1e-15 and _rel(out, (q @ S0.repeat_interleave(2, 1)) / D**0.5) <= 1e-12
    out, S = gated_delta_attention(q, k, v, g, zero, state=S0, chunk_size=4)  # only the decay acts
    assert _rel(S, torch.exp(g.sum(-1))[..., None, None] * S0) <= 1e-12


def test_beta_one_with_one_key_stores_its_value():
    # β = 1, g = 0 and a unit key: the delta rule replaces what that key reads by v exactly
    B, H, Hkv, N, D, Dv = 1, 2, 1, 6, 4, 3
    q, k, v, _, _ = _problem(B, H, Hkv, N, N, D, Dv, seed=10)
    k[:] = F.normalize(k[:, :, :1], dim=-1)  # the same key at every position
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64)
    _, S = gated_delta_attention(q, k, v, torch.zeros(B, Hkv, N, dtype=F64), torch.ones(B, Hkv, N, dtype=F64), state=S0, chunk_size=4)
    assert _rel(S[0, 0].T @ k[0, 0, 0], v[0, 0, -1]) <= 1e-12  # reads the last value written


@pytest.mark.parametrize("C", [4, 5])
def test_state_split_at_every_chunk_boundary_and_anywhere(C):
    B, H, Hkv, N, D, Dv = 2, 6, 3, 23, 4, 3
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=11)
    km = _mask(B, N, seed=12, p=0.2)
    s0 = init_gated_delta_state(B, Hkv, D, Dv, dtype=F64)
    full, S_full = gated_delta_attention(q, k, v, g, beta, key_mask=km, state=s0, chunk_size=C)
    ref, S_ref = delta_oracle(q, k, v, g, beta, key_mask=km)
    assert _rel(full, ref) <= 1e-12 and _rel(S_full, S_ref) <= 1e-12
    for T in sorted(set(range(C, N, C)) | {1, 2, 7, 13, 22}):
        a, st = gated_delta_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], g[:, :, :T], beta[:, :, :T], key_mask=km[:, :T], state=s0, chunk_size=C)
        b, S2 = gated_delta_attention(q[:, :, T:], k[:, :, T:], v[:, :, T:], g[:, :, T:], beta[:, :, T:], key_mask=km[:, T:], state=st, chunk_size=C)
        assert _rel(torch.cat([a, b], 2), full) <= 1e-12 and _rel(S2, S_full) <= 1e-12, T


def test_prefill_then_steps_equals_one_call():
    B, H, Hkv, N, D, Dv, T = 2, 4, 2, 15, 3, 5, 6
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=13)
    km = _mask(B, N, seed=14, p=0.2)
    full = gated_delta_attention(q, k, v, g, beta, key_mask=km, scale=0.7, chunk_size=4)
    out, st = gated_delta_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], g[:, :, :T], beta[:, :, :T], key_mask=km[:, :T],
                                    scale=0.7, state=init_gated_delta_state(B, Hkv, D, Dv, dtype=F64))
    outs = [out]
    for t in range(T, N):
        sl = slice(t, t + 1)
        o, st = gated_delta_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], st, scale=0.7, key_mask=km[:, sl])
        outs.append(o)
    assert _rel(torch.cat(outs, 2), full) <= 1e-12
    st2, outs = None, []
    for t in range(N):
        sl = slice(t, t + 1)
        o, st2 = gated_delta_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], st2, scale=0.7, key_mask=km[:, sl])
        outs.append(o)
    assert _rel(torch.cat(outs, 2), full) <= 1e-12
    S_ref = delta_oracle(q, k, v, g, beta, key_mask=km)[1]
    assert _rel(st, S_ref) <= 1e-12 and _rel(st2, S_ref) <= 1e-12


def test_gradcheck():
    B, H, Hkv, N, D, Dv = 1, 2, 1, 7, 3, 2
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=15)
    g = g - 0.05  # stays < 0 under the finite differences
    km = torch.ones(B, N, dtype=torch.bool)
    km[0, 2] = False
    args = tuple(t.requires_grad_(True) for t in (q, k, v, g, beta))
    fn = lambda a, b, c, d, e: gated_delta_attention(a, b, c, d, e, key_mask=km, chunk_size=3)
    assert torch.autograd.gradcheck(fn, args)
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64, requires_grad=True)
    fs = lambda a, b, c, d, e, s: gated_delta_attention(a, b, c, d, e, state=s, chunk_size=4)
    assert torch.autograd.gradcheck(fs, (*args, S0), fast_mode=True)


def test_bf16_inputs_keep_an_fp32_state():
    B, H, Hkv, N, D, Dv = 1, 4, 2, 40, 8, 8
    lo = [t.bfloat16() for t in _problem(B, H, Hkv, N, N, D, Dv, seed=16)]
    s0 = init_gated_delta_state(B, Hkv, D, Dv, dtype=torch.bfloat16)
    assert s0.dtype == torch.float32
    out, S = gated_delta_attention(*lo, state=s0, chunk_size=16)
    assert out.dtype == torch.bfloat16 and S.dtype == torch.float32
    ref, S_ref = delta_oracle(*[t.double() for t in lo])
    assert _rel(out, ref) <= 1e-2 and _rel(S, S_ref) <= 1e-5  # the state is not rounded to bf16
    o, S1 = gated_delta_attention_step(*[t[:, :, :1] for t in lo], S)
    assert o.dtype == torch.bfloat16 and S1.dtype == torch.float32
    out16 = gated_delta_attention(*[t.half() for t in lo], chunk_size=16)
    assert out16.dtype == torch.float16 and _rel(out16, ref) <= 5e-3


def test_never_materialises_n_by_n_or_per_position_state():
    B, H, Hkv, N, D, C = 1, 4, 2, 1024, 32, 64
    q, k, v, g, beta = (t.requires_grad_(True) for t in _problem(B, H, Hkv, N, N, D, D, seed=17))
    with MaxNumel() as probe:
        out, _ = gd._delta_forward(q, k, v, g, beta, None, 0.5, C)
        out.sin().sum().backward()
    assert torch.isfinite(beta.grad).all() and torch.isfinite(g.grad).all()
    assert probe.max_numel >= B * H * N * C  # the probe sees inside: the C×C blocks
    assert probe.max_numel <= max(B * H * N * max(D, C), B * Hkv * N * (D + D))  # inputs, C×C blocks, [βV, βK]
    assert probe.max_numel < B * Hkv * N * D * D // 2  # a per-position state
    assert probe.max_numel < B * H * N * N // 4


def test_opcheck():
    q, k, v, g, beta = _problem(2, 4, 2, 5, 7, 3, 2, seed=18)
    km = _mask(2, 7, seed=19)
    args = tuple(t.requires_grad_(True) for t in (q, k, v, g, beta)) + (km, 0.5, 4)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")
    result = torch.library.opcheck(torch.ops.attnopt.gated_delta_attention.default, args, test_utils=checks)
    assert set(result) == set(checks) and all(r == "SUCCESS" for r in result.values()), result


def test_export_keeps_one_op_node():
    q, k, v, g, beta = _problem(1, 4, 2, 8, 8, 4, 4, seed=20)
    assert_exports_as_one_node(
        lambda q, k, v: gated_delta_attention(q, F.normalize(k, dim=-1), v, g * 1.0, beta * 1.0) + 1.0,
        torch.ops.attnopt.gated_delta_attention.default,
        (q, k, v),
    )


def _bad_call(case):
    q, k, v, g, beta = _problem(1, 4, 2, 5, 5, 3, 2, seed=0)
    kw = {}
    if case == "g_channel":
        g = -torch.rand(1, 2, 5, 3, dtype=F64)
    elif case == "g_positive":
        g = g.clone()
        g[0, 1, 3] = 0.5
    elif case == "g_inf":
        g = g.clone()
        g[0, 0, 0] = float("-inf")
    elif case == "beta_shape":
        beta = beta[..., None]
    elif case == "beta_int":
        beta = torch.ones(1, 2, 5, dtype=torch.long)
    elif case == "beta_none":
        beta = None
    elif case == "beta_nan":
        beta = beta.clone()
        beta[0, 0, 1] = float("nan")
    elif case == "chunk0":
        kw = dict(chunk_size=0)
    elif case == "scale":
        kw = dict(scale=float("inf"))
    elif case == "nq_gt_nk":
        k, v, g, beta = k[:, :, :3], v[:, :, :3], g[:, :, :3], beta[:, :, :3]
    elif case == "state_shape":
        kw = dict(state=torch.zeros(1, 4, 3, 2, dtype=F64))
    elif case == "state_tuple":
        kw = dict(state=(torch.zeros(1, 2, 3, 2, dtype=F64), None))
    elif case == "step_n":
        return lambda: gated_delta_attention_step(q, k, v, g, beta, None)
    return lambda: gated_delta_attention(q, k, v, g, beta, **kw)


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("g_channel", ValueError, r"g \(log-gates\) must have shape \[B, Hkv, N\] = \[1, 2, 5\], got \[1, 2, 5, 3\]"),
        ("g_positive", ValueError, r"must be finite and <= 0 \(got 0.5\)"),
        ("g_inf", ValueError, r"must be finite and <= 0 \(got -inf\)"),
        ("beta_shape", ValueError, r"beta must have shape \[B, Hkv, N\] = \[1, 2, 5\]"),
        ("beta_int", TypeError, r"beta must be floating point"),
        ("beta_none", TypeError, r"beta must be a tensor"),
        ("beta_nan", ValueError, r"beta must be finite"),
        ("chunk0", ValueError, r"chunk_size must be an int >= 1, got 0"),
        ("scale", ValueError, r"scale must be a finite float"),
        ("nq_gt_nk", ValueError, r"needs Nq <= Nk"),
        ("state_shape", ValueError, r"state must be a tensor S of shape \[B, Hkv, D, Dv\] = \[1, 2, 3, 2\], got \[1, 4, 3, 2\]"),
        ("state_tuple", ValueError, r"state must be a tensor S"),
        ("step_n", ValueError, r"expects one token"),
    ],
)
def test_bad_arguments_raise_one_line_errors(case, exc, words):
    with pytest.raises(exc, match=words) as info:
        _bad_call(case)()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("gated_delta_attention")


def test_fp32_gradients_stay_finite_where_a_chunk_spans_nearly_the_factor_range():
    """Chunks of 64 whose gates sum to about −58 (factored chunks; exp(b)² underflows in fp32): the fp32
    gradients equal the fp64 ones (a division by exp(b) made them NaN)."""
    B, H, Hkv, N, D, Dv, C = 1, 2, 1, 128, 4, 3, 64
    q, k, v, _, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=51)
    g = torch.full((B, Hkv, N), -58.0 / C, dtype=F64) + 0.01 * torch.rand(B, Hkv, N, dtype=F64,
                                                                          generator=torch.Generator().manual_seed(52))
    grads = {}
    for dtype in (F64, torch.float32):
        args = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        out = gated_delta_attention(*args, chunk_size=C)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
        grads[dtype] = [a.grad for a in args]
    for lo, hi in zip(grads[torch.float32], grads[F64]):
        assert torch.isfinite(lo).all() and _rel(lo, hi) <= 1e-4


def test_strong_gates_take_shorter_factored_chunks_and_stay_exact():
    B, H, Hkv, N, D, Dv = 1, 2, 1, 96, 4, 3
    q, k, v, _, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=53)
    for per_step in (-2.0, -5.0):  # a chunk of 16 spans 32 (factored), then 80 (the exact form)
        g = torch.full((B, Hkv, N), per_step, dtype=F64)
        ref, S_ref = delta_oracle(q, k, v, g, beta)
        out, S = gated_delta_attention(*(t.float() for t in (q, k, v, g, beta)),
                                       state=init_gated_delta_state(B, Hkv, D, Dv))
        assert torch.isfinite(out).all() and _rel(out, ref) <= 2e-5 and _rel(S, S_ref) <= 2e-5, per_step


@pytest.mark.parametrize("C, block", [(64, 16), (128, 32), (48, 16), (30, 16)])  # 30: no block divides it: LAPACK
def test_blocked_solve_and_longer_chunks_match_the_recurrence(C, block):
    B, H, Hkv, N, D, Dv = 1, 4, 2, 150, 5, 3
    q, k, v, g, beta = _problem(B, H, Hkv, N, N, D, Dv, seed=57)
    km = _mask(B, N, seed=58, p=0.1)
    ref, _ = delta_oracle(q, k, v, g, beta, key_mask=km)
    out = gd.gated_delta_chunked(q, k, v, g, beta, key_mask=km, chunk_size=C, solve_block=block)
    assert _rel(out, ref) <= 1e-9
    L = torch.randn(3, C, C, dtype=F64, generator=torch.Generator().manual_seed(59)).tril(-1) * 0.3
    rhs = torch.randn(3, C, 7, dtype=F64, generator=torch.Generator().manual_seed(60))
    x = gd.unit_lower_solve(L, rhs, block)
    assert _rel((torch.eye(C, dtype=F64) + L) @ x, rhs) <= 1e-12
