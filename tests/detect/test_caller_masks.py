"""Masks the caller passes in: a rewrite must never drop a pattern or a bias the example did not show.

- An input with a query axis ([N, N], [B, 1, N, N]) can hide keys per query on the next call: the
  site keeps exact attention and says why, even when the example's mask hides nothing.
- A mask that looks causal on the example is not made causal by a scalar constant beside it (GPT-2's
  masked_bias); a buffer holding a pattern (a tril) still proves causality.
- A float key mask ([B, 1, 1, N]) read as padding runs exact on a call where it brings a bias.

Each case compares the compiled model with the original on a run-time mask the example lacked, where
a window of 64 covers every key of 31 tokens (so any difference is the mask dropped).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnopt

B, N, C, H = 2, 24, 32, 4
D = C // H


def _x(n, seed):
    return torch.randn(B, n, C, generator=torch.Generator().manual_seed(seed))


class SdpaTakesMask(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.o = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        return x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, C))


class HiddenTimesConstant(nn.Module):
    """scores + hidden · c, with c a scalar buffer (GPT-2's masked_bias) or a literal; `hidden` is the
    subclass's, read from the call's second input."""

    def __init__(self, buffer: bool):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.o = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.buffer = buffer
        self.register_buffer("masked_bias", torch.tensor(-1e9))

    def forward(self, x, given):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * D**-0.5 + self.hidden(given) * (self.masked_bias if self.buffer else -1e9)
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, C))


class KeepTimesConstant(HiddenTimesConstant):
    """hidden = 1 - keep, with `keep` a [N, N] input."""

    def hidden(self, keep):
        return 1 - keep


class KeepFromInputPositions(HiddenTimesConstant):
    """hidden[i, j] = pos[j] > pos[i] from a [N] positions input (causal when pos is arange)."""

    def hidden(self, pos):
        return (pos[None, :] > pos[:, None]).float()


def _compile(model, example_mask, long_mask):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attnopt.compile(model, "window:64", example_inputs=(_x(N, 1), example_mask),
                               verify_inputs=[(_x(300, 9), long_mask)], dispatch="off")


def _relative_difference(opt, model, mask) -> float:
    x = _x(31, 5)
    with torch.no_grad():
        ref = model(x, mask)
        return float((opt(x, mask) - ref).norm() / ref.norm())


def _random_keep(n):
    keep = torch.rand(n, n, generator=torch.Generator().manual_seed(3)) > 0.4
    return keep.fill_diagonal_(True)


@pytest.mark.parametrize("example, long, run", [
    (torch.zeros(N, N), torch.zeros(300, 300), torch.randn(31, 31, generator=torch.Generator().manual_seed(4)) * 3),
    (torch.ones(N, N, dtype=torch.bool), torch.ones(300, 300, dtype=torch.bool), _random_keep(31)),
], ids=["float bias", "bool per-query mask"])
def test_an_input_mask_with_a_query_axis_keeps_the_site_exact(example, long, run):
    model = SdpaTakesMask().eval()
    opt = _compile(model, example, long)
    [record] = opt.attnopt_report.sites
    assert record.site.mask.arbitrary and record.outcome.final_form == "exact"
    assert "input 'mask' with a query axis" in record.outcome.reason
    assert _relative_difference(opt, model, run) < 1e-6


@pytest.mark.parametrize("buffer", [False, True], ids=["literal", "scalar buffer"])
def test_a_causal_looking_input_is_not_made_causal_by_a_scalar_constant(buffer):
    model = KeepTimesConstant(buffer).eval()
    opt = _compile(model, torch.ones(N, N).tril(), torch.ones(300, 300).tril())
    [record] = opt.attnopt_report.sites
    assert not record.site.mask.causal and record.outcome.final_form == "exact"
    assert _relative_difference(opt, model, torch.ones(31, 31)) < 1e-6  # a bidirectional mask this call


@pytest.mark.parametrize("buffer", [False, True], ids=["literal", "scalar buffer"])
def test_a_mask_from_input_positions_is_not_made_causal_by_a_scalar_buffer(buffer):
    model = KeepFromInputPositions(buffer).eval()
    opt = _compile(model, torch.arange(N), torch.arange(300))
    [record] = opt.attnopt_report.sites
    assert not record.site.mask.causal and record.outcome.final_form == "exact"
    assert _relative_difference(opt, model, torch.zeros(31, dtype=torch.long)) < 1e-6  # every key, this call


def test_a_float_key_mask_that_brings_a_bias_runs_exact_on_that_call():
    model = SdpaTakesMask().eval()
    keep_all = torch.zeros(B, 1, 1, N)
    opt = _compile(model, keep_all, torch.zeros(B, 1, 1, 300))
    [record] = opt.attnopt_report.sites
    assert record.site.mask.padding and record.outcome.final_form == "window"  # read as key padding
    padding = torch.zeros(B, 1, 1, 31)
    padding[1, ..., 25:] = float("-inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a padding call stays quiet
        assert _relative_difference(opt, model, padding) < 1e-6
    bias = torch.randn(B, 1, 1, 31, generator=torch.Generator().manual_seed(6))
    with pytest.warns(RuntimeWarning, match="carries a bias"):
        assert _relative_difference(opt, model, bias) < 1e-6


class PaddingFromFrames(nn.Module):
    """Key padding read from a [B, N, F] input (all-zero frames pad): a key mask without a query axis."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.qkv, self.o = nn.Linear(40, C), nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, feats):
        x = self.inp(feats)
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        keep = feats.abs().sum(-1) > 0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.o(out.transpose(1, 2).reshape(b, n, C))


def test_a_key_mask_read_from_an_input_with_a_token_axis_is_padding_and_rewritten():
    feats = torch.randn(B, 48, 40, generator=torch.Generator().manual_seed(1))
    feats[1, 42:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = attnopt.compile(PaddingFromFrames().eval(), "linear", example_inputs=(feats,), tolerance=50.0,
                              e2e_tolerance=None, dispatch="off")
    [record] = opt.attnopt_report.sites
    assert record.site.mask.kind == "padding" and record.outcome.final_form == "linear"
