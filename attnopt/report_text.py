"""The report as text: number formats, the site-table cells, and the Markdown page.

The HTML page (`report_html`) builds on these; nothing here imports the report classes, which are
read by attribute.
"""

from __future__ import annotations

import math
from typing import Any, Optional


def fmt_num(x: Optional[float], digits: int = 3) -> str:
    """Short number for tables: '—' for None, 'nan'/'inf' kept, else `digits` significant digits."""
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}g}"


def fmt_flops(x: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def decode_memory_table(rep) -> tuple[list[str], list[list[str]], str]:
    """(titles, rows, note) of the decode-memory table, per batch row; ([], [], "") for encoders. With
    dispatch thresholds it also shows what the sites hold once the context is past them, and the
    note says why the two differ."""
    mem = rep.decode_memory
    if mem is None:
        return [], [], ""
    titles = ["context", "decode state", "original KV cache", "ratio"]
    shown = bool(mem.thresholds) and any(mem.prefix_counted)
    if shown:
        titles += ["decode state past the threshold", "ratio past the threshold"]
    rows = []
    for i, (n, t, o, r) in enumerate(zip(mem.contexts, mem.total, mem.original, mem.ratio)):
        mark = " *" if shown and mem.prefix_counted[i] else ""
        row = [f"{n:,}", f"{fmt_flops(t)}B", f"{fmt_flops(o)}B", fmt_num(r, 4) + mark]
        if shown:
            row += [f"{fmt_flops(mem.past_threshold[i])}B", fmt_num(mem.ratio_past_threshold[i], 4)]
        rows.append(row)
    return titles, rows, decode_memory_note(mem) if shown else ""


def decode_memory_note(mem) -> str:
    """Why the decode state can exceed the original below a dispatch threshold (the rows marked *)."""
    ts = ", ".join(f"{t:,}" for t in mem.thresholds)
    return (f"* Below its dispatch threshold (min_seq_len: {ts} tokens here) a rewritten site runs exact attention, so "
            "until the context reaches the threshold it keeps the exact KV cache besides its own state; the decode "
            "state counts both, and can exceed the original's there. Past the threshold only the form's state is "
            "kept (the last two columns). Set min_seq_len in the policy, or compile(dispatch='off'), to use the "
            "form from the first token.")


def decode_memory_lines(rep) -> list[str]:
    titles, rows, note = decode_memory_table(rep)
    if not rows:
        return []
    out = ["", "## Decode memory (per batch row, all causal sites)", "",
           "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    out += [f"| {' | '.join(r)} |" for r in rows]
    return out + (["", note] if note else [])


def head_map_rows(rep) -> tuple[list[str], list[list[str]]]:
    """(titles, rows) of the layers x KV heads map: per layer, each KV head's "exact" or its form."""
    layers = sorted({r.site.layer for r in rep.sites})
    grid = rep.head_map()
    width = max((len(row) for row in grid), default=0)
    titles = ["layer"] + [f"KV head {j}" for j in range(width)]
    return titles, [[str(layer)] + row + [""] * (width - len(row)) for layer, row in zip(layers, grid)]


CURVE_TITLES = ("exact", "KV heads exact", "share", "probe accuracy ×", "perplexity ×", "budget")


def curve_rows(hs: dict) -> list[list[str]]:
    """The search's path: one row per model it measured on the way (what was exact, what it reached)."""
    rows = []
    for p in hs.get("curve", []):
        rows.append([", ".join(p["exact"]) or "none", str(p["exact_heads"]), f"{p['fraction']:.1%}",
                     fmt_num(p["probe"], 4), fmt_num(p["perplexity"], 5), "holds" if p["holds"] else "—"])
    return rows


def head_selection_text(rep) -> list[str]:
    """The keep:recall findings in sentences: budget, outcome, original against selected, cost, speed."""
    hs = rep.head_selection
    if not hs:
        return []
    b = hs["budget"]
    out = [f"keep:recall ({'by layer' if b['by'] == 'layer' else 'by KV head'}): {hs['summary']}.",
           f"Budget: probe accuracy ≥ {fmt_num(b['recall'])}× the original's, perplexity ≤ {fmt_num(b['perplexity'])}× "
           f"on the verification text, at most {b['exact']:.0%} of the KV heads exact."]
    o, s = hs.get("original") or {}, hs.get("selected") or {}
    if o:
        probes = hs.get("probes", {})
        out.append(f"Probes ({', '.join(probes.get('probes', []))}; {probes.get('rows')} rows of {probes.get('length')} "
                   f"tokens, {probes.get('tokenizer')}): original {fmt_num(o.get('probe'), 4)}, selected "
                   f"{fmt_num(s.get('probe'), 4)}; perplexity original {fmt_num(o.get('perplexity'), 5)}, selected "
                   f"{fmt_num(s.get('perplexity'), 5)}.")
    out.append(f"{hs.get('measured', 0) + 1} models measured (the original and {hs.get('measured', 0)} candidates; "
               f"{hs.get('cached', 0)} read from the cache), {fmt_num(hs.get('seconds'), 3)} s.")
    d = hs.get("decode")
    if d:
        out.append(f"Decoding after {d['context']:,} tokens: {fmt_num(d['selected_ms'], 3)} ms per token against the "
                   f"original's {fmt_num(d['original_ms'], 3)} ms ({fmt_num(d['ratio'], 3)}×; {d['threads']} threads, "
                   f"{d['new_tokens']} tokens; benchmarks/head_hybrid.py times it on a quiet machine).")
    return out + list(hs.get("notes", []))


def kept_kv_text(rep) -> str:
    kept = rep.kept_kv()
    if not kept or not any(kept["exact_heads"]):
        return ""
    parts = [f"{n:,}: {fmt_flops(k)}B of {fmt_flops(o)}B ({fmt_num(k / o if o else None, 3)}×)"
             for n, k, o in zip(kept["contexts"], kept["exact_heads"], kept["original"])]
    return "K/V kept by the exact heads per batch row, against the original's KV cache, by context: " + "; ".join(parts) + "."


def head_lines(rep) -> list[str]:
    """The Markdown "Exact heads" section: the share, the layers x heads map, keep:recall's findings and
    curve; nothing when no site keeps exact heads and no rule asked keep:recall."""
    if not rep.head_selection and not any(r.exact_heads for r in rep.sites):
        return []
    out = ["", "## Exact heads", "",
           f"{rep.exact_head_fraction():.1%} of the rewritten sites' KV heads are exact softmax attention "
           "(each with its own K/V cache); the others run the site's form."]
    kv = kept_kv_text(rep)
    if kv:
        out += ["", kv]
    titles, rows = head_map_rows(rep)
    out += ["", "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    text = head_selection_text(rep)
    if text:
        out += [""] + [f"- {_md_cell(t)}" for t in text]
        out += ["", "| " + " | ".join(CURVE_TITLES) + " |", "|" + "---|" * len(CURVE_TITLES)]
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in curve_rows(rep.head_selection)]
    return out


def crossover_groups(rep) -> list[tuple[list[str], Any]]:
    """([site ids], threshold) per distinct set of dispatch timings: sites of one geometry, form and
    parameters share one measurement (one cache entry), shown once."""
    groups: dict = {}
    for r in rep.sites:
        t = r.threshold
        if t is None or not (t.timings or t.decode_timings):
            continue
        key = (t.form, tuple(t.timings), tuple(t.decode_timings))
        groups.setdefault(key, ([], t))[0].append(r.site.id)
    return list(groups.values())


CROSSOVER_TITLES = ("sites", "form", "tokens", "form ms", "exact ms", "form speed-up", "exact below (source)")


def crossover_rows(rep) -> list[list[str]]:
    """One row per timed length of each crossover group: the form against exact attention (SDPA) in
    one attention op; the decoding step's timings follow, marked so."""
    rows = []
    for ids, t in crossover_groups(rep):
        sites = ids[0] if len(ids) == 1 else f"{ids[0]} and {len(ids) - 1} more"
        taken = t.source + ("" if t.load is None else f", load {t.load:.1f}") + (", loaded machine" if t.loaded else "")
        timed = [(str(n), f, e) for n, f, e in t.timings] + [(f"{n} (decode step)", f, e) for n, f, e in t.decode_timings]
        for i, (n, form_s, exact_s) in enumerate(timed):
            rows.append([sites if i == 0 else "", t.form if i == 0 else "", n, fmt_num(form_s * 1e3),
                         fmt_num(exact_s * 1e3), f"{fmt_num(exact_s / form_s)}x" if form_s > 0 else "—",
                         f"{t.min_seq_len} ({taken})" if i == 0 else ""])
    return rows


CROSSOVER_NOTE = ("Dispatch crossover timings: one attention op on random inputs (batch 1, the site's heads and head "
                  "dims), the form against exact attention (SDPA), best of 3; a site runs exact below the first "
                  "length from which its form stays faster. Cached timings were measured by an earlier compile on "
                  "this machine, under the load shown.")


def measured_time_lines(rep) -> list[str]:
    """The Markdown "Measured time" section: the conditions, the forward original against rewritten,
    compile's own step times, and the crossover timings behind the dispatch thresholds."""
    forward, conditions = rep.forward_time, rep.conditions
    crossovers = crossover_rows(rep)
    if forward is None and conditions is None and not crossovers and not rep.timings:
        return []
    out = ["", "## Measured time", ""]
    if forward is not None:
        out.append(f"- {_md_cell(forward.text())}; the two taking turns after a warm-up, "
                   f"{_md_cell(forward.conditions.text())}.")
    if rep.timings:
        steps = ", ".join(f"{_md_cell(k)} {v:.2f}" for k, v in rep.timings.items())
        where = f", {_md_cell(conditions.text())}" if conditions is not None else ""
        out.append(f"- compile steps (s): {steps}{where}.")
    if crossovers:
        out += ["", CROSSOVER_NOTE, "", "| " + " | ".join(CROSSOVER_TITLES) + " |", "|" + "---|" * len(CROSSOVER_TITLES)]
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in crossovers]
    return out


def _md_cell(text: Any) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def site_row(r, multipliers: tuple) -> dict[str, str]:
    """The cells of one site-table row, as plain text, shared by the Markdown and HTML tables."""
    o, s = r.outcome, r.site
    drift = o.drift
    last = len(multipliers) - 1
    return {
        "id": s.id,
        "module": s.module_path or "(top level)",
        "layer": str(s.layer),
        "mask": s.mask.kind,
        "form": o.planned_form if o.planned_form == o.final_form else f"{o.planned_form} → {o.final_form}",
        "status": str(o.status),
        "reason": o.reason,
        "drift": "—" if drift is None else f"{fmt_num(drift.rel_rms)} / {fmt_num(drift.cosine, 4)}",
        "tolerance": fmt_num(o.tolerance),
        # Dispatch: the site runs exact attention below this query length (the form from it on).
        "threshold": "—" if r.threshold is None else f"{r.threshold.min_seq_len} ({r.threshold.source}"
                     f"{', loaded machine' if r.threshold.loaded else ''})",
        "ratio_first": fmt_num(r.flops_ratio(0)),
        "ratio_last": fmt_num(r.flops_ratio(last)),
    }


SITE_COLUMNS = (
    ("id", "site"),
    ("module", "module"),
    ("layer", "layer"),
    ("mask", "mask"),
    ("form", "form planned → final"),
    ("status", "status"),
    ("reason", "reason"),
    ("drift", "drift rel-RMS / cosine"),
    ("tolerance", "tolerance"),
    ("threshold", "exact below N (source)"),
    ("ratio_first", "FLOPs ratio @first"),
    ("ratio_last", "FLOPs ratio @last"),
)


def column_titles(multipliers: tuple) -> list[str]:
    titles = []
    for key, title in SITE_COLUMNS:
        if key == "ratio_first":
            title = f"FLOPs ratio @{multipliers[0]}×"
        elif key == "ratio_last":
            title = f"FLOPs ratio @{multipliers[-1]}×"
        titles.append(title)
    return titles


def markdown(rep) -> str:
    """The whole report as one Markdown page."""
    t = rep.totals
    out = [f"# attnopt report: {_md_cell(rep.model_name)}", ""]
    out.append(
        f"Capture: {_md_cell(rep.capture)} · mechanism: {_md_cell(rep.mechanism_text)} · torch {rep.torch_version} · "
        f"attnopt {rep.attnopt_version}"
    )
    out += ["", "## Totals", ""]
    out.append(
        f"- sites: {t['sites']} ({t['rewritten']} rewritten, {t['kept']} kept, {t['reverted']} reverted, "
        f"{t['unsupported']} unsupported, {t['unverified']} unverified); near misses: {t['near_misses']}"
    )
    for m, b, a, ratio in zip(rep.cost_multipliers, t["flops_before"], t["flops_after"], t["flops_ratio"]):
        out.append(f"- attention FLOPs at {m}× length: {fmt_flops(b)}FLOP → {fmt_flops(a)}FLOP (ratio {fmt_num(ratio)})")
    out += decode_memory_lines(rep)
    out += head_lines(rep)
    out += measured_time_lines(rep)
    out += ["", "## End-to-end drift", ""]
    e2e = rep.end_to_end
    if e2e is None:
        out.append("not measured")
    else:
        out += ["| output | rel RMS | cosine | max abs | finite |", "|---|---|---|---|---|"]
        for name, d in e2e.per_output.items():
            out.append(f"| {_md_cell(name)} | {fmt_num(d.rel_rms)} | {fmt_num(d.cosine, 4)} | {fmt_num(d.max_abs)} | {d.finite} |")
        if e2e.worst is not None:
            out.append(f"| **worst** | {fmt_num(e2e.worst.rel_rms)} | {fmt_num(e2e.worst.cosine, 4)} | {fmt_num(e2e.worst.max_abs)} | {e2e.worst.finite} |")
        if e2e.embedding_cosine is not None:
            out += ["", f"Mean embedding cosine: {fmt_num(e2e.embedding_cosine, 5)}"]
    budget = rep.counts.get("budget", {}) if isinstance(getattr(rep, "counts", None), dict) else {}
    if budget.get("e2e_tolerance") is not None:
        tol = budget["e2e_tolerance"]
        out += ["", f"End-to-end budget: worst output relative RMS < {fmt_num(tol)} (and mean embedding cosine "
                    f">= {fmt_num(1 - tol / 6)} where measured)."]
    for i, s in enumerate(getattr(rep, "budget_steps", []) or []):
        out.append(f"- step {i + 1}: reverted {_md_cell(s['site_id'])} (site drift {fmt_num(s['site_drift'])}): "
                   f"end-to-end {fmt_num(s['e2e_before'])} → {fmt_num(s['e2e_after'])}")
    out += ["", "## Sites", ""]
    if rep.sites:
        titles = column_titles(rep.cost_multipliers)
        out.append("| " + " | ".join(titles) + " |")
        out.append("|" + "---|" * len(titles))
        for r in rep.sites:
            row = site_row(r, rep.cost_multipliers)
            out.append("| " + " | ".join(_md_cell(row[k]) for k, _ in SITE_COLUMNS) + " |")
    else:
        out.append("No attention sites found.")
    out += ["", "## Near misses", ""]
    if rep.near_misses:
        out += ["| node | module | code | reason |", "|---|---|---|---|"]
        for n in rep.near_misses:
            out.append(f"| {_md_cell(n.node)} | {_md_cell(n.module_path)} | {_md_cell(n.code)} | {_md_cell(n.reason)} |")
    else:
        out.append("None.")
    out += ["", "## Policy", "", "```", rep.policy_text().replace("```", "'''"), "```"]
    if rep.notes:
        out += ["", "## Notes", ""]
        out += [f"- {_md_cell(n)}" for n in rep.notes]
    return "\n".join(out) + "\n"
