"""The I/O contract of an attnopt decode graph, as stored in model.onnx's metadata_props["attnopt.decode"].

Inputs: input_ids int64 [batch, T]; attention_mask int64 [batch, past + T] (1 = real token, the
transformers convention; left padding allowed); position_ids int64 [batch, T]; one past input per
state tensor. Outputs: logits [batch, T, vocab]; one present output per state, fed back as the
next call's past. Metadata: {"states": [{"past", "present", "dtype", "shape", "init": "zeros",
"site", "form"}, ...], "eos_token_id", "pad_token_id", ...}; a shape entry is an int, "batch", or
"past_sequence" (the state grows with the context and starts at size 0: exact and reuse K/V only).
A runtime that knows only this generates: zeros for every initial state, then each present fed
back as past.

Informative only (a runtime needs none of it): a packed state (past_key_values.N.recurrent_state
[batch, 1, 1, R] float32 / conv_state [batch, 1, C] int64, the one pair per layer that
onnxruntime-genai feeds) lists the site's own states it holds under "packs" ({"state", "shape",
"offset"} each, flattened per row in that order, zeros after the last); a site whose compiled model
runs exact attention below a dispatch threshold carries "exact_prefix" [batch, Hkv, T, D + Dv].
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

CONTRACT_KEY = "attnopt.decode"
BATCH, PAST = "batch", "past_sequence"


def hf_positions(attention_mask: np.ndarray) -> np.ndarray:
    """position_ids for every column as transformers' generate makes them: cumsum − 1, 0 at pads."""
    mask = np.asarray(attention_mask, dtype=np.int64)
    return np.where(mask == 0, 0, np.cumsum(mask, axis=-1) - 1).astype(np.int64)


@dataclass(frozen=True)
class Contract:
    """The parsed metadata: the state tensors and the token ids the model was exported with."""

    data: dict

    @classmethod
    def from_json(cls, text: str) -> "Contract":
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("states"), list):
            raise ValueError(f"metadata {CONTRACT_KEY!r} has no 'states' list; this file is not an attnopt decode graph")
        return cls(data)

    @property
    def states(self) -> list:
        return list(self.data["states"])

    def initial_state(self, batch: int) -> dict:
        """{past name: zeros} of every state for `batch` rows ("past_sequence" → 0)."""
        out = {}
        for s in self.states:
            shape = [batch if d == BATCH else 0 if d == PAST else int(d) for d in s["shape"]]
            out[s["past"]] = np.zeros(shape, dtype=np.dtype(s["dtype"]))
        return out

    def presents(self) -> dict:
        """{present name: past name}."""
        return {s["present"]: s["past"] for s in self.states}

    def token_id(self, name: str):
        value = self.data.get(name)
        return value[0] if isinstance(value, list) and value else value
