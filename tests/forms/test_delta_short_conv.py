"""delta's short causal convolution on k and v: against a per-row, per-token fp64 loop written here
(a deque of the row's previous real inputs), split at every point, with pads anywhere, gradients, and
at site level (identity at init; decoding through its history equals the whole forward)."""

from collections import deque

import pytest
import torch

from attnopt import forms
from attnopt.ir.errors import PolicyError
from attnopt.forms.common.base import BuildContext
from attnopt.forms.delta.short_conv import causal_short_conv
from test_gated_forms import B, D, HKV, _call, _site

F64 = torch.float64


def conv_oracle(x_BHNW, w_HWK, keep_BN=None, history_BHKW=None):
    """y and the final history, one row and one real token at a time."""
    Bx, Hx, N, W = x_BHNW.shape
    K = w_HWK.shape[-1]
    y = torch.zeros(Bx, Hx, N, W, dtype=F64)
    hist_out = torch.zeros(Bx, Hx, K - 1, W, dtype=F64)
    for b in range(Bx):
        past = deque([history_BHKW[b, :, j].double() if history_BHKW is not None else torch.zeros(Hx, W, dtype=F64)
                      for j in range(K - 1)], maxlen=K - 1)
        for n in range(N):
            if keep_BN is not None and not keep_BN[b, n]:
                continue
            taps = list(past) + [x_BHNW[b, :, n].double()]  # oldest first, the current token last
            y[b, :, n] = sum(w_HWK[:, :, j].double() * taps[j] for j in range(K))
            past.append(x_BHNW[b, :, n].double())
        for j, h in enumerate(past):
            hist_out[b, :, j] = h
    return y, hist_out


def _case(seed, Bx=3, Hx=2, N=11, W=5, K=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(Bx, Hx, N, W, dtype=F64, generator=g), torch.randn(Hx, W, K, dtype=F64, generator=g),
            torch.randn(Bx, Hx, K - 1, W, dtype=F64, generator=g))


def _masks(Bx, N):
    left = torch.ones(Bx, N, dtype=torch.bool)
    left[0, :4] = False  # left padding
    left[1, :1] = False
    middle = left.clone()
    middle[2, 3] = middle[2, 7] = middle[1, 5] = False  # pads between real tokens
    empty = left.clone()
    empty[0] = False  # a row with no real token: its history must stay as it was
    return {"left": left, "middle": middle, "empty_row": empty}


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("with_history", [False, True])
def test_matches_the_per_token_loop_without_padding(K, with_history):
    x, w, h = _case(0, K=K)
    h = h if with_history else None
    y, hist = causal_short_conv(x, w, h)
    want_y, want_h = conv_oracle(x, w, None, h)
    assert torch.allclose(y, want_y, rtol=1e-12, atol=1e-12) and torch.allclose(hist, want_h, rtol=0, atol=0)


@pytest.mark.parametrize("mask", ["left", "middle", "empty_row"])
@pytest.mark.parametrize("with_history", [False, True])
def test_a_pad_neither_enters_a_tap_nor_moves_the_history(mask, with_history):
    x, w, h = _case(1)
    keep = _masks(x.shape[0], x.shape[2])[mask]
    h = h if with_history else None
    y, hist = causal_short_conv(x, w, h, keep)
    want_y, want_h = conv_oracle(x, w, keep, h)
    real = keep[:, None, :, None]
    assert torch.allclose(y * real, want_y, rtol=1e-12, atol=1e-12)
    assert (y[~real.expand_as(y)] == 0).all()  # a pad's output is 0
    assert torch.allclose(hist, want_h, rtol=0, atol=0)


def test_left_padding_changes_no_real_output():
    x, w, _ = _case(2, Bx=1)
    pad = torch.randn(1, x.shape[1], 3, x.shape[3], dtype=F64)
    keep = torch.cat([torch.zeros(1, 3, dtype=torch.bool), torch.ones(1, x.shape[2], dtype=torch.bool)], dim=1)
    y_pad, h_pad = causal_short_conv(torch.cat([pad, x], dim=2), w, None, keep)
    y, h = causal_short_conv(x, w)
    assert torch.allclose(y_pad[:, :, 3:], y, rtol=1e-13, atol=1e-13) and torch.equal(h_pad, h)


@pytest.mark.parametrize("masked", [False, True])
def test_a_split_at_every_point_equals_the_whole(masked):
    x, w, h0 = _case(3)
    keep = _masks(x.shape[0], x.shape[2])["middle"] if masked else None
    y, hist = causal_short_conv(x, w, h0, keep)
    for cut in range(x.shape[2] + 1):
        k1, k2 = (None, None) if keep is None else (keep[:, :cut], keep[:, cut:])
        y1, h1 = causal_short_conv(x[:, :, :cut], w, h0, k1)
        y2, h2 = causal_short_conv(x[:, :, cut:], w, h1, k2)
        assert torch.allclose(torch.cat([y1, y2], dim=2), y, rtol=1e-13, atol=1e-13), cut
        assert torch.equal(h2, hist), cut


@pytest.mark.parametrize("masked", [False, True])
def test_gradients_match_finite_differences(masked):
    x, w, h = _case(4, Bx=2, N=11, W=3, K=3)
    keep = _masks(3, 11)["middle"][1:] if masked else None
    x, w, h = x.requires_grad_(), w.requires_grad_(), h.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: causal_short_conv(a, b, c, keep), (x, w, h))


def _delta(**params):
    form = forms.get("delta")
    return form.build(_site(), form.validate({"fit_steps": 0, **params}), BuildContext())


def test_identity_at_init_and_no_tensor_when_off():
    c = _call(seed=5)
    with_conv, without = _delta(), _delta(conv=0)
    taps = with_conv.conv_HkvWK
    assert taps.shape == (HKV, 2 * D, 4) and without.conv_HkvWK is None and _delta(conv=1).conv_HkvWK is None
    assert (taps[..., -1] == 1).all() and (taps[..., :-1] == 0).all()  # only the current token, weight 1
    with torch.no_grad():
        assert torch.equal(with_conv.attend(c.q, c.k, c.v, None, None, None),
                           without.attend(c.q, c.k, c.v, None, None, None))
    with pytest.raises(PolicyError, match="conv"):
        forms.get("delta").validate({"conv": -1})


def test_learnt_taps_change_the_output_and_decode_through_the_history():
    """Random taps: a prefill then one-token steps (row 1's first new token masked) equal the site's
    forward over the whole sequence with that key dropped; the same with identity taps differs."""
    m = _delta()
    with torch.no_grad():
        m.conv_HkvWK.copy_(torch.randn(m.conv_HkvWK.shape, generator=torch.Generator().manual_seed(6)) * 0.5)
    c = _call(seed=7)
    n0, n = 20, 26
    q, k, v = c.q[:, :, :n], c.k[:, :, :n], c.v[:, :, :n]
    keep = torch.ones(B, n, dtype=torch.bool)
    keep[1, n0] = False
    keep[0, :3] = False  # and left padding in row 0
    with torch.no_grad():
        want = m.attend(q, k, v, keep, None, None)
        plain = _delta().attend(q, k, v, keep, None, None)
        out, state = m.decode(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], keep[:, :n0], None)
        outs = [out]
        for t in range(n0, n):
            out, state = m.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], keep[:, t:t + 1], state)
            outs.append(out)
    got, real = torch.cat(outs, dim=2), keep[:, None, :, None]
    assert torch.allclose(got * real, want * real, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want * real, plain * real, rtol=1e-2, atol=1e-3)  # the taps do act
