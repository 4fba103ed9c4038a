"""Score a model on probe samples: exact match of greedy `generate()` (the decode path, from the model's
cache) and teacher-forced token accuracy from one full forward (the prefill path), over every answer
token and over the first alone: a model that copies a fact once started but misses where it starts has
a high token accuracy and a low first-token one, and fails exact match.

Where both run, a row whose generated answer differs from the full forward's greedy answer (token for
token) is a decode disagreement: greedy decoding equals the forward's argmax along the gold answer as
long as every token is right, so the two can only differ when the decode state computes something the
full forward does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnopt.evaluation.perplexity import TOKEN_BUDGET

SLACK = 2  # extra tokens generated for subword tokenizers (the answer may come out in more pieces)


@dataclass
class RowScore:
    teacher_forced: float  # share of scored tokens whose argmax is the gold token
    first_token: float  # share of scored spans whose first token's argmax is right: the fact was found
    forward_exact: bool  # every answer token right under the full forward
    generated_exact: bool  # generate() produced the answer (forward_exact when there is no generate())
    generated_tokens_exact: bool  # generate()'s tokens equal the answer's (the disagreement check)


def _teacher_forced(lm, batch: list) -> list:
    length = batch[0].length
    first = min(s.scored[0][0] for s in batch)
    keep = length - first + 1
    ids = torch.tensor([s.ids for s in batch], dtype=torch.long)
    pred = lm.logits(ids, keep).argmax(-1).cpu()  # pred[:, j] predicts token length - keep + j + 1
    out = []
    for row, s in enumerate(batch):
        hits = []
        for a, b in s.scored:
            idx = torch.arange(a, b)
            hits.append(pred[row, idx - 1 - (length - keep)] == ids[row, idx])
        found = sum(bool(h[0]) for h in hits) / len(hits)
        out.append((float(torch.cat(hits).float().mean()), found, bool(hits[-1].all())))
    return out


def _generated(lm, batch: list, codec) -> list:
    slack = 0 if codec.byte_level else SLACK
    new = max(len(s.answer) for s in batch) + slack
    gens = lm.greedy([s.prompt for s in batch], new, codec.pad_id)
    out = []
    for s, gen in zip(batch, gens):
        tokens = gen[: len(s.answer)] == s.answer
        text = tokens if codec.byte_level else codec.decode(gen).lstrip().startswith(s.answer_text.lstrip())
        out.append((text, tokens))
    return out


def batches(samples: list, length: int) -> list:
    per = max(1, TOKEN_BUDGET // length)
    return [samples[i : i + per] for i in range(0, len(samples), per)]


def score_rows(lm, samples: list, codec, tick) -> list:
    """RowScore for each sample (all of one length), in order; `tick(what)` after each model call."""
    out = []
    for batch in batches(samples, samples[0].length):
        forward = _teacher_forced(lm, batch)
        tick("forward")
        if lm.generates:
            generated = _generated(lm, batch, codec)
            tick("generate")
        else:
            generated = [(exact, exact) for *_, exact in forward]
        out += [RowScore(tf, ft, fx, gx, gt) for (tf, ft, fx), (gx, gt) in zip(forward, generated)]
    return out


def calls(n_samples: int, length: int, generates: bool) -> int:
    """How many model calls score_rows makes (for the progress total)."""
    return len(batches(list(range(n_samples)), length)) * (2 if generates else 1)
