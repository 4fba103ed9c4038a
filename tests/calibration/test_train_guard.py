"""Calibration's per-site training skips a step whose gradients are not finite (a finite loss can have
them); before, that step wrote NaN into the gate tensors and the next call of the gated op refused them."""

import math

import torch
import torch.nn.functional as F

from attnopt import forms
from attnopt.calibration.distributed import World
from attnopt.calibration.train import train_site
from attnopt.forms.common.base import BuildContext
from attnopt.ir.calls import SiteCall
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes

B, H, HKV, N, D = 1, 2, 1, 32, 8


def _site():
    return AttentionSite(
        id="a#0", module_path="a", module_type="A", layer=0, source="sdpa", batch=B, heads=H, kv_heads=HKV,
        q_len=N, kv_len=N, head_dim=D, v_head_dim=D, scale=D ** -0.5, causal=True,
        mask=MaskInfo(form="is_causal", causal=True), window=None, dropout_p=0.0, dtype="float32",
        nodes=SiteNodes(query="q", key="k", value="v", output="o"))


def test_steps_with_non_finite_gradients_are_skipped_and_the_gates_stay_finite():
    form = forms.get("gla")
    module = form.build(_site(), form.validate({"fit_steps": 0, "feature_map": "elu"}), BuildContext())
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, H, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g), torch.randn(B, HKV, N, D, generator=g)
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    calls = [SiteCall(q, k, v, None, out)]
    attend, count = module.attend, [0]

    def poisoned(*args):  # steps 3 and 4: a finite output whose gradient w.r.t. the gates is NaN
        count[0] += 1
        o = attend(*args)
        if count[0] in (4, 5):
            bias = module.gates.gate_bias_HkvG
            o = o + ((bias - bias.detach()).abs() ** 0.5).sum()
        return o

    module.attend = poisoned
    record = train_site(module, calls, [None], steps=20, lr=0.05, seed=0, world=World(), progress=False)
    assert record.skipped_steps == 2 and "2 steps with non-finite gradients were skipped" in record.reason
    assert record.status == "trained" and math.isfinite(record.rms_after) and record.rms_after < record.rms_before
    assert all(torch.isfinite(t).all() for t in module.parameters())
