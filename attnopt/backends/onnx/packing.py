"""The packed layout of a decode graph's fixed-size states: each layer's in one recurrent_state /
conv_state pair of one shape, the only fixed-size states onnxruntime-genai feeds.

genai 0.18 drives a decoder by state names: past_key_values.%d.key / value (growing K/V) and, per
fixed-size layer, past_key_values.%d.recurrent_state (rank 4) + conv_state (rank 3), every layer's
pair of the shapes it reads from the first layer's inputs. A layer that carries anything else
(linear+window's linear_state, gla+window's gated_state and gated_keys, the exact prefix of a site
under min_seq_len) or pairs of another shape (a delta layer beside a linear one) gets no input
from genai ("Missing Input"). Such graphs are exported packed: each fixed-size layer's float32
states flattened, concatenated and zero-padded into recurrent_state [B, 1, 1, R], its int64 states
into conv_state [B, 1, C], R and C the most any layer needs. The graph splits them on the way in
and packs its presents on the way out; the step ops see the states they always see.

genai binds each present to the buffer of its past (in place). Every piece split off a past is an
input of that layer's present, so the past is read in full before the present is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnopt.forms.common.graph import BATCH, StateSpec

FLOAT, INT = torch.float32, torch.int64
RECURRENT, CONV = "recurrent_state", "conv_state"


def _numel(spec: StateSpec) -> int:
    n = 1
    for d in spec.shape[1:]:
        n *= int(d)
    return n


def packable(plan) -> bool:
    """Whether a layer's states can live in the pair: all fixed-size, float32 or int64."""
    return bool(plan.states) and all(not s.grows and s.dtype in (FLOAT, INT) for s in plan.states)


@dataclass(frozen=True)
class Packing:
    """R float32 and C int64 elements per row for every packed layer."""

    floats: int
    ints: int

    @classmethod
    def of(cls, layers: list) -> "Packing":
        held = [p for p in layers if packable(p)]
        floats = max((sum(_numel(s) for s in p.states if s.dtype == FLOAT) for p in held), default=0)
        ints = max((sum(_numel(s) for s in p.states if s.dtype == INT) for p in held), default=0)
        return cls(max(1, floats), max(1, ints))  # genai wants every dim but the batch positive

    def specs(self) -> list:
        return [StateSpec(RECURRENT, FLOAT, (BATCH, 1, 1, self.floats)), StateSpec(CONV, INT, (BATCH, 1, self.ints))]

    def describe(self, plan) -> dict:
        """{pair name: [{"state", "shape", "offset"}, ...]}: where each of a layer's states lies (the contract)."""
        out = {RECURRENT: [], CONV: []}
        offsets = {FLOAT: 0, INT: 0}
        for s in plan.states:
            pair = RECURRENT if s.dtype == FLOAT else CONV
            out[pair].append({"state": s.name, "shape": list(s.shape), "offset": offsets[s.dtype]})
            offsets[s.dtype] += _numel(s)
        return out

    def unpack(self, plan, recurrent: Tensor, conv: Tensor) -> list:
        """The layer's states from its pair, in its own order."""
        B = recurrent.shape[0]
        pieces = {}
        for dtype, packed, total in ((FLOAT, recurrent, self.floats), (INT, conv, self.ints)):
            specs = [s for s in plan.states if s.dtype == dtype]
            sizes = [_numel(s) for s in specs]
            parts = torch.split(packed.reshape(B, total), sizes + [total - sum(sizes)], dim=1)
            pieces.update({s.name: p.reshape(B, *[int(d) for d in s.shape[1:]]) for s, p in zip(specs, parts)})
        return [pieces[s.name] for s in plan.states]

    def pack(self, plan, presents: list) -> list:
        """[recurrent_state, conv_state] holding the layer's present states (zeros in the padding)."""
        B = presents[0].shape[0]
        out = []
        for dtype, total, shape in ((FLOAT, self.floats, (1, 1, self.floats)), (INT, self.ints, (1, self.ints))):
            flat = [t.reshape(B, -1).to(dtype) for s, t in zip(plan.states, presents) if s.dtype == dtype]
            used = sum(f.shape[1] for f in flat)
            if used < total:
                flat.append(presents[0].new_zeros(B, total - used, dtype=dtype))
            out.append(torch.cat(flat, dim=1).reshape(B, *shape))
        return out
