"""gla_window_attention (window softmax + gated state of the keys that left it, one normaliser) and its
decode state, against the token-by-token fp64 oracle in gated_oracles.py.

Letters: B batch, H query heads, Hkv kv heads, N length, D head dim, Dv value dim, M feature width.
"""

import pytest
import torch
import torch.nn.functional as F
from gated_oracles import gla_window_oracle
from kernel_testing import assert_exports_as_one_node

from attnopt.forms.gla_window.decode import gla_window_decode
from attnopt.forms.gla_window.reference import gla_window_attention, window_gate_sums

F64 = torch.float64


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def _problem(B, H, Hkv, Nq, Nk, D, Dv, M, gate, seed, p_drop=0.25):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, Nq, D, dtype=F64, generator=g), torch.randn(B, Hkv, Nk, D, dtype=F64, generator=g)
    v = torch.randn(B, Hkv, Nk, Dv, dtype=F64, generator=g)
    phi_q, phi_k = torch.rand(B, H, Nq, M, dtype=F64, generator=g), torch.rand(B, Hkv, Nk, M, dtype=F64, generator=g)
    shape = (B, Hkv, Nk, M) if gate == "channel" else (B, Hkv, Nk)
    gates = F.logsigmoid(torch.randn(shape, dtype=F64, generator=g) + 1.0)
    keep = torch.rand(B, Nk, generator=g) > p_drop
    keep[:, -1] = True
    beta = torch.rand(H, dtype=F64, generator=g) + 0.1
    return q, k, v, phi_q, phi_k, gates, keep, beta


# (B, H, Hkv, Nq, Nk, D, Dv, M): GQA, Nq < Nk, pairwise-distinct sizes
SHAPES = [(2, 6, 3, 19, 19, 4, 5, 6), (1, 4, 2, 11, 23, 3, 2, 5)]


@pytest.mark.parametrize("gate", ["channel", "head"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}Hkv{}Nq{}Nk{}".format(*s))
@pytest.mark.parametrize("window, sinks", [(1, 0), (4, 2), (7, 0), (40, 3)])
def test_matches_the_token_oracle(gate, shape, window, sinks):
    q, k, v, pq, pk, g, keep, beta = _problem(*shape, gate=gate, seed=window + sinks)
    kw = dict(window=window, sinks=sinks, scale=0.45, linear_weight=beta, key_mask=keep)
    ref = gla_window_oracle(q, k, v, pq, pk, g, window=window, sinks=sinks, scale=0.45, beta=beta, key_mask=keep)
    for C in (3, 64):
        assert _rel(gla_window_attention(q, k, v, pq, pk, g, chunk_size=C, **kw), ref) <= 1e-9, C


def test_beta_zero_is_the_window_and_a_huge_window_is_softmax():
    q, k, v, pq, pk, g, keep, beta = _problem(2, 4, 2, 15, 15, 3, 4, 5, "channel", seed=1)
    win = gla_window_attention(q, k, v, pq, pk, g, window=4, sinks=1, linear_weight=0.0, key_mask=keep)
    ref = gla_window_oracle(q, k, v, pq, pk, g, window=4, sinks=1, beta=torch.zeros(4), key_mask=keep)
    assert _rel(win, ref) <= 1e-12
    full = gla_window_attention(q, k, v, pq, pk, g, window=10 ** 6, linear_weight=beta)
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert _rel(full, sdpa) <= 1e-12


def test_left_padding_equals_the_row_alone():
    q, k, v, pq, pk, g, _, beta = _problem(2, 4, 2, 17, 17, 3, 4, 5, "channel", seed=2)
    keep = torch.ones(2, 17, dtype=torch.bool)
    keep[1, :6] = False
    k[1, :, :6], g[1, :, :6] = 40.0, -5.0  # garbage at the pads must change nothing
    out = gla_window_attention(q, k, v, pq, pk, g, window=3, sinks=2, linear_weight=beta, key_mask=keep)
    alone = gla_window_attention(q[1:, :, 6:], k[1:, :, 6:], v[1:, :, 6:], pq[1:, :, 6:], pk[1:, :, 6:], g[1:, :, 6:],
                                 window=3, sinks=2, linear_weight=beta)
    assert _rel(out[1:, :, 6:], alone) <= 1e-12


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_prefill_then_any_split_into_steps_equals_one_call(gate):
    N, W, S = 26, 5, 2
    q, k, v, pq, pk, g, keep, beta = _problem(2, 4, 2, N, N, 3, 4, 5, gate, seed=3, p_drop=0.0)
    keep[1, :4] = False  # a left-padded row
    keep[0, 9] = False  # and a hole
    kw = dict(window=W, sinks=S, linear_weight=beta)
    full = gla_window_attention(q, k, v, pq, pk, g, key_mask=keep, **kw)
    for prefill, step in ((1, 1), (7, 3), (12, 1)):
        cut = slice(0, prefill)
        out, state = gla_window_decode(q[:, :, cut], k[:, :, cut], v[:, :, cut], pq[:, :, cut], pk[:, :, cut],
                                       g[:, :, cut], None, key_mask=keep[:, cut], **kw)
        outs = [out]
        for t in range(prefill, N, step):
            sl = slice(t, min(N, t + step))
            out, state = gla_window_decode(q[:, :, sl], k[:, :, sl], v[:, :, sl], pq[:, :, sl], pk[:, :, sl],
                                           g[:, :, sl], state, key_mask=keep[:, sl], **kw)
            outs.append(out)
        real = keep[:, None, :, None].expand_as(full)
        assert (torch.cat(outs, 2) - full)[real].abs().max() <= 1e-12, (prefill, step)
        assert state.phi_BHkvLM.shape[2] == W - 1 and state.S_BHkvMW.shape[-2:] == (5, 5)  # fixed size


def test_gradients_reach_every_input():
    q, k, v, pq, pk, g, keep, beta = _problem(1, 2, 1, 9, 9, 2, 3, 3, "channel", seed=4)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, pq, pk, g, beta)]

    def fn(q, k, v, pq, pk, g, beta):
        return gla_window_attention(q, k, v, pq, pk, g, window=3, sinks=1, linear_weight=beta, key_mask=keep)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_window_gate_sums_are_short_range_sums():
    g = -torch.rand(1, 2, 23, 3, dtype=F64)
    for W in (1, 4, 23, 50):
        want = torch.stack([g[:, :, j + 1:j + 1 + W].sum(2) for j in range(23)], dim=2)
        assert torch.allclose(window_gate_sums(g, W), want, atol=1e-14), W


def test_export_keeps_one_op_node():
    q, k, v, pq, pk, g, keep, beta = _problem(1, 4, 2, 8, 8, 4, 4, 4, "head", seed=5)
    assert_exports_as_one_node(
        lambda q, k, v: gla_window_attention(q, k, v, pq * 1.0, pk * 1.0, g * 1.0, window=3, linear_weight=beta),
        torch.ops.attnopt.gla_window_attention.default, (q, k, v))


@pytest.mark.parametrize("case, words", [
    ("window", "window must be an int >= 1"),
    ("gate", "must be finite and <= 0"),
    ("beta", "linear_weight β must be >= 0"),
    ("phi", "phi_q must be [B, H, Nq, M]"),
])
def test_bad_arguments_raise_one_line_errors(case, words):
    q, k, v, pq, pk, g, keep, beta = _problem(1, 4, 2, 6, 6, 3, 2, 4, "channel", seed=6)
    kw = dict(window=2, linear_weight=beta)
    if case == "window":
        kw["window"] = 0
    elif case == "gate":
        g = g.abs()
    elif case == "beta":
        kw["linear_weight"] = -beta
    elif case == "phi":
        pq = pq[:, :, :3]
    with pytest.raises((ValueError, TypeError)) as err:
        gla_window_attention(q, k, v, pq, pk, g, **kw)
    assert words in str(err.value) and "\n" not in str(err.value)
