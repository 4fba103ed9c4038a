"""mkdocs hook: the capability runs' heatmap pages (benchmarks/results/capability/<machine>.html) join
the site as assets/capability-<machine>.html, read from the result files at build time, so the
repository keeps one copy of each page and the site always shows the current one."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent / "results" / "capability"


def on_files(files, config):
    for page in sorted(RESULTS.glob("*.html")):
        files.append(File.generated(config, f"assets/capability-{page.stem}.html", abs_src_path=str(page)))
    return files
