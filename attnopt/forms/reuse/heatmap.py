"""The seed's observation as a picture: how well each earlier layer's block selection serves a
layer's attention (plan.py's overlap), one cell per (layer, earlier layer), the anchors in use framed -- for the compile report (what the measured plan
saw, `counts["verify"]["plans"]["reuse"]`) and the calibration report (`calibration["reuse"]`)."""

from __future__ import annotations

from html import escape
from typing import Any, Optional

CELL = 34


def overlap_heatmap_html(data: Optional[dict], caption: str) -> str:
    """An SVG heatmap of data["overlap"] (row = site, column = an earlier site; None = not comparable)
    with data["reuse"] (site id -> anchor id) framed; "" when there is no matrix."""
    if not data or not data.get("overlap"):
        return ""
    ids, layers, overlap = data["site_ids"], data["layers"], data["overlap"]
    in_use = data.get("reuse") or {}
    n = len(overlap)
    cells = []
    for li, row in enumerate(overlap):
        for ai, value in enumerate(row):
            if value is None:
                continue
            shade = int(255 * (1 - max(0.0, min(1.0, value))))  # overlap 1 dark blue .. 0 white
            framed = in_use.get(ids[li]) == ids[ai]
            frame = ' stroke="#e8590c" stroke-width="3"' if framed else ""
            text = "#fff" if value > 0.6 else "#000"
            cells.append(
                f'<rect x="{60 + ai * CELL}" y="{20 + li * CELL}" width="{CELL - 2}" height="{CELL - 2}" '
                f'fill="rgb({shade},{shade},255)"{frame}><title>layer {escape(str(layers[li]))} on layer '
                f'{escape(str(layers[ai]))}: overlap {value:.3f}</title></rect>'
                f'<text x="{62 + ai * CELL}" y="{40 + li * CELL}" style="fill:{text}">{value:.2f}</text>')
    labels = "".join(f'<text x="4" y="{40 + i * CELL}">L{escape(str(layers[i]))}</text>'
                     f'<text x="{64 + i * CELL}" y="14">L{escape(str(layers[i]))}</text>' for i in range(n))
    threshold = data.get("threshold")
    rule = data.get("rule") or {}
    what = ", ".join(f"{k} {v}" for k, v in rule.items() if v is not None)
    note = f" Threshold {threshold:g}." if isinstance(threshold, (int, float)) else ""
    return (f'<figure><svg width="{70 + n * CELL}" height="{30 + n * CELL}" role="img">{labels}{"".join(cells)}</svg>'
            f"<figcaption>{escape(caption)}: share of a layer's attention rows (row; its worst head) whose "
            f"target the blocks an earlier layer (column) selects hold: no block left out carries 30% of the "
            f"row's mass ({escape(what)}); orange frame = the anchor in use.{note}</figcaption></figure>")


def reuse_heatmaps_html(report: Any) -> str:
    """The compile report's measured plan and the calibration's overlap, whichever the report holds."""
    plan = ((getattr(report, "counts", None) or {}).get("verify") or {}).get("plans", {}).get("reuse")
    if plan and "plans" in plan:  # several rules measured: the first one's matrix
        plan = plan["plans"][0]
    calibration = (getattr(report, "calibration", None) or {}).get("reuse")
    parts = [overlap_heatmap_html(plan, "Reuse plan, measured on the compile inputs"),
             overlap_heatmap_html(calibration, "Reuse overlap on the calibration data")]
    body = "".join(p for p in parts if p)
    return f'<h2>Cross-layer block overlap</h2><div class="plots">{body}</div>' if body else ""
