"""decay_attention (retention / SSM form) against the explicit decayed sum and the recurrence, fp64.

Letters: B batch, H query heads, Hkv kv heads, N length, D head dim, Dv value dim, C chunk.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnopt.forms.ssm.reference as decay_module
from attnopt.forms.ssm.reference import (
    decay_attention,
    decay_attention_reference,
    decay_attention_step,
    init_decay_state,
    retnet_decay,
)
from kernel_testing import MaxNumel, assert_exports_as_one_node
from oracles import decay_oracle, decay_state_oracle
from kernel_testing import sdpa_inputs as _inputs

F64 = torch.float64


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


SHAPES = [
    # (B, H, Hkv, Nq, Nk, D, Dv, chunk, padded)
    (1, 2, 2, 1, 1, 3, 2, 64, False),  # N = 1
    (2, 3, 3, 13, 13, 4, 5, 4, False),  # N not a multiple of the chunk
    (2, 4, 2, 11, 11, 3, 6, 3, False),  # GQA
    (2, 4, 1, 5, 13, 4, 3, 4, False),  # Nq < Nk (bottom-right), MQA
    (3, 2, 2, 12, 12, 4, 5, 5, True),  # padding
]
DECAYS = [None, 0.8, "per_head", "tensor"]


def _decay_arg(kind, H):
    if kind == "per_head":
        return [0.3 + 0.7 * (h + 1) / H for h in range(H)]  # includes γ = 1 for the last head
    if kind == "tensor":
        return torch.linspace(0.5, 0.95, H, dtype=F64)
    return kind


def _gammas(kind, H):
    d = _decay_arg(kind, H)
    if d is None:
        return retnet_decay(H).tolist()
    if isinstance(d, float):
        return [d] * H
    return [float(x) for x in d]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Nq{}Nk{}C{}pad{}".format(*s[:5], s[7], s[8]))
def test_matches_explicit_sum(shape):
    B, H, Hkv, Nq, Nk, D, Dv, C, padded = shape
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=Nq * 17 + Nk)
    key_mask = None
    if padded:
        key_mask = torch.rand(B, Nk, generator=torch.Generator().manual_seed(3)) > 0.35
    for normalize, fmap, dk in itertools.product([False, True], ["identity", "elu", "relu"], DECAYS):
        if normalize and fmap == "identity":
            continue  # φ(q)ᵀz can cross zero: the ratio is ill-conditioned, compared below with elu/relu
        kw = dict(decay=_decay_arg(dk, H), feature_map=fmap, normalize=normalize, key_mask=key_mask)
        out = decay_attention(q, k, v, chunk_size=C, **kw)
        assert out.shape == (B, H, Nq, Dv) and out.dtype == F64
        ref = decay_attention_reference(q, k, v, **kw)
        assert _rel_err(out, ref) <= 1e-10, (normalize, fmap, dk)


ORACLE_GAMMAS = [0.9, 0.5, 1.0, 0.7, 0.3, 0.97]  # per head, γ = 1 included


@pytest.mark.parametrize(
    "normalize, fmap",
    [(False, "identity"), (False, "elu"), (False, "relu"), (True, "elu"), (True, "relu")],
)
def test_matches_oracle_written_from_the_formula(normalize, fmap):
    # Pairwise-distinct B, H, Hkv, Nq, Nk, D, Dv; GQA, padding on both sides, Nq < Nk, three full
    # chunks and a remainder, a scale that is not 1/√D, and an eps that visibly moves the ratio.
    B, H, Hkv, Nq, Nk, D, Dv = 2, 6, 3, 5, 11, 4, 7
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=21)
    km = torch.ones(B, Nk, dtype=torch.bool)
    km[0, :2] = False
    km[1, [5, 10]] = False
    kw = dict(feature_map=fmap, normalize=normalize, scale=0.41, key_mask=km)
    for eps in (1e-6, 2.0) if normalize else (1e-6,):
        out = decay_attention(q, k, v, decay=ORACLE_GAMMAS, eps=eps, chunk_size=3, **kw)
        ref = decay_oracle(q, k, v, gammas=ORACLE_GAMMAS, eps=eps, **kw)
        assert out.shape == (B, H, Nq, Dv) and _rel_err(out, ref) <= 1e-10, eps
        if eps > 1e-3:  # eps must be visible, or the check above would not see it ignored
            assert _rel_err(ref, decay_oracle(q, k, v, gammas=ORACLE_GAMMAS, eps=1e-6, **kw)) > 1e-2


def test_relu_zero_denominator_gives_zero_row_not_nan():
    q = -torch.ones(1, 1, 2, 3, dtype=F64)  # ReLU(q) = 0: every kernel value is 0
    k, v = torch.ones(1, 1, 4, 3, dtype=F64), torch.randn(1, 1, 4, 2, dtype=F64)
    out = decay_attention(q, k, v, decay=0.9, feature_map="relu", normalize=True, eps=0.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_identity_normalized_matches_reference():
    q, k, v = _inputs(1, 2, 2, 9, 9, 3, 3, seed=5)
    q, k = q.abs(), k.abs()  # keep φ(q)ᵀz away from zero
    out = decay_attention(q, k, v, decay=0.9, normalize=True, chunk_size=4)
    ref = decay_attention_reference(q, k, v, decay=0.9, normalize=True)
    assert _rel_err(out, ref) <= 1e-10


def test_retnet_schedule_and_default_scale():
    g = retnet_decay(4)
    assert g.tolist() == [1 - 2**-5, 1 - 2**-6, 1 - 2**-7, 1 - 2**-8]
    q, k, v = _inputs(1, 4, 4, 6, 6, 4, 2, seed=2)
    a = decay_attention(q, k, v)
    assert torch.equal(a, decay_attention(q, k, v, decay="retnet"))
    assert _rel_err(a, decay_attention(q, k, v, decay=g)) <= 1e-14
    assert _rel_err(a, decay_attention(q, k, v, scale=0.3) * (1 / math.sqrt(4)) / 0.3) <= 1e-12
    assert _rel_err(a, decay_attention(q, k, v, scale=0.3)) > 0.1


@settings(max_examples=25, deadline=None)
@given(
    dims=st.permutations([1, 2, 3, 4]),  # pairwise-distinct B, H, N, D
    extraN=st.sampled_from([0, 5, 9]),
    gamma=st.floats(0.05, 1.0),
    fmap=st.sampled_from(["identity", "elu", "relu"]),
    normalize=st.booleans(),
    C=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(dims, extraN, gamma, fmap, normalize, C, seed):
    B, H, N, D = dims
    N += extraN
    if normalize and fmap == "identity":
        fmap = "elu"
    q, k, v = _inputs(B, H, H, N, N, D, D + 1, seed)
    kw = dict(decay=gamma, feature_map=fmap, normalize=normalize)
    out = decay_attention(q, k, v, chunk_size=C, **kw)
    assert _rel_err(out, decay_attention_reference(q, k, v, **kw)) <= 1e-10


@pytest.mark.parametrize("normalize, fmap", [(False, "identity"), (True, "elu")])
def test_prefill_then_steps_equals_full_prefill(normalize, fmap):
    B, H, Hkv, N, D, Dv, T = 2, 4, 2, 19, 3, 5, 8
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=31)
    kw = dict(decay=[0.9, 0.6, 0.99, 1.0], feature_map=fmap, normalize=normalize)
    full = decay_attention(q, k, v, chunk_size=3, **kw)
    state = init_decay_state(B, H, D, Dv, normalize=normalize, dtype=F64)
    out, state = decay_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], state=state, chunk_size=3, **kw)
    outs = [out]
    for t in range(T, N):
        o, state = decay_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, **kw)
        outs.append(o)
    assert _rel_err(torch.cat(outs, dim=2), full) <= 1e-10
    # stepping from scratch (state=None) is the same recurrence too
    state, outs = None, []
    for t in range(N):
        o, state = decay_attention_step(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, **kw)
        outs.append(o)
    assert _rel_err(torch.cat(outs, dim=2), full) <= 1e-10
    S, z = state
    assert S.shape == (B, H, D, Dv) and (z is not None) == normalize
    gammas = kw.pop("decay")
    assert _rel_err(full, decay_oracle(q, k, v, gammas=gammas, scale=1 / math.sqrt(D), eps=1e-6, **kw)) <= 1e-10
    S_ref, z_ref = decay_state_oracle(k, v, gammas=gammas, feature_map=fmap, H=H)
    assert _rel_err(S, S_ref) <= 1e-10 and (not normalize or _rel_err(z, z_ref) <= 1e-10)


@pytest.mark.parametrize("normalize", [False, True])
def test_two_calls_with_state_equal_one_call(normalize):
    B, H, N, D, Dv = 2, 3, 23, 4, 2
    q, k, v = _inputs(B, H, H, N, N, D, Dv, seed=41)
    km = torch.rand(B, N, generator=torch.Generator().manual_seed(1)) > 0.2
    kw = dict(decay=0.85, feature_map="elu", normalize=normalize)
    s0 = init_decay_state(B, H, D, Dv, normalize=normalize, dtype=F64)
    full, (S_full, z_full) = decay_attention(q, k, v, key_mask=km, state=s0, chunk_size=5, **kw)
    a, st1 = decay_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], key_mask=km[:, :10], state=s0, chunk_size=4, **kw)
    b, (S2, z2) = decay_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], key_mask=km[:, 10:], state=st1, chunk_size=4, **kw)
    assert _rel_err(torch.cat([a, b], dim=2), full) <= 1e-10
    assert _rel_err(S2, S_full) <= 1e-10
    if normalize:
        assert _rel_err(z2, z_full) <= 1e-10
    assert _rel_err(full, decay_attention(q, k, v, key_mask=km, **kw)) <= 1e-10
    gammas = [kw.pop("decay")] * H
    ref = decay_oracle(q, k, v, gammas=gammas, scale=1 / math.sqrt(D), eps=1e-6, key_mask=km, **kw)
    S_ref, z_ref = decay_state_oracle(k, v, gammas=gammas, feature_map="elu", H=H, key_mask=km)
    assert _rel_err(full, ref) <= 1e-10 and _rel_err(S2, S_ref) <= 1e-10
    if normalize:
        assert _rel_err(z2, z_ref) <= 1e-10


@pytest.mark.parametrize("gamma, C", [(0.5, 64), (0.5, 4), (1 - 1e-9, 64), (1e-3, 16), (1.0, 7)])
def test_long_sequences_stay_finite_and_exact(gamma, C):
    # γ = 0.5 with C = 64: γ^(i-j) for j > i would be 2^63 and inf for smaller γ; masking in log
    # space before the exp keeps those out. C = 4 gives 75 chunks (more than one scan group).
    q, k, v = _inputs(1, 2, 2, 300, 300, 4, 3, seed=51)
    for normalize, fmap in [(False, "identity"), (True, "elu")]:
        kw = dict(decay=gamma, feature_map=fmap, normalize=normalize)
        out = decay_attention(q, k, v, chunk_size=C, **kw)
        assert torch.isfinite(out).all()
        assert _rel_err(out, decay_attention_reference(q, k, v, **kw)) <= 1e-10
    out32 = decay_attention(q.float(), k.float(), v.float(), decay=gamma, chunk_size=C)
    assert out32.dtype == torch.float32 and torch.isfinite(out32).all()


def test_half_precision_keeps_dtype():
    q, k, v = _inputs(1, 2, 2, 20, 20, 8, 8, seed=8)
    out = decay_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), feature_map="elu", normalize=True, chunk_size=8)
    assert out.dtype == torch.bfloat16
    ref = decay_attention_reference(q, k, v, feature_map="elu", normalize=True)
    assert (out.double() - ref).abs().max().item() < 5e-2


def test_never_materialises_n_by_n_or_per_position_state():
    # The probe runs on the op's plain-PyTorch body: a dispatch mode sees a custom op as one call
    # (only its output), so probing the public call would pass even with an N x N inside.
    B, H, N, D, C = 1, 2, 1024, 8, 16
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, H, H, N, N, D, D, seed=9))
    gamma = retnet_decay(H)
    with MaxNumel() as probe:
        out, _, _ = decay_module._decay_forward(q, k, v, gamma, None, "elu", True, 0.5, 1e-6, C)
        out.sin().sum().backward()
    assert torch.isfinite(q.grad).all()
    intra_scores = B * H * N * C  # the intra-chunk blocks [B, H, N/C, C, C]
    assert probe.max_numel >= intra_scores  # the probe does see inside
    # largest allowed: inputs / v with the z column, or the intra-chunk scores
    assert probe.max_numel <= max(B * H * N * (D + 1), intra_scores)
    assert probe.max_numel < B * H * N * D * D // 2  # a per-position state (naive scan)
    assert probe.max_numel < B * H * N * N // 32


def test_gradcheck_through_custom_op():
    q, k, v = _inputs(2, 4, 2, 6, 6, 3, 2, seed=10)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    km = torch.tensor([[True] * 6, [False, True, True, False, True, True]])
    for normalize, fmap in [(False, "identity"), (True, "elu")]:
        fn = lambda a, b, c: decay_attention(a, b, c, decay=0.7, feature_map=fmap, normalize=normalize, key_mask=km, chunk_size=4)
        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_opcheck():
    q, k, v = _inputs(2, 4, 2, 5, 5, 3, 2, seed=11)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    km = torch.rand(2, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    args = (q, k, v, retnet_decay(4), km, "elu", True, 0.5, 1e-6, 8)
    result = torch.library.opcheck(torch.ops.attnopt.decay_attention.default, args)
    assert set(result) >= {"test_schema", "test_faketensor", "test_aot_dispatch_dynamic"}
    assert all(r == "SUCCESS" for r in result.values()), result


def test_export_keeps_one_op_node():
    assert_exports_as_one_node(
        lambda q, k, v: decay_attention(q, k, v, decay=0.9, feature_map="elu", normalize=True) + 1.0,
        torch.ops.attnopt.decay_attention.default,
        _inputs(1, 2, 2, 8, 8, 4, 4, seed=12),
    )


@pytest.mark.parametrize(
    "decay, exc, words",
    [
        (0.0, ValueError, r"\(0, 1\]"),
        (1.5, ValueError, r"\(0, 1\]"),
        (-0.2, ValueError, r"\(0, 1\]"),
        (float("nan"), ValueError, r"\(0, 1\]"),
        ([0.5, 1.2], ValueError, r"\(0, 1\]"),
        (torch.tensor([0.5, 0.0]), ValueError, r"\(0, 1\]"),
        ([0.5, 0.5, 0.5], ValueError, "one per head"),
        (torch.ones(3), ValueError, r"shape \[H\]"),
        (True, TypeError, "decay must be"),
        ("linear", TypeError, "decay must be"),
    ],
)
def test_bad_decay_values_raise_clear_errors(decay, exc, words):
    q, k, v = _inputs(1, 2, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(exc, match=words):
        decay_attention(q, k, v, decay=decay)


def test_bad_arguments_raise_clear_errors():
    q, k, v = _inputs(1, 2, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(ValueError, match="feature_map"):
        decay_attention(q, k, v, feature_map="favor")
    with pytest.raises(ValueError, match="chunk_size"):
        decay_attention(q, k, v, chunk_size=0)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        decay_attention(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        decay_attention(q[:, :1].expand(1, 3, 4, 3), k, v)
    with pytest.raises(ValueError, match="needs state z"):
        decay_attention(q, k, v, normalize=True, feature_map="elu", state=init_decay_state(1, 2, 3, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"state S must have shape"):
        decay_attention(q, k, v, state=init_decay_state(1, 2, 3, 4, dtype=F64))
    with pytest.raises(ValueError, match="one token"):
        decay_attention_step(q, k, v, None)
    with pytest.raises(ValueError, match="positive int"):
        retnet_decay(0)
