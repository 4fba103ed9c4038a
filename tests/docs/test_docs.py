"""The README and the docs site say what the code and the results say: generated tables equal what the
renderer writes now, every Python block is a tested file, no run log creeps back, every gap of the
compatibility matrix has its reason and every ✅ its test."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str, path: Path):
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render():
    return _load("attnopt_docs_render", ROOT / "benchmarks" / "render.py")


def markdown_files() -> list[Path]:
    return [README, ROOT / "benchmarks" / "README.md", *sorted(DOCS.rglob("*.md"))]


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


# ---------------------------------------------------------------- README


def test_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; keep it a front page (≤ 250) and move detail to docs/"


def test_readme_first_screen_says_what_has_never_run():
    first_screen = "\n".join(README.read_text(encoding="utf-8").splitlines()[:20])
    assert "Never run on real hardware" in first_screen and "Triton" in first_screen and "TensorRT" in first_screen
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache-2.0" in first_screen and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence  # the full text, not a stub


def test_readme_install_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = README.read_text(encoding="utf-8")
    assert 'pip install torch==2.13.0 && pip install -e ".[dev,onnx]" && attnopt demo' in readme
    assert '"torch==2.13.0"' in ci and '-e ".[dev,onnx,docs]"' in ci
    assert "python -m pytest -q -n 2 --dist loadfile" in readme and "python -m pytest -q -n 2 --dist loadfile" in ci
    assert "mkdocs build --strict" in ci


# ---------------------------------------------------------------- no run logs


RUN_LOG = re.compile(r"\b(run|runs|issue|issues) \d+|since issue|_run\d+", re.I)


def without_block(text: str, name: str) -> str:
    """The goals table cites the issue that set each goal, by design: leave that block out."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    if start in text:
        head, rest = text.split(start, 1)
        return head + rest.split(end, 1)[1]
    return text


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_or_issue_numbers_outside_the_changelog(path):
    text = without_block(path.read_text(encoding="utf-8"), "goals")
    found = [m.group(0) for m in RUN_LOG.finditer(text)]
    assert not found, f"{path.relative_to(ROOT)} names {found}: run logs and issue numbers belong in CHANGELOG.md"


def test_the_run_log_pattern_catches_what_it_must():
    caught = [t for t in ("decode run 17", "since issue 21", "issue 13's goal", "runs 20", "e2e_16k_run8/")
              if RUN_LOG.search(t)]
    assert len(caught) == 5 and not RUN_LOG.search("runs as written; issued once; 2 runs")


# ---------------------------------------------------------------- code blocks are tested files


def examples_run_by_tests() -> set[str]:
    text = (ROOT / "tests" / "test_examples.py").read_text()
    return {p.stem for p in (ROOT / "examples").glob("*.py") if f'"{p.stem}"' in text or f"{p.name}" in text}


def test_every_readme_python_block_is_a_tested_example_as_written():
    blocks = fenced_blocks(README.read_text(encoding="utf-8"), "python")
    assert blocks, "the README has no Python block: where did the quickstart go?"
    tested = examples_run_by_tests()
    for block in blocks:
        sources = {p.stem: "\n".join(line for line in p.read_text().splitlines() if "--8<--" not in line) + "\n"
                   for p in (ROOT / "examples").glob("*.py") if p.stem in tested}
        assert block in sources.values(), ("a README Python block is not a tested file of examples/ as written: "
                                           "run `python benchmarks/render.py`")


@pytest.mark.parametrize("path", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docs_python_block_embeds_a_tested_example(path):
    tested = examples_run_by_tests()
    for block in fenced_blocks(path.read_text(encoding="utf-8"), "python"):
        match = re.fullmatch(r'--8<-- "examples/(\w+)\.py(?::(\w+))?"\n', block)
        assert match, (f"{path.relative_to(ROOT)}: a Python block that is not a snippet of a tested file; embed "
                       f'one with --8<-- "examples/<file>.py[:section]":\n{block[:200]}')
        stem, section = match.groups()
        assert stem in tested, f"{path.relative_to(ROOT)} embeds examples/{stem}.py, which tests/test_examples.py never runs"
        if section:
            src = (ROOT / "examples" / f"{stem}.py").read_text()
            assert f"# --8<-- [start:{section}]" in src and f"# --8<-- [end:{section}]" in src


# ---------------------------------------------------------------- generated tables


def test_every_generated_block_equals_what_the_renderer_writes_now(render):
    assert render.stale() == [], "a generated table differs from its source: run `python benchmarks/render.py`"


def test_a_changed_result_makes_its_table_stale(render, monkeypatch):
    results = render.current_results()
    machine, result = next(iter(results["decode_cpu"].items()))
    changed = json.loads(json.dumps(result))
    changed["contexts"]["8192"]["linear"]["speedup_vs_baseline"] *= 2  # a planted change in one number
    monkeypatch.setattr(render, "current_results", lambda: {**results, "decode_cpu": {machine: changed}})
    assert "README.md" in render.stale() and "docs/benchmarks.md" in render.stale()


def test_goals_name_their_source_and_a_metric_the_renderer_has(render):
    goals = render.load_goals()
    assert len({g["id"] for g in goals}) == len(goals) >= 10
    for g in goals:
        assert re.search(r"[≤≥]|\d", g["source"]["quote"]), f"goal {g['id']}: its quote states no bound"


def test_a_goal_is_judged_from_the_result_not_assumed(render):
    goal = next(g for g in render.load_goals() if g["id"] == "decode-8k")
    result = render.current_results()["decode_cpu"]
    r = next(iter(result.values()))
    assert render.verdict(goal, r).startswith("**met**")
    slower = json.loads(json.dumps(r))
    slower["contexts"]["8192"]["ssm"]["speedup_vs_baseline"] = 2.0  # 0.5 of the baseline's time
    assert render.verdict(goal, slower).startswith("**missed** by ssm")
    assert render.verdict(goal, None) == "no current result"


def test_a_goal_names_what_its_result_did_not_measure(render):
    goal = next(g for g in render.load_goals() if g["id"] == "e2e-short")
    r = {"rows": [{"N": 1024, "speedup": {"original": 1.0, "linear": 1.1, "ceiling": 1.3}}]}
    text = render.verdict(goal, r)
    assert text.startswith("**met where measured** (linear at 1024 1.1)"), text
    assert "not measured: every policy at 256; " in text and "hybrid" in text.split("at 256; ")[1], text
    every = {"rows": [{"N": n, "speedup": {"original": 1.0, **{v: 1.0 for v in render.E2E_POLICIES}}}
                      for n in (256, 1024)]}
    assert render.verdict(goal, every).startswith("**met** (") and "not measured" not in render.verdict(goal, every)


def test_headline_commits_say_dirty_and_not_recorded(render):
    sha = "0123456789abcdef0123456789abcdef01234567"
    assert render.commit_text({"commit": sha, "dirty": False}) == "commit `0123456`"
    assert render.commit_text({"commit": sha, "dirty": True}) == "commit `0123456` + uncommitted changes"
    assert render.commit_text({"commit": sha, "commit_note": "the run did not record"}).startswith("commit not recorded")
    block = render.headline_block(render.current_results())
    for machine_results in render.current_results().values():
        for r in machine_results.values():
            m = r["meta"]
            if m.get("dirty") and not m.get("commit_note"):
                assert f"`{m['commit'][:7]}` + uncommitted changes" in block or m["benchmark"] not in {
                    h.benchmark for h in render.HEADLINES}


def test_every_current_result_has_its_own_renderer(render):
    """No benchmark falls back to a settings-only table: each shows its measurements."""
    assert set(render.current_results()) <= set(render.RENDERERS)
    assert "while 1" not in render.results_block(render.current_results())  # compile_under_load's busy loop code


# ---------------------------------------------------------------- the compatibility matrix


def test_every_gap_has_a_reason_and_every_check_a_test(render):
    assert render.compat_problems() == []


def test_the_matrix_check_catches_a_gap_without_reason_and_a_test_that_does_not_exist(render, monkeypatch, tmp_path):
    tests = yaml.safe_load(render.COMPAT_TESTS.read_text())
    gaps = yaml.safe_load(render.COMPAT_GAPS.read_text())
    del tests["ssm"]["threads"]  # a cell that loses its test is a gap, here without a reason
    tests["window"]["generate"] = ["tests/compile/test_decode_consistency.py::test_that_does_not_exist"]
    tests["exact"]["triton"] = ["tests/triton/test_triton_kernels.py::test_kernel_matches_dense_oracle"]  # no kernels
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(tests))
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(gaps))
    monkeypatch.setattr(render, "COMPAT_TESTS", tmp_path / "t.yaml")
    monkeypatch.setattr(render, "COMPAT_GAPS", tmp_path / "g.yaml")
    problems = "\n".join(render.compat_problems())
    assert "ssm × threads: a gap with no reason" in problems
    assert "test_that_does_not_exist: no such test function" in problems
    assert "exact × triton: docs/compat_tests.yaml lists tests, yet the forms registry says" in problems


# ---------------------------------------------------------------- results, environment, benchmarks README


def test_every_current_result_says_command_commit_date_and_fingerprint():
    files = sorted(RESULTS.glob("*/*.json"))
    assert len(files) >= 8
    for path in files:
        meta = json.loads(path.read_text())["meta"]
        where = path.relative_to(ROOT)
        assert meta["benchmark"] == path.parent.name and meta["machine"] == path.stem, where
        assert meta["command"].startswith(("python benchmarks/", "torchrun ")), where
        assert re.fullmatch(r"[0-9a-f]{40}", meta["commit"] or ""), where
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["date"]), where
        fp = meta["fingerprint"]
        assert (isinstance(fp, dict) and fp.get("sgemm_512_gflops")) or "not recorded" in meta["fingerprint_note"], where


def test_no_run_numbered_result_files():
    named = [p.relative_to(ROOT) for p in RESULTS.rglob("*") if re.search(r"_run\d", p.name)]
    assert not named, f"run-numbered result files: {named}; one current file per benchmark and machine"


def test_the_environment_page_lists_every_variable_the_code_reads():
    code = [*(ROOT / "attnopt").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    read = {m for p in code for m in re.findall(r"[\"'](ATTNOPT_[A-Z_]+)[\"']", p.read_text(encoding="utf-8"))}
    page = (DOCS / "reference" / "environment.md").read_text()
    listed = set(re.findall(r"^\| `(ATTNOPT_[A-Z_]+)` \|", page, flags=re.M))
    assert read and read == listed, f"in the code, not on the page: {read - listed}; on the page only: {listed - read}"


def test_benchmarks_readme_covers_every_script():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    missing = [p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in text]
    assert not missing, f"benchmarks/README.md does not cover {missing}"
