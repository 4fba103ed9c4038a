"""One decoding token of a reused layer, reading its listed blocks from a slab kept between selections.

Decoding refreshes a query block's list once, when its first token arrives (selection.py), and the
list ends with the block itself: the only listed block that grows. So a reused layer copies its
listed blocks' keys and values together once per block and then appends each new token's column;
a step reads one contiguous [B, Hkv, ≤ K·b, D] slab instead of gathering K blocks out of the whole
cache. The keys are the same, in the same order, as the gathered path's (reference._one_query).

Measured on the 8-layer, hidden-128 decoder at 8k (benchmarks/reuse_cpu.py, decode): the gathered
step cost ~120 µs per reused layer inside the model, where the cold cache dominated the 17 block
copies; the slab step is an append and one SDPA call over memory that stays warm.

A step inside a block takes the hot path: the attention function hands it to the cache layer
(attnopt.hf.cache.ReuseCacheLayer.step), which advances the selection (selection.in_block_step) and
calls `BlockSlab.step`, skipping the per-call checks that held at the block's first token. It gives
the general path's output bit for bit (tests/forms/test_reuse_form.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from attnopt.kernels.layout import compute_dtype


class BlockSlab:
    """The listed blocks of one reused layer's current query block, gathered (per cache layer)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.ids_BK: Optional[Tensor] = None  # the list the slab holds
        self.keys: Optional[Tensor] = None  # [B, Hkv, K·b, D] buffers; the first `length` columns hold keys
        self.values: Optional[Tensor] = None
        self.length = 0
        self.covered = 0  # cache columns the slab reflects (the last is the newest token's)
        self.block = -1  # the query block whose list it holds
        self.block_size = 1  # positions per block, and the slab's batch and columns (ints: checked per step)
        self.batch = -1
        self.room = 0
        self.own_start, self.key_columns, self.value_columns = 0, (), ()
        self.source: Optional[tuple] = None  # (history, m) the list came from, when the selection said
        self.rows: Optional[list] = None  # one slab per row, for rows with leading padding

    def attend(self, q: Tensor, k: Tensor, v: Tensor, ids_BK: Tensor, block: int, scale: float,
               source: Optional[tuple] = None, offsets_B: Optional[Tensor] = None) -> Optional[Tensor]:
        """Attention of the last column's query q [B, H, 1, D] over the keys of the blocks ids_BK
        [B, K] lists (k, v: the whole cache, [B, Hkv, Nk, D], every column real, position = column);
        None where the slab cannot serve (rows list different numbers of blocks, or a list that does
        not end with the query's own block): the caller takes the gathered path. `source`: the
        Selection's (history, m) the list is row m of, when known (then no comparison is needed).
        `offsets_B`: leading pad columns per row (every column after them real); each row then keeps
        a slab of its own, over its columns from the offset on (rows sit at different positions)."""
        if offsets_B is not None:
            return self._attend_rows(q, k, v, ids_BK, block, scale, offsets_B)
        if not (self._continues(k) and self._holds(ids_BK, source)):
            if not self._gather(k, v, ids_BK, block, (k.shape[2] - 1) // block, compute_dtype(q.dtype)):
                return None
            self.source = source
        else:
            self._append(k, v)
        return self._read(q, scale)

    def step(self, q: Tensor, k: Tensor, v: Tensor, history_BMK: Tensor, m: int, scale: float,
             new: Optional[tuple] = None) -> Optional[Tensor]:
        """`attend` for the next column of block m, when the slab holds row m of `history_BMK` (the
        decoding hot path: one append and one SDPA call); None where the slab does not follow on.
        `new`: the cache's newest column of keys and values [B, Hkv, 1, D], when the caller has it."""
        mine = self.source
        if mine is None or mine[0] is not history_BMK or mine[1] != m or not self._continues(k):
            return None
        self._append(k, v, new)
        return self._read(q, scale)

    def _continues(self, k: Tensor) -> bool:
        """Whether the cache k [B, Hkv, Nk, D] is the slab's columns plus one new one of its block."""
        Nk = k.shape[2]
        return (self.covered == Nk - 1 and self.block == (Nk - 1) // self.block_size and self.length < self.room
                and self.batch == k.shape[0])

    def _append(self, k: Tensor, v: Tensor, new: Optional[tuple] = None) -> None:
        """The newest cache column (`new`, when the caller has it as [B, Hkv, 1, D]) joins its block,
        the last in the slab, through the column views `_gather` made."""
        last = k.shape[2] - 1
        k_new, v_new = new if new is not None else (k.narrow(2, last, 1), v.narrow(2, last, 1))
        i = self.length - self.own_start
        self.key_columns[i].copy_(k_new)
        self.value_columns[i].copy_(v_new)
        self.length, self.covered = self.length + 1, last + 1

    def _read(self, q: Tensor, scale: float) -> Tensor:
        n, keys = self.length, self.keys
        qc = q if q.dtype == keys.dtype else q.to(keys.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(qc, keys.narrow(2, 0, n), self.values.narrow(2, 0, n),
                                                               scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def _attend_rows(self, q, k, v, ids_BK, block, scale, offsets_B) -> Optional[Tensor]:
        if self.rows is None or len(self.rows) != q.shape[0]:
            self.clear()
            self.rows = [BlockSlab() for _ in range(q.shape[0])]
        outs = []
        for r, (slab, o) in enumerate(zip(self.rows, offsets_B.tolist())):
            out = slab.attend(q[r:r + 1], k[r:r + 1, :, o:], v[r:r + 1, :, o:], ids_BK[r:r + 1], block, scale)
            if out is None:
                return None
            outs.append(out)
        return torch.cat(outs, dim=0)

    def _holds(self, ids_BK: Tensor, source: Optional[tuple]) -> bool:
        """Whether the slab holds the list ids_BK: the same row of the same history tensor (kept
        alive by the slab, so never another one at its address), or equal contents."""
        mine = self.source
        if source is not None and mine is not None and source[0] is mine[0] and source[1] == mine[1]:
            return True
        return torch.equal(self.ids_BK, ids_BK)

    def _gather(self, k: Tensor, v: Tensor, ids_BK: Tensor, block: int, m: int, dtype) -> bool:
        """Copy the listed blocks before m, then block m's columns so far; False if no slab fits."""
        B, Hkv, Nk = k.shape[:3]
        listed = ids_BK >= 0
        counts = listed.sum(-1).tolist()
        if len(set(counts)) != 1 or not bool((ids_BK.max(-1).values == m).all()):
            self.clear()
            return False
        K = counts[0]
        whole = ids_BK.sort(-1).values[:, ids_BK.shape[1] - K:-1]  # listed blocks before m, ascending
        size = (B, Hkv, K * block)
        if self.keys is None or tuple(self.keys.shape[:3]) != size or self.keys.dtype != dtype \
                or self.keys.device != k.device:
            self.keys = k.new_empty(*size, k.shape[-1], dtype=dtype)
            self.values = v.new_empty(*size, v.shape[-1], dtype=dtype)
        w = (K - 1) * block
        for r in range(B if w else 0):  # whole blocks taken as slabs of a [m, b] view of the cache
            k_r = k[r:r + 1, :, : m * block].unflatten(2, (m, block)).index_select(2, whole[r])
            v_r = v[r:r + 1, :, : m * block].unflatten(2, (m, block)).index_select(2, whole[r])
            self.keys[r:r + 1, :, :w].copy_(k_r.flatten(2, 3))
            self.values[r:r + 1, :, :w].copy_(v_r.flatten(2, 3))
        own = Nk - m * block
        self.keys[:, :, w:w + own].copy_(k[:, :, m * block:])
        self.values[:, :, w:w + own].copy_(v[:, :, m * block:])
        self.ids_BK, self.length, self.covered, self.block = ids_BK.clone(), w + own, Nk, m
        self.block_size, self.batch, self.room = block, B, self.keys.shape[2]
        # The own block's columns as views [B, Hkv, 1, D]: a step copies its token into one (`step`).
        self.own_start = w
        self.key_columns = self.keys.narrow(2, w, block).split(1, dim=2)
        self.value_columns = self.values.narrow(2, w, block).split(1, dim=2)
        return True
