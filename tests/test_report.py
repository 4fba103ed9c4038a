"""CompileReport: totals from the records, JSON round-trip, Markdown content, self-contained escaped HTML."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess

import pytest

from attnopt.analysis.cost import cost_curve
from attnopt.ir.outcomes import Attempt, Drift, OutputDrift, SiteOutcome, SitePlan, Status, Verdict
from attnopt.ir.site import AttentionSite, MaskInfo, NearMiss, SiteNodes
from attnopt.policy import Policy
from attnopt.report import CompileReport, SiteRecord

EVIL = "<script>alert(1)</script>"


def make_site(layer, module, q_len=128, arbitrary=False):
    return AttentionSite(
        id=f"{module}#0", module_path=module, module_type="Attn", layer=layer, source="sdpa",
        batch=1, heads=2, kv_heads=2, q_len=q_len, kv_len=q_len, head_dim=8, v_head_dim=8,
        scale=8 ** -0.5, causal=False, mask=MaskInfo(form="additive" if arbitrary else "none", arbitrary=arbitrary),
        window=None, dropout_p=0.0, dtype="float32",
        nodes=SiteNodes(query="q", key="k", value="v", output="o", members=("q", "o")), spelling=("scale:mul",),
    )


def record(layer, module, planned, final, status, reason, drift=None, tolerance=None, params=None, arbitrary=False):
    site = make_site(layer, module, arbitrary=arbitrary)
    params = params or {}
    plan = SitePlan(site_id=site.id, form=planned, params=params, rule=f"rule for {module}", reason=f"plan: {reason}",
                    candidates=((planned, params), ("exact", {})))
    outcome = SiteOutcome(
        site_id=site.id, planned_form=planned, final_form=final, params=params, status=Status(status),
        reason=reason, tolerance=tolerance, drift=drift,
        tried=(Attempt(planned, params, drift, Verdict.ACCEPTED if status == "rewritten" else Verdict.OVER_TOLERANCE,
                       reason, tolerance),) if drift is not None else (),
    )
    return SiteRecord(site, plan, outcome, cost_curve(site, "exact", {}), cost_curve(site, final, params))


@pytest.fixture
def report():
    sites = [
        record(0, "enc.layer.0.attn", "exact", "exact", "kept", "rule 0 (layer 0) chose exact"),
        record(1, "enc.layer.1.attn", "linear", "linear", "rewritten", "drift 0.12 <= tolerance 0.35",
               Drift(0.12, 0.99, 0.5), 0.35, {"feature_map": "elu"}),
        record(2, EVIL, "window", "exact", "reverted", "drift 0.41 > tolerance 0.35: reverted to exact",
               Drift(0.41, 0.9, 1.2), 0.35, {"window": 32, "sinks": 0}),
        record(3, "enc.layer.3.attn", "linear", "exact", "unsupported", "mask is arbitrary: kept exact", arbitrary=True),
        record(4, "enc.layer.4.attn", "window", "window", "rewritten", "drift nan is not finite? accepted for test",
               Drift(float("nan"), float("nan"), float("inf"), finite=False), 0.35, {"window": 32, "sinks": 0}),
    ]
    return CompileReport(
        model_name=f"tiny {EVIL}",
        policy=Policy.parse({"name": EVIL, "rules": [{"layers": 0, "form": "exact"}, {"form": "linear"}]}),
        capture="torch.export",
        sites=sites,
        near_misses=[NearMiss(node="softmax_3", module_path=EVIL, reason="softmax over dim 1, not the key axis", code="softmax_axis")],
        end_to_end=OutputDrift(per_output={"last_hidden_state": Drift(0.05, 0.998, 0.3)}, worst=Drift(0.05, 0.998, 0.3), embedding_cosine=0.999),
        timings={"capture": 0.5, "detect": 0.1},
        notes=["example note"],
    )


def test_totals_are_counted_from_the_records(report):
    t = report.totals
    assert (t["sites"], t["rewritten"], t["kept"], t["reverted"], t["unsupported"], t["near_misses"]) == (5, 2, 1, 1, 1, 1)
    exact_128 = 2 * 1 * 2 * 128 * 128 * 16  # per site at 1×
    assert t["flops_before"][0] == 5 * exact_128
    linear_128 = 2 * 2 * 128 * 8 * 9 * 2
    window_128 = 2 * 2 * 128 * (2 * 32 - 1) * 16
    assert t["flops_after"][0] == 3 * exact_128 + linear_128 + window_128
    assert t["flops_before"][2] == 5 * 256 * exact_128  # 16× length
    assert t["flops_ratio"][2] == pytest.approx(t["flops_after"][2] / t["flops_before"][2])
    assert t["flops_ratio"][2] < t["flops_ratio"][0] < 1
    assert "5 attention sites — 2 rewritten, 1 kept, 1 reverted, 1 unsupported" in str(report)


def test_json_round_trips(report, tmp_path):
    text = report.to_json(tmp_path / "r.json")
    data = json.loads(text)
    assert json.loads((tmp_path / "r.json").read_text()) == data
    assert data["totals"]["reverted"] == 1 and data["policy"]["name"] == EVIL
    assert data["sites"][4]["outcome"]["drift"]["rel_rms"] == "nan"  # strict JSON, no NaN literal
    assert data["sites"][2]["site"]["module_path"] == EVIL
    again = CompileReport.from_dict(data)
    assert again.sites[1].outcome == report.sites[1].outcome
    assert again.sites[1].plan == report.sites[1].plan
    assert again.sites[2].site == report.sites[2].site
    assert math.isnan(again.sites[4].outcome.drift.rel_rms)
    assert again.totals["flops_after"] == report.totals["flops_after"]
    assert json.loads(again.to_json()) == data


def test_markdown_lists_every_site_and_reason(report):
    md = report.to_markdown()
    for r in report.sites:
        assert r.site.id in md.replace("\\|", "|")
        assert r.outcome.reason in md
    assert "window → exact" in md and "0.41 / 0.9" in md
    assert "softmax over dim 1" in md and "## Near misses" in md
    assert "| last_hidden_state | 0.05 |" in md
    ratio16 = report.sites[1].flops_ratio(2)
    assert f"{ratio16:.3g}" in md


def test_html_is_self_contained_with_plots_and_escaped(report, tmp_path):
    page = report.to_html(tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text() == page
    assert page.count("<svg") == 2
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<script\b", page) and "<link" not in page and "@import" not in page
    assert EVIL not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # one drift bar per site with a measured drift; the reverted one in its own colour
    assert page.count("rel RMS 0.41") == 1 and "#e8590c" in page
    for r in report.sites:
        assert html.escape(r.outcome.reason) in page
    # log-scale cost plot: original and rewritten series, one point per multiplier each
    assert page.count("<circle") == 6 and "N=2048" in page


def test_empty_report_renders():
    rep = CompileReport(model_name="empty", policy="exact", capture="dynamo")
    assert rep.totals["sites"] == 0 and rep.flops_ratio == [None, None, None]
    assert "No attention sites found." in rep.to_markdown()
    page = rep.to_html()
    assert "no attention cost recorded" in page and "<svg" in page


def test_preview_screenshot(report):
    """Render the preview page; screenshot it only where a headless browser is installed."""
    path = "/tmp/attnopt_report_preview.html"
    report.to_html(path)
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no headless browser installed; preview written to " + path)
    shot = "/tmp/attnopt_report_preview.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                    "--window-size=1280,1600", "file://" + path], check=True, timeout=60, capture_output=True)
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
