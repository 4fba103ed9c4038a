"""A mask the model builds from positions is read at a longer length too (passes/mask_lengths).

On an example shorter than the pattern's own scale, a prefix-LM mask hides nothing and a model's
sliding window looks fully causal. A rewrite trusting that reading leaks future tokens (a
bidirectional form on a causal tail) or widens the model's window.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

import attnopt

B, N, C, H = 2, 24, 32, 4
D = C // H


def _x(n, seed):
    return torch.randn(B, n, C, generator=torch.Generator().manual_seed(seed))


class PositionsMask(nn.Module):
    """Self-attention under a mask built from arange: prefix-LM (`prefix`) or a causal band (`window`)."""

    def __init__(self, prefix: int = 0, window: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.o = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.prefix, self.window = prefix, window

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        i = torch.arange(n, device=x.device)
        keep = i[None, :] <= i[:, None]
        if self.prefix:
            keep = keep | (i[None, :] < self.prefix)
        if self.window:
            keep = keep & (i[None, :] > i[:, None] - self.window)
        scores = ((q @ k.transpose(-1, -2)) * D**-0.5).masked_fill(~keep, float("-inf"))
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, C))


def _compile(model, policy, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attnopt.compile(model, policy, example_inputs=(_x(N, 1),), verify_inputs=[(_x(300, 9),)],
                               dispatch="off", **options)


def test_a_prefix_lm_mask_that_hides_nothing_on_the_example_keeps_its_site_exact():
    model = PositionsMask(prefix=30).eval()
    opt = _compile(model, "linear")
    [record] = opt.attnopt_report.sites
    assert record.site.mask.arbitrary and record.outcome.final_form == "exact"
    assert "depends on the length" in record.outcome.reason
    x = _x(300, 5)
    later = x.clone()
    later[:, 299] += 1.0
    with torch.no_grad():  # no future token reaches position 100
        torch.testing.assert_close(opt(later)[:, 100], opt(x)[:, 100], rtol=0, atol=0)
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-6)


def test_the_models_own_window_longer_than_the_example_is_read_and_kept():
    model = PositionsMask(window=32).eval()
    opt = _compile(model, "window:64")
    [record] = opt.attnopt_report.sites
    assert record.site.mask.causal and record.site.mask.window == 32 and record.site.window == 32
    assert record.outcome.final_form == "window"
    x = _x(300, 5)
    with torch.no_grad():  # a band of 64 over the model's band of 32 is the model's band
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_plain_causal_mask_reads_the_same_at_both_lengths_and_is_rewritten():
    opt = _compile(PositionsMask().eval(), "window:8", tolerance=10.0, e2e_tolerance=None)
    [record] = opt.attnopt_report.sites
    assert record.site.mask.kind == "causal" and record.outcome.final_form == "window"
    detect = opt.attnopt_report.counts["detect"]
    assert detect["masks_reread"] == 1 and detect["masks_changed"] == 0
