"""The audit is honest both ways: recall_lm (trained to retrieve, benchmarks/train_recall_lm.py) scores
far above chance on passkey and copy, teacher-forced, in probe formats it was not trained on, and a
window that cannot reach the fact loses it. Skipped until benchmarks/data/recall_lm exists.

What recall_lm does not do (measured, benchmarks/data/recall_lm/train_log.json and docs/guides/evaluation.md):
the first token of a looked-up answer. Its induction heads copy a key once it has started (teacher-forced
85% on passkey and copy at 2048), but they match one token of context, so greedy generate() rarely gets a
whole passkey right: exact match is near 0 on the lookups and about 30% on copy."""

import json
from pathlib import Path

import pytest

RECALL = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "recall_lm"
pytestmark = pytest.mark.skipif(not (RECALL / "model.safetensors").is_file(),
                                reason="benchmarks/data/recall_lm is not trained yet")


@pytest.fixture(scope="module")
def recall():
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(RECALL).eval()
    return model, transformers.AutoTokenizer.from_pretrained(RECALL)


def test_recall_lm_retrieves_at_short_lengths(recall):
    from attnopt.evaluation import evaluate

    model, tok = recall
    rep = evaluate(model, tokenizer=tok, probes=["passkey", "copy"], lengths=[512], depths=[0.0, 0.5, 1.0], samples=2)
    assert rep.tokenizer.startswith("UTF-8 bytes")
    for probe in ("passkey", "copy"):
        forced = rep.model.probe_mean(probe, which="teacher_forced")
        assert forced >= 0.7 and forced >= 5 * rep.chance[probe], (probe, rep.teacher_forced[probe])
    assert rep.model.decode_disagreements == 0


@pytest.mark.slow
def test_recall_lm_retrieves_at_its_trained_context_and_a_window_does_not(recall):
    import attnopt
    from attnopt.evaluation import evaluate

    model, tok = recall
    seq_len = json.loads((RECALL / "train_log.json").read_text())["seq_len"]
    rep = evaluate(model, tokenizer=tok, probes=["passkey", "copy"], lengths=[seq_len], depths=[0.25, 0.5, 0.75],
                   samples=2)
    for probe in ("passkey", "copy"):
        assert rep.model.probe_mean(probe, which="teacher_forced") >= 0.7, (probe, rep.teacher_forced[probe])
    assert rep.model.probe_mean("copy") > 0.0  # some whole spans come back through generate()
    ids = tok("The river flows past the old mill and on to the sea. " * 8, return_tensors="pt")["input_ids"]
    opt = attnopt.compile(model, "window:64", example_inputs={"input_ids": ids}, tolerance=10, e2e_tolerance=None)
    windowed = evaluate(opt, tokenizer=tok, probes=["copy"], lengths=[seq_len], depths=[0.0, 0.5], samples=2)
    # the span is ~1000+ tokens back: a 64-token window cannot copy it
    assert windowed.retrieval["copy"][seq_len] == {0.0: 0.0, 0.5: 0.0}
    assert windowed.model.probe_mean("copy", which="teacher_forced") <= 0.25
    assert windowed.model.decode_disagreements == 0
