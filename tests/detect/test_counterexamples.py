"""Softmaxes that are not replaceable attention: never a site, always a near miss with a reason.

Each counter-example is a place where a pattern matcher that skips its checks would produce a
silent wrong rewrite (classifier and router softmaxes, the wrong axis, a permuted key, reused
probabilities, a temperature softmax in a loss, log-probabilities, elementwise values).
"""

from __future__ import annotations

import pytest
import torch

from attnopt.inspection import inspect
from zoo_hf import gemma2
from zoo_models import COUNTER_EXAMPLES, D, KeyBatchHeadSwapped, KeyViewedNotTransposed


@pytest.mark.parametrize("example", COUNTER_EXAMPLES, ids=lambda e: e.name)
def test_counter_example_is_a_near_miss_not_a_site(example):
    inspection = inspect(example.build(), *example.inputs(), dynamic=False)
    assert inspection.sites == [], f"{example.name} ({example.why}) taken as {[s.id for s in inspection.sites]}"
    codes = [m.code for m in inspection.near_misses]
    assert len(inspection.near_misses) == 1, codes
    [miss] = inspection.near_misses
    assert miss.code in example.codes, (miss.code, miss.reason)
    assert len(miss.reason) > 10 and miss.node


def test_softmax_axis_reason_names_the_axis():
    example = next(e for e in COUNTER_EXAMPLES if e.name == "softmax_over_heads")
    [miss] = inspect(example.build(), *example.inputs(), dynamic=False).near_misses
    assert "1" in miss.reason and "dim" in miss.reason.lower()


@pytest.mark.parametrize("module_cls", [KeyViewedNotTransposed, KeyBatchHeadSwapped])
def test_wrong_key_layout_really_changes_the_result(module_cls):
    """Guards the traps themselves: with the proper transpose the output differs, so a detector
    taking them for attention would rewrite them into something else."""
    torch.manual_seed(0)
    module = module_cls().eval()
    example = next(e for e in COUNTER_EXAMPLES if e.module_cls is module_cls)
    (x,) = example.inputs()
    b, n, _ = x.shape
    heads = module.q_proj.out_features // D
    q, k, v = (p(x).view(b, n, heads, D).transpose(1, 2) for p in (module.q_proj, module.k_proj, module.v_proj))
    proper = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    trap_scores = q @ (k.reshape(b, heads, D, n) if module_cls is KeyViewedNotTransposed else k.permute(1, 0, 3, 2))
    trap = (trap_scores * D**-0.5).softmax(-1) @ v
    assert (proper - trap).abs().max() > 1e-2


def test_gemma2_logit_softcapping_is_not_plain_softmax_attention():
    """tanh soft-capping of the logits changes the probabilities, so an exact SDPA replacement
    would be wrong: each layer must be a near miss that says so, and no site."""
    zoo = gemma2(softcap=50.0)
    inspection = inspect(zoo.model, *zoo.args, **zoo.kwargs, dynamic=False)
    assert inspection.sites == [], [s.id for s in inspection.sites]
    misses = [m for m in inspection.near_misses if "self_attn" in m.module_path]
    assert sorted(m.module_path for m in misses) == [e.module_path for e in zoo.expected]
    for miss in misses:
        assert "softcap" in miss.code or "tanh" in miss.reason.lower(), (miss.code, miss.reason)


class ChannelAttention(torch.nn.Module):
    """XCiT-style cross-covariance attention: softmax over a channels × channels matrix, so the tokens
    are the "head dim" of the chain and its "sequence" is the fixed channel count."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 4, 1)  # [B, H, D, N]
        qn = torch.nn.functional.normalize(q, dim=-1)
        kn = torch.nn.functional.normalize(k, dim=-1)
        attn = (qn @ kn.transpose(-1, -2)).softmax(-1)  # [B, H, D, D]
        return x + self.o((attn @ v).permute(0, 3, 1, 2).reshape(b, n, c))


def test_channel_attention_is_a_near_miss_and_the_model_runs_at_every_length():
    import attnopt

    torch.manual_seed(0)
    model = ChannelAttention().eval()
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1))
    opt = attnopt.compile(model, "linear:hedgehog", example_inputs=(x,), dispatch="off")
    report = opt.attnopt_report
    assert report.sites == []
    [miss] = report.near_misses
    assert miss.code == "channel attention" and "head dim follows the input's length" in miss.reason
    longer = torch.randn(2, 31, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(opt(longer), model(longer), rtol=1e-5, atol=1e-6)
