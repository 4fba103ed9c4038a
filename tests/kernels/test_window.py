"""window_attention against SDPA with an explicit band + sinks mask, in fp64.

Letters: B batch, H query heads, Hkv kv heads, Nq/Nk lengths, D head dim, Dv value dim, W window.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnopt.forms.window.reference as window_module
from attnopt.forms.window.reference import (
    default_window_block_size,
    window_attention,
    window_attention_reference,
    window_visibility_mask,
)
from kernel_testing import MaxNumel, assert_exports_as_one_node
from oracles import window_oracle
from kernel_testing import sdpa_inputs as _inputs

F64 = torch.float64


def _loop_mask(B, Nq, Nk, W, causal, sinks, key_mask):
    """The visibility rule spelled out element by element (independent of the module's mask)."""
    m = torch.zeros(B, 1, Nq, Nk, dtype=torch.bool)
    for b in range(B):
        real = [j for j in range(Nk) if key_mask is None or bool(key_mask[b, j])]
        sink_set = set(real[:sinks])  # the row's first `sinks` real tokens
        for i in range(Nq):
            p = Nk - Nq + i  # bottom-right alignment
            for j in range(Nk):
                in_band = (p - W < j <= p) if causal else abs(p - j) < W
                is_sink = j in sink_set and (j <= p or not causal)
                m[b, 0, i, j] = (in_band or is_sink) and j in real
    return m


def _sdpa_oracle(q, k, v, mask):
    kr = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    vr = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)


def _assert_close_on_seen_rows(out, ref, mask, tol=1e-10):
    seen = mask.any(-1)[..., None].expand_as(out)  # rows with >= 1 visible key
    assert seen.any()
    err = (out - ref).abs()[seen].max().item()
    scale = ref.abs()[seen].max().item()
    assert err <= tol * max(scale, 1.0), f"max abs err {err:.3e} (ref scale {scale:.3e})"
    # rows without any key are exactly 0 (SDPA gives NaN or garbage there)
    assert torch.all(out[~seen] == 0)


SHAPES = [
    # (B, H, Hkv, Nq, Nk, D, Dv, block_size, padded)
    (1, 2, 2, 1, 1, 4, 3, None, False),  # N = 1
    (2, 3, 3, 13, 13, 5, 7, 4, False),  # N not a multiple of the block
    (2, 4, 2, 11, 11, 3, 6, 3, False),  # GQA
    (2, 4, 1, 5, 13, 4, 4, 2, False),  # Nq < Nk (bottom-right), MQA
    (3, 2, 2, 12, 12, 4, 5, 5, True),  # padding mask
    (2, 4, 2, 6, 10, 3, 3, 4, True),  # padding + GQA + Nq < Nk
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Nq{}Nk{}bs{}pad{}".format(*s[:5], s[7], s[8]))
def test_matches_sdpa_with_band_and_sinks_mask(shape):
    B, H, Hkv, Nq, Nk, D, Dv, bs, padded = shape
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=Nq * 31 + Nk)
    key_mask = None
    if padded:
        key_mask = torch.rand(B, Nk, generator=torch.Generator().manual_seed(7)) > 0.35
        key_mask[0] = True
    for causal, sinks, W in itertools.product([True, False], [0, 3], [1, 4, Nk + 5]):
        mask = _loop_mask(B, Nq, Nk, W, causal, sinks, key_mask)
        out = window_attention(q, k, v, window=W, causal=causal, sinks=sinks, key_mask=key_mask, block_size=bs)
        assert out.shape == (B, H, Nq, Dv) and out.dtype == F64
        _assert_close_on_seen_rows(out, _sdpa_oracle(q, k, v, mask), mask)


def test_visibility_mask_helper_matches_the_rule():
    km = torch.tensor([[True, False, True, True, True, True, False], [False, False, False, True, False, True, True]])
    for causal, sinks, W, Nq in itertools.product([True, False], [0, 2, 5], [1, 3], [7, 4]):
        got = window_visibility_mask(Nq, 7, window=W, causal=causal, sinks=sinks, key_mask=km)
        assert torch.equal(got, _loop_mask(2, Nq, 7, W, causal, sinks, km))
    # row 1's sinks with S = 2 are its first real tokens 3 and 5, never the pads 0 and 1
    got = window_visibility_mask(7, 7, window=1, causal=True, sinks=2, key_mask=km)
    assert got[1, 0, 6].nonzero().flatten().tolist() == [3, 5, 6]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_matches_oracle_with_distinct_sizes_and_scale(causal):
    # Pairwise-distinct B, H, Hkv, Nq, Nk, D, Dv, GQA, padding on both sides, Nq < Nk, and a scale
    # that is not 1/√D (the SDPA-based checks above use the default one).
    B, H, Hkv, Nq, Nk, D, Dv = 2, 6, 3, 5, 11, 4, 7
    q, k, v = _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed=26)
    km = torch.ones(B, Nk, dtype=torch.bool)
    km[0, :2] = False
    km[1, [5, 10]] = False
    for W, sinks in [(1, 0), (3, 2)]:
        kw = dict(window=W, causal=causal, sinks=sinks, scale=0.41, key_mask=km)
        out = window_attention(q, k, v, block_size=2, **kw)
        assert out.shape == (B, H, Nq, Dv)
        assert (out - window_oracle(q, k, v, **kw)).abs().max().item() <= 1e-12, (W, sinks)


# ------------------------------------------------------------- sinks are the first real tokens


def _run_alone(q, k, v, b, keep, **kw):
    """Row b with only its kept keys (and the matching query rows) as an unpadded batch of one."""
    idx = keep.nonzero().flatten()
    return window_attention(q[b : b + 1, :, idx], k[b : b + 1, :, idx], v[b : b + 1, :, idx], **kw)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("Hkv", [3, 1], ids=["mha", "gqa"])
def test_padded_rows_equal_the_same_rows_unpadded(causal, Hkv):
    # Row 0 left-padded by 4, row 1 right-padded by 3, row 2 unpadded, row 3 left 1 + right 2,
    # row 4 has 2 real tokens (< sinks): every real query row equals the row run alone.
    B, H, N, D, Dv = 5, 6, 13, 4, 7
    q, k, v = _inputs(B, H, Hkv, N, N, D, Dv, seed=21)
    km = torch.ones(B, N, dtype=torch.bool)
    km[0, :4] = False
    km[1, -3:] = False
    km[3, :1] = False
    km[3, -2:] = False
    km[4, :] = False
    km[4, 5:7] = True
    for W, sinks in [(3, 3), (2, 4), (5, 1)]:
        kw = dict(window=W, causal=causal, sinks=sinks)
        out = window_attention(q, k, v, key_mask=km, block_size=4, **kw)
        worst = 0.0
        for b in range(B):
            alone = _run_alone(q, k, v, b, km[b], **kw)
            worst = max(worst, (out[b : b + 1, :, km[b]] - alone).abs().max().item())
        assert worst <= 1e-12, (W, sinks, worst)
        ref = window_oracle(q, k, v, window=W, causal=causal, sinks=sinks, scale=1 / math.sqrt(D), key_mask=km)
        assert (out - ref).abs().max().item() <= 1e-12


def test_left_padding_moves_the_sinks_off_the_pads():
    # The old rule (keys 0..S-1 as sinks) gives pad keys to a left-padded row: it then misses its
    # first real tokens. The first-real-token rule must differ from that rule by a visible margin.
    q, k, v = _inputs(1, 2, 2, 10, 10, 4, 3, seed=22)
    km = torch.tensor([[False] * 3 + [True] * 7])
    out = window_attention(q, k, v, window=2, causal=True, sinks=2, key_mask=km)
    alone = window_attention(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], window=2, causal=True, sinks=2)
    assert (out[:, :, 3:] - alone).abs().max().item() <= 1e-12
    positional = _sdpa_oracle(q, k, v, window_visibility_mask(10, 10, window=2, causal=True) & km)
    assert (out[:, :, 6:] - positional[:, :, 6:]).abs().max().item() > 1e-2


@pytest.mark.parametrize("per_step", [1, None])
def test_sinks_per_row_padding_with_bottom_right_queries(monkeypatch, per_step):
    # Nq < Nk (decode-style), per-row padding, GQA; one block per step hits sinks left of the band.
    if per_step is not None:
        monkeypatch.setattr(window_module, "SCORES_PER_STEP", per_step)
    q, k, v = _inputs(3, 4, 2, 5, 11, 3, 2, seed=23)
    km = torch.tensor(
        [[False] * 4 + [True] * 7, [True] * 6 + [False] * 5, [False, True, False, True] + [True] * 7]
    )
    for causal, sinks in itertools.product([True, False], [1, 3, 9]):
        out = window_attention(q, k, v, window=2, causal=causal, sinks=sinks, key_mask=km, block_size=2)
        ref = window_oracle(q, k, v, window=2, causal=causal, sinks=sinks, scale=1 / math.sqrt(3), key_mask=km)
        assert (out - ref).abs().max().item() <= 1e-12, (causal, sinks)


def test_all_masked_rows_are_zero_with_finite_gradients():
    q, k, v = _inputs(3, 4, 2, 7, 7, 3, 2, seed=24)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    km = torch.ones(3, 7, dtype=torch.bool)
    km[1] = False
    km[2, :5] = False
    for causal in (True, False):
        out = window_attention(q, k, v, window=2, causal=causal, sinks=2, key_mask=km, block_size=3)
        assert torch.all(out[1] == 0) and torch.isfinite(out).all()
        if causal:  # row 2: queries 0..4 see neither band nor sinks (both real keys come later)
            assert torch.all(out[2, :, :5] == 0)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, 2, dtype=F64)).sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.all(grads[0][1] == 0) and torch.all(grads[1][1] == 0) and torch.all(grads[2][1] == 0)


def test_gradcheck_sinks_under_left_padding():
    q, k, v = _inputs(2, 4, 2, 6, 6, 3, 2, seed=25)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    km = torch.tensor([[False, False, True, True, True, True], [True, True, True, True, False, False]])
    for causal in (True, False):
        fn = lambda a, b, c: window_attention(a, b, c, window=1, causal=causal, sinks=2, key_mask=km, block_size=4)
        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_window_counts_keys_including_self():
    # causal W=3: query 5 sees keys 3, 4, 5 -> 3 keys (ORT local_window_size=3, ONNX left_window_size=2)
    m = window_visibility_mask(8, 8, window=3, causal=True)[0, 0]
    assert m[5].nonzero().flatten().tolist() == [3, 4, 5]
    # non-causal W=3: |i-j| < 3 -> 5 keys
    m = window_visibility_mask(8, 8, window=3, causal=False)[0, 0]
    assert m[5].nonzero().flatten().tolist() == [3, 4, 5, 6, 7]
    # one value vector per key: with W=1 causal, output == own value
    q, k, v = _inputs(1, 2, 2, 6, 6, 4, 3, seed=1)
    out = window_attention(q, k, v, window=1, causal=True)
    assert torch.allclose(out, v, atol=1e-12)


def test_sink_inside_band_is_counted_once():
    # All keys equal score -> uniform weights; a double-counted sink would get weight 2/(n+1).
    B, H, N, D = 1, 1, 6, 2
    q = torch.zeros(B, H, N, D, dtype=F64)
    k = torch.zeros(B, H, N, D, dtype=F64)
    v = torch.arange(N, dtype=F64).view(1, 1, N, 1)
    out = window_attention(q, k, v, window=3, causal=True, sinks=2, block_size=2)
    # query 2 sees {0,1,2} (sinks 0,1 are also in band): mean 1; query 5 sees {0,1,3,4,5}: mean 13/5
    assert out[0, 0, 2, 0].item() == pytest.approx(1.0, abs=1e-12)
    assert out[0, 0, 5, 0].item() == pytest.approx(13 / 5, abs=1e-12)


def test_rows_without_keys_are_zero_not_nan():
    q, k, v = _inputs(2, 2, 2, 9, 9, 3, 4, seed=3)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[1] = False  # batch 1 sees nothing at all
    key_mask[0, :5] = False  # batch 0: with W=2 causal, queries 0..4 see nothing
    for causal, sinks in itertools.product([True, False], [0, 2]):
        out = window_attention(q, k, v, window=2, causal=causal, sinks=sinks, key_mask=key_mask, block_size=4)
        assert torch.isfinite(out).all()
        assert torch.all(out[1] == 0)
        if causal:
            assert torch.all(out[0, :, :5] == 0)
        assert out[0, :, 5:].abs().sum() > 0
        ref = window_attention_reference(q, k, v, window=2, causal=causal, sinks=sinks, key_mask=key_mask)
        assert torch.allclose(out, ref, atol=1e-12, rtol=0)
    # Nq > Nk causal: the first queries sit before key 0 and see nothing
    q2, k2, v2 = _inputs(1, 2, 2, 6, 3, 3, 2, seed=4)
    out = window_attention(q2, k2, v2, window=2, causal=True, block_size=2)
    assert torch.all(out[:, :, :3] == 0) and out[:, :, 3:].abs().sum() > 0


def test_block_size_does_not_change_the_result():
    q, k, v = _inputs(2, 4, 2, 17, 17, 4, 3, seed=5)
    ref = window_attention_reference(q, k, v, window=5, causal=True, sinks=2)
    for bs in (1, 3, 8, 17, 64):
        out = window_attention(q, k, v, window=5, causal=True, sinks=2, block_size=bs)
        assert (out - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("per_step", [1, 200])
def test_many_small_steps_match(monkeypatch, per_step):
    # per_step=1: one query block per step, so edge steps, interior steps (cached mask) and
    # sinks left of the band all occur; 200: a few blocks per step.
    monkeypatch.setattr(window_module, "SCORES_PER_STEP", per_step)
    q, k, v = _inputs(2, 4, 2, 19, 23, 3, 2, seed=14)
    km = torch.rand(2, 23, generator=torch.Generator().manual_seed(2)) > 0.3
    for causal, sinks, mask in itertools.product([True, False], [0, 2], [None, km]):
        kw = dict(window=4, causal=causal, sinks=sinks, key_mask=mask)
        out = window_attention(q, k, v, block_size=3, **kw)
        ref = window_attention_reference(q, k, v, **kw)
        assert (out - ref).abs().max().item() < 1e-12


def test_scale_argument():
    q, k, v = _inputs(1, 2, 2, 10, 10, 4, 4, seed=6)
    out = window_attention(q, k, v, window=4, causal=False, scale=0.3)
    ref = window_attention(q * (0.3 * math.sqrt(4)), k, v, window=4, causal=False)
    assert (out - ref).abs().max().item() < 1e-12
    assert (out - window_attention(q, k, v, window=4, causal=False)).abs().max().item() > 1e-3


def test_half_precision_keeps_dtype_and_computes_in_fp32():
    q, k, v = _inputs(1, 2, 2, 20, 20, 8, 8, seed=8)
    out16 = window_attention(q.half(), k.half(), v.half(), window=6, causal=True, sinks=1)
    assert out16.dtype == torch.float16
    ref = window_attention_reference(q, k, v, window=6, causal=True, sinks=1)
    assert (out16.double() - ref).abs().max().item() < 5e-3


@settings(max_examples=25, deadline=None)
@given(
    dims=st.permutations([1, 2, 3, 4]).map(lambda p: p[:3]),  # pairwise-distinct B, H, D (+ N below)
    N=st.sampled_from([5, 6, 7, 9, 11]),
    W=st.integers(1, 12),
    sinks=st.integers(0, 4),
    causal=st.booleans(),
    bs=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(dims, N, W, sinks, causal, bs, seed):
    B, H, D = dims
    q, k, v = _inputs(B, H, H, N, N, D, D + 1, seed)
    mask = window_visibility_mask(N, N, window=W, causal=causal, sinks=sinks)
    out = window_attention(q, k, v, window=W, causal=causal, sinks=sinks, block_size=bs)
    _assert_close_on_seen_rows(out, _sdpa_oracle(q, k, v, mask), mask)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-mask"])
def test_never_materialises_n_by_n(masked):
    # Probes the op's plain-PyTorch body, forward and backward: a dispatch mode sees the custom op
    # itself as one call (only its output), so probing window_attention would prove nothing.
    B, H, N, D, W, S = 1, 2, 1024, 4, 16, 4
    q, k, v = (t.requires_grad_(True) for t in _inputs(B, H, H, N, N, D, D, seed=9))
    km = None
    if masked:  # the per-row sink gather
        km = torch.ones(B, N, dtype=torch.bool)
        km[:, :5] = False
    bs = default_window_block_size(W, True)
    with MaxNumel() as probe:
        out = window_module._window_forward(q, k, v, km, W, True, S, 0.5, bs)
        out.sin().sum().backward()
    assert torch.isfinite(q.grad).all()
    all_bands = B * H * N * (bs + W - 1)  # scores of every query block against its key band
    assert probe.max_numel >= all_bands  # the probe does see inside
    assert probe.max_numel <= max(B * H * N * D, all_bands)  # O(N·W)
    assert probe.max_numel < B * H * N * N // 8


def test_gradcheck_through_custom_op():
    q, k, v = _inputs(2, 4, 2, 6, 6, 3, 2, seed=10)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    km = torch.tensor([[True] * 6, [False, True, True, False, True, True]])
    for causal in (True, False):
        fn = lambda a, b, c: window_attention(a, b, c, window=2, causal=causal, sinks=1, key_mask=km, block_size=4)
        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_fused_softmax_path_with_partial_last_block():
    # no sinks / padding: the fused-softmax path; N=5 with blocks of 2 leaves padded query rows
    q, k, v = _inputs(1, 2, 2, 5, 5, 3, 2, seed=13)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    for causal, W in itertools.product([True, False], [1, 2]):
        fn = lambda a, b, c: window_attention(a, b, c, window=W, causal=causal, block_size=2)
        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_opcheck():
    # One small case: the aot_dispatch_dynamic check compiles forward + backward and is slow.
    q, k, v = _inputs(2, 4, 2, 5, 5, 3, 2, seed=11)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    km = torch.rand(2, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    result = torch.library.opcheck(torch.ops.attnopt.window_attention.default, (q, k, v, km, 2, True, 1, 0.5, 8))
    assert set(result) >= {"test_schema", "test_faketensor", "test_aot_dispatch_dynamic"}
    assert all(r == "SUCCESS" for r in result.values()), result


def test_export_keeps_one_op_node():
    assert_exports_as_one_node(
        lambda q, k, v: window_attention(q, k, v, window=3, causal=True, sinks=1) * 2.0,
        torch.ops.attnopt.window_attention.default,
        _inputs(1, 2, 2, 8, 8, 4, 4, seed=12),
    )


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(window=0, causal=True), ValueError, "window must be >= 1"),
        (dict(window=-3, causal=True), ValueError, "window must be >= 1"),
        (dict(window=2.5, causal=True), TypeError, "window must be an int"),
        (dict(window=True, causal=True), TypeError, "window must be an int"),
        (dict(window=2, causal=True, sinks=-1), ValueError, "sinks must be >= 0"),
        (dict(window=2, causal="yes"), TypeError, "causal must be a bool"),
        (dict(window=2, causal=True, block_size=0), ValueError, "block_size must be >= 1"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, exc, words):
    q, k, v = _inputs(1, 2, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(exc, match=words):
        window_attention(q, k, v, **kwargs)


def test_bad_shapes_raise_clear_errors():
    q, k, v = _inputs(1, 3, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        window_attention(q, k, v, window=2, causal=True)
    q, k, v = _inputs(1, 2, 2, 4, 4, 3, 3, seed=0)
    with pytest.raises(ValueError, match="head dim"):
        window_attention(q[..., :2], k, v, window=2, causal=True)
    with pytest.raises(ValueError, match="keys but v has"):
        window_attention(q, k, v[:, :, :3], window=2, causal=True)
    with pytest.raises(ValueError, match="4-D"):
        window_attention(q[0], k, v, window=2, causal=True)
    with pytest.raises(ValueError, match=r"key_mask must have shape \[B, Nk\]"):
        window_attention(q, k, v, window=2, causal=True, key_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool tensor"):
        window_attention(q, k, v, window=2, causal=True, key_mask=torch.ones(1, 4))
