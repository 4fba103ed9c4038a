"""Perplexity by position: the overall number is the one tiny_lm's training run recorded on its held-out
text, and the buckets split exactly the predicted tokens."""

import json
from pathlib import Path

import pytest

from attnopt.evaluation.model_io import LanguageModel
from attnopt.evaluation.perplexity import bucket_edges, perplexity, windows_of

TINY = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "tiny_lm"


def test_bucket_edges_double_from_32_to_the_window():
    assert bucket_edges(256) == [1, 32, 64, 128, 256]
    assert bucket_edges(2048) == [1, 32, 64, 128, 256, 512, 1024, 2048]
    assert bucket_edges(20) == [1, 20]


def test_windows_are_whole_and_capped():
    assert windows_of(list(range(10)), 4, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert windows_of(list(range(10)), 4, 1) == [[0, 1, 2, 3]]
    assert windows_of(list(range(3)), 4, 8) == [[0, 1, 2]]  # shorter than a window: one short window
    assert windows_of([7], 4, 8) == []


def test_tiny_lm_held_out_perplexity_is_what_its_training_recorded():
    """Oracle: benchmarks/train_tiny_lm.py's own perplexity over the same 42 windows of 256 bytes."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(TINY).eval()
    log = json.loads((TINY / "train_log.json").read_text())
    ids = list((TINY / "heldout.txt").read_text(encoding="utf-8").encode("utf-8"))
    ppl = perplexity(LanguageModel(model, "tiny_lm"), ids, log["seq_len"], "held-out", most=10_000)
    assert ppl.windows == log["held_out_chunks"] == 42
    assert ppl.overall == pytest.approx(log["held_out_perplexity"], rel=1e-5)
    assert [(b["start"], b["end"]) for b in ppl.buckets] == [(1, 32), (32, 64), (64, 128), (128, 256)]
    assert sum(b["tokens"] for b in ppl.buckets) == ppl.tokens == 42 * 255
    assert ppl.buckets[0]["tokens"] == 42 * 31
    # the first bytes of a window have the least context: the highest perplexity
    assert ppl.buckets[0]["perplexity"] > max(b["perplexity"] for b in ppl.buckets[1:])
