"""CompileReport: totals from the records, JSON round-trip, Markdown content, self-contained escaped HTML."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import subprocess

import pytest
from dataclasses import replace

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
    # the rebuilt report describes its policy's rules as the original does, not as a JSON dump
    assert again.policy_text() == report.policy_text() and "rule 0:" in again.policy_text()
    assert again.to_markdown() == report.to_markdown()


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


# ---------------------------------------------------------------- measured time and decode memory


def _timed_report():
    from attnopt.analysis.timing import Conditions, ForwardTime
    from attnopt.passes.crossover import Threshold

    quiet = Conditions(threads=2, cores=2, load=0.3, others=0.1)
    busy = Conditions(threads=2, cores=2, load=6.0, others=1.4, loaded=True)
    sites = [record(i, f"enc.layer.{i}.attn", "linear", "linear", "rewritten", "ok", Drift(0.1, 0.99, 0.5), 0.8,
                    {"feature_map": "elu"}) for i in range(3)]
    timings = ((64, 2e-4, 1e-4), (128, 3e-4, 3e-4), (256, 4e-4, 8e-4))
    for i, r in enumerate(sites):  # sites 0 and 1 share one measurement; site 2 has its own
        r.threshold = Threshold(r.site.id, "linear", 256, "measured" if i < 2 else "cached", "timed",
                                timings if i < 2 else ((64, 1e-4, 5e-4),), load=6.0 if i < 2 else 0.2,
                                loaded=i < 2, others=1.4 if i < 2 else 0.0)
    forward = ForwardTime((4, 128), 128, 0.0125, 0.0100, 3, 3, 2, quiet)
    return CompileReport(model_name="timed", policy="linear", capture="torch.export", sites=sites,
                         timings={"capture+detect": 1.25, "total": 4.5}, forward_time=forward, conditions=busy)


def test_measured_time_is_in_markdown_json_and_html_with_its_conditions():
    rep = _timed_report()
    md = rep.to_markdown()
    section = md[md.index("## Measured time"):md.index("## End-to-end drift")]
    assert ("forward on the verification input [4×128], 128 queries at the sites: 12.5 ms original, 10 ms "
            "rewritten (1.25x), best of 3; 2 of 3 rewritten sites ran exact attention") in section
    assert "2 torch threads on 2 cores (cpu), load average 0.3, other work holding 0.1 cores." in section
    assert "capture+detect 1.25, total 4.50, 2 torch threads on 2 cores (cpu), load average 6.0" in section
    assert "a loaded machine, times are noisy" in section
    # one crossover group per measurement: the shared one's rows, then site 2's single row
    rows = [line for line in section.splitlines() if line.startswith("| ") and "sites" not in line]
    assert rows[0] == "| enc.layer.0.attn#0 and 1 more | linear | 64 | 0.2 | 0.1 | 0.5x | 256 (measured, load 6.0, loaded machine) |"
    assert rows[2] == "|  |  | 256 | 0.4 | 0.8 | 2x |  |"
    assert rows[3].startswith("| enc.layer.2.attn#0 | linear | 64 | 0.1 | 0.5 | 5x | 256 (cached, load 0.2) |")
    assert len(rows) == 4

    data = json.loads(rep.to_json())
    assert data["forward_time"]["original_s"] == 0.0125 and data["forward_time"]["speedup"] == pytest.approx(1.25)
    assert data["forward_time"]["conditions"] == {"threads": 2, "cores": 2, "load": 0.3, "others": 0.1,
                                                  "device": "cpu", "loaded": False}
    assert data["conditions"]["loaded"] is True
    again = CompileReport.from_dict(data)
    assert again.forward_time == rep.forward_time and again.conditions == rep.conditions
    assert json.loads(again.to_json()) == data  # "loaded" is kept as judged when measured, not re-judged here
    assert again.to_markdown() == md

    page = rep.to_html()
    section = page[page.index("<h2>Measured time</h2>"):page.index("<h2>End-to-end drift</h2>")]
    assert "12.5 ms original, 10 ms rewritten (1.25x)" in section and "load average 6.0" in section
    assert '<td class="num">0.5x</td>' in section and '<td class="num">1.250 s</td>' in section
    assert "<b>1.25×</b><span>forward speed-up (measured)</span>" in page


def test_a_forward_too_slow_to_time_says_so():
    from attnopt.analysis.timing import Conditions, ForwardTime

    rep = CompileReport(model_name="big", policy="linear", capture="torch.export", forward_time=ForwardTime(
        (1, 4096), 4096, None, None, 0, 4, 0, Conditions(8, 8, 1.0), "one forward took 9.0 s"))
    assert "forward on the verification input [1×4096], 4096 queries at the sites: not timed (one forward took 9.0 s)" \
        in rep.to_markdown()
    assert "<b>—</b><span>forward speed-up (measured)</span>" in rep.to_html()


def _causal_record(layer, form, params):
    site = replace(make_site(layer, f"dec.layer.{layer}.attn"), causal=True,
                   mask=MaskInfo(form="is_causal", causal=True))
    outcome = SiteOutcome(site_id=site.id, planned_form=form, final_form=form, params=params,
                          status=Status.REWRITTEN, reason="ok", tolerance=0.8, drift=Drift(0.1, 0.99, 0.5))
    plan = SitePlan(site_id=site.id, form=form, params=params, rule="r", reason="r", candidates=((form, params),))
    return SiteRecord(site, plan, outcome)


def test_decode_memory_explains_the_exact_prefix_below_the_threshold():
    # Two linear sites, exact below 2048 tokens: at 1k each keeps its KV cache AND its state (> original).
    rep = CompileReport(model_name="dec", policy="linear", capture="torch.export",
                        sites=[_causal_record(i, "linear", {"feature_map": "elu", "min_seq_len": 2048}) for i in (0, 1)])
    mem = rep.decode_memory
    kv_1k = 2 * (2 * 1024 * 8 * 2 * 4)  # two sites, [Hkv=2, N, D=8] keys and values, fp32
    state = 2 * (2 * 8 * (8 + 1) * 4)  # two sites, H=2, elu map: D=8 features x (Dv + 1) fp32 accumulators
    assert mem.original[0] == kv_1k and mem.total[0] == kv_1k + state and mem.past_threshold[0] == state
    assert mem.prefix_counted == [True, False, False] and mem.thresholds == (2048,)
    md = rep.to_markdown()
    table = md[md.index("## Decode memory"):md.index("## Measured time") if "## Measured time" in md else None]
    assert "| context | decode state | original KV cache | ratio | decode state past the threshold |" in table
    assert f"| 1,024 | {(kv_1k + state) / 1e3:.3g} kB | {kv_1k / 1e3:.3g} kB | {(kv_1k + state) / kv_1k:.4g} * |" in table
    assert "(min_seq_len: 2,048 tokens here)" in table and "exact KV cache besides its own state" in table
    assert "min_seq_len: 2,048 tokens here" in rep.to_html()
    # No threshold: no extra columns and no note.
    plain = CompileReport(model_name="dec", policy="linear", capture="torch.export",
                          sites=[_causal_record(0, "linear", {"feature_map": "elu", "min_seq_len": 0})])
    assert "past the threshold" not in plain.to_markdown() and "*" not in plain.to_markdown().split("## Decode")[1]
