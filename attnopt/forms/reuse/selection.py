"""The anchor's block selection: which key blocks each query block of a reused layer reads.

Positions count each row's columns from its first real token (a left-padded row selects what the
row alone selects). Key block j holds positions [j·b, (j+1)·b); query block m likewise. Query block
m reads, besides the blocks every query keeps,
  sinks    blocks 0 .. S−1 (the first S·b positions, StreamingLLM's sinks),
  window   its own block and the W before it (causal: m−W .. m; bidirectional: m−W .. m+W),
the `top_k` other visible blocks (causal: j < m−W) with the most attention mass from the ANCHOR's
probe queries, summed over the anchor's heads (the selection is shared by every head of a reused
layer: heads of different layers do not correspond). `mass` (optional) stops earlier, once the
blocks read hold that share of the probes' attention mass.

The probes of a causal query block are the P positions just before it starts, [m·b − P, m·b)
(default P = b: the whole previous block): the selection uses only what is complete before the
block's first token, so a prefill and token-by-token decoding choose the same blocks (decoding
refreshes the selection once per block, when its first token arrives, from the last P anchor
queries it keeps). Bidirectional sites (no decoding) probe with the block's own last P queries.

A probe's attention mass on a block is taken from Quest's bound: the block's keys are summarised by
their elementwise min and max, q·k ≤ Σ_d max(q_d·min_d, q_d·max_d) for every key of the block, and
the mass is the softmax of the scaled bounds over the visible blocks. That costs P·J·D per query
block instead of P·N·D: the exact mass of 16 probes, scored against every key, took 2.6× an exact
causal SDPA at 8k on this project's 2-core CPU, more than a reused layer saves; the bounds keep
single-key spikes (a retrieved token) that a mean-pooled key would dilute.

Letters: B batch, H anchor query heads, Hkv anchor key heads, G = H / Hkv, N positions, b block,
M query blocks, J key blocks, K = slots (the most blocks one query block reads), P probes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import Tensor

# Tokens a cache may drop from the end (assisted and prompt-lookup decoding reject drafts): the
# decode state keeps that many anchor queries beyond the probes.
CROP_TOKENS = 128
# Probe bounds per chunk of query blocks: at most this many at once (32 MB in fp32).
SCORES_PER_CHUNK = 1 << 23


@dataclass(frozen=True)
class BlockRule:
    """The selection rule: block size, how many blocks by mass, which blocks always, the probes."""

    block: int
    top_k: int
    window: int
    sinks: int
    probes: int
    causal: bool
    mass: Optional[float] = None  # stop choosing once the blocks read hold this share of the probes' mass
    # The site's min_seq_len: causal, the positions below it attend exactly, so a block wholly below
    # it is not scored (its list, sinks, window and the earliest candidates, is never read);
    # bidirectional, a call shorter than it is exact, so none of its blocks is.
    exact_below: int = 0

    def __post_init__(self):
        for name in ("block", "probes"):
            if getattr(self, name) < 1:
                raise ValueError(f"BlockRule: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("top_k", "window", "sinks", "exact_below"):
            if getattr(self, name) < 0:
                raise ValueError(f"BlockRule: {name} must be >= 0, got {getattr(self, name)}")
        if self.probes > self.block:
            raise ValueError(f"BlockRule: probes {self.probes} > block {self.block}; at most one block of queries probes")
        if self.mass is not None and not 0.0 < self.mass <= 1.0:
            raise ValueError(f"BlockRule: mass must be in (0, 1], got {self.mass}")

    @property
    def slots(self) -> int:
        """The most key blocks one query block reads."""
        return self.sinks + (self.window + 1 if self.causal else 2 * self.window + 1) + self.top_k

    def blocks(self, n: int) -> int:
        return -(-n // self.block)

    def scores(self, m: int, J: int) -> bool:
        """Whether query block m's list is chosen by mass (of J blocks): it has more candidates than
        fit, and some query that reads it (`exact_below`)."""
        read = (m + 1) * self.block > self.exact_below if self.causal else J * self.block >= self.exact_below
        return read and self.candidates(m, J) > self.fits

    def reads_everything(self, n: int) -> bool:
        """Whether at `n` positions every query block reads every block it can see (no choice is left:
        the form then equals exact attention)."""
        if type(n) is not int:  # a SymInt: no hash
            return self._reads_everything(self.blocks(n))
        return _reads_everything(self, self.blocks(n))  # keyed by blocks: decoding asks once per block

    def _reads_everything(self, M: int) -> bool:
        # The most candidates: at the last block (causal: they grow with m), or while the window still
        # overlaps the sinks (bidirectional); the blocks between add nothing.
        edge = set(range(min(M, self.sinks + self.window + 1))) | {M - 1} if M else set()
        return max((self.candidates(m, M) for m in edge), default=0) <= self.fits

    @property
    def fits(self) -> int:
        """Candidates a query block reads without scoring them: top_k, or none under a mass threshold
        (which may leave some out)."""
        return self.top_k if self.mass is None else 0

    def candidates(self, m: int, J: int) -> int:
        """How many blocks query block m chooses among when J key blocks exist."""
        visible = m + 1 if self.causal else J
        lo, hi = max(0, m - self.window), min(visible, m + self.window + 1)
        forced = len(set(range(min(self.sinks, visible))) | set(range(lo, hi)))
        return visible - forced


# Asked by every reused layer at every decoding step (the answer changes only with the length).
_reads_everything = functools.lru_cache(maxsize=4096)(BlockRule._reads_everything)


@dataclass(frozen=True)
class Selection:
    """The key blocks each query of one call reads (position space; −1 = an empty slot), and each
    row's leading padding (position = column − offset; None: no padding)."""

    blocks_BQK: Tensor
    offsets_B: Optional[Tensor] = None
    # (history, m): every row reads row m of `history`, a tensor never written after it is made (a
    # decoding step inside a block says so; the slab then knows its list without comparing it).
    source: Optional[tuple] = None
    # Every key column from a row's offset on is real (padding only leads the rows): a decoding step
    # may then read the key blocks as positions = columns − offset without a key mask.
    dense: bool = False


# ---------------------------------------------------------------------------------------------
# positions and columns
# ---------------------------------------------------------------------------------------------


def leading_pads(keep_BN: Optional[Tensor]) -> Optional[Tensor]:
    """Long [B]: columns before each row's first real token; None when no row starts with padding."""
    if keep_BN is None:
        return None
    lead = torch.where(keep_BN.any(-1), keep_BN.long().argmax(-1), torch.zeros_like(keep_BN[:, 0], dtype=torch.long))
    return lead if bool(lead.any()) else None


def to_positions(x_BXND: Tensor, offsets_B: Optional[Tensor], dim: int = 2) -> Tensor:
    """Each row shifted left by its offset along `dim` (position p at index p; the tail is filled
    from the row's start and must be masked by the caller)."""
    if offsets_B is None:
        return x_BXND
    N = x_BXND.shape[dim]
    idx_BN = (torch.arange(N, device=x_BXND.device)[None, :] + offsets_B[:, None]) % N
    shape = [x_BXND.shape[0]] + [1] * (x_BXND.dim() - 1)
    shape[dim] = N
    return x_BXND.gather(dim, idx_BN.view(shape).expand(*x_BXND.shape[:dim], N, *x_BXND.shape[dim + 1:]))


def to_columns(x_BXND: Tensor, offsets_B: Optional[Tensor], dim: int = 2) -> Tensor:
    """The inverse of `to_positions`."""
    if offsets_B is None:
        return x_BXND
    N = x_BXND.shape[dim]
    return to_positions(x_BXND, (N - offsets_B) % N, dim)


def positions_keep(keep_BN: Optional[Tensor], offsets_B: Optional[Tensor]) -> Optional[Tensor]:
    """The keep mask in position space (the rolled-in tail is padding)."""
    if keep_BN is None:
        return None
    if offsets_B is None:
        return keep_BN
    N = keep_BN.shape[1]
    rolled = to_positions(keep_BN, offsets_B, dim=1)
    return rolled & (torch.arange(N, device=keep_BN.device)[None, :] < (N - offsets_B)[:, None])


# ---------------------------------------------------------------------------------------------
# probe mass and the choice
# ---------------------------------------------------------------------------------------------


def key_bounds(k_BHkvLD: Tensor, keep_BL: Optional[Tensor], block: int) -> tuple[Tensor, Tensor, Tensor]:
    """(min [B, Hkv, J, D], max [B, Hkv, J, D], has_key [B, J]) of each key block's real keys (keys
    at positions 0 .. L−1, J = ceil(L / b)); a block without a real key has zero bounds."""
    B, Hkv, L, D = k_BHkvLD.shape
    J = -(-L // block)
    dtype = torch.float32 if k_BHkvLD.dtype in (torch.float16, torch.bfloat16) else k_BHkvLD.dtype
    if keep_BL is None and L % block == 0:  # every key real, whole blocks (a decoding refresh): one pass
        k = k_BHkvLD.reshape(B, Hkv, J, block, D).to(dtype)  # (amin and amax: 12x faster than aminmax here)
        return k.amin(3), k.amax(3), torch.ones(B, J, dtype=torch.bool, device=k_BHkvLD.device)
    real = torch.ones(B, L, dtype=torch.bool, device=k_BHkvLD.device) if keep_BL is None else keep_BL
    real = torch.nn.functional.pad(real, (0, J * block - L)).view(B, 1, J, block, 1)
    k = torch.nn.functional.pad(k_BHkvLD.to(dtype), (0, 0, 0, J * block - L)).view(B, Hkv, J, block, D)
    lo = torch.where(real, k, torch.inf).amin(3)
    hi = torch.where(real, k, -torch.inf).amax(3)
    has_key = real.view(B, J, block).any(-1)
    ok = has_key[:, None, :, None]
    return torch.where(ok, lo, 0.0), torch.where(ok, hi, 0.0), has_key


def bound_mass(q_BHCPD: Tensor, present_BCP: Tensor, lo: Tensor, hi: Tensor, visible_BCJ: Tensor,
               scale: float) -> Tensor:
    """Float64 [B, C, J]: per query block (C of them, P probes each) the probes' softmax over the
    visible key blocks of their scaled Quest bounds, summed over the anchor's heads and the probes
    that are present."""
    B, H, C, P, D = q_BHCPD.shape
    Hkv, J = lo.shape[1], lo.shape[2]
    q = q_BHCPD.to(lo.dtype).reshape(B * Hkv, (H // Hkv) * C * P, D) * scale
    u = torch.bmm(q.clamp_min(0), hi.reshape(B * Hkv, J, D).transpose(-1, -2))
    u = torch.baddbmm(u, q.clamp_max(0), lo.reshape(B * Hkv, J, D).transpose(-1, -2))
    u = u.view(B, Hkv, H // Hkv, C, P, J).masked_fill_(~visible_BCJ[:, None, None, :, None, :], -torch.inf)
    w = torch.softmax(u, dim=-1)
    hidden = ~visible_BCJ.any(-1)  # a query block that sees no block: its probes add nothing
    if bool(hidden.any()):
        w.nan_to_num_(0.0)
    if not bool(present_BCP.all()):
        w.mul_(present_BCP[:, None, None, :, :, None])
    return w.sum(dim=(1, 2, 4)).to(torch.float64)


def choose_blocks(mass_BMJ: Optional[Tensor], m_BM: Tensor, n_blocks_B: Tensor, rule: BlockRule, J: int) -> Tensor:
    """Long [B, M, K]: the blocks query blocks m_BM read (sorted, −1 padded): sinks, window and the
    top candidates by `mass_BMJ` (ties: the earlier block). mass None: every block has no mass (only
    for blocks whose candidates all fit, or that no row reads: `BlockRule.scores`)."""
    B, M = m_BM.shape
    j = torch.arange(J, device=m_BM.device)
    m = m_BM[..., None]
    valid = j < n_blocks_B[:, None, None]
    if rule.causal:
        valid = valid & (j <= m)
        in_window = (j >= m - rule.window) & (j <= m)
    else:
        in_window = (j - m).abs() <= rule.window
    forced = valid & ((j < rule.sinks) | in_window)
    candidate = valid & ~forced
    if mass_BMJ is None:
        mass_BMJ = torch.zeros(B, M, J, dtype=torch.float64, device=m_BM.device)
    # Ranked in steps of 2^-16 of the visible mass: a prefill and a decoding step sum the same masses in
    # another order, and exact ties (a probe of zeros, the embedding of a pad token, spreads its mass
    # evenly) must stay ties there, broken alike (the earlier block).
    quantum = ((mass_BMJ * valid).sum(-1, keepdim=True) * 2.0 ** -16).clamp_min(1e-30)
    score = torch.where(candidate, torch.round(mass_BMJ / quantum), torch.full_like(mass_BMJ, -1.0))
    order = torch.sort(-score, dim=-1, stable=True).indices  # best first; ties keep the earlier block
    rank = torch.empty_like(order).scatter_(-1, order, j.expand_as(order))
    chosen = candidate & (rank < rule.top_k)
    if rule.mass is not None:
        total = (mass_BMJ * valid).sum(-1, keepdim=True)
        have = (mass_BMJ * forced).sum(-1, keepdim=True)
        ranked = torch.gather(torch.where(candidate, mass_BMJ, 0.0), -1, order)
        before = ranked.cumsum(-1) - ranked  # mass of the better candidates, in rank order
        needed_sorted = (have + before) < rule.mass * total
        needed = torch.empty_like(needed_sorted).scatter_(-1, order, needed_sorted)
        chosen = chosen & needed
    read = forced | chosen
    ids = torch.where(read, j, J + j).sort(dim=-1).values[..., : rule.slots]
    ids = torch.nn.functional.pad(ids, (0, max(0, rule.slots - ids.shape[-1])), value=2 * J)
    return torch.where(ids < J, ids, -1)


def _n_blocks(keep_BN: Optional[Tensor], B: int, N: int, rule: BlockRule, device) -> Tensor:
    """Long [B]: blocks up to each row's last real position (position space)."""
    if keep_BN is None:
        return torch.full((B,), rule.blocks(N), dtype=torch.long, device=device)
    last = torch.where(keep_BN.any(-1), N - keep_BN.flip(-1).long().argmax(-1), torch.zeros(B, dtype=torch.long,
                                                                                            device=device))
    return -(-last // rule.block)


def select_positions(q_BHND: Tensor, k_BHkvND: Tensor, keep_BN: Optional[Tensor], rule: BlockRule,
                     scale: float) -> Tensor:
    """Long [B, M, K]: every query block's blocks, M = ceil(N / b), for a whole sequence in position
    space (self-attention: query i and key i are position i; keep [B, N] marks the real ones)."""
    B, H, N, D = q_BHND.shape
    M, b, P = rule.blocks(N), rule.block, rule.probes
    m_BM = torch.arange(M, device=q_BHND.device).expand(B, M)
    n_blocks = _n_blocks(keep_BN, B, N, rule, q_BHND.device)
    chooses = [m for m in range(M) if rule.scores(m, M)]
    if not chooses:
        return choose_blocks(None, m_BM, n_blocks, rule, M)
    lo, hi, has_key = key_bounds(k_BHkvND, keep_BN, b)
    mass = torch.zeros(B, M, M, dtype=torch.float64, device=q_BHND.device)
    ar = torch.arange(P, device=q_BHND.device)
    j = torch.arange(M, device=q_BHND.device)
    step = max(1, SCORES_PER_CHUNK // max(1, B * H * P * M))
    for i in range(0, len(chooses), step):  # chunks of query blocks: their probes' bounds at once
        ms = torch.tensor(chooses[i:i + step], device=q_BHND.device)
        if rule.causal:  # the P positions before the block; the blocks complete before it
            pos = ms[:, None] * b - P + ar
            visible = j[None, :] < ms[:, None]
        else:  # the block's last P positions; every block
            end = torch.clamp((ms + 1) * b, max=N)
            pos = end[:, None] - P + ar
            pos = torch.where(pos >= (ms * b)[:, None], pos, -1)
            visible = torch.ones(len(ms), M, dtype=torch.bool, device=q_BHND.device)
        present = (pos >= 0).expand(B, *pos.shape)
        if keep_BN is not None:
            present = present & keep_BN[:, pos.clamp_min(0)]
        q_BHCPD = q_BHND.index_select(2, pos.clamp_min(0).flatten()).view(B, H, len(ms), P, D)
        mass[:, ms] = bound_mass(q_BHCPD, present, lo, hi, visible[None] & has_key[:, None, :], scale)
    return choose_blocks(mass, m_BM, n_blocks, rule, M)


def per_query(blocks_BMK: Tensor, N: int, block: int) -> Tensor:
    """[B, N, K]: each position's row of its query block's list."""
    return blocks_BMK.repeat_interleave(block, dim=1)[:, :N]


# ---------------------------------------------------------------------------------------------
# one call: a prefill, or new tokens after a decode state
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectionState:
    """What decoding keeps to select like a prefill: per row the real positions seen, the anchor's
    last P + CROP_TOKENS queries (the next block's probes, with room for a cache to drop up to
    CROP_TOKENS tokens), the selection of every block started so far, and the row's leading padding."""

    seen_B: Tensor  # long; positions seen, less the pending ones
    stash_BHWD: Tensor  # queries at positions seen_B − W .. seen_B − 1 (zeros before position 0)
    history_BMK: Tensor  # long; row m: block m's selection (−1 rows for blocks not started)
    offsets_B: Tensor  # long
    # The anchor's key bounds of blocks 0 .. J−1, kept between block starts so that each start
    # summarises one new block instead of the whole cache (O(b) per block, not O(N)). Only while
    # every key is real and no row is padded; None otherwise (each start then reads every key).
    lo_BHkvJD: Optional[Tensor] = None
    hi_BHkvJD: Optional[Tensor] = None
    # Anchor queries [B, H, 1, D] of the one-token steps since the stash was last written, oldest
    # first: a step inside a block only keeps a reference (no copy of the stash per token).
    pending: tuple = ()
    # Every column from a row's offset on is real (what generate() makes: padding only leads a row).
    dense: bool = True

    def seen(self) -> Tensor:
        """Long [B]: the positions each row has seen, pending ones included."""
        return self.seen_B + len(self.pending)

    def with_query(self, q_a: Tensor) -> "SelectionState":
        """The state after a one-token step inside a block: its anchor query held by reference (no copy
        of the stash per token; the constructor, not dataclasses.replace: this runs per anchor and token)."""
        return SelectionState(self.seen_B, self.stash_BHWD, self.history_BMK, self.offsets_B, self.lo_BHkvJD,
                              self.hi_BHkvJD, self.pending + (q_a,), self.dense)

    def folded(self) -> "SelectionState":
        """The same state with the pending queries written into the stash and counted in seen_B."""
        if not self.pending:
            return self
        W, n, dtype = self.stash_BHWD.shape[2], len(self.pending), self.stash_BHWD.dtype
        kept = [self.stash_BHWD[:, :, n:]] if n < W else []
        stash = torch.cat(kept + [q if q.dtype == dtype else q.to(dtype) for q in self.pending[-W:]], dim=2)
        return replace(self, seen_B=self.seen_B + n, stash_BHWD=stash, pending=())

    def crop(self, tokens: int, rule: BlockRule) -> "SelectionState":
        """The state with the last `tokens` positions dropped (assisted decoding); at most CROP_TOKENS."""
        if tokens == 0:
            return self
        self = self.folded()
        if tokens > CROP_TOKENS:
            raise ValueError(f"reuse: a cache can drop at most {CROP_TOKENS} tokens of a reused layer's selection "
                             f"state, not {tokens}; use fewer assistant or prompt-lookup tokens per step")
        # The last `tokens` columns go: a row loses that many real positions, and the rest of them
        # from its leading padding when it has fewer (a left-padded row cropped into its pads).
        dropped_B = torch.clamp(self.seen_B, max=tokens)
        pads_B = tokens - dropped_B
        if bool((pads_B > self.offsets_B).any()):
            raise ValueError(f"reuse: cannot drop {tokens} tokens from a sequence of "
                             f"{int((self.seen_B + self.offsets_B).min())}")
        seen = self.seen_B - dropped_B
        W = self.stash_BHWD.shape[2]
        src_BW = torch.arange(W, device=seen.device)[None, :] - dropped_B[:, None]  # row r's slot j was j − dropped
        stash = self.stash_BHWD.gather(2, src_BW.clamp_min(0)[:, None, :, None].expand_as(self.stash_BHWD))
        stash = stash.masked_fill((src_BW < 0)[:, None, :, None], 0.0)
        started = -(-seen // rule.block)  # blocks whose first position survives
        m = torch.arange(self.history_BMK.shape[1], device=seen.device)
        history = torch.where((m[None, :] < started[:, None])[..., None], self.history_BMK, -1)
        return replace(self, seen_B=seen, stash_BHWD=stash, history_BMK=history, offsets_B=self.offsets_B - pads_B,
                       lo_BHkvJD=None, hi_BHkvJD=None)


def stash_width(rule: BlockRule) -> int:
    return rule.probes + CROP_TOKENS


def select_call(q_a: Tensor, k_a: Tensor, keep_BN: Optional[Tensor], rule: BlockRule, scale: float,
                state: Optional[SelectionState]) -> tuple[Selection, SelectionState]:
    """The selection for the last Nq columns of one call (the anchor's queries q_a [B, H, Nq, D] and
    every key so far k_a [B, Hkv, Nk, D]; keep [B, Nk] or None), and the state after it. A call
    without state is a prefill (Nq == Nk); with one, its new tokens must all be real."""
    if state is None:
        return _prefill(q_a, k_a, keep_BN, rule, scale)
    return _extend(q_a, k_a, keep_BN, rule, scale, state)


def _prefill(q_a, k_a, keep_BN, rule, scale):
    B, H, N, D = q_a.shape
    if k_a.shape[2] != N:
        raise ValueError(f"reuse: a prefill needs as many anchor queries as keys; got {N} queries and "
                         f"{k_a.shape[2]} keys (a cache made by another model?)")
    offsets = leading_pads(keep_BN)
    keep_pos = positions_keep(keep_BN, offsets)
    q_pos, k_pos = to_positions(q_a, offsets), to_positions(k_a, offsets)
    blocks = select_positions(q_pos, k_pos, keep_pos, rule, scale)
    queries = per_query(blocks, N, rule.block)  # position space
    if keep_pos is not None:
        queries = torch.where(keep_pos[..., None], queries, -1)
    queries = to_columns(queries, offsets, dim=1)
    seen = torch.full((B,), N, dtype=torch.long, device=q_a.device) if keep_pos is None else _n_positions(keep_pos)
    W = stash_width(rule)
    stash = torch.zeros(B, H, W, D, dtype=q_a.dtype, device=q_a.device)
    idx = seen[:, None] - W + torch.arange(W, device=q_a.device)  # positions of the stash slots
    got = q_pos.gather(2, idx.clamp(0, N - 1)[:, None, :, None].expand(B, H, W, D))
    stash = torch.where((idx >= 0)[:, None, :, None], got, stash)
    off = offsets if offsets is not None else torch.zeros(B, dtype=torch.long, device=q_a.device)
    dense = keep_pos is None or bool((keep_pos | (torch.arange(N, device=q_a.device) >= N - off[:, None])).all())
    state = SelectionState(seen, stash, _history(blocks, seen, rule), off, dense=dense)
    return Selection(queries, offsets), state


def _n_positions(keep_pos: Tensor) -> Tensor:
    """Positions a row has: up to and including its last real one."""
    N = keep_pos.shape[1]
    return torch.where(keep_pos.any(-1), N - keep_pos.flip(-1).long().argmax(-1), torch.zeros_like(keep_pos[:, 0],
                                                                                                   dtype=torch.long))


def _history(blocks_BMK: Tensor, seen_B: Tensor, rule: BlockRule) -> Tensor:
    started = -(-seen_B // rule.block)
    m = torch.arange(blocks_BMK.shape[1], device=blocks_BMK.device)
    return torch.where((m[None, :] < started[:, None])[..., None], blocks_BMK, -1)


def _extend(q_a, k_a, keep_BN, rule, scale, state: SelectionState):
    B, H, T, D = q_a.shape
    Nk = k_a.shape[2]
    if T == 1 and (keep_BN is None or bool(keep_BN[:, -1].all())):
        got = _one_token_inside_a_block(q_a, Nk, rule, state)
        if got is not None:
            return got
    state = state.folded()
    if keep_BN is not None and not bool(keep_BN[:, -T:].all()):
        raise ValueError("reuse: tokens after a prefill must all be real (no padding among the new tokens); "
                         "generate() never pads them")
    b, W = rule.block, stash_width(rule)
    history = state.history_BMK
    need = int(-(-(state.seen_B.max() + T) // b))
    if history.shape[1] < need:
        history = torch.nn.functional.pad(history, (0, 0, 0, need - history.shape[1]), value=-1)
    stash = torch.cat([state.stash_BHWD, q_a.to(state.stash_BHWD.dtype)], dim=2)  # positions seen − W .. seen + T − 1
    seen_list = state.seen_B.tolist()
    starts = [(r, t) for r in range(B) for t in range(T) if (seen_list[r] + t) % b == 0]  # a block's first token
    if starts:
        history = history.clone()
    # Every key real and no row padded: the rows' positions are their columns, and the bounds of the
    # blocks already summarised stay valid (the anchor's cache only grows).
    kept = keep_BN is None and not bool(state.offsets_B.any())
    lo, hi = (state.lo_BHkvJD, state.hi_BHkvJD) if kept else (None, None)
    for r, t in starts:
        p0 = seen_list[r] + t
        m = p0 // b
        bounds = None
        if kept and rule.scores(m, m + 1):
            lo, hi = _bounds_upto(k_a, m, b, lo, hi)
            bounds = (lo[r:r + 1, :, :m], hi[r:r + 1, :, :m])
        history[r, m] = _choose_at(stash[r:r + 1], W + t, p0, k_a[r:r + 1], keep_BN, r, int(state.offsets_B[r]),
                                   m, rule, scale, bounds)
    pos = state.seen_B[:, None] + torch.arange(T, device=q_a.device)
    queries = history.gather(1, (pos // b)[..., None].expand(B, T, rule.slots))
    seen = state.seen_B + T
    if bool((Nk - state.offsets_B < seen).any()):
        raise ValueError("reuse: the anchor's cache holds fewer keys than the positions decoded (was the cache edited?)")
    new_state = SelectionState(seen, stash[:, :, -W:], history, state.offsets_B, lo, hi, dense=state.dense)
    offsets = state.offsets_B if bool(state.offsets_B.any()) else None
    # One token at the same position in every row: each reads row m of `history` (a tensor never
    # written from here on), which the slab of a reused layer then recognises without a comparison.
    same = T == 1 and seen_list.count(seen_list[0]) == B
    source = (history, seen_list[0] // b) if same else None
    return Selection(queries, offsets, source, dense=state.dense), new_state


def _bounds_upto(k_BHkvND: Tensor, m: int, block: int, lo: Optional[Tensor], hi: Optional[Tensor]):
    """(lo, hi) covering at least key blocks 0 .. m−1 of every row: the ones given, extended by the
    blocks they lack (whole blocks of real keys, positions = columns)."""
    have = 0 if lo is None else lo.shape[2]
    if have >= m:
        return lo, hi
    new_lo, new_hi, _ = key_bounds(k_BHkvND[:, :, have * block:m * block], None, block)
    if lo is None:
        return new_lo, new_hi
    return torch.cat([lo, new_lo], dim=2), torch.cat([hi, new_hi], dim=2)


def _one_token_inside_a_block(q_a, Nk: int, rule: BlockRule, state: SelectionState):
    """`_extend` for the common decoding step: one real token per row, no row starting a block (so no
    choice is made; each row reads its block's list). None where that does not hold."""
    if len(state.pending) >= state.stash_BHWD.shape[2]:  # (a long block: hold at most a stash of references)
        state = state.folded()
    n = len(state.pending)
    seen, offsets = [s + n for s in state.seen_B.tolist()], state.offsets_B.tolist()
    b = rule.block
    if any(s % b == 0 or s // b >= state.history_BMK.shape[1] for s in seen):
        return None
    if any(Nk - o < s + 1 for s, o in zip(seen, offsets)):
        raise ValueError("reuse: the anchor's cache holds fewer keys than the positions decoded (was the cache edited?)")
    m = seen[0] // b
    padded = state.offsets_B if any(offsets) else None
    if all(s // b == m for s in seen):
        selection = Selection(state.history_BMK[:, m:m + 1], padded, (state.history_BMK, m), state.dense)
    else:
        idx = torch.tensor([s // b for s in seen], device=q_a.device)
        selection = Selection(state.history_BMK.gather(1, idx[:, None, None].expand(-1, 1, rule.slots)), padded,
                              dense=state.dense)
    return selection, state.with_query(q_a)


def in_block_step(q_a: Tensor, Nk: int, rule: BlockRule, state: SelectionState) -> Optional[tuple[int, SelectionState]]:
    """(m, state after) for a one-token decoding step inside query block m of every row, the anchor's
    cache holding Nk columns and no row padded: each row then reads row m of `state.history_BMK`.
    None where that does not hold (`select_call` then). The `_one_token_inside_a_block` of the
    decoding hot path: no Selection is made, and no tensor is read but the rows' positions."""
    n = len(state.pending)
    if n >= state.stash_BHWD.shape[2] or not state.dense:
        return None
    seen = state.seen_B.tolist()
    s = seen[0] + n  # the new token's position, in every row; its column Nk − 1 says no row is padded
    if s + 1 != Nk or s % rule.block == 0 or s // rule.block >= state.history_BMK.shape[1] \
            or (len(seen) > 1 and seen.count(seen[0]) != len(seen)):
        return None
    return s // rule.block, state.with_query(q_a)


def _choose_at(stash_1HXD, end, p0, k_1HkvND, keep_BN, r, offset, m, rule, scale, bounds=None):
    """Block m's selection (its first position p0) from the P queries just before it (the stash's
    slots end − P .. end − 1) and the anchor's keys at positions 0 .. p0 − 1 (or `bounds`, their
    (lo, hi) when every one is real)."""
    P, b = rule.probes, rule.block
    J = m + 1  # causal: the blocks up to its own
    m_BM = torch.tensor([[m]], device=stash_1HXD.device)
    n_blocks = torch.tensor([J], device=stash_1HXD.device)
    if not rule.scores(m, J):
        return choose_blocks(None, m_BM, n_blocks, rule, J)[0, 0]
    pos = p0 - P + torch.arange(P, device=stash_1HXD.device)
    present = (pos >= 0)[None]
    keep = None if keep_BN is None else keep_BN[r:r + 1, offset:offset + p0]
    if keep is not None:
        present = present & _probe_real(keep_BN[r], offset, pos)[None]
    if bounds is None:
        lo, hi, has_key = key_bounds(k_1HkvND[:, :, offset:offset + p0], keep, b)
    else:
        (lo, hi), has_key = bounds, torch.ones(1, m, dtype=torch.bool, device=stash_1HXD.device)
    mass = bound_mass(stash_1HXD[:, :, end - P:end][:, :, None], present[:, None], lo, hi, has_key[:, None], scale)
    return choose_blocks(torch.nn.functional.pad(mass, (0, J - mass.shape[-1])), m_BM, n_blocks, rule, J)[0, 0]


def _probe_real(keep_N: Tensor, offset: int, pos: Tensor) -> Tensor:
    cols = (pos + offset).clamp(0, keep_N.shape[0] - 1)
    return keep_N[cols] & (pos >= 0)


def probe_cost(rule: BlockRule, n: int) -> float:
    """Multiply-adds per anchor head and head dim to score the blocks at n positions: every query
    block's P probes against two bounds of each block."""
    M = rule.blocks(n)
    return 2.0 * rule.probes * M * M


# ---------------------------------------------------------------------------------------------
# the same selection as one vectorised function of fixed-size state (the exported decode step)
# ---------------------------------------------------------------------------------------------


def select_span(q_a: Tensor, k_a: Tensor, keep_BN: Tensor, rule: BlockRule, scale: float, stash_BHPD: Tensor,
                current_BK: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`select_call` without Python control flow over the data, for a graph: the new queries are the
    last T of N columns (keep [B, N] bool, every column so far); the state is the anchor's last P
    queries (stash [B, H, P, D], zeros to start) and the current block's selection (current [B, K],
    −1 to start). Returns (blocks [B, T, K] in position space, offsets [B], stash, current) after the
    call. Padding may only lead a row (what generate() makes); no crop (a graph has no history)."""
    B, H, T, D = q_a.shape
    N, b, P, K = k_a.shape[2], rule.block, rule.probes, rule.slots
    dev = q_a.device
    offset = torch.where(keep_BN.any(-1), keep_BN.long().argmax(-1), N)  # leading pad columns (all, so far)
    first = (N - T) - offset  # position of the call's first column (negative: padding)
    seen = first.clamp_min(0)  # real positions before the call
    pos_BT = first[:, None] + torch.arange(T, device=dev)
    history = torch.cat([stash_BHPD.to(q_a.dtype), q_a], dim=2)  # stash: positions seen − P .. seen − 1

    def slot(x):  # index into `history` of position x
        return torch.where(x < seen[..., None] if x.dim() == 2 else x < seen[:, None, None],
                           x - (seen - P).view(-1, *[1] * (x.dim() - 1)), P + x - first.view(-1, *[1] * (x.dim() - 1)))

    # The blocks that start inside this call, each scored from the P queries before it.
    C = T // b + 1
    first_block = -(-seen // b)
    m_BC = first_block[:, None] + torch.arange(C, device=dev)
    starts = m_BC * b < (seen + (pos_BT[:, -1] + 1 - seen).clamp_min(0))[:, None]
    probe_pos = m_BC[..., None] * b - P + torch.arange(P, device=dev)  # [B, C, P]
    idx = slot(probe_pos)
    present = starts[..., None] & (probe_pos >= 0) & (idx >= 0) & (idx < P + T)
    q_probe = history.gather(2, idx.clamp(0, P + T - 1).view(B, 1, C * P, 1).expand(B, H, C * P, D))
    cols = (offset[:, None] + torch.arange(N, device=dev))
    inside = cols < N
    k_pos = k_a.gather(2, cols.clamp(max=N - 1)[:, None, :, None].expand(-1, k_a.shape[1], -1, k_a.shape[3]))
    keep_pos = keep_BN.gather(1, cols.clamp(max=N - 1)) & inside
    lo, hi, has_key = key_bounds(k_pos, keep_pos, b)
    J = lo.shape[2]
    j = torch.arange(J, device=dev)
    visible = (j < m_BC[..., None]) & has_key[:, None, :]
    mass = bound_mass(q_probe.view(B, H, C, P, D), present, lo, hi, visible, scale)
    lists = choose_blocks(mass, m_BC, torch.full((B,), J, device=dev), rule, J)  # [B, C, K]
    # Each new query reads its block's list: made in this call, or the current one.
    m_BT = torch.div(pos_BT, b, rounding_mode="floor")
    fresh = lists.gather(1, (m_BT - first_block[:, None]).clamp(0, C - 1)[..., None].expand(B, T, K))
    blocks = torch.where((m_BT * b < seen[:, None])[..., None], current_BK[:, None, :], fresh)
    blocks = torch.where((pos_BT >= 0)[..., None], blocks, -1)
    end = pos_BT[:, -1] + 1  # positions after the call (the last column is real)
    stash_pos = end[:, None] - P + torch.arange(P, device=dev)
    stash_idx = slot(stash_pos).clamp(0, P + T - 1)
    stash = history.gather(2, stash_idx[:, None, :, None].expand(B, H, P, D))
    stash = torch.where((stash_pos >= 0)[:, None, :, None], stash, 0.0)
    return blocks, offset, stash, blocks[:, -1]
