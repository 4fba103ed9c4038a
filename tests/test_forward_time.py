"""compile's measured forward (attnopt.analysis.timing.forward_time): turns, best-of, the time budget, and
the sites that ran exact; and the forward time a real compile records in its report."""

import json
import os

import pytest

from attnopt.analysis.timing import forward_time, longest_batch


class FakeClock:
    """A clock that each run advances by its own fixed cost, so nothing real is timed."""

    def __init__(self):
        self.now = 0.0
        self.calls = []

    def __call__(self):
        return self.now

    def run(self, name, costs):
        def go():
            self.calls.append(name)
            self.now += costs.pop(0) if isinstance(costs, list) else costs
        return go


def test_best_of_three_rounds_taking_turns_after_a_warm_up():
    clock = FakeClock()
    ms = 2 ** -10  # about a millisecond, exact in binary so the sums are too
    original = clock.run("original", [9 * ms, 5 * ms, 4 * ms, 6 * ms])  # warm-up first
    rewritten = clock.run("rewritten", [8 * ms, 3 * ms, 2.5 * ms, 2 * ms])
    t = forward_time(original, rewritten, (2, 64), 64, thresholds=[0, 128, 32], clock=clock)
    # warm-up in order, then who goes first alternates
    assert clock.calls == ["original", "rewritten", "original", "rewritten", "rewritten", "original",
                           "original", "rewritten"]
    assert (t.original_s, t.rewritten_s, t.repeats) == (4 * ms, 2 * ms, 3)
    assert t.speedup == pytest.approx(2.0)
    assert (t.rewritten_sites, t.exact_sites, t.length, t.input_shape) == (3, 1, 64, (2, 64))  # 128 > 64 runs exact


def test_the_rounds_stop_at_the_budget_and_a_slow_model_is_not_timed():
    clock = FakeClock()
    t = forward_time(clock.run("o", 1.0), clock.run("r", 1.0), (1, 8), 8, [], budget_s=2.5, clock=clock)
    assert t.repeats == 1 and clock.calls == ["o", "r", "o", "r"]  # warm-up 2 s, then one round: past 2.5 s
    clock = FakeClock()
    t = forward_time(clock.run("o", 2.0), clock.run("r", 2.0), (1, 8), 8, [], budget_s=3.0, clock=clock)
    assert t.repeats == 0 and t.original_s is None and t.speedup is None and clock.calls == ["o", "r"]
    assert "took 4.0 s, more than the 3 s" in t.skipped and "not timed" in t.text()


def test_the_longest_verification_batch_is_the_one_timed():
    from types import SimpleNamespace

    def call(n):
        return SimpleNamespace(q=SimpleNamespace(shape=(1, 2, n, 8)))

    calls = {"a": [call(16), call(64), call(32)], "b": [call(16), call(64)]}
    assert longest_batch([None, None, None], calls) == (1, 64)
    assert longest_batch([None], {}) == (0, None)


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "custom_model.py")


def test_a_compile_reports_its_measured_forward(tmp_path):
    import attnopt
    from attnopt.models import load_model

    model, args, kwargs, name = load_model(f"{EXAMPLE}:build")
    opt = attnopt.compile(model, "window:16+sinks:2", example_inputs=(args, kwargs), tolerance=0.99, name=name)
    rep = opt.attnopt_report
    t = rep.forward_time
    assert t is not None and t.repeats >= 1 and t.original_s > 0 and t.rewritten_s > 0
    assert t.input_shape == tuple(args[0].shape) and t.length == args[0].shape[1]  # [B, N, C]: N queries
    assert t.conditions.threads >= 1 and rep.conditions.cores >= 1
    assert "time_forward" in rep.timings and rep.timings["total"] >= rep.timings["time_forward"]
    data = json.loads(rep.to_json())
    assert data["forward_time"]["repeats"] == t.repeats and "## Measured time" in rep.to_markdown()
