"""The checks a decode folder passes before it is written: greedy steps in ONNX Runtime against torch.

The prompt is the example's first row twice, the second row left-padded (a quarter of it pads).
torch: `generate()` of the compiled model, greedy, GREEDY_STEPS new tokens, with every step's
logits. ONNX Runtime: the graph driven by its contract (attnopt.onnx.Session), the prompt in one
call and again in two chunks, then one call per new token, fed torch's tokens (so a near tie that
flips a token cannot hide a logit error later). Each step's logits must match torch's within
relative RMS PARITY_TOLERANCE. A failure is localised to the first site whose step op, exported
alone, differs from its torch implementation on the same inputs.

Sites under a dispatch threshold (an exact prefix of T slots) are checked across it: the prompt is
stretched to T + 2 tokens and row 1 gets 4 pads, so row 0 passes T inside the prompt and row 1
during the greedy steps (`crossing`), where T + 2 + GREEDY_STEPS fits the context and CROSS_LIMIT.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from attnopt.backends.onnx.checks import rel_rms
from attnopt.ir.errors import ParityError
from attnopt.onnx.generator import Session

GREEDY_STEPS = 8
CROSS_LIMIT = 4096  # the longest prompt the check stretches to cross an exact prefix
CROSS_PADS = 4


@dataclass
class Prompt:
    """Two rows [2, N] (row 1 left-padded) and the pad id; `batch` adds transformers' positions."""

    ids: torch.Tensor
    mask: torch.Tensor
    pad_id: int

    @property
    def batch(self) -> tuple:
        return self.ids, self.mask, (self.mask.cumsum(-1) - 1).clamp(min=0) * self.mask

    def real_tokens(self, row: int) -> list:
        return self.ids[row][self.mask[row].bool()].tolist()


def prompt_of(model, input_ids: torch.Tensor) -> Prompt:
    """The check prompt from the example's input ids (its first row; at least 2 tokens)."""
    row = input_ids[0].long()
    if row.numel() < 2:
        raise ValueError("export_onnx(decode=True) needs an example prompt of at least 2 tokens to check decoding; "
                         "pass example_inputs={'input_ids': ...} with a longer prompt")
    pad_id = getattr(model.config, "pad_token_id", None)
    pad_id = int(pad_id) if isinstance(pad_id, int) else 0
    pads = max(1, row.numel() // 4)
    ids = torch.stack([row, torch.cat([torch.full((pads,), pad_id, dtype=row.dtype), row[pads:]])])
    mask = torch.ones_like(ids)
    mask[1, :pads] = 0
    return Prompt(ids, mask, pad_id)


def crossing(prompt: Prompt, threshold: int, context: Optional[int]) -> Prompt:
    """The check prompt for an exact prefix of `threshold` slots: threshold + 2 tokens (the example's
    row repeated), row 1 with CROSS_PADS pads; the prompt as it is where that does not fit."""
    n = threshold + 2
    if threshold < CROSS_PADS or n > CROSS_LIMIT or (context is not None and n + GREEDY_STEPS > context):
        return prompt
    row = prompt.ids[0]
    row = row.repeat(-(-n // row.numel()))[:n]
    ids = torch.stack([row, torch.cat([torch.full((CROSS_PADS,), prompt.pad_id, dtype=row.dtype), row[CROSS_PADS:]])])
    mask = torch.ones_like(ids)
    mask[1, :CROSS_PADS] = 0
    return Prompt(ids, mask, prompt.pad_id)


def torch_greedy(model, prompt: Prompt, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences [B, N + steps], per-step logits [B, steps, V]) of the compiled model's generate()."""
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, num_beams=1, max_new_tokens=steps, min_new_tokens=None, eos_token_id=None,
                  pad_token_id=prompt.pad_id, temperature=None, top_k=None, top_p=None, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_ids=prompt.ids, attention_mask=prompt.mask, generation_config=config)
    return out.sequences, torch.stack(out.logits, dim=1).float()


def ort_steps(session: Session, prompt: Prompt, tokens: np.ndarray, chunk: Optional[int]) -> np.ndarray:
    """Per-step logits [B, steps, V] of the graph: the prompt (in chunks of `chunk`), then `tokens`."""
    ids, mask = prompt.ids.numpy(), prompt.mask.numpy()
    logits, state = session.prefill(ids, mask, chunk)
    out = [logits]
    for t in range(tokens.shape[1] - 1):
        mask = np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], axis=1)
        step, state = session.run(tokens[:, t:t + 1], mask, mask.sum(1, keepdims=True) - 1, state)
        out.append(step[:, -1])
    return np.stack(out, axis=1)


def greedy_parity(model, path, prompt: Prompt, tolerance: float,
                  on_failure: Callable[[str], str]) -> tuple[list, list]:
    """Figures per run (one call, two chunks) and torch's new tokens per row; ParityError naming the site."""
    sequences, want = torch_greedy(model, prompt, GREEDY_STEPS)
    N = prompt.ids.shape[1]
    tokens = sequences[:, N:].numpy()
    session = Session(path)
    figures = []
    for label, chunk in (("prompt in one call", None), ("prompt in two chunks", -(-N // 2))):
        try:
            got = ort_steps(session, prompt, tokens, chunk)
        except Exception as exc:
            raise ParityError(f"ONNX Runtime cannot run the decode graph ({label}): "
                              f"{str(exc).strip().splitlines()[0]}") from None
        per_step = [rel_rms(got[:, t], want[:, t].numpy()) for t in range(want.shape[1])]
        worst = max(per_step)
        figures.append({"runtime": "onnxruntime-cpu", "check": f"greedy {GREEDY_STEPS} steps, {label}", "batch": 2,
                        "length": N, "rel_rms": worst, "per_step": per_step,
                        "same_tokens": bool((got.argmax(-1) == tokens).all())})
        if not worst <= tolerance:
            step = int(np.argmax(per_step))
            where = on_failure(f"relative RMS {worst:.2e} > {tolerance:g} at step {step} ({label})")
            raise ParityError(f"the decode graph does not match torch generate(): {where}")
    return figures, tokens.tolist()
