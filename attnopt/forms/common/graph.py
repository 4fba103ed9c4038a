"""What a site carries through an exported decode graph: named state tensors in, the same names out.

A decode graph (`attnopt.backends.onnx.decode`) runs every attention site of a causal LM as one
step op: the new tokens' q [B, H, T, D], k/v [B, Hkv, T, ·], the attention mask over every column
so far [B, P + T] (bool, True = real token; P columns came before this call) and the site's past
state tensors go in; its output [B, H, T, Dv] and the present state tensors come out, to be fed
back as the next call's past. One call may bring any T ≥ 1 tokens after any P ≥ 0 (a prefill, a
chunk of one, a decoding step): the outputs are exactly those of `SiteModule.decode` on the same
tokens.

Each form says how in its folder's `step.py`:

    STEP = GraphStep(states=lambda site: [StateSpec(...), ...], call=lambda site, q, k, v, mask, pasts: ...)

where `site` is a `StepSite` (the site module, or None for a site the model runs as written, plus
its geometry) and `call` invokes the form's `attnopt::<form>_step` op, whose ONNX lowering is the
folder's `onnx.py` DECODE_LOWERING. Every initial state is zeros; a state shape entry is an int,
"batch", or "past_sequence" (grows with the context, from 0: only softmax K/V caches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor, nn

BATCH = "batch"
PAST = "past_sequence"

Dim = Union[int, str]


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a site: its name inside the site ("key", "recurrent_state", ...), dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple

    @property
    def grows(self) -> bool:
        return PAST in self.shape

    def zeros(self, batch: int, past: int = 0, device=None) -> Tensor:
        """The initial state (past = 0), or a zero state of `past` columns (export examples)."""
        return torch.zeros([batch if d == BATCH else past if d == PAST else int(d) for d in self.shape],
                           dtype=self.dtype, device=device)

    def row_bytes(self, context: int) -> int:
        """Bytes one batch row holds at `context` tokens."""
        n = 1
        for d in self.shape:
            n *= 1 if d == BATCH else context if d == PAST else int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StepGeometry:
    """The shapes of one site's call as the model makes it (read from q, k, v), and its scale."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    dtype: torch.dtype = torch.float32  # the model's: softmax K/V caches keep it, fixed states accumulate in fp32


@dataclass(frozen=True)
class StepSite:
    """A site as a decode graph sees it: its module (None when the model runs its own attention) and
    geometry; `window` is the model's own sliding window of an exact site (None: full attention);
    `anchor`: a reuse site reads this one's q and keys (present keys = its first present state)."""

    module: Optional[nn.Module]
    geometry: StepGeometry
    window: Optional[int] = None
    anchor: bool = False  # a reuse site reads this site's q and keys: its states start with its own keys


@dataclass(frozen=True)
class GraphStep:
    """A form's decode step in a graph: its state tensors and the call of its op."""

    states: Callable[[StepSite], list]
    call: Callable[..., tuple]  # (site, q, k, v, mask, pasts) -> (out, presents)
    why_not: Optional[Callable[[StepSite], Optional[str]]] = None  # why this site cannot run in a graph
    # The call also takes anchor=(the anchor's new queries, its present keys) and x=(the layer input of
    # the new tokens): reuse, which reads an earlier exact site's q and every key it has cached.
    needs_anchor: bool = False


def new_keep(mask: Tensor, T: int) -> Tensor:
    """Bool [B, T]: which of the call's new tokens are real (the mask's last T columns). Taken from the
    flipped mask's first T, so a traced call puts no guard on the past length (a slice starting at
    total − T makes torch.export require past ≥ 1)."""
    return mask.flip(1)[:, :T].flip(1).bool()


def add_real_tokens(count: Tensor, keep_BT: Tensor) -> Tensor:
    """The per-row count state [B, 1, 1] (int64) advanced by this call's real tokens."""
    return count + keep_BT.long().sum(-1).view(-1, 1, 1)


def count_spec() -> StateSpec:
    """The real-token count every fixed-size state carries beside it ([B, 1, 1] int64: onnxruntime-genai's
    fixed-state layers pair each rank-4 recurrent tensor with a rank-3 one, and this is that one)."""
    return StateSpec("conv_state", torch.int64, (BATCH, 1, 1))


def recurrent_states(heads: int, M: int, W: int) -> list:
    """The states of a linear-state form: recurrent_state [B, heads, M, W] float32 (its S, with the
    normaliser z as one more column when it has one: kernels.normaliser) and the real-token count."""
    return [StateSpec("recurrent_state", torch.float32, (BATCH, heads, M, W)), count_spec()]


def per_kv_head(state_BHX: Tensor, kv_heads: int) -> Tensor:
    """A state kept per query head whose heads repeat within each group -> one per kv head."""
    H = state_BHX.shape[1]
    return state_BHX if H == kv_heads else state_BHX[:, :: H // kv_heads]


def per_query_head(state_BhX: Tensor, heads: int) -> Tensor:
    h = state_BhX.shape[1]
    return state_BhX if h == heads else state_BhX.repeat_interleave(heads // h, dim=1)

