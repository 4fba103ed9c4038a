"""The audit as HTML: a depth x length heatmap per probe (the needle-in-a-haystack picture), the model
beside its reference, and perplexity by position. Inline CSS and SVG only; nothing is fetched."""

from __future__ import annotations

import html
import math


CELL_W, CELL_H, LEFT, TOP = 64, 26, 54, 34
PAGE_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;color:#1f2328;margin:0;background:#fff}
main{max-width:1100px;margin:0 auto;padding:24px} h1{font-size:22px;margin:0 0 4px}
"""
# Scoped to the audit's section, so the compile report's page can carry it without restyling itself.
AUDIT_CSS = """
.audit h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #d0d7de} .audit h3{font-size:15px;margin:18px 0 6px}
.audit table{border-collapse:collapse;font-size:13px} .audit td,.audit th{border:1px solid #d0d7de;padding:3px 8px}
.audit th{background:#f6f8fa;text-align:left} .audit .num{text-align:right;font-variant-numeric:tabular-nums}
.audit .pair{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}
.audit figure{margin:8px 0} .audit figcaption{font-size:12px;color:#57606a;max-width:520px}
.audit svg text{font-size:11px;font-family:inherit} .audit .meta{color:#57606a;font-size:12px}
"""
CSS = PAGE_CSS + AUDIT_CSS

_STOPS = ((0.0, (215, 48, 39)), (0.5, (254, 224, 139)), (1.0, (26, 152, 80)))


def esc(x) -> str:
    return html.escape(str(x))


def color(acc) -> str:
    """Red (0) through yellow (0.5) to green (1); grey for no value."""
    if acc is None:
        return "#eaeef2"
    acc = min(1.0, max(0.0, acc))
    for (a, ca), (b, cb) in zip(_STOPS[:-1], _STOPS[1:]):
        if acc <= b:
            t = (acc - a) / (b - a)
            return "rgb(%d,%d,%d)" % tuple(round(x + t * (y - x)) for x, y in zip(ca, cb))
    return "rgb(26,152,80)"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def heatmap(scores, probe: str, lengths: list, depths: list, samples: int) -> str:
    """One SVG: rows are depths (0% at the top), columns lengths, each cell the exact-match accuracy."""
    w, h = LEFT + CELL_W * len(lengths) + 4, TOP + CELL_H * len(depths) + 4
    parts = [f'<text x="{LEFT}" y="12" font-weight="600">{esc(scores.name)[:60]}</text>']
    for j, n in enumerate(lengths):
        parts.append(f'<text x="{LEFT + j * CELL_W + CELL_W / 2}" y="28" text-anchor="middle">{n}</text>')
    for i, d in enumerate(depths):
        y = TOP + i * CELL_H
        parts.append(f'<text x="{LEFT - 6}" y="{y + CELL_H / 2 + 4}" text-anchor="end">{100 * d:.0f}%</text>')
        for j, n in enumerate(lengths):
            acc = scores.retrieval[probe][n][d]
            tf = scores.teacher_forced[probe][n][d]
            x = LEFT + j * CELL_W
            tip = (f"{probe}, {n} tokens, depth {100 * d:.0f}%: exact match {_pct(acc)} of {samples}, teacher-forced "
                   f"{_pct(tf)}")
            if scores.first_token:
                tip += f", first token {_pct(scores.first_token[probe][n][d])}"
            parts.append(f'<rect x="{x}" y="{y}" width="{CELL_W - 2}" height="{CELL_H - 2}" fill="{color(acc)}">'
                         f'<title>{esc(tip)}</title></rect>'
                         f'<text x="{x + CELL_W / 2 - 1}" y="{y + CELL_H / 2 + 3}" text-anchor="middle">{_pct(acc)}</text>')
    return (f'<svg width="{w}" height="{h}" role="img" aria-label="{esc(probe)} accuracy by depth and length">'
            + "".join(parts) + "</svg>")


def _means(scores, probe: str) -> str:
    text = (f"{esc(scores.name)}: exact match {_pct(scores.probe_mean(probe))}, teacher-forced "
            f"{_pct(scores.probe_mean(probe, which='teacher_forced'))}")
    if scores.first_token:
        text += f" (first token {_pct(scores.probe_mean(probe, which='first_token'))})"
    return text


def _probe_section(rep, probe: str) -> str:
    maps = [heatmap(s, probe, rep.lengths, rep.depths, rep.samples) for s in (rep.model, rep.reference) if s]
    means = "; ".join(_means(s, probe) for s in (rep.model, rep.reference) if s)
    if rep.chance.get(probe) is not None:
        means += f"; chance per token {_pct(rep.chance[probe])}"
    return (f'<h3>{esc(probe)}</h3><figure><div class="pair">{"".join(maps)}</div><figcaption>Rows: depth of the fact '
            f"in the context (0% = start); columns: context length in tokens. {means}.</figcaption></figure>")


def _ppl_svg(rep) -> str:
    series = [(s, c) for s, c in ((rep.model, "#cf222e"), (rep.reference, "#0969da")) if s and s.perplexity]
    if not series:
        return ""
    buckets = series[0][0].perplexity.buckets
    values = [b["perplexity"] for s, _ in series for b in s.perplexity.buckets]
    lo, hi = math.log(min(values)), math.log(max(values))
    span = hi - lo or 1.0
    w, h, left, top, step = 80 + 70 * len(buckets), 190, 56, 14, 70
    parts = []
    for k in range(5):
        v = math.exp(lo + span * k / 4)
        y = top + 140 - 140 * k / 4
        parts.append(f'<line x1="{left}" x2="{w - 10}" y1="{y}" y2="{y}" stroke="#eaeef2"/>'
                     f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{v:.3g}</text>')
    for j, b in enumerate(buckets):
        parts.append(f'<text x="{left + 20 + j * step}" y="{top + 160}" text-anchor="middle">{b["start"]}-{b["end"] - 1}'
                     "</text>")
    for s, c in series:
        pts = " ".join(f'{left + 20 + j * step},{top + 140 - 140 * (math.log(b["perplexity"]) - lo) / span:.1f}'
                       for j, b in enumerate(s.perplexity.buckets))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"><title>{esc(s.name)}</title>'
                     "</polyline>")
    legend = " · ".join(f'<span style="color:{c}">&#9632;</span> {esc(s.name)}' for s, c in series)
    return (f'<figure><svg width="{w}" height="{h}" role="img" aria-label="perplexity by position">{"".join(parts)}'
            f"</svg><figcaption>Perplexity (log scale) by the predicted token's position. {legend}</figcaption></figure>")


def _ppl_table(rep) -> str:
    ppl, ref = rep.model.perplexity, rep.reference.perplexity if rep.reference else None
    if ppl is None:
        return "<p>No perplexity (no text of at least 2 tokens).</p>"
    head = "<th>positions</th><th>tokens</th><th>model</th>" + ("<th>reference</th><th>ratio</th>" if ref else "")
    rows = []
    pairs = list(zip(ppl.buckets, ref.buckets if ref else [None] * len(ppl.buckets)))
    pairs.append(({"start": "all", "end": None, "tokens": ppl.tokens, "perplexity": ppl.overall},
                  {"perplexity": ref.overall} if ref else None))
    for b, r in pairs:
        where = "all" if b["end"] is None else f"{b['start']}-{b['end'] - 1}"
        row = f"<td>{where}</td><td class='num'>{b['tokens']}</td><td class='num'>{b['perplexity']:.4g}</td>"
        if r is not None:
            row += (f"<td class='num'>{r['perplexity']:.4g}</td>"
                    f"<td class='num'>{b['perplexity'] / r['perplexity']:.3f}x</td>")
        rows.append(f"<tr>{row}</tr>")
    return (f"<p>{ppl.windows} window(s) of {ppl.window} tokens of {esc(ppl.text)}.</p><table><thead><tr>{head}</tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table>")


def fragment(rep) -> str:
    """The audit's section: setup line, perplexity by position, one heatmap pair per probe, notes."""
    scored = rep.model.scored_by_text
    disagree = "".join(f"<li>{esc(s.name)}: {s.decode_disagreements}/{s.rows} rows where generate() and the full "
                       "forward disagree on the answer</li>" for s in (rep.model, rep.reference)
                       if s is not None and s.decode_disagreements)
    notes = "".join(f"<li>{esc(n)}</li>" for n in rep.notes) + disagree
    return (f'<section class="audit"><style>{AUDIT_CSS}</style><h2>Capability audit</h2><p class="meta">{len(rep.probes)} probes × '
            f"{len(rep.lengths)} lengths × {len(rep.depths)} depths × {rep.samples} samples per cell, seed {rep.seed}; "
            f"tokens: {esc(rep.tokenizer)}; scored by {esc(scored)}, and by teacher-forced token accuracy (hover a "
            f"cell).</p><h3>Perplexity by position</h3>{_ppl_table(rep)}{_ppl_svg(rep)}"
            + "".join(_probe_section(rep, p) for p in rep.probes)
            + (f"<h3>Notes</h3><ul>{notes}</ul>" if notes else "") + "</section>")


def page(rep) -> str:
    title = f"attnopt capability audit: {rep.model.name}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{esc(title)}</title><style>{PAGE_CSS}</style></head>'
            f"<body><main><h1>{esc(title)}</h1>{fragment(rep)}</main></body></html>\n")
