"""The forms registry: every form implements every hook, and the policy reference is generated from it."""

import inspect
from pathlib import Path

import pytest
import torch

from attnopt import forms
from attnopt.forms.common.base import BuildContext, CostAt, Form, SiteModule
from attnopt.ir.calls import SiteCall
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes
from attnopt.policy import Policy

README = Path(__file__).resolve().parents[2] / "README.md"
HOOKS = ("check_site", "cost", "build")
B, H, HKV, N, D, DV = 2, 6, 3, 301, 10, 7  # pairwise distinct; N beyond every default window


def _site(layer, causal=True):
    return AttentionSite(
        id=f"layers.{layer}.attn#0", module_path=f"layers.{layer}.attn", module_type="Attn", layer=layer,
        source="sdpa", batch=B, heads=H, kv_heads=HKV, q_len=N, kv_len=N, head_dim=D, v_head_dim=DV,
        scale=0.3, causal=causal, mask=MaskInfo(form="is_causal" if causal else "none", causal=causal),
        window=None, dropout_p=0.0, dtype="float32", nodes=SiteNodes(query="q", key="k", value="v", output="o"),
    )


@pytest.mark.parametrize("name", forms.names())
def test_every_registered_form_implements_every_hook(name):
    form = forms.get(name)
    assert isinstance(form, Form) and not inspect.isabstract(type(form))
    for hook in HOOKS:  # overridden in the form's own class, not inherited from an abstract stub
        assert hook in type(form).__dict__ or any(hook in c.__dict__ for c in type(form).__mro__[1:-2]), hook
    assert form.summary and form.presets and isinstance(form.cost_rank, int) and form.default_tolerance >= 0
    for preset in form.presets:  # each advertised preset parses to this form
        assert Policy.parse(preset).rules[0].form == name
    params = form.validate({})
    sites = [_site(0), _site(1)]
    assert form.why_not(sites[1], params, sites) is None  # a plain causal self-attention site fits every form
    c = form.cost(sites[1], params, B, N, N)
    assert isinstance(c, CostAt) and c.flops > 0 and c.elements > 0
    module = form.build(sites[1], params, BuildContext(sites=sites, calls={}))
    assert isinstance(module, SiteModule)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g), torch.randn(B, HKV, N, DV, generator=g)
    out = module(q, k, v)
    assert out.shape == (B, H, N, DV) and torch.isfinite(out).all()
    fit = form.fit(module, [SiteCall(q, k, v, None, out)])
    assert fit is None or fit.rel_rms_after <= fit.rel_rms_before + 1e-6
    assert all(callable(fn) for fn in form.public_ops().values())


def test_registry_order_is_cheapest_first_with_exact_last():
    ranks = [forms.get(n).cost_rank for n in forms.names()]
    assert ranks == sorted(ranks) and forms.names()[-1] == "exact"
    assert forms.get("keep") is forms.get("exact") and forms.get("recurrent") is forms.get("ssm")


def test_readme_policy_table_is_the_generated_one():
    from attnopt.policy.presets import policy_reference

    text = README.read_text(encoding="utf-8")
    start, end = text.index("<!-- policy-table -->"), text.index("<!-- /policy-table -->")
    assert text[start:end].strip().removeprefix("<!-- policy-table -->").strip() == policy_reference(), (
        "README's policy table is out of date: run `python -m attnopt.policy.presets` and paste its output")


def test_cli_help_lists_every_form_preset():
    from attnopt.cli import policy_presets_help

    text = policy_presets_help()
    assert all(p in text for n in forms.names() for p in forms.get(n).presets)


def test_ops_exports_every_forms_public_ops():
    import attnopt.ops as ops

    for n in forms.names():
        for name, fn in forms.get(n).public_ops().items():
            assert getattr(ops, name) is fn and name in ops.__all__
