"""benchmarks/fidelity.py's check of issue 39's gated goals: per held-out text, each gated policy's
perplexity ratio against its limit and against ssm's, and no reverted site."""

import importlib.util
from pathlib import Path

import pytest

FIDELITY = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity.py"


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("fidelity_under_test", FIDELITY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only the standard library at module level
    return module


def row(policy, ratios, reverted=()):
    return {"policy": policy, "perplexity_over_original_by_text": ratios, "reverted": list(reverted)}


def result(*rows):
    return {"model": "tiny_lm", "rows": [{"policy": "original", "perplexity": 2.0}, *rows]}


def test_every_text_must_meet_the_limit(fidelity):
    goals = fidelity.gated_goals(result(row("ssm", {"a": 20.0, "b": 4.0}), row("gla", {"a": 1.49, "b": 1.51}),
                                        row("gla+window:64", {"a": 1.005, "b": 0.99})))
    assert goals["gla"]["by_text"]["a"]["met"] is True
    assert goals["gla"]["by_text"]["b"]["met"] is False and goals["gla"]["met"] is False
    assert goals["gla+window:64"]["met"] is True  # the limit itself passes (<=)
    assert "delta" not in goals  # a policy not run is not judged


def test_worse_than_ssm_fails_even_within_the_limit(fidelity):
    goals = fidelity.gated_goals(result(row("ssm", {"a": 1.2}), row("delta", {"a": 1.3})))
    check = goals["delta"]["by_text"]["a"]
    assert (check["ratio"], check["ssm_ratio"], check["met"]) == (1.3, 1.2, False)


def test_a_reverted_site_fails_the_policy(fidelity):
    reverted = [{"site": "layers.2", "step": "compile", "reason": "g holds log-gates and must be finite"}]
    goals = fidelity.gated_goals(result(row("ssm", {"a": 20.0}), row("gla", {"a": 1.1}, reverted)))
    assert goals["gla"]["by_text"]["a"]["met"] is True
    assert (goals["gla"]["reverted"], goals["gla"]["met"]) == (1, False)


def test_an_uncalibrated_row_is_not_met(fidelity):
    goals = fidelity.gated_goals(result(row("ssm", {"a": 20.0}), {"policy": "gla", "after": None, "reverted": []}))
    assert goals["gla"] == {"by_text": {}, "reverted": 0, "met": False}
