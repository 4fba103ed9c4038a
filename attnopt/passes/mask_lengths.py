"""Read a mask the graph builds from positions again at a longer length, where its pattern may differ.

A mask read on the example alone says what it does at that length: a prefix-LM mask (bidirectional
over the first P tokens, causal after) hides nothing on an example shorter than P, and a model's own
sliding window of W looks fully causal on one shorter than W. When the capture keeps the length
symbolic, the graph runs once more on the example tiled to a longer length (position inputs counted
on, not repeated), and every such mask is read there too:
  - the same reading: kept;
  - causal there with a window the example was too short to show: the model's window, adopted;
  - anything else: the pattern depends on the length, so the site's mask is arbitrary (exact).

Letters: N the example's length, L the longer one.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from attnopt.ir.site import MaskInfo
from attnopt.passes.capture import CapturedGraph
from attnopt.passes.mask_proof import StructureOracle, symbolic
from attnopt.passes.mask_reading import read_mask
from attnopt.passes.record import ValueRecorder

# The longer length: at least twice the example's, and far enough to see short prefixes and windows.
MIN_LENGTH = 256


def longer_length(n: int) -> int:
    return max(2 * n + 1, MIN_LENGTH)


def reread_masks(captured: CapturedGraph, checked: list, oracle: StructureOracle, wanted_of) -> tuple[list, dict]:
    """`checked`: [(candidate, CheckResult)]; returns it with masks corrected where the longer
    reading differs, and counts {"reread", "changed", "failed"}. `wanted_of(candidates)`: the node
    names a candidate's check reads."""
    counts = {"reread": 0, "changed": 0, "failed": 0}
    todo = [(i, c, r) for i, (c, r) in enumerate(checked) if _from_positions(c, r.mask, oracle)]
    by_length: dict = {}
    for i, c, r in todo:
        symbol = _length_symbol(c)
        if symbol is not None:
            by_length.setdefault(symbol, []).append((i, c, r))
    out = list(checked)
    for symbol, group in by_length.items():
        n = _example_length(captured, symbol)
        values, L = None, None
        for L in () if n is None else dict.fromkeys((longer_length(n), 2 * n + 1)):
            values = _run_at(captured, symbol, n, L, wanted_of([c for _, c, _ in group]))
            if values is not None:
                break
        if values is None:
            counts["failed"] += len(group)
            continue
        for i, c, r in group:
            counts["reread"] += 1
            try:
                longer = read_mask(c, values, oracle, *_frame(c, values))
            except (RuntimeError, ValueError, IndexError, KeyError):
                longer = None
            mask = _settle(r.mask, longer, n, L)
            if mask != r.mask:
                counts["changed"] += 1
                out[i] = (c, dataclasses.replace(r, mask=mask))
    return out, counts


def _run_at(captured: CapturedGraph, symbol, n: int, L: int, wanted: set) -> Optional[dict]:
    """The wanted nodes' values with the length grown from n to L; None where the model cannot run
    there (a position table shorter than L, say: it then keeps the example's reading)."""
    inputs = _inputs_at(captured, symbol, n, L)
    if inputs is None:
        return None
    try:
        return ValueRecorder(captured.graph_module, wanted, stop_early=True).record(*inputs)
    except Exception:  # noqa: BLE001 - any failure of the user's model at L
        return None


def _frame(c, values: dict) -> tuple:
    """(q shape, k shape) as numeric_check replays them: k untransposed, at q's heads."""
    q, k = values[c.query.name], values[c.key.name]
    nk = k.shape[-1] if c.key_is_transposed else k.shape[-2]
    return tuple(q.shape), tuple(q.shape[:-2]) + (nk, q.shape[-1])


def _settle(example: MaskInfo, longer, n: int, L: int) -> MaskInfo:
    """The site's mask given its readings at N and at L."""
    if not isinstance(longer, MaskInfo):
        return dataclasses.replace(example, arbitrary=True, padding=False,
                                   why=f"its mask could not be read again at {L} tokens")
    if (longer.causal, longer.window, longer.arbitrary) == (example.causal, example.window, example.arbitrary):
        return example
    if example.causal and example.window is None and longer.causal and not longer.arbitrary \
            and longer.window is not None and longer.window >= n:
        return dataclasses.replace(example, window=longer.window)  # the model's own window
    return dataclasses.replace(example, arbitrary=True, padding=False,
                               why=f"its pattern depends on the length: {example.kind} at {n} tokens, "
                                   f"{longer.kind} at {L}")


def _from_positions(c, mask: MaskInfo, oracle: StructureOracle) -> bool:
    """A mask tensor the graph builds (in part) from positions or constants, not yet arbitrary."""
    if mask.arbitrary or mask.node is None or mask.form in ("none", "is_causal"):
        return False
    return oracle.sources(mask.node)[0]


def _length_symbol(c):
    """The symbol of the site's query and key length, when the capture keeps both the same symbol."""
    q = getattr(c.query.meta.get("val"), "shape", None)
    k = getattr(c.key.meta.get("val"), "shape", None)
    if q is None or k is None or len(q) < 2:
        return None
    k_len = k[-1] if c.key_is_transposed else k[-2]
    q_len = q[-2]
    if not (symbolic(q_len) and isinstance(k_len, torch.SymInt)) or q_len.node.expr != k_len.node.expr:
        return None
    return q_len.node.expr


def _example_length(captured: CapturedGraph, symbol) -> Optional[int]:
    for node, value in zip(captured.placeholders(), captured.flat_inputs):
        shape = getattr(node.meta.get("val"), "shape", ())
        for d, size in enumerate(shape):
            if isinstance(size, torch.SymInt) and size.node.expr == symbol and isinstance(value, torch.Tensor):
                return int(value.shape[d])
    return None


def _inputs_at(captured: CapturedGraph, symbol, n: int, L: int) -> Optional[list]:
    """The example inputs with every dim of length `symbol` grown from n to L: positions (an integer
    arange along it) counted on, anything else tiled. None when some dim depends on the length in
    another way (2·N, N + 1), which tiling cannot follow."""
    grown = []
    for node, value in zip(captured.placeholders(), captured.flat_inputs):
        shape = getattr(node.meta.get("val"), "shape", ())
        if not isinstance(value, torch.Tensor):
            grown.append(value)
            continue
        for d, size in enumerate(shape):
            if not symbolic(size):
                continue
            if size.node.expr == symbol:
                value = _grow(value, d, n, L)
            elif symbol in size.node.expr.free_symbols:
                return None
        grown.append(value)
    return grown


def _grow(value: torch.Tensor, dim: int, n: int, L: int) -> torch.Tensor:
    counting = torch.arange(n, device=value.device)
    view = [1] * value.dim()
    view[dim] = n
    if not value.dtype.is_floating_point and value.dtype != torch.bool and \
            torch.equal(value, counting.view(view).expand_as(value).to(value.dtype)):
        view[dim] = L
        shape = list(value.shape)
        shape[dim] = L
        return torch.arange(L, device=value.device).view(view).expand(shape).to(value.dtype).contiguous()
    return value.index_select(dim, torch.arange(L, device=value.device) % n)
