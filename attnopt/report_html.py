"""The report as one self-contained HTML page: inline CSS, hand-drawn SVG plots, no network.

Every string that came from the user or the model (names, module paths, reasons, policy text) goes
through `esc` -- a module path is attacker-controlled as far as a shared report is concerned.
"""

from __future__ import annotations

import html
import math
from typing import Any, Optional

from attnopt.evaluation.report import EvalReport
from attnopt.forms.reuse.heatmap import reuse_heatmaps_html
from attnopt.report_text import (
    CROSSOVER_NOTE,
    CROSSOVER_TITLES,
    CURVE_TITLES,
    SITE_COLUMNS,
    column_titles,
    crossover_rows,
    curve_rows,
    decode_memory_table,
    fmt_flops,
    fmt_num,
    head_map_rows,
    head_selection_text,
    kept_kv_text,
    site_row,
)

STATUS_COLOURS = {"rewritten": "#2f9e44", "reverted": "#e8590c", "kept": "#868e96", "unsupported": "#adb5bd",
                  "unverified": "#f59f00"}
BEFORE_COLOUR, AFTER_COLOUR, TOL_COLOUR = "#495057", "#1c7ed6", "#c92a2a"

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#212529;background:#f8f9fa;margin:0}
main{max-width:1180px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 10px;border-bottom:1px solid #dee2e6;padding-bottom:4px}
.meta{color:#6c757d}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(130px,1fr));gap:10px;margin:16px 0}
.card{background:#fff;border:1px solid #dee2e6;border-radius:8px;padding:10px 14px;min-width:110px}
.card b{display:block;font-size:20px}.card span{color:#6c757d;font-size:12px}
.plots{display:flex;flex-wrap:wrap;gap:16px}
figure{background:#fff;border:1px solid #dee2e6;border-radius:8px;margin:0;padding:8px}
figcaption{font-size:12px;color:#495057;padding:2px 6px 6px}
table{border-collapse:collapse;background:#fff;width:100%;font-size:13px}
th,td{border:1px solid #dee2e6;padding:4px 7px;text-align:left;vertical-align:top}
th{background:#f1f3f5}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.rewritten td.st{color:#2f9e44;font-weight:600}tr.reverted td.st{color:#e8590c;font-weight:600}
tr.kept td.st,tr.unsupported td.st{color:#868e96}tr.unverified td.st{color:#f59f00;font-weight:600}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
pre{background:#fff;border:1px solid #dee2e6;border-radius:8px;padding:10px;overflow-x:auto}
svg text{font-family:system-ui,sans-serif;font-size:11px;fill:#495057}
""".strip()


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


# ---------------------------------------------------------------- plots


def drift_svg(rep, width: int = 560, height: int = 260) -> str:
    """Bars of each site's relative RMS drift in plan order, its tolerance as a red tick, colour by status."""
    left, right, top, bottom = 48, 12, 14, 46
    records = rep.sites
    values = []
    for r in records:
        d = r.outcome.drift
        values.append(None if d is None else d.rel_rms)
    finite = [v for v in values if v is not None and math.isfinite(v)]
    tols = [r.outcome.tolerance for r in records if r.outcome.tolerance is not None and math.isfinite(r.outcome.tolerance)]
    ymax = max(finite + tols + [1e-3]) * 1.15
    plot_w, plot_h = width - left - right, height - top - bottom

    def y(v: float) -> float:
        return top + plot_h * (1 - min(v, ymax) / ymax)

    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="per-site drift">']
    for k in range(5):
        v = ymax * k / 4
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e9ecef"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{fmt_num(v, 2)}</text>')
    n = max(len(records), 1)
    slot = plot_w / n
    bar = max(min(slot * 0.7, 40), 1.0)
    for i, (r, v) in enumerate(zip(records, values)):
        x0 = left + i * slot + (slot - bar) / 2
        colour = STATUS_COLOURS.get(r.outcome.status, "#868e96")
        label = f"{r.site.id} (layer {r.site.layer}): {r.outcome.final_form}, {r.outcome.status}"
        if v is None:
            parts.append(f'<rect x="{x0:.1f}" y="{top + plot_h - 2}" width="{bar:.1f}" height="2" fill="{colour}"><title>{esc(label)}: no drift measured</title></rect>')
        else:
            shown = v if math.isfinite(v) else ymax
            parts.append(
                f'<rect x="{x0:.1f}" y="{y(shown):.1f}" width="{bar:.1f}" height="{top + plot_h - y(shown):.1f}" fill="{colour}">'
                f"<title>{esc(label)}: rel RMS {fmt_num(v)}</title></rect>"
            )
            if not math.isfinite(v):
                # a non-finite drift is drawn full height and labelled, never silently clipped
                parts.append(f'<text x="{x0 + bar / 2:.1f}" y="{y(shown) + 12:.1f}" text-anchor="middle" style="fill:#fff">{fmt_num(v)}</text>')
        tol = r.outcome.tolerance
        if tol is not None and math.isfinite(tol):
            parts.append(f'<line x1="{x0 - 2:.1f}" x2="{x0 + bar + 2:.1f}" y1="{y(tol):.1f}" y2="{y(tol):.1f}" stroke="{TOL_COLOUR}" stroke-width="2" stroke-dasharray="4 2"/>')
        if len(records) <= 40:
            parts.append(f'<text x="{x0 + bar / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle">{esc(r.site.layer)}</text>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#868e96"/>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 18}" text-anchor="middle">layer (one bar per site, plan order)</text>')
    lx = left
    for status in ("rewritten", "reverted", "unverified", "kept"):
        parts.append(f'<rect x="{lx}" y="{height - 11}" width="10" height="10" fill="{STATUS_COLOURS[status]}"/><text x="{lx + 14}" y="{height - 2}">{status}</text>')
        lx += 90
    parts.append(f'<line x1="{lx}" x2="{lx + 16}" y1="{height - 6}" y2="{height - 6}" stroke="{TOL_COLOUR}" stroke-width="2" stroke-dasharray="4 2"/><text x="{lx + 20}" y="{height - 2}">tolerance</text>')
    parts.append("</svg>")
    return "".join(parts)


def cost_svg(rep, width: int = 520, height: int = 260) -> str:
    """Total attention FLOPs, original vs rewritten, at each length multiplier; both axes log-scale."""
    left, right, top, bottom = 64, 16, 14, 46
    before, after = rep.flops_before, rep.flops_after
    mults = list(rep.cost_multipliers)
    lens = _lengths(rep)
    positive = [v for v in before + after if v > 0]
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="attention cost vs sequence length">']
    if not positive or not mults:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no attention cost recorded</text></svg>')
        return "".join(parts)
    lo_dec, hi_dec = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    if hi_dec == lo_dec:
        hi_dec += 1
    xs_log = [math.log10(m) for m in mults]
    x_lo, x_hi = min(xs_log), max(xs_log)
    x_span = (x_hi - x_lo) or 1.0

    def x(i: int) -> float:
        return left + 10 + (plot_w - 20) * (xs_log[i] - x_lo) / x_span if len(mults) > 1 else left + plot_w / 2

    def y(v: float) -> float:
        return top + plot_h * (1 - (math.log10(v) - lo_dec) / (hi_dec - lo_dec))

    for dec in range(lo_dec, hi_dec + 1):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(10 ** dec):.1f}" y2="{y(10 ** dec):.1f}" stroke="#e9ecef"/>')
        parts.append(f'<text x="{left - 6}" y="{y(10 ** dec) + 4:.1f}" text-anchor="end">1e{dec}</text>')
    for i, m in enumerate(mults):
        label = f"{m}×" + (f" (N={lens[i]})" if lens else "")
        anchor = "start" if i == 0 and len(mults) > 1 else ("end" if i == len(mults) - 1 and len(mults) > 1 else "middle")
        parts.append(f'<text x="{x(i):.1f}" y="{top + plot_h + 14}" text-anchor="{anchor}">{esc(label)}</text>')
    for series, colour, name in ((before, BEFORE_COLOUR, "original"), (after, AFTER_COLOUR, "rewritten")):
        pts = [(x(i), y(v)) for i, v in enumerate(series) if v > 0]
        if len(pts) > 1:
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}"/>')
        for i, v in enumerate(series):
            if v > 0:
                parts.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="4" fill="{colour}"><title>{name} at {mults[i]}×: {esc(fmt_flops(v))}FLOP</title></circle>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + plot_h}" stroke="#868e96"/>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="#868e96"/>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 18}" text-anchor="middle">sequence length (× example input)</text>')
    parts.append(f'<rect x="{left}" y="{height - 11}" width="10" height="10" fill="{BEFORE_COLOUR}"/><text x="{left + 14}" y="{height - 2}">original</text>')
    parts.append(f'<rect x="{left + 90}" y="{height - 11}" width="10" height="10" fill="{AFTER_COLOUR}"/><text x="{left + 104}" y="{height - 2}">rewritten</text>')
    parts.append("</svg>")
    return "".join(parts)


def _lengths(rep) -> Optional[list]:
    """The query lengths behind each multiplier when every site agrees on them, else None."""
    seen = {tuple(c.seq_len for c in r.costs_before) for r in rep.sites if r.costs_before}
    if len(seen) == 1:
        lens = list(next(iter(seen)))
        if len(lens) == len(rep.cost_multipliers):
            return lens
    return None


# ---------------------------------------------------------------- page


def _card(value: Any, label: str) -> str:
    return f'<div class="card"><b>{esc(value)}</b><span>{esc(label)}</span></div>'


def _site_table(rep) -> str:
    if not rep.sites:
        return "<p>No attention sites found.</p>"
    numeric = {"layer", "drift", "tolerance", "threshold", "ratio_first", "ratio_last"}
    head = "".join(f"<th>{esc(t)}</th>" for t in column_titles(rep.cost_multipliers))
    rows = []
    for r in rep.sites:
        row = site_row(r, rep.cost_multipliers)
        cells = []
        for key, _ in SITE_COLUMNS:
            cls = "num" if key in numeric else ("st" if key == "status" else "")
            text = f"<code>{esc(row[key])}</code>" if key in ("id", "module") else esc(row[key])
            attrs = f' class="{cls}"' if cls else ""
            if key == "threshold" and r.threshold is not None:  # how it was decided, on hover
                attrs += f' title="{esc(r.threshold.detail)}"'
            cells.append(f"<td{attrs}>{text}</td>")
        rows.append(f'<tr class="{esc(r.outcome.status)}">{"".join(cells)}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _near_miss_table(rep) -> str:
    if not rep.near_misses:
        return "<p>None.</p>"
    rows = "".join(
        f"<tr><td><code>{esc(n.node)}</code></td><td><code>{esc(n.module_path)}</code></td><td>{esc(n.code)}</td><td>{esc(n.reason)}</td></tr>"
        for n in rep.near_misses
    )
    return f"<table><thead><tr><th>node</th><th>module</th><th>code</th><th>reason</th></tr></thead><tbody>{rows}</tbody></table>"


def _e2e_table(rep) -> str:
    e2e = rep.end_to_end
    if e2e is None:
        return "<p>Not measured.</p>"
    rows = []
    items = list(e2e.per_output.items()) + ([("worst", e2e.worst)] if e2e.worst is not None else [])
    for name, d in items:
        rows.append(
            f'<tr><td><code>{esc(name)}</code></td><td class="num">{fmt_num(d.rel_rms)}</td><td class="num">{fmt_num(d.cosine, 4)}</td>'
            f'<td class="num">{fmt_num(d.max_abs)}</td><td>{esc(d.finite)}</td></tr>'
        )
    table = f"<table><thead><tr><th>output</th><th>rel RMS</th><th>cosine</th><th>max abs</th><th>finite</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
    if e2e.embedding_cosine is not None:
        table += f"<p>Mean embedding cosine: <b>{fmt_num(e2e.embedding_cosine, 5)}</b></p>"
    budget = (rep.counts or {}).get("budget", {})
    if budget.get("e2e_tolerance") is not None:
        tol = budget["e2e_tolerance"]
        table += (f"<p>End-to-end budget: worst output relative RMS &lt; {fmt_num(tol)} (and mean embedding "
                  f"cosine &ge; {fmt_num(1 - tol / 6)} where measured).</p>")
    steps = "".join(
        f'<tr><td>{i + 1}</td><td><code>{esc(s["site_id"])}</code></td><td class="num">{fmt_num(s["site_drift"])}</td>'
        f'<td class="num">{fmt_num(s["e2e_before"])}</td><td class="num">{fmt_num(s["e2e_after"])}</td></tr>'
        for i, s in enumerate(rep.budget_steps or [])
    )
    if steps:
        table += ("<table><thead><tr><th>step</th><th>site reverted</th><th>its drift</th><th>end-to-end before</th>"
                  f"<th>after</th></tr></thead><tbody>{steps}</tbody></table>")
    return table


def _table(titles, rows, numeric_from: int = 0) -> str:
    """A plain table of text cells; cells from column `numeric_from` on are right-aligned numbers."""
    num = ' class="num"'
    head = "".join(f"<th>{esc(t)}</th>" for t in titles)
    body = "".join("<tr>" + "".join(f"<td{num if i >= numeric_from else ''}>{esc(c)}</td>" for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _decode_table(rep) -> str:
    titles, rows, note = decode_memory_table(rep)
    if not rows:
        return ""
    return ("<h2>Decode memory</h2><p>Bytes each batch row holds while generating: the rewritten sites' decode "
            "states (fixed-size for linear and ssm, window-sized for window forms) against the KV cache of the "
            f"same sites left exact.</p>{_table(titles, rows)}" + (f"<p>{esc(note)}</p>" if note else ""))


def measured_time_html(rep) -> str:
    """The "Measured time" section: the forward original against rewritten, compile's step times, and
    the crossover timings behind the dispatch thresholds, each with the conditions it was taken under."""
    forward, conditions, crossovers = rep.forward_time, rep.conditions, crossover_rows(rep)
    if forward is None and conditions is None and not crossovers and not rep.timings:
        return ""
    parts = ["<h2>Measured time</h2>"]
    if forward is not None:
        parts.append(f"<p>{esc(forward.text())}; the two taking turns after a warm-up, "
                     f"{esc(forward.conditions.text())}.</p>")
    if rep.timings:
        rows = [[k, f"{v:.3f} s"] for k, v in rep.timings.items()]
        where = f" ({esc(conditions.text())})" if conditions is not None else ""
        parts.append(f"<p>Compile steps{where}:</p>{_table(['step', 'time'], rows, numeric_from=1)}")
    if crossovers:
        parts.append(f"<p>{esc(CROSSOVER_NOTE)}</p>{_table(CROSSOVER_TITLES, crossovers, numeric_from=2)}")
    return "".join(parts)


EXACT_COLOUR, FORM_COLOUR = "#1c7ed6", "#d3f9d8"


def head_map_html(rep) -> str:
    """The layers x KV heads map as a table of coloured cells: blue exact, green the form."""
    titles, rows = head_map_rows(rep)
    head = "".join(f"<th>{esc(t)}</th>" for t in titles)
    body = ""
    for row in rows:
        cells = f"<td>{esc(row[0])}</td>"
        for c in row[1:]:
            colour = EXACT_COLOUR if c == "exact" else FORM_COLOUR if c else "#fff"
            style = f"background:{colour};color:{'#fff' if c == 'exact' else '#212529'};text-align:center"
            cells += f'<td style="{style}">{esc(c)}</td>'
        body += f"<tr>{cells}</tr>"
    return f"<table style=\"width:auto\"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def curve_svg(hs: dict, width: int = 520, height: int = 240) -> str:
    """Quality against the share of KV heads exact along the search's path: probe accuracy and perplexity as
    multiples of the original's, the recall target dashed."""
    points = hs.get("curve") or []
    if not points:
        return ""
    left, right, top, bottom = 48, 48, 14, 40
    xmax = max(max(p["fraction"] for p in points), hs["budget"]["exact"], 1e-3)
    probe = [p["probe"] for p in points]
    ppl = [p["perplexity"] for p in points if p["perplexity"] is not None]
    ymax = max(probe + [hs["budget"]["recall"], 1.0]) * 1.05
    pmin, pmax = (min(ppl + [1.0]), max(ppl + [hs["budget"]["perplexity"]]) * 1.001) if ppl else (1.0, 1.02)
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(f):
        return left + plot_w * f / xmax

    def y(v):
        return top + plot_h * (1 - v / ymax)

    def yp(v):
        return top + plot_h * (1 - (v - pmin) / max(pmax - pmin, 1e-9))

    parts = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
             'aria-label="quality against the exact share">']
    for k in range(5):
        v = ymax * k / 4
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e9ecef"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{fmt_num(v, 2)}</text>')
    r = hs["budget"]["recall"]
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(r):.1f}" y2="{y(r):.1f}" stroke="{TOL_COLOUR}" '
                 'stroke-dasharray="4 2"/>')
    cap = hs["budget"]["exact"]
    parts.append(f'<line x1="{x(cap):.1f}" x2="{x(cap):.1f}" y1="{top}" y2="{top + plot_h}" stroke="{TOL_COLOUR}" '
                 'stroke-dasharray="2 3"/>')
    line = " ".join(f"{x(p['fraction']):.1f},{y(p['probe']):.1f}" for p in points)
    parts.append(f'<polyline points="{line}" fill="none" stroke="{AFTER_COLOUR}" stroke-width="2"/>')
    for p in points:
        label = f"{', '.join(p['exact']) or 'none'} exact: probe {fmt_num(p['probe'], 4)}×, perplexity {fmt_num(p['perplexity'], 5)}×"
        parts.append(f'<circle cx="{x(p["fraction"]):.1f}" cy="{y(p["probe"]):.1f}" r="4" fill="{AFTER_COLOUR}">'
                     f'<title>{esc(label)}</title></circle>')
    if ppl:
        with_ppl = [p for p in points if p["perplexity"] is not None]
        line = " ".join(f"{x(p['fraction']):.1f},{yp(p['perplexity']):.1f}" for p in with_ppl)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{BEFORE_COLOUR}" stroke-width="1.5" '
                     'stroke-dasharray="5 3"/>')
        parts.append(f'<text x="{width - right + 4}" y="{yp(pmin) + 4:.1f}">{fmt_num(pmin, 4)}</text>'
                     f'<text x="{width - right + 4}" y="{yp(pmax) + 4:.1f}">{fmt_num(pmax, 4)}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 22}" text-anchor="middle">share of KV heads exact '
                 f'(0 to {xmax:.0%}; dotted: the budget\'s cap)</text>')
    parts.append(f'<text x="{left}" y="{height - 6}">solid: probe accuracy × the original (left axis; dashed red: recall '
                 'target) · dashed grey: perplexity × (right axis)</text></svg>')
    return "".join(parts)


def head_selection_html(rep) -> str:
    """The "Exact heads" section: share, K/V kept, the layers x heads map, keep:recall's findings and curve."""
    if not rep.head_selection and not any(r.exact_heads for r in rep.sites):
        return ""
    parts = ["<h2>Exact heads</h2>",
             f"<p>{rep.exact_head_fraction():.1%} of the rewritten sites' KV heads are exact softmax attention (each "
             "with its own K/V cache); the others run the site's form.</p>"]
    kv = kept_kv_text(rep)
    if kv:
        parts.append(f"<p>{esc(kv)}</p>")
    parts.append(head_map_html(rep))
    hs = rep.head_selection
    if hs:
        parts.append("<ul>" + "".join(f"<li>{esc(t)}</li>" for t in head_selection_text(rep)) + "</ul>")
        parts.append(f'<figure>{curve_svg(hs)}<figcaption>The path keep:recall walked: each point a model it '
                     "measured, with one more unit exact.</figcaption></figure>")
        parts.append(_table(CURVE_TITLES, curve_rows(hs), numeric_from=1))
    return "".join(parts)


def _totals_table(rep) -> str:
    t = rep.totals
    rows = "".join(
        f'<tr><td>{esc(m)}×</td><td class="num">{esc(fmt_flops(b))}FLOP</td><td class="num">{esc(fmt_flops(a))}FLOP</td>'
        f'<td class="num">{fmt_num(ratio)}</td><td class="num">{esc(fmt_flops(bb))}B</td><td class="num">{esc(fmt_flops(ba))}B</td></tr>'
        for m, b, a, ratio, bb, ba in zip(rep.cost_multipliers, t["flops_before"], t["flops_after"], t["flops_ratio"], t["bytes_before"], t["bytes_after"])
    )
    return (
        "<table><thead><tr><th>length</th><th>attention FLOPs before</th><th>after</th><th>ratio</th>"
        f"<th>bytes before</th><th>after</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def calibration_html(rep) -> str:
    """The calibration section: per-site and end-to-end drift before/after on held-out batches, the loss
    curves, and (with reuse sites) the cross-layer reuse-drift heatmap with the anchors in use."""
    cal = getattr(rep, "calibration", None)
    if not cal:
        return ""
    rows = []
    for s in cal["sites"]:
        hb, ha = s.get("held_out_before") or {}, s.get("held_out_after") or {}
        rows.append(f"<tr><td><code>{esc(s['site_id'])}</code></td><td>{esc(s['form'])}</td><td>{esc(s['status'])}</td>"
                    f'<td class="num">{fmt_num(s["rms_before"])} → {fmt_num(s["rms_after"])}</td>'
                    f'<td class="num">{fmt_num(hb.get("rel_rms"))} → {fmt_num(ha.get("rel_rms"))}</td>'
                    f"<td>{esc(s['reason'])}</td></tr>")
    e2e = ""
    for label, key in (("before", "end_to_end_before"), ("after", "end_to_end_after")):
        d = cal.get(key) or {}
        worst = (d.get("worst") or {}).get("rel_rms")
        e2e += f'<tr><td>{label}</td><td class="num">{fmt_num(worst)}</td><td class="num">{fmt_num(d.get("embedding_cosine"))}</td></tr>'
    # Loss curves: relative RMS per step, one polyline per site, log scale.
    w, h, pad = 560, 220, 40
    curves = [s["curve"] for s in cal["sites"] if s.get("curve")] + ([cal["lora"]["curve"]] if cal.get("lora") else [])
    pts = [v for c in curves for _, v in c if v > 0 and math.isfinite(v)]
    svg = ""
    if pts:
        lo, hi = math.log10(min(pts)), math.log10(max(pts)) + 1e-9
        steps = max(max(st for st, _ in c) for c in curves) or 1
        lines = []
        for i, c in enumerate(curves):
            xy = " ".join(f"{pad + (w - 2 * pad) * st / steps:.1f},{h - pad - (h - 2 * pad) * (math.log10(max(v, 1e-30)) - lo) / (hi - lo + 1e-9):.1f}"
                          for st, v in c if v > 0 and math.isfinite(v))
            lines.append(f'<polyline fill="none" stroke="hsl({(i * 47) % 360},65%,42%)" stroke-width="1.4" points="{xy}"/>')
        svg = (f'<svg width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img"><text x="{pad}" y="14">relative RMS '
               f'{10 ** hi:.3g} (top) to {10 ** lo:.3g} (bottom), log; steps 0 to {steps}</text>{"".join(lines)}</svg>')
    heat = ""
    reuse = cal.get("reuse")
    if reuse and reuse.get("drift"):
        n, cell = len(reuse["drift"]), 34
        ids = reuse["site_ids"]
        cells = []
        for li, row in enumerate(reuse["drift"]):
            for ai, d in enumerate(row):
                if d is None:
                    continue
                shade = max(0.0, min(1.0, d))  # drift 0 white .. 1 and above dark red
                frame = ' stroke="#1c7ed6" stroke-width="3"' if reuse["reuse"].get(ids[li]) == ids[ai] else ""
                cells.append(f'<rect x="{60 + ai * cell}" y="{20 + li * cell}" width="{cell - 2}" height="{cell - 2}" '
                             f'fill="rgb(255,{int(255 * (1 - shade))},{int(255 * (1 - shade))})"{frame}><title>site {esc(ids[li])} on '
                             f'{esc(ids[ai])}: drift {d:.3g}</title></rect><text x="{62 + ai * cell}" y="{40 + li * cell}">{d:.2f}</text>')
        labels = "".join(f'<text x="4" y="{40 + i * cell}">L{esc(reuse["layers"][i])}</text>'
                         f'<text x="{64 + i * cell}" y="14">L{esc(reuse["layers"][i])}</text>' for i in range(n))
        heat = (f'<figure><svg width="{70 + n * cell}" height="{30 + n * cell}" role="img">{labels}{"".join(cells)}'
                f"</svg><figcaption>Reuse drift: row = site, column = the earlier site whose q, k it would use (pure "
                f"reuse, calibration data); blue frame = the anchor in use.</figcaption></figure>")
    return (f"<h2>Calibration</h2><p>{esc(cal['params'])}, {cal['steps']} steps per site, lr {fmt_num(cal['lr'])}, seed "
            f"{cal['seed']}, {cal['train_batches']} training / {cal['held_out_batches']} held-out batches on "
            f"{cal['world_size']} rank(s), {fmt_num(cal['seconds'])} s.</p>"
            "<table><thead><tr><th>held out</th><th>worst output rel RMS</th><th>embedding cosine</th></tr></thead>"
            f"<tbody>{e2e}</tbody></table><br><table><thead><tr><th>site</th><th>form</th><th>status</th>"
            "<th>training rel RMS</th><th>held-out rel RMS</th><th>why</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
            f'<div class="plots"><figure>{svg}<figcaption>Loss curves per site (and LoRA).</figcaption></figure>{heat}</div>')


def exports_html(rep) -> str:
    """One row per attnopt.export_onnx call on this model: what it wrote, how each form was lowered,
    and its parity with torch (the checks it passed before it was kept); nothing when there is none."""
    rows = []
    for e in rep.exports:
        lowered = ", ".join(sorted({f"{s.get('form')}: {s.get('lowering')}" for s in e.get("sites", [])})) or "—"
        parity = e.get("parity") or []
        worst = max((p["rel_rms"] for p in parity if p.get("rel_rms") is not None), default=None)
        checked = ", ".join(f"{p.get('runtime', '?')} at {p.get('length', '?')}" for p in parity) or "—"
        genai = e.get("genai") or {}
        kind = "decode folder" + ("" if not genai else " (genai)" if genai.get("supported") else " (no genai)") \
            if e.get("decode") else "prefill file"
        rows.append([e.get("folder") or e.get("path", "?"), kind, e.get("target", "?"), e.get("opset", "?"), lowered,
                     checked, "—" if worst is None else f"{worst:.1e}", f"{e.get('seconds', 0.0):.1f}"])
    if not rows:
        return ""
    return ("<h2>ONNX exports</h2><p>What each export wrote and how its sites were lowered; every one was checked "
            "against torch before it was kept (worst relative RMS over the checks).</p>"
            + _table(["written", "kind", "target", "opset", "lowerings", "checked", "worst rel RMS", "seconds"], rows,
                     numeric_from=6))


def evaluation_html(rep) -> str:
    """The capability audit stored by attnopt.evaluate(..., attach=True): its own section (heatmaps,
    perplexity by position); nothing when there is none."""
    if not rep.evaluation:
        return ""
    return EvalReport.from_dict(rep.evaluation).html_fragment()


def render_html(rep) -> str:
    t = rep.totals
    ratio = t["flops_ratio"][-1] if t["flops_ratio"] else None
    worst = rep.end_to_end.worst.rel_rms if rep.end_to_end is not None and rep.end_to_end.worst is not None else None
    speedup = rep.forward_time.speedup if rep.forward_time is not None else None
    cards = "".join(
        [
            _card(t["sites"], "attention sites"),
            _card(t["rewritten"], "rewritten"),
            _card(t["kept"], "kept exact"),
            _card(t["reverted"], "reverted"),
            _card(t["unsupported"], "unsupported"),
            _card(t["unverified"], "unverified"),
            _card(t["near_misses"], "near misses"),
            _card(fmt_num(ratio), f"FLOPs ratio @{rep.cost_multipliers[-1]}×" if rep.cost_multipliers else "FLOPs ratio"),
            _card(fmt_num(worst), "end-to-end worst rel RMS"),
            _card("—" if speedup is None else f"{speedup:.2f}×", "forward speed-up (measured)"),
        ]
    )
    notes = ""
    if rep.notes:
        notes = "<h2>Notes</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in rep.notes) + "</ul>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>attnopt report: {esc(rep.model_name)}</title>
<style>{CSS}</style></head>
<body><main>
<h1>attnopt report: {esc(rep.model_name)}</h1>
<div class="meta">capture: {esc(rep.capture)} · mechanism: {esc(rep.mechanism_text)} · torch {esc(rep.torch_version)} · attnopt {esc(rep.attnopt_version)}</div>
<div class="cards">{cards}</div>
<h2>Drift and cost</h2>
<div class="plots">
<figure>{drift_svg(rep)}<figcaption>Relative RMS drift of each site's output given the original inputs; red ticks: tolerance.</figcaption></figure>
<figure>{cost_svg(rep)}<figcaption>Total attention FLOPs (log scale) at 1× and longer inputs, original vs rewritten.</figcaption></figure>
</div>
<h2>Totals</h2>
{_totals_table(rep)}
{_decode_table(rep)}
{head_selection_html(rep)}
{measured_time_html(rep)}
<h2>End-to-end drift</h2>
{_e2e_table(rep)}
<h2>Sites</h2>
{_site_table(rep)}
{calibration_html(rep)}
{reuse_heatmaps_html(rep)}
{evaluation_html(rep)}
{exports_html(rep)}
<h2>Near misses</h2>
{_near_miss_table(rep)}
<h2>Policy</h2>
<pre>{esc(rep.policy_text())}</pre>
{notes}
</main></body></html>
"""
