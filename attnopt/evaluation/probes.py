"""Retrieval probes: a fact written at a depth of a haystack, asked for at the end.

Five probes, each over a length × depth grid, sample i of cell (probe, length, depth) drawn from its own
seeded generator, so a cell's samples do not depend on which other cells run:

    passkey   a 10-digit vault code in repetitive filler, asked for at the end (S-NIAH-1)
    needle    a word -> 7-digit number fact written into real text (S-NIAH-2)
    multikey  the same with three more word -> number facts as distractors (MK-NIAH)
    mqar      a directory of 6 key -> value pairs; 3 of them asked again at the end (multi-query recall)
    copy      a random 24-token span; its first 4 tokens are repeated at the end, the rest must follow

Each sample is exactly `length` tokens: prompt, then the answer that greedy decoding must produce. The
wording, fillers and key lengths are this module's own, not the ones recall_lm was trained on
(benchmarks/train_recall_lm.py), so the audit is not its training distribution. Depth 0 writes the fact
at the start of the haystack, depth 1 right before the question.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Optional, Sequence

PROBES = ("passkey", "needle", "multikey", "mqar", "copy")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MIN_HAYSTACK = 16  # tokens of haystack a sample needs besides its facts and question
SNAP = 24  # how far (tokens) a fact may move to start at a word

PASSKEY_FILLER = "The hall was quiet and the lamps burned low. A cart rolled past the gate and was gone. "
WORDS = ("lantern", "harbor", "violin", "meadow", "compass", "glacier", "orchard", "saddle", "beacon", "pepper",
         "canyon", "falcon", "thimble", "marble", "quarry", "ribbon", "tunnel", "walnut", "anchor", "blanket",
         "cactus", "dolphin", "ember", "feather", "garnet", "hammock", "igloo", "jasmine", "kettle", "ladder")
COPY_ALPHABET = string.ascii_letters + string.digits
SPAN, CUE = 24, 4  # copy: span tokens, of which the first CUE are repeated as the cue
PAIRS, QUERIES = 6, 3  # mqar: pairs listed, pairs asked again


@dataclass(frozen=True)
class Sample:
    """One probe row: `ids` (exactly `length` tokens) = prompt + answer."""

    probe: str
    length: int
    depth: float
    ids: tuple
    answer_start: int  # ids[answer_start:] is what greedy decoding must produce
    scored: tuple  # [start, end) token spans scored teacher-forced; the last one is the answer
    answer_text: str

    @property
    def prompt(self) -> list:
        return list(self.ids[: self.answer_start])

    @property
    def answer(self) -> list:
        return list(self.ids[self.answer_start :])


@dataclass
class Layout:
    """What a probe writes: the fact at the depth, distractors elsewhere, and the tail after the haystack
    as (text or ids, scored) pieces whose last piece is the answer."""

    haystack: str  # "filler" or "text"
    fact: list
    tail: list
    distractors: list = field(default_factory=list)


class Haystacks:
    """The token ids haystacks are cut from: the real text (cycled when short) and the passkey filler."""

    def __init__(self, codec, text: str):
        self.codec = codec
        self.text = codec.encode(text.strip() + "\n\n")
        if len(self.text) < MIN_HAYSTACK:
            raise ValueError(f"the haystack text is {len(self.text)} tokens; give at least {MIN_HAYSTACK}")
        self.filler = codec.encode(PASSKEY_FILLER)
        # copy's span tokens when the codec is not bytes: text tokens that decode to letters and digits only
        self.alnum = sorted({t for t in self.text if codec.decode([t]).strip().isalnum()}) or sorted(set(self.text))

    def cut(self, kind: str, n: int, rng: random.Random) -> list:
        """`n` tokens of the filler or the text (from a seeded place), starting and ending at a word."""
        source = self.filler if kind == "filler" else self.text
        start = 0 if kind == "filler" else rng.randrange(len(source))
        reps = (start + n + 3 * SNAP) // len(source) + 2
        run = (source * reps)[start : start + n + 3 * SNAP]
        # Start at a word and end at one (a fact at depth 1 and the question follow), both where the
        # source allows: a filler cut off mid-word glued the fact to it ("...the lampNote this down").
        ends = [j for j in range(1, 2 * SNAP) if self.codec.starts_word(run, j + n)]
        shift = next((j for j in ends if self.codec.starts_word(run, j)), ends[0] if ends else 0)
        return run[shift : shift + n]


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(n))


def _fact(word: str, value: str) -> str:
    return f'The number for "{word}" is {value}. '


def _ask(word: str) -> str:
    return f'\nWhat is the number for "{word}"? The number for "{word}" is'


def passkey(rng: random.Random, hay: Haystacks) -> Layout:
    key = _digits(rng, 10)
    return Layout("filler", [f"Note this down: the vault code is {key}. "],
                  [("\nWhich vault code was noted? The vault code is", False), (f" {key}", True)])


def needle(rng: random.Random, hay: Haystacks) -> Layout:
    word, value = rng.choice(WORDS), _digits(rng, 7)
    return Layout("text", [_fact(word, value)], [(_ask(word), False), (f" {value}", True)])


def multikey(rng: random.Random, hay: Haystacks) -> Layout:
    words = rng.sample(WORDS, 4)
    values = [_digits(rng, 7) for _ in words]
    return Layout("text", [_fact(words[0], values[0])], [(_ask(words[0]), False), (f" {values[0]}", True)],
                  distractors=[[_fact(w, v)] for w, v in zip(words[1:], values[1:])])


def mqar(rng: random.Random, hay: Haystacks) -> Layout:
    keys = set()
    while len(keys) < PAIRS:
        keys.add("".join(rng.choice(string.ascii_lowercase) for _ in range(4)))
    pairs = [(k, _digits(rng, 4)) for k in sorted(keys)]
    rng.shuffle(pairs)
    listing = "Directory: " + " ".join(f"{k} gets {v};" for k, v in pairs) + " "
    tail: list = [("\nAgain:", False)]
    for i, (k, v) in enumerate(rng.sample(pairs, QUERIES)):
        tail += [(f" {k} gets", False), (f" {v}", True)] + ([(";", False)] if i < QUERIES - 1 else [])
    return Layout("text", [listing], tail)


def copy(rng: random.Random, hay: Haystacks) -> Layout:
    if hay.codec.byte_level:
        span = hay.codec.encode("".join(rng.choice(COPY_ALPHABET) for _ in range(SPAN)))
    else:
        span = [rng.choice(hay.alnum) for _ in range(SPAN)]
    return Layout("text", [span, " "], [("\n", False), (span[:CUE], False), (span[CUE:], True)])


BUILDERS = {"passkey": passkey, "needle": needle, "multikey": multikey, "mqar": mqar, "copy": copy}


def chance(probe: str, codec) -> Optional[float]:
    """Per-token teacher-forced accuracy of a uniform guess among the answer's characters (byte codecs
    only: a subword tokenizer has no such alphabet)."""
    if not codec.byte_level:
        return None
    return 1 / len(COPY_ALPHABET) if probe == "copy" else 1 / 10


def _ids(codec, piece) -> list:
    return codec.encode(piece) if isinstance(piece, str) else list(piece)


def _pieces(codec, parts: Sequence) -> list:
    return [t for p in parts for t in _ids(codec, p)]


def _snap(codec, hay: list, at: int) -> int:
    """The word start nearest `at` (within SNAP tokens), so a fact is not written inside a word."""
    for step in range(SNAP + 1):
        for i in (at - step, at + step):
            if 0 <= i <= len(hay) and (i == len(hay) or codec.starts_word(hay, i)):
                return i
    return at


def build(probe: str, codec, hay: Haystacks, length: int, depth: float, index: int, seed: int = 0) -> Sample:
    """Sample `index` of cell (probe, length, depth): exactly `length` tokens, seeded by all five."""
    rng = random.Random(f"attnopt-eval/{seed}/{probe}/{length}/{depth:.6g}/{index}")
    layout = BUILDERS[probe](rng, hay)
    fact = _pieces(codec, layout.fact)
    distractors = [_pieces(codec, d) for d in layout.distractors]
    tail, scored_pieces = [], []
    for piece, is_scored in layout.tail:
        ids = _ids(codec, piece)
        if is_scored:
            # Whitespace tokens in front of a value (a byte model's " ") are prompt, not answer: every
            # model predicts them.
            while len(ids) > 1 and not codec.decode(ids[:1]).strip():
                tail.append(ids.pop(0))
            scored_pieces.append((len(tail), len(tail) + len(ids)))
        tail += ids
    prefix = list(codec.prefix)
    n_hay = length - len(prefix) - len(fact) - sum(map(len, distractors)) - len(tail)
    if n_hay < MIN_HAYSTACK:
        raise ValueError(f"length {length} is too short for probe {probe!r}: it needs at least "
                         f"{length - n_hay + MIN_HAYSTACK} tokens with this tokenizer; give longer lengths")
    stack = hay.cut(layout.haystack, n_hay, rng)
    places = [(_snap(codec, stack, round(depth * n_hay)), 0, fact)]
    places += [(_snap(codec, stack, rng.randint(0, n_hay)), 1, d) for d in distractors]
    ids, last = list(prefix), 0
    for at, _, piece in sorted(places, key=lambda p: (p[0], p[1])):
        ids += stack[last:at] + piece
        last = at
    ids += stack[last:]
    start = len(ids)
    ids += tail
    assert len(ids) == length, (probe, len(ids), length)
    scored = tuple((start + a, start + b) for a, b in scored_pieces)
    answer_start = scored[-1][0]
    if scored[-1][1] != length:
        raise AssertionError(f"probe {probe!r}: the answer must end the sample")
    return Sample(probe, length, depth, tuple(ids), answer_start, scored, codec.decode(ids[answer_start:]))


def grid(probes: Sequence[str], lengths: Sequence[int], depths: Sequence[float], samples: int, codec,
         hay: Haystacks, seed: int = 0) -> dict:
    """{(probe, length): [Sample, ...]} for every cell, depth-major, `samples` per cell."""
    return {(p, n): [build(p, codec, hay, n, d, i, seed) for d in depths for i in range(samples)]
            for p in probes for n in lengths}
