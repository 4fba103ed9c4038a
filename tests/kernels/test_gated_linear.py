"""gated_linear_attention (GLA: data-dependent decay per feature channel or per head) against the
token-by-token fp64 recurrence in gated_oracles.py, plus the properties the decode paths rely on.

Letters: B batch, H query heads, Hkv kv heads, N length, D head dim, Dv value dim, C chunk.
"""

import pytest
import torch
import torch.nn.functional as F
from gated_oracles import gla_oracle, ungated_causal_linear
from kernel_testing import MaxNumel, assert_exports_as_one_node
from kernel_testing import sdpa_inputs as _inputs

import attnopt.forms.gla.reference as gl
from attnopt.forms.gla.reference import (
    gated_linear_attention,
    gated_linear_attention_step,
    init_gated_linear_state,
)
from attnopt.forms.linear.reference import linear_attention
from attnopt.forms.ssm.reference import decay_attention

F64 = torch.float64
MAPS = [("identity", False), ("elu", False), ("relu", False), ("elu", True), ("relu", True)]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def _gates(kind, B, Hkv, N, D, seed, shift=1.0, dtype=F64):
    """Log-gates in (-inf, 0): logsigmoid of a shifted normal (a typical gate keeps ~70% per step)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (B, Hkv, N, D) if kind == "channel" else (B, Hkv, N)
    return F.logsigmoid(torch.randn(shape, dtype=F64, generator=gen) + shift).to(dtype)


def _mask(B, N, seed, p=0.3):
    return torch.rand(B, N, generator=torch.Generator().manual_seed(seed)) > p


# (B, H, Hkv, Nq, Nk, D, Dv): pairwise distinct, GQA with G = 2 and 3, Nq < Nk, N not a multiple of C
SHAPES = [(2, 6, 3, 13, 19, 4, 5), (3, 6, 2, 17, 17, 5, 7)]


@pytest.mark.parametrize("path", ["factorised", "exact"])
@pytest.mark.parametrize("gate", ["channel", "head"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Nq{}Nk{}".format(*s))
def test_matches_token_recurrence(gate, shape, path, monkeypatch):
    if path == "exact":  # no chunk passes the range check: the exact sub-chunk blocks run
        monkeypatch.setattr(gl, "FACTOR_RANGE", -1.0)
    B, H, Hkv, Nq, Nk, D, Dv = shape
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=Nk + H)
    g = _gates(gate, B, Hkv, Nk, D, seed=Nq)
    km = _mask(B, Nk, seed=Dv)
    for fmap, normalize in MAPS:
        for eps in (1e-6, 0.7) if normalize else (1e-6,):
            kw = dict(feature_map=fmap, normalize=normalize, scale=0.37, eps=eps, key_mask=km)
            ref, _, _ = gla_oracle(q, k, v, g, **kw)
            for C in (1, 3, 4, 64):
                out = gated_linear_attention(q, k, v, g, chunk_size=C, **kw)
                assert out.shape == (B, H, Nq, Dv) and out.dtype == F64
                assert _rel(out, ref) <= 1e-9, (fmap, normalize, eps, C)


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_long_sequence_sub_chunks_and_scan_groups(gate):
    # N = 150: C = 20 pads chunks to two 16-wide sub-chunks; C = 64 has four; C = 2 gives 75 chunks
    # (two scan groups); C = 150 is one chunk of ten sub-chunks.
    B, H, Hkv, N, D, Dv = 1, 4, 2, 150, 3, 2
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=3)
    g = _gates(gate, B, Hkv, N, D, seed=4, shift=2.0)
    km = _mask(B, N, seed=5, p=0.1)
    ref, S_ref, _ = gla_oracle(q, k, v, g, key_mask=km)
    for C in (2, 20, 64, 150):
        out, (S, _) = gated_linear_attention(q, k, v, g, key_mask=km, chunk_size=C, state=init_gated_linear_state(B, Hkv, D, Dv, dtype=F64))
        assert _rel(out, ref) <= 1e-9 and _rel(S, S_ref) <= 1e-9, C


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_fp32_matches_oracle(gate):
    B, H, Hkv, N, D, Dv = 2, 6, 3, 90, 8, 6
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=6)
    g = _gates(gate, B, Hkv, N, D, seed=7, shift=2.0)
    for fmap, normalize in [("identity", False), ("elu", True)]:
        ref, _, _ = gla_oracle(q, k, v, g, feature_map=fmap, normalize=normalize)
        out = gated_linear_attention(q.float(), k.float(), v.float(), g.float(), feature_map=fmap, normalize=normalize)
        assert out.dtype == torch.float32 and _rel(out, ref) <= 1e-5, fmap


@pytest.mark.parametrize("gate", ["channel", "head"])
@pytest.mark.parametrize("dtype, tol", [(F64, 1e-12), (torch.float32, 2e-5)])
def test_strong_gates_stay_finite_and_exact(gate, dtype, tol):
    # g ≈ -10 per step: an 8- or 16-step sum reaches -100 or less, so a factorised
    # exp(l_i)·exp(-l_j) would overflow fp32; chunk 32 spans several sub-chunks and both scans.
    B, H, Hkv, N, D, Dv = 1, 2, 1, 70, 3, 4
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=8)
    g = _gates(gate, B, Hkv, N, D, seed=9, shift=0.0) * 10.0
    g[:, :, 5:30] *= 1e-3  # weak gates in between, so the output is not just the last key
    ref, S_ref, _ = gla_oracle(q, k, v, g)
    s0 = init_gated_linear_state(B, Hkv, D, Dv, dtype=dtype)
    out, (S, _) = gated_linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype), chunk_size=32, state=s0)
    assert torch.isfinite(out).all() and _rel(out, ref) <= tol and _rel(S, S_ref) <= tol


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_left_padding_equals_the_row_alone(gate):
    B, H, Hkv, N, D, Dv = 3, 4, 2, 21, 3, 5
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=12)
    g = _gates(gate, B, Hkv, N, D, seed=13)
    pads = [0, 5, 13]
    km = torch.ones(B, N, dtype=torch.bool)
    for b, p in enumerate(pads):
        km[b, :p] = False
        g[b, :, :p] = -7.0  # padding carries garbage: a strong gate that must not decay anything
        k[b, :, :p] = 50.0
    for fmap, normalize in [("identity", False), ("elu", True)]:
        kw = dict(feature_map=fmap, normalize=normalize)
        s0 = init_gated_linear_state(B, Hkv, D, Dv, normalize=normalize, dtype=F64)
        out, (S, z) = gated_linear_attention(q, k, v, g, key_mask=km, state=s0, chunk_size=4, **kw)
        for b, p in enumerate(pads):
            sl = slice(b, b + 1)
            s1 = init_gated_linear_state(1, Hkv, D, Dv, normalize=normalize, dtype=F64)
            alone, (S1, z1) = gated_linear_attention(q[sl, :, p:], k[sl, :, p:], v[sl, :, p:], g[sl, :, p:], state=s1, chunk_size=4, **kw)
            assert _rel(out[sl, :, p:], alone) <= 1e-12, (fmap, b)
            assert _rel(S[sl], S1) <= 1e-12 and (z is None or _rel(z[sl], z1) <= 1e-12)


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_masked_keys_leave_the_state_unchanged(gate):
    B, Hkv, N, D, Dv = 2, 2, 11, 3, 4
    q, k, v = _inputs(B, 4, Hkv, N, N, D, Dv, seed=14)
    g = _gates(gate, B, Hkv, N, D, seed=15)
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64)
    z0 = torch.rand(B, Hkv, D, dtype=F64)
    none = torch.zeros(B, N, dtype=torch.bool)
    out, (S, z) = gated_linear_attention(q, k, v, g, key_mask=none, state=(S0, z0), normalize=True, feature_map="elu", chunk_size=4)
    assert _rel(S, S0) <= 1e-15 and _rel(z, z0) <= 1e-15
    # every query then reads the unchanged state
    fq = F.elu(q) + 1
    ref = (fq @ S0.repeat_interleave(2, 1)) / ((fq * z0.repeat_interleave(2, 1)[:, :, None]).sum(-1, keepdim=True) + 1e-6)
    assert _rel(out, ref) <= 1e-12
    # dropping keys in the middle equals deleting them (for the positions that remain)
    km = torch.ones(B, N, dtype=torch.bool)
    km[:, [3, 4, 8]] = False
    keep = km[0]
    a = gated_linear_attention(q, k, v, g, key_mask=km, chunk_size=3)
    b = gated_linear_attention(q[:, :, keep], k[:, :, keep], v[:, :, keep], g[:, :, keep], chunk_size=3)
    assert _rel(a[:, :, keep], b) <= 1e-12


@pytest.mark.parametrize("gate, normalize", [("channel", False), ("head", True), ("channel", True)])
def test_state_split_at_every_chunk_boundary_and_anywhere(gate, normalize):
    B, H, Hkv, N, D, Dv, C = 2, 6, 3, 23, 4, 3, 5
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=16)
    g = _gates(gate, B, Hkv, N, D, seed=17)
    km = _mask(B, N, seed=18, p=0.2)
    kw = dict(feature_map="elu" if normalize else "identity", normalize=normalize)
    s0 = init_gated_linear_state(B, Hkv, D, Dv, normalize=normalize, dtype=F64)
    full, (S_full, z_full) = gated_linear_attention(q, k, v, g, key_mask=km, state=s0, chunk_size=C, **kw)
    ref, S_ref, z_ref = gla_oracle(q, k, v, g, key_mask=km, **kw)
    assert _rel(full, ref) <= 1e-12 and _rel(S_full, S_ref) <= 1e-12
    assert not normalize or _rel(z_full, z_ref) <= 1e-12
    for T in sorted(set(range(C, N, C)) | {1, 2, 7, 13, 22}):
        a, st = gated_linear_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], g[:, :, :T], key_mask=km[:, :T], state=s0, chunk_size=C, **kw)
        b, (S2, z2) = gated_linear_attention(q[:, :, T:], k[:, :, T:], v[:, :, T:], g[:, :, T:], key_mask=km[:, T:], state=st, chunk_size=C, **kw)
        assert _rel(torch.cat([a, b], 2), full) <= 1e-12, T
        assert _rel(S2, S_full) <= 1e-12 and (not normalize or _rel(z2, z_full) <= 1e-12), T


@pytest.mark.parametrize("gate, fmap, normalize", [("channel", "identity", False), ("head", "elu", True)])
def test_prefill_then_steps_equals_one_call(gate, fmap, normalize):
    B, H, Hkv, N, D, Dv, T = 2, 4, 2, 15, 3, 5, 6
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=19)
    g = _gates(gate, B, Hkv, N, D, seed=20)
    km = _mask(B, N, seed=21, p=0.2)
    kw = dict(feature_map=fmap, normalize=normalize, scale=0.6)
    full = gated_linear_attention(q, k, v, g, key_mask=km, chunk_size=4, **kw)
    s0 = init_gated_linear_state(B, Hkv, D, Dv, normalize=normalize, dtype=F64)
    out, st = gated_linear_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], g[:, :, :T], key_mask=km[:, :T], state=s0, **kw)
    outs = [out]
    for t in range(T, N):
        sl = slice(t, t + 1)
        o, st = gated_linear_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], st, key_mask=km[:, sl], **kw)
        outs.append(o)
    assert _rel(torch.cat(outs, 2), full) <= 1e-12
    st_none, outs = None, []
    for t in range(N):
        sl = slice(t, t + 1)
        o, st_none = gated_linear_attention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], st_none, key_mask=km[:, sl], **kw)
        outs.append(o)
    assert _rel(torch.cat(outs, 2), full) <= 1e-12
    _, S_ref, z_ref = gla_oracle(q, k, v, g, key_mask=km, **kw)
    assert _rel(st[0], S_ref) <= 1e-12 and _rel(st_none[0], S_ref) <= 1e-12
    assert (st[1] is None) == (not normalize)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("gate", ["channel", "head"])
def test_step_with_a_masked_token_leaves_that_row_alone(gate, normalize):
    """One decode step whose new token is masked in one row: that row's state comes back unchanged (not
    even decayed) and its output reads the carried state, as the fp64 oracle says; the other rows step."""
    B, H, Hkv, D, Dv = 3, 4, 2, 3, 5
    q, k, v = _inputs(B, H, Hkv, 1, 1, D, Dv, seed=31)
    g = _gates(gate, B, Hkv, 1, D, seed=32, shift=-1.0)  # strong gates: a decayed row is far off
    gen = torch.Generator().manual_seed(33)
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64, generator=gen)
    z0 = torch.rand(B, Hkv, D, dtype=F64, generator=gen) + 0.5 if normalize else None
    km = torch.tensor([[True], [False], [True]])
    kw = dict(feature_map="elu", normalize=normalize, scale=0.6)
    out, (S, z) = gated_linear_attention_step(q, k, v, g, (S0.clone(), None if z0 is None else z0.clone()), key_mask=km,
                                              **kw)
    ref, S_ref, z_ref = gla_oracle(q, k, v, g, key_mask=km, S0=S0, z0=z0, **kw)
    assert torch.equal(S[1], S0[1]) and (z is None or torch.equal(z[1], z0[1]))
    assert _rel(out, ref) <= 1e-12 and _rel(S, S_ref) <= 1e-12 and (z is None or _rel(z, z_ref) <= 1e-12)
    assert _rel(S[0], S0[0]) > 0.1 and _rel(S[2], S0[2]) > 0.1  # the kept rows did step


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_zero_gate_is_plain_causal_linear_attention(gate):
    B, H, Hkv, Nq, Nk, D, Dv = 2, 6, 2, 9, 14, 4, 3
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=22)
    g = torch.zeros((B, Hkv, Nk, D) if gate == "channel" else (B, Hkv, Nk), dtype=F64)
    km = _mask(B, Nk, seed=23)
    out = gated_linear_attention(q, k, v, g, key_mask=km, chunk_size=4)
    assert _rel(out, ungated_causal_linear(q, k, v, key_mask=km)) <= 1e-12
    # normalized elu with g = 0 is attnopt's causal linear attention
    out = gated_linear_attention(q, k, v, g, feature_map="elu", normalize=True, key_mask=km, chunk_size=4)
    assert _rel(out, linear_attention(q, k, v, feature_map="elu", causal=True, key_mask=km)) <= 1e-12


def test_constant_head_gate_is_decay_attention():
    B, H, Hkv, N, D, Dv = 2, 6, 3, 19, 4, 5
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=24)
    gammas = [0.9, 0.5, 0.99]
    g = torch.tensor(gammas, dtype=F64).log().view(1, Hkv, 1).expand(B, Hkv, N).contiguous()
    per_query_head = [gammas[h // (H // Hkv)] for h in range(H)]
    for fmap, normalize in [("identity", False), ("elu", True)]:
        kw = dict(feature_map=fmap, normalize=normalize)
        out = gated_linear_attention(q, k, v, g, chunk_size=4, **kw)
        assert _rel(out, decay_attention(q, k, v, decay=per_query_head, **kw)) <= 1e-12


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_gradcheck(gate):
    # N = C = 18: two 16-wide sub-chunks (the inner scan) and the remainder's padding
    B, H, Hkv, N, D, Dv = 1, 2, 1, 18, 2, 2
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=25)
    g = _gates(gate, B, Hkv, N, D, seed=26) - 0.05  # stays < 0 under the finite differences
    km = torch.ones(B, N, dtype=torch.bool)
    km[0, [2, 17]] = False
    args = tuple(t.requires_grad_(True) for t in (q, k, v, g))
    for fmap, normalize in [("identity", False), ("elu", True)]:
        fn = lambda a, b, c, d: gated_linear_attention(a, b, c, d, feature_map=fmap, normalize=normalize, key_mask=km, chunk_size=18)
        assert torch.autograd.gradcheck(fn, args, fast_mode=True)


def test_gradcheck_through_the_state_path():
    B, H, Hkv, N, D, Dv = 1, 2, 1, 7, 2, 3
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=27)
    g = _gates("channel", B, Hkv, N, D, seed=28) - 0.05
    S0 = torch.randn(B, Hkv, D, Dv, dtype=F64)
    args = tuple(t.requires_grad_(True) for t in (q, k, v, g, S0))
    def fn(a, b, c, d, s):
        out, (S, _) = gated_linear_attention(a, b, c, d, state=(s, None), chunk_size=3)
        return out, S

    assert torch.autograd.gradcheck(fn, args)


def test_bf16_inputs_keep_an_fp32_state():
    B, H, Hkv, N, D, Dv = 1, 4, 2, 40, 8, 8
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=29)
    g = _gates("channel", B, Hkv, N, D, seed=30, shift=2.0)
    lo = [t.bfloat16() for t in (q, k, v, g)]
    s0 = init_gated_linear_state(B, Hkv, D, Dv, normalize=True, dtype=torch.bfloat16)
    assert s0[0].dtype == torch.float32
    out, (S, z) = gated_linear_attention(*lo, feature_map="elu", normalize=True, state=s0, chunk_size=16)
    assert out.dtype == torch.bfloat16 and S.dtype == torch.float32 and z.dtype == torch.float32
    ref, S_ref, _ = gla_oracle(*[t.double() for t in lo], feature_map="elu", normalize=True)
    assert _rel(out, ref) <= 1e-2 and _rel(S, S_ref) <= 1e-5  # the state is not rounded to bf16
    o, (S1, _) = gated_linear_attention_step(*[t[:, :, :1] for t in lo], (S, z), feature_map="elu", normalize=True)
    assert o.dtype == torch.bfloat16 and S1.dtype == torch.float32
    out16 = gated_linear_attention(*[t.half() for t in (q, k, v, g)], chunk_size=16)
    assert out16.dtype == torch.float16 and _rel(out16, gla_oracle(q, k, v, g)[0]) <= 5e-3


@pytest.mark.parametrize("shift", [3.0, -4.0])  # weak gates: the factorised chunks; strong: the exact blocks
def test_never_materialises_n_by_n_or_per_position_state(shift):
    B, H, Hkv, N, D, C = 1, 4, 2, 1024, 32, 64
    q, k, v = _inputs(B, H, Hkv, N, N, D, D, seed=31)
    g = _gates("channel", B, Hkv, N, D, seed=32, shift=shift)
    exact = not gl.factorable(g.reshape(B * Hkv, N, D), C)
    assert exact == (shift < 0)
    q, k, v, g = (t.requires_grad_(True) for t in (q, k, v, g))
    with MaxNumel() as probe:
        out, _, _ = gl._gla_forward(q, k, v, g, None, "elu", True, 0.5, 1e-6, C)
        out.sin().sum().backward()
    assert torch.isfinite(g.grad).all()
    c = gl.SUB_CHUNK["channel"]
    if exact:
        assert probe.max_numel >= B * Hkv * N * c * D  # the probe sees inside: the [c, c, M] blocks
    # inputs, the [c, c, M] blocks or the factorised path's C×C chunk products
    assert probe.max_numel <= max(B * H * N * (D + 1), B * Hkv * N * c * D, B * H * N * C)
    assert probe.max_numel < B * Hkv * N * D * D // 2  # a per-position state
    assert probe.max_numel < B * H * N * N // 4


# test_aot_dispatch_dynamic passes too but costs ~15 s per call on 2 busy cores (symbolic tracing of
# the recomputed backward); the static AOT check traces the same backward.
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")


def test_opcheck():
    q, k, v = _inputs(2, 4, 2, 5, 7, 3, 2, seed=33)
    g = _gates("channel", 2, 2, 7, 3, seed=34)
    km = _mask(2, 7, seed=35)
    for gg in (g, g[..., 0]):
        args = (q, k, v, gg.clone(), km, "elu", True, 0.5, 1e-6, 4)
        args = tuple(t.requires_grad_(True) if isinstance(t, torch.Tensor) and t.dtype == F64 else t for t in args)
        result = torch.library.opcheck(torch.ops.attnopt.gated_linear_attention.default, args, test_utils=OPCHECKS)
        assert set(result) == set(OPCHECKS) and all(r == "SUCCESS" for r in result.values()), result


def test_export_keeps_one_op_node():
    q, k, v = _inputs(1, 4, 2, 8, 8, 4, 4, seed=36)
    g = _gates("channel", 1, 2, 8, 4, seed=37)
    assert_exports_as_one_node(
        lambda q, k, v: gated_linear_attention(q, k, v, g * 1.0, feature_map="elu", normalize=True) + 1.0,
        torch.ops.attnopt.gated_linear_attention.default,
        (q, k, v),
    )


def _bad_call(case):
    q, k, v = _inputs(1, 4, 2, 5, 5, 3, 2, seed=0)
    g = -torch.rand(1, 2, 5, 3, dtype=F64)
    kw = {}
    if case == "g_shape":
        g = g[..., :2]
    elif case == "g_positive":
        g = g.clone()
        g[0, 1, 3, 0] = 0.25
    elif case == "g_nan":
        g = g.clone()
        g[0, 0, 0, 0] = float("nan")
    elif case == "g_int":
        g = torch.zeros(1, 2, 5, dtype=torch.long)
    elif case == "g_list":
        g = [0.0] * 5
    elif case == "fmap":
        kw = dict(feature_map="favor")
    elif case in ("chunk0", "chunk_bool", "chunk_float"):
        kw = dict(chunk_size={"chunk0": 0, "chunk_bool": True, "chunk_float": 8.0}[case])
    elif case == "nq_gt_nk":
        k, v, g = k[:, :, :3], v[:, :, :3], g[:, :, :3]
    elif case == "state_shape":
        kw = dict(state=init_gated_linear_state(1, 4, 3, 2, dtype=F64))  # per query head: wrong
    elif case == "state_z":
        kw = dict(state=init_gated_linear_state(1, 2, 3, 2, dtype=F64), normalize=True, feature_map="elu")
    elif case == "state_type":
        kw = dict(state=torch.zeros(1, 2, 3, 2))
    elif case == "heads":
        q = q[:, :3]
    elif case == "normalize":
        kw = dict(normalize=1)
    elif case == "step_n":
        return lambda: gated_linear_attention_step(q, k, v, g, None)
    return lambda: gated_linear_attention(q, k, v, g, **kw)


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("g_shape", ValueError, r"g \(log-gates\) must have shape \[B, Hkv, N\] = \[1, 2, 5\] or \[B, Hkv, N, M\]"),
        ("g_positive", ValueError, r"must be finite and <= 0 \(got 0.25\)"),
        ("g_nan", ValueError, r"must be finite and <= 0 \(got nan\)"),
        ("g_int", TypeError, r"g \(log-gates\) must be floating point"),
        ("g_list", TypeError, r"g \(log-gates\) must be a tensor"),
        ("fmap", ValueError, r"unknown feature_map 'favor'; allowed: identity, elu, relu"),
        ("chunk0", ValueError, r"chunk_size must be an int >= 1, got 0"),
        ("chunk_bool", ValueError, r"chunk_size must be an int >= 1, got True"),
        ("chunk_float", ValueError, r"chunk_size must be an int >= 1, got 8.0"),
        ("nq_gt_nk", ValueError, r"needs Nq <= Nk"),
        ("state_shape", ValueError, r"state S must have shape \[B, Hkv, M, Dv\] = \[1, 2, 3, 2\], got \[1, 4, 3, 2\]"),
        ("state_z", ValueError, r"normalize=True needs state z"),
        ("state_type", TypeError, r"state must be a pair"),
        ("heads", ValueError, r"multiple of key/value heads"),
        ("normalize", TypeError, r"normalize must be a bool"),
        ("step_n", ValueError, r"expects one token"),
    ],
)
def test_bad_arguments_raise_one_line_errors(case, exc, words):
    with pytest.raises(exc, match=words) as info:
        _bad_call(case)()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("gated_linear_attention")


@pytest.mark.parametrize("kind", ["channel", "head"])
def test_fp32_gradients_stay_finite_where_a_chunk_spans_nearly_the_factor_range(kind):
    """Chunks of 64 whose gates sum to about −58: inside FACTOR_RANGE, so the two-matmul chunks run, and
    exp(b)² underflows in fp32 there. The fp32 gradients of q, k, v and g equal the fp64 ones (a
    gradient through a division by exp(b) was NaN here and made the compile-time gate fit diverge)."""
    B, H, Hkv, N, D, C = 1, 2, 1, 128, 4, 64
    q, k, v = _inputs(B, H, Hkv, N, N, D, D, seed=41)
    shape = (B, Hkv, N, D) if kind == "channel" else (B, Hkv, N)
    g = torch.full(shape, -58.0 / C, dtype=F64) + 0.01 * torch.rand(shape, dtype=F64, generator=torch.Generator().manual_seed(42))
    assert gl.factorable(g.reshape(B * Hkv, N, -1), C)
    grads = {}
    for dtype in (F64, torch.float32):
        args = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k, v, g)]
        out = gated_linear_attention(*args, feature_map="elu", normalize=True, chunk_size=C)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum().backward()
        grads[dtype] = [a.grad for a in args]
    for lo, hi in zip(grads[torch.float32], grads[F64]):
        assert torch.isfinite(lo).all() and _rel(lo, hi) <= 1e-4


def test_strong_gates_take_shorter_factored_chunks_and_stay_exact():
    # −2 per step: a chunk of 64 spans 128 of decay, one of 16 spans 32; at −5 even 16 spans 80.
    B, H, Hkv, N, D = 1, 2, 1, 128, 4
    q, k, v = _inputs(B, H, Hkv, N, N, D, D, seed=43)
    jitter = 0.1 * torch.rand(B, Hkv, N, D, dtype=F64, generator=torch.Generator().manual_seed(44))
    for per_step, chunk in ((-2.0, 16), (-0.5, 64), (-5.0, None)):
        g = per_step + jitter
        assert gl.factored_chunk(g.reshape(B * Hkv, N, D), 64) == chunk
        ref = gla_oracle(q, k, v, g, feature_map="elu", normalize=True)[0]
        out = gated_linear_attention(*(t.float() for t in (q, k, v, g)), feature_map="elu", normalize=True)
        assert torch.isfinite(out).all() and _rel(out, ref) <= 2e-5, per_step
