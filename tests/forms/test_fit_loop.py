"""The shared compile-time fit loop (forms/common/fitting.py): a non-finite step is rejected, the loop
stops once the loss has stopped falling, and its steps are reported."""

import math

import torch

from attnopt.forms.common.fitting import PATIENCE, adam_fit, fit_progress


def _quadratic(p, target):
    return ((p - target) ** 2).sum()


def test_a_step_with_non_finite_gradients_is_rejected_and_the_fit_goes_on():
    target = torch.tensor([3.0, -2.0])
    p = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    calls = []

    def loss(sampled):
        calls.append(sampled)
        value = _quadratic(p, target)
        if sampled and len(calls) in (4, 5):  # finite loss, NaN gradient: d|x|^0.5 at 0 is inf, times 0
            value = value + ((p - p.detach()).abs() ** 0.5).sum()
        return value

    fit = adam_fit("toy", [p], loss, steps=200, lr=0.1, patience=0)
    assert torch.isfinite(p).all() and math.isfinite(fit.rel_rms_after)
    assert fit.rel_rms_after < 0.05 * fit.rel_rms_before  # it still converged after the rejected steps
    assert fit.steps == 200


def test_a_fit_whose_every_step_is_non_finite_keeps_its_start():
    p = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def loss(sampled):
        return _quadratic(p, 0.0) + (float("nan") * p).sum() if sampled else _quadratic(p, 0.0)

    fit = adam_fit("toy", [p], loss, steps=50)
    assert torch.equal(p, torch.ones(3)) and fit.rel_rms_after == fit.rel_rms_before
    assert fit.steps < 50  # it gave up instead of taking every step


def test_the_fit_stops_once_the_loss_stops_falling_and_reports_its_steps():
    p = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    seen = []
    with fit_progress(lambda step, steps: seen.append((step, steps))):
        fit = adam_fit("toy", [p], lambda sampled: _quadratic(p, torch.tensor([1.0, 1.0])), steps=1000, lr=0.3)
    assert PATIENCE < fit.steps < 1000  # converged long before 1000 steps
    assert seen and seen[0] == (5, 1000) and all(b == 1000 for _, b in seen)
    assert [s for s, _ in seen] == list(range(5, fit.steps + 1, 5))
    assert fit.rel_rms_after < 0.1 * fit.rel_rms_before
