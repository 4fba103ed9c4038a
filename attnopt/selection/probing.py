"""What keep:recall measures: retrieval probes built with the model's tokenizer at the compile length
(the capability audit's probes, attnopt.evaluation.probes, with a seed of their own), scored
teacher-forced from one forward, and perplexity on the verification text.

A model that decodes what its forward computes (attnopt's sites do: tests compare them per step)
gets the same answers from `generate()` as from teacher forcing while every answer token is right,
so one forward per row measures what generation would, at a fraction of the cost.

An encoder (a sentence embedder such as MiniLM: no next-token head) is measured on what it is used
for: fact retrieval by mean-pooled embedding (a fact sentence written at a depth of one of several
haystack passages; the query is the fact alone; top-1 is its passage) and the mean cosine of its
pooled embeddings to the original's on those passages, which takes perplexity's place in the budget.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch

from attnopt.analysis.perplexity import is_causal_lm
from attnopt.evaluation.codec import codec_for
from attnopt.evaluation.model_io import LanguageModel
from attnopt.evaluation.probes import Haystacks, build
from attnopt.samples import english_passages

# The audit's probes (multikey left out: needle's format with distractors), at depths that put the
# fact beyond a short window (depth 1 writes it right before the question, which any window reaches).
# One row per (probe, depth): a selection measures many candidate models, and these rows are what
# each one costs.
PROBES = ("passkey", "needle", "mqar", "copy")
DEPTHS = (0.0, 0.3, 0.6)
SEED = 36  # not the audit's default seed 0: the rows selection reads are not the rows it is judged on
TOKENS_PER_FORWARD = 16384


@dataclass(frozen=True)
class Quality:
    """One model's numbers: teacher-forced accuracy of the probe answers (mean over every scored token
    of every row, and per probe), perplexity on the verification text (None: not a causal LM's)."""

    probe: float
    per_probe: dict
    perplexity: Optional[float] = None
    cosine: Optional[float] = None  # an encoder's: mean cosine of its pooled embeddings to the original's

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Quality":
        return cls(float(d["probe"]), dict(d["per_probe"]), d.get("perplexity"), d.get("cosine"))


@dataclass
class ProbeSet:
    """The probe rows every candidate is measured on, and the text whose perplexity it keeps."""

    length: int
    rows: list  # evaluation.probes.Sample
    text: list  # [ids [1, N]] of the verification text, unpadded rows
    codec: str
    probes: tuple = PROBES
    depths: tuple = DEPTHS
    seed: int = SEED
    repeat_row: list = field(default_factory=list)  # a random span written twice: the induction signal

    def describe(self) -> dict:
        return {"length": self.length, "rows": len(self.rows), "probes": list(self.probes),
                "depths": list(self.depths), "seed": self.seed, "tokenizer": self.codec,
                "text_tokens": sum(int(t.shape[1]) for t in self.text)}


def probe_set(model, tokenizer, length: int, text_batches: Sequence[torch.Tensor], probes: Sequence[str] = PROBES,
              depths: Sequence[float] = DEPTHS, seed: int = SEED):
    """Rows of `length` tokens for every (probe, depth), built with `tokenizer` (None: UTF-8 bytes for a
    byte-level model); ValueError naming the fix when the tokenizer does not fit the model or the
    length is too short for a probe. An encoder gets an EncoderProbeSet."""
    if not generates(model):
        return encoder_probe_set(model, tokenizer, length, depths, seed)
    lm = LanguageModel(model, type(model).__name__)
    codec = codec_for(tokenizer, lm.vocab())
    hay = Haystacks(codec, "\n\n".join(english_passages()))
    rows = [build(p, codec, hay, length, d, 0, seed) for p in probes for d in depths]
    rng = random.Random(f"attnopt-keep-recall/{seed}/{length}")
    span = [rng.choice(hay.alnum) for _ in range(length // 2)]  # real tokens in random order, then again
    repeat = list(codec.prefix) + span + span
    return ProbeSet(length, rows, list(text_batches), codec.name, tuple(probes), tuple(depths), seed,
                    repeat[:length])


def teacher_forced(lm: LanguageModel, rows: list) -> list:
    """Per row, the answer tokens whose argmax under one forward is the gold token (a bool tensor)."""
    out = []
    length = rows[0].length
    per = max(1, TOKENS_PER_FORWARD // length)
    for i in range(0, len(rows), per):
        batch = rows[i:i + per]
        first = min(s.scored[0][0] for s in batch)
        keep = length - first + 1
        ids = torch.tensor([s.ids for s in batch], dtype=torch.long)
        pred = lm.logits(ids, keep).argmax(-1).cpu()  # pred[:, j] predicts token length - keep + j + 1
        for r, s in enumerate(batch):
            idx = torch.cat([torch.arange(a, b) for a, b in s.scored])
            out.append(pred[r, idx - 1 - (length - keep)] == ids[r, idx])
    return out


def text_perplexity(lm: LanguageModel, text: list) -> Optional[float]:
    """exp(mean next-token NLL) over the verification text rows (None when there is none)."""
    total, count = 0.0, 0
    for ids in text:
        if ids.shape[1] < 2:
            continue
        logits = lm.logits(ids, ids.shape[1])[:, :-1]
        flat = logits.reshape(-1, logits.shape[-1]).double()
        nll = torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1).to(flat.device), reduction="sum")
        total += float(nll)
        count += ids[:, 1:].numel()
    return math.exp(total / count) if count else None


def measure(model, probes) -> Quality:
    """The model's probe accuracy and perplexity on `probes` (no grad, one forward per batch of rows)."""
    if isinstance(probes, EncoderProbeSet):
        return measure_encoder(model, probes)
    lm = LanguageModel(model, type(model).__name__)
    hits = teacher_forced(lm, probes.rows)
    per: dict = {}
    for s, h in zip(probes.rows, hits):
        per.setdefault(s.probe, []).append(h)
    per_probe = {p: float(torch.cat(h).float().mean()) for p, h in per.items()}
    every = torch.cat(hits).float()
    return Quality(float(every.mean()), per_probe, text_perplexity(lm, probes.text))


def text_rows(batches: Sequence[Any]) -> list:
    """The unpadded rows of input_ids among `batches` ((args, kwargs) pairs), each [1, N]."""
    rows = []
    for args, kwargs in batches:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            continue
        mask = kwargs.get("attention_mask")
        for r in range(ids.shape[0]):
            if isinstance(mask, torch.Tensor) and mask.shape == ids.shape and not bool(mask[r].bool().all()):
                real = ids[r][mask[r].bool()]
                rows.append(real[None])
            else:
                rows.append(ids[r:r + 1])
    return rows


def compile_length(batches: Sequence[Any], limit: Optional[int]) -> Optional[int]:
    """The longest token length among the verification batches, within the model's position limit."""
    lengths = [int(t.shape[1]) for t in text_rows(batches)]
    if not lengths:
        return None
    n = max(lengths)
    return min(n, limit) if limit else n


# ---------------------------------------------------------------- encoders

FACTS = 12  # passages per depth: a query's top-1 is one of these
WORD_OF = ("lantern", "harbor", "violin", "meadow", "compass", "glacier", "orchard", "saddle", "beacon", "pepper",
           "canyon", "falcon", "thimble", "marble", "quarry", "ribbon", "tunnel", "walnut")


def generates(model) -> bool:
    """Whether `model` is a causal LM (a next-token head, generate()): else it is measured as an encoder."""
    if is_causal_lm(model):
        return True
    can = getattr(model, "can_generate", None)
    return bool(callable(can) and can())


@dataclass
class EncoderProbeSet:
    """Per depth, FACTS passages of `length` tokens each holding one fact sentence, the facts alone as
    queries, and the original's pooled embeddings of the passages (what the cosine compares with)."""

    length: int
    passages: dict  # tokenizer output of every passage (depth-major, FACTS per depth)
    queries: dict  # tokenizer output of every fact sentence, same order
    depths: tuple
    reference: Optional[torch.Tensor] = None  # the original's pooled passage embeddings
    codec: str = ""
    seed: int = SEED
    probes: tuple = ("fact retrieval",)
    rows: list = field(default_factory=list)
    repeat_row: list = field(default_factory=list)
    text: list = field(default_factory=list)

    def describe(self) -> dict:
        return {"length": self.length, "rows": int(self.passages["input_ids"].shape[0]), "probes": list(self.probes),
                "depths": list(self.depths), "seed": self.seed, "tokenizer": self.codec, "text_tokens": 0}


def encoder_probe_set(model, tokenizer, length: int, depths: Sequence[float], seed: int) -> EncoderProbeSet:
    if tokenizer is None or not callable(tokenizer):
        raise ValueError(f"{type(model).__name__} is not a causal LM, so keep:recall measures fact retrieval by its "
                         "embeddings, built from text with its tokenizer: pass compile(..., tokenizer=...)")
    rng = random.Random(f"attnopt-keep-recall-encoder/{seed}/{length}")
    words = " ".join(english_passages()).split()
    passages, queries = [], []
    for depth in depths:
        for i in range(FACTS):
            fact = f"The number for {WORD_OF[i]} is {rng.randrange(10 ** 6, 10 ** 7)}."
            start = rng.randrange(len(words))
            filler = (words[start:] + words)[: 2 * length]  # more words than tokens: truncation cuts the tail
            at = max(0, int(depth * length * 0.6))  # a word count roughly at that token depth
            passages.append(" ".join(filler[:at] + [fact] + filler[at:]))
            queries.append(fact)
    enc = tokenizer(passages, truncation=True, max_length=length, padding="max_length", return_tensors="pt")
    q = tokenizer(queries, truncation=True, max_length=length, padding=True, return_tensors="pt")
    probes = EncoderProbeSet(length, dict(enc), dict(q), tuple(depths),
                             codec=getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__, seed=seed)
    probes.reference = pooled(model, probes.passages)
    return probes


def pooled(model, enc: dict) -> torch.Tensor:
    """Mean-pooled last hidden states over the real tokens (sentence-transformers' pooling), [R, C]."""
    with torch.no_grad():
        out = model(**enc)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None and isinstance(out, dict):
        hidden = out.get("last_hidden_state")
    if hidden is None and isinstance(out, (tuple, list)):
        hidden = out[0]
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError(f"{type(model).__name__} returns no hidden states [batch, tokens, channels] to pool; keep:recall "
                         "measures an encoder by its pooled embeddings")
    w = enc["attention_mask"].to(hidden.dtype)[..., None]
    return (hidden * w).sum(1) / w.sum(1).clamp_min(1)


def measure_encoder(model, probes: EncoderProbeSet) -> Quality:
    """Top-1 fact retrieval per depth (query embedding against the FACTS passages of its depth) and the mean
    cosine of the passage embeddings to the original's."""
    passages = torch.nn.functional.normalize(pooled(model, probes.passages).double(), dim=-1)
    queries = torch.nn.functional.normalize(pooled(model, probes.queries).double(), dim=-1)
    per = {}
    for d, depth in enumerate(probes.depths):
        rows = slice(d * FACTS, (d + 1) * FACTS)
        best = (queries[rows] @ passages[rows].T).argmax(-1)
        per[f"depth {depth:g}"] = float((best == torch.arange(FACTS)).double().mean())
    ref = torch.nn.functional.normalize(probes.reference.double(), dim=-1)
    cosine = float((passages * ref).sum(-1).mean())
    return Quality(sum(per.values()) / len(per), per, None, cosine)
