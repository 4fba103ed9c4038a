"""attnopt.compile on the real pretrained all-MiniLM-L6-v2 with 256-token English passages."""

import json

import pytest
import torch

import attnopt


@pytest.fixture(scope="module")
def window_sinks(minilm, english_256):
    model, _ = minilm
    return attnopt.compile(model, "window:64+sinks:4", example_inputs=english_256)


def test_window_with_sinks_keeps_embeddings(window_sinks, english_256):
    report = window_sinks.attnopt_report
    assert len(report.sites) == 6
    statuses = [r.outcome.status for r in report.sites]
    assert statuses == ["rewritten"] * 6, [r.outcome.reason for r in report.sites]
    assert all(r.outcome.final_form == "window" for r in report.sites)
    assert all(r.outcome.params["window"] == 64 and r.outcome.params["sinks"] == 4 for r in report.sites)
    cos = report.end_to_end.embedding_cosine
    assert 0.95 <= cos < 0.999, cos  # moved, but by little
    assert "Mean embedding cosine" in report.to_markdown()
    # The window cuts attention FLOPs: 256 queries x (127 + 4) keys instead of 256 x 256.
    assert report.sites[0].costs_after[0].flops < 0.6 * report.sites[0].costs_before[0].flops


def test_window_without_sinks_drifts_more(minilm, english_256, window_sinks):
    model, _ = minilm
    plain = attnopt.compile(model, "window:64", example_inputs=english_256, tolerance=0.99, e2e_tolerance=None)
    with_sinks = window_sinks.attnopt_report.end_to_end.embedding_cosine
    without = plain.attnopt_report.end_to_end.embedding_cosine
    assert without < with_sinks - 0.03, (without, with_sinks)  # sinks matter on BERT-style encoders


def test_linear_reports_its_drift_and_auto_reverts_it(minilm, english_256):
    model, _ = minilm
    linear = attnopt.compile(model, "linear", example_inputs=english_256, tolerance=0.99, e2e_tolerance=None)
    rep = linear.attnopt_report
    assert [r.outcome.final_form for r in rep.sites] == ["linear"] * 6
    assert all(r.outcome.drift.rel_rms > 0.4 for r in rep.sites)  # honest: ELU+1 is far from softmax
    assert rep.end_to_end.embedding_cosine < 0.8
    # Under the default budgets the same preset keeps only what the model can afford.
    safe = attnopt.compile(model, "linear", example_inputs=english_256).attnopt_report
    assert 0 < safe.count("rewritten") < 6 and safe.end_to_end.embedding_cosine >= 0.9

    auto = attnopt.compile(model, "auto", example_inputs=english_256)
    arep = auto.attnopt_report
    for r in arep.sites:
        assert r.outcome.final_form != "linear"
        tried = {t.form: t for t in r.outcome.tried}
        assert "linear" in tried and tried["linear"].drift.rel_rms > 0.3  # tried, measured, rejected
        if r.outcome.status == "rewritten":
            assert r.outcome.drift.rel_rms <= 0.3
        else:
            assert r.outcome.status == "reverted" and "no form within tolerance" in r.outcome.reason
    assert arep.end_to_end.embedding_cosine >= 0.95


def test_original_model_untouched(minilm, english_256):
    model, _ = minilm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out_before = model(**english_256).last_hidden_state.clone()
    attnopt.compile(model, "window:16", example_inputs=english_256, tolerance=0.99, e2e_tolerance=None)
    assert model.config._attn_implementation == "sdpa"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with torch.no_grad():
        assert torch.equal(model(**english_256).last_hidden_state, out_before)


def test_report_renders(window_sinks, tmp_path):
    report = window_sinks.attnopt_report
    data = json.loads(report.to_json())
    assert len(data["sites"]) == 6
    page = report.to_html(tmp_path / "r.html")
    assert (tmp_path / "r.html").exists() and "<svg" in page
    assert "encoder.layer.5.attention.self" in page


def test_exact_policy_is_bit_identical(minilm, english_256):
    model, _ = minilm
    opt = attnopt.compile(model, "exact", example_inputs=english_256)
    assert [r.outcome.status for r in opt.attnopt_report.sites] == ["kept"] * 6
    with torch.no_grad():
        assert torch.equal(opt(**english_256).last_hidden_state, model(**english_256).last_hidden_state)
