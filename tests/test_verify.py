"""The verifier's verdicts: defaults reject an all-zero or unrelated site output, a tolerance is the
first drift refused, and a form that changed nothing is never called verified."""

import pytest
import torch

from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.ir.outcomes import Drift, Verdict
from attnopt.ir.calls import SiteCall
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes
from attnopt.passes.verify import drift, judge, try_form

B, H, N, D = 2, 3, 41, 8


def _site(n=N):
    return AttentionSite(
        id="a#0", module_path="a", module_type="A", layer=0, source="sdpa", batch=B, heads=H, kv_heads=H,
        q_len=n, kv_len=n, head_dim=D, v_head_dim=D, scale=D**-0.5, causal=True,
        mask=MaskInfo(form="is_causal", causal=True), window=None, dropout_p=0.0, dtype="float32",
        nodes=SiteNodes(query="q", key="k", value="v", output="o"),
    )


def _call(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    return SiteCall(q, k, v, None, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_a_tolerance_is_the_first_drift_refused():
    assert judge(Drift(1.0, 0.0, 1.0), 1.0)[0] is Verdict.OVER_TOLERANCE
    assert judge(Drift(0.999, 0.0, 1.0), 1.0)[0] is Verdict.ACCEPTED
    assert judge(Drift(float("inf"), float("nan"), float("inf"), finite=False), 10.0)[0] is Verdict.NOT_FINITE


@pytest.mark.parametrize("name", [n for n in forms.names() if n != "exact"])
def test_default_tolerances_reject_zero_and_unrelated_outputs(name):
    tol = forms.get(name).default_tolerance
    c = _call()
    zero = drift(torch.zeros_like(c.out), c.out)
    unrelated = drift(_call(seed=5).out, c.out)
    assert zero.rel_rms == pytest.approx(1.0) and unrelated.rel_rms > 1.0
    assert judge(zero, tol)[0] is Verdict.OVER_TOLERANCE and judge(unrelated, tol)[0] is Verdict.OVER_TOLERANCE


def test_a_broken_form_is_reverted_under_its_default(monkeypatch):
    linear = forms.get("linear")
    params = linear.validate({})
    monkeypatch.setattr(type(linear.build(_site(), params, BuildContext())), "attend",
                        lambda self, q, k, v, keep, mask, x: torch.zeros(q.shape[:-1] + v.shape[-1:]))
    attempt, module = try_form(_site(), "linear", params, BuildContext(calls={"a#0": [_call()]}),
                               linear.default_tolerance)
    assert module is None and attempt.verdict is Verdict.OVER_TOLERANCE and attempt.drift.rel_rms == pytest.approx(1.0)


def test_a_form_that_does_not_act_is_unverified_and_never_rewritten():
    window = forms.get("window")
    params = window.validate({"window": 64, "sinks": 4})  # covers all 41 keys
    attempt, module = try_form(_site(), "window", params, BuildContext(calls={"a#0": [_call()]}), 0.6)
    assert module is None and attempt.verdict is Verdict.UNVERIFIED and attempt.drift is None
    assert "verified from about 272 tokens" in attempt.reason
    # Given a long enough call too, it is verified on that call alone.
    long = _call(n=300, seed=1)
    attempt, module = try_form(_site(), "window", params, BuildContext(calls={"a#0": [_call(), long]}), 0.99)
    assert module is not None and attempt.verdict is Verdict.ACCEPTED and attempt.drift.rel_rms > 0
    assert "on the 1 of 2 verification inputs" in attempt.reason


def test_min_seq_len_above_every_input_is_unverified():
    linear = forms.get("linear")
    params = linear.validate({"min_seq_len": 1024})
    attempt, _ = try_form(_site(), "linear", params, BuildContext(calls={"a#0": [_call()]}), 0.8)
    assert attempt.verdict is Verdict.UNVERIFIED and "1024" in attempt.reason


def test_drift_leaves_out_the_outputs_of_padding_queries():
    # A right-padded row's last 3 queries and a left-padded row's first 2 are padding: whatever a form
    # gives there is read by no one, so a module wrong only there has no drift; wrong on a real row, it has.
    from types import SimpleNamespace

    from attnopt.passes.verify import site_drift

    B, H, N, D = 2, 2, 8, 4
    g = torch.Generator().manual_seed(0)
    q, k, v, out = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    real = torch.ones(B, N, dtype=torch.bool)
    real[0, -3:], real[1, :2] = False, False
    mask = torch.ones(N, N, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    call = SiteCall(q, k, v, mask, out)

    class WrongAt(torch.nn.Module):
        geometry = SimpleNamespace(keep_when="true")

        def __init__(self, rows):
            super().__init__()
            self.rows = rows

        def forward(self, q, k, v, mask):
            return torch.where(self.rows[:, None, :, None], out + 1.0, out)

    assert site_drift(WrongAt(~real), [call]).rel_rms == 0.0
    wrong_real = torch.zeros(B, N, dtype=torch.bool)
    wrong_real[0, 0] = True
    assert site_drift(WrongAt(wrong_real), [call]).rel_rms > 0.05
