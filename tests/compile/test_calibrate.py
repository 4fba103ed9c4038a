"""Attention transfer: a hedgehog feature map fitted to a site's own softmax outputs."""

import torch
import torch.nn.functional as F

import attnopt
from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.ir.calls import SiteCall
from attnopt.passes.verify import site_drift

LINEAR = forms.get("linear")


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(4, 3, 120, d, generator=g) for d in (8, 8, 5))


def test_hedgehog_fit_reduces_drift_and_only_moves_the_map():
    q, k, v = _inputs(0)
    (site,) = attnopt.inspect(Sdpa(), q, k, v, dynamic=False).sites
    params = LINEAR.validate({"feature_map": "hedgehog"})
    module = LINEAR.build(site, params, BuildContext())
    calls = [SiteCall(q, k, v, None, Sdpa()(q, k, v))]
    before = site_drift(module, calls).rel_rms
    fit = LINEAR.fit(module, calls, steps=80)
    after = site_drift(module, calls).rel_rms
    assert abs(fit.rel_rms_before - before) < 1e-4 and abs(fit.rel_rms_after - after) < 1e-4
    assert after < 0.85 * before, (before, after)
    # Held-out inputs from the same distribution improve too (the map learnt the kernel, not the data).
    q2, k2, v2 = _inputs(1)
    held = [SiteCall(q2, k2, v2, None, Sdpa()(q2, k2, v2))]
    fresh = LINEAR.build(site, params, BuildContext())
    assert site_drift(module, held).rel_rms < site_drift(fresh, held).rel_rms
    assert not any(p.requires_grad for p in module.parameters())


def test_fixed_maps_have_nothing_to_fit():
    q, k, v = _inputs(0)
    (site,) = attnopt.inspect(Sdpa(), q, k, v, dynamic=False).sites
    params = LINEAR.validate({"feature_map": "elu"})
    assert LINEAR.fit(LINEAR.build(site, params, BuildContext()), [SiteCall(q, k, v, None, v)]) is None
