"""Block-sparse attention (the reuse form's op) against an fp64 oracle written here, and the anchor's
block selection against its rule worked out by hand and against itself across prefill and decoding.

The oracle imports nothing from attnopt: visibility is decided key by key from the definition
(block of the key's position in the query's list, causality, padding, offsets), heads map by h // G
explicitly, and the softmax is dense.
"""

from __future__ import annotations

import pytest
import torch

from attnopt.forms.reuse.reference import block_sparse_attention, flex_attention_cpu, gathered_attention
from attnopt.forms.reuse.selection import (
    BlockRule,
    bound_mass,
    key_bounds,
    choose_blocks,
    in_block_step,
    select_call,
    select_positions,
    select_span,
)

F64 = torch.float64


def oracle(q, k, v, blocks, *, block, causal, scale, key_mask=None, offsets=None):
    """o[b, h, i] = softmax over the visible keys of scale·q·k, in fp64, key by key."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    G = H // Hkv
    out = torch.zeros(B, H, Nq, v.shape[-1], dtype=F64)
    for b in range(B):
        off = 0 if offsets is None else int(offsets[b])
        for i in range(Nq):
            qpos = Nk - Nq + i - off
            listed = {int(x) for x in blocks[b, i] if int(x) >= 0}
            cols = [j for j in range(Nk) if j - off >= 0 and (j - off) // block in listed
                    and (not causal or j - off <= qpos) and (key_mask is None or bool(key_mask[b, j]))]
            if qpos < 0 or not cols:
                continue
            for h in range(H):
                kv = h // G
                s = torch.stack([scale * (q[b, h, i].to(F64) @ k[b, kv, j].to(F64)) for j in cols])
                w = torch.softmax(s, 0)
                out[b, h, i] = sum(w[n] * v[b, kv, j].to(F64) for n, j in enumerate(cols))
    return out


def _inputs(B, H, Hkv, Nq, Nk, D, Dv, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Nq, D, generator=g, dtype=dtype), torch.randn(B, Hkv, Nk, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Nk, Dv, generator=g, dtype=dtype))


def _random_lists(B, Nq, Nk, block, K, seed, *, per_block=True, offset=0):
    """Unique block ids per query (some slots −1); queries of one block share a list when per_block."""
    g = torch.Generator().manual_seed(seed)
    J = -(-Nk // block)
    out = torch.full((B, Nq, K), -1, dtype=torch.long)
    for b in range(B):
        for i in range(Nq):
            pos = Nk - Nq + i - offset
            key = pos // block if per_block else i
            gg = torch.Generator().manual_seed(seed * 1000 + b * 97 + key)
            n = int(torch.randint(1, K + 1, (1,), generator=gg))
            ids = torch.randperm(J, generator=gg)[:n]
            out[b, i, :n] = ids
            out[b, i] = out[b, i][torch.randperm(K, generator=gg)]  # −1 anywhere, unsorted
    del g
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2)])
def test_gathered_path_equals_the_oracle(causal, H, Hkv):
    q, k, v = _inputs(2, H, Hkv, 37, 37, 8, 6, seed=1)
    blocks = _random_lists(2, 37, 37, 8, 3, seed=2)
    key_mask = torch.ones(2, 37, dtype=torch.bool)
    key_mask[1, 5:9] = False  # a hole
    key_mask[0, 30] = False
    got = gathered_attention(q, k, v, blocks, block=8, causal=causal, scale=0.4, key_mask=key_mask)
    want = oracle(q, k, v, blocks, block=8, causal=causal, scale=0.4, key_mask=key_mask)
    assert torch.allclose(got.to(F64), want, atol=2e-6), (got.to(F64) - want).abs().max()


@pytest.mark.parametrize("causal", [True, False])
def test_lists_that_differ_inside_a_query_block_are_each_queries_own(causal):
    # The op takes a list per query: a prefill whose queries of one block list different blocks must
    # not read its block's first list for all of them (the tiles share a list only where they do).
    q, k, v = _inputs(2, 4, 2, 37, 37, 8, 6, seed=11)
    blocks = _random_lists(2, 37, 37, 8, 3, seed=12, per_block=False)
    got = block_sparse_attention(q, k, v, blocks, block=8, causal=causal, scale=0.4)
    want = oracle(q, k, v, blocks, block=8, causal=causal, scale=0.4)
    assert torch.allclose(got.to(F64), want, atol=2e-6), (got.to(F64) - want).abs().max()


def test_lists_per_query_offsets_and_queries_after_a_cache():
    # Decoding shape: 3 new queries after 20 cached columns; rows padded on the left by 0 and 5 columns.
    q, k, v = _inputs(2, 2, 1, 3, 23, 4, 4, seed=3)
    offsets = torch.tensor([0, 5])
    blocks = _random_lists(2, 3, 23, 4, 2, seed=4, per_block=False)
    key_mask = torch.ones(2, 23, dtype=torch.bool)
    key_mask[1, :5] = False
    got = block_sparse_attention(q, k, v, blocks, block=4, causal=True, scale=0.5, key_mask=key_mask, offsets=offsets)
    want = oracle(q, k, v, blocks, block=4, causal=True, scale=0.5, key_mask=key_mask, offsets=offsets)
    assert torch.allclose(got.to(F64), want, atol=2e-6)
    # The same offset in every row tiles by blocks; a query before its row's offset is a zero row.
    q2, k2, v2 = _inputs(1, 2, 2, 9, 9, 4, 4, seed=5)
    lists = _random_lists(1, 9, 9, 4, 2, seed=6, offset=2)
    got = block_sparse_attention(q2, k2, v2, lists, block=4, causal=False, scale=0.5, offsets=torch.tensor([2]))
    want = oracle(q2, k2, v2, lists, block=4, causal=False, scale=0.5, offsets=torch.tensor([2]))
    assert torch.allclose(got.to(F64), want, atol=2e-6) and float(got[0, :, :2].abs().max()) == 0.0


@pytest.mark.parametrize("causal", [True, False])
def test_one_decoding_query_equals_the_oracle(causal):
    q, k, v = _inputs(2, 4, 2, 1, 37, 8, 6, seed=3)
    lists = _random_lists(2, 1, 37, 4, 3, seed=5, per_block=False)
    lists[1, 0] = torch.tensor([9, -1, 2])  # the last, partial block (key 36 only), an empty slot
    got = block_sparse_attention(q, k, v, lists, block=4, causal=causal, scale=0.4)
    assert torch.allclose(got.to(F64), oracle(q, k, v, lists, block=4, causal=causal, scale=0.4), atol=2e-6)


def test_a_query_that_sees_nothing_gets_zeros_and_fp64_stays_fp64():
    q, k, v = _inputs(1, 2, 2, 8, 8, 4, 4, seed=7, dtype=F64)
    blocks = torch.full((1, 8, 2), -1, dtype=torch.long)
    blocks[0, 4:, 0] = 1  # the second half reads its own block; the first half reads nothing
    got = block_sparse_attention(q, k, v, blocks, block=4, causal=True, scale=0.5)
    assert got.dtype == F64 and float(got[0, :, :4].abs().max()) == 0.0
    assert torch.allclose(got, oracle(q, k, v, blocks, block=4, causal=True, scale=0.5), atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_a_query_with_an_empty_list_reads_nothing_beside_listed_ones_in_its_block(causal):
    """A prefill masks its padded rows' lists to −1: a right-padded row's tail inside its last block,
    or a hole at a block's first query, reads nothing, and the block's other queries read their list."""
    q, k, v = _inputs(2, 4, 2, 21, 21, 8, 6, seed=8)
    blocks = _random_lists(2, 21, 21, 4, 3, seed=9)
    blocks[0, 14:] = -1  # row 0: real up to position 13, the rest of block 3 and block 4 padding
    blocks[1, 8] = -1  # row 1: a hole at the first query of block 2
    key_mask = torch.ones(2, 21, dtype=torch.bool)
    key_mask[0, 14:] = False
    got = gathered_attention(q, k, v, blocks, block=4, causal=causal, scale=0.4, key_mask=key_mask)
    want = oracle(q, k, v, blocks, block=4, causal=causal, scale=0.4, key_mask=key_mask)
    assert float(got[0, :, 14:].abs().max()) == 0.0 and float(got[1, :, 8].abs().max()) == 0.0
    assert torch.allclose(got.to(F64), want, atol=2e-6), (got.to(F64) - want).abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("causal, padded", [(True, False), (False, True)])
def test_flex_path_equals_the_oracle(causal, padded):
    # The prefill path (compiled FlexAttention, a few seconds the first time in a process).
    q, k, v = _inputs(2, 4, 2, 70, 70, 16, 16, seed=8)
    blocks = _random_lists(2, 70, 70, 16, 3, seed=9)
    key_mask = None
    if padded:
        key_mask = torch.ones(2, 70, dtype=torch.bool)
        key_mask[1, 60:] = False
    got = flex_attention_cpu(q, k, v, blocks[:, ::16], block=16, causal=causal, scale=0.3, key_mask=key_mask)
    want = oracle(q, k, v, blocks, block=16, causal=causal, scale=0.3, key_mask=key_mask)
    real = torch.ones(2, 70, dtype=torch.bool) if key_mask is None else key_mask
    assert torch.allclose(got.to(F64)[real[:, None, :, None].expand_as(got)], want[real[:, None, :, None].expand_as(want)],
                          atol=3e-6)


def test_the_op_has_a_gradient_and_says_what_is_wrong():
    q, k, v = _inputs(1, 2, 2, 8, 8, 4, 4, seed=10, dtype=F64)
    blocks = _random_lists(1, 8, 8, 4, 2, seed=11)
    q.requires_grad_(True)
    torch.autograd.gradcheck(lambda q_: block_sparse_attention(q_, k, v, blocks, block=4, causal=True, scale=0.5), (q,))
    with pytest.raises(ValueError, match=r"blocks must be an int tensor \[B, Nq, K\]"):
        block_sparse_attention(q, k, v, blocks.float(), block=4, causal=True)
    with pytest.raises(ValueError, match="block must be a positive int"):
        block_sparse_attention(q, k, v, blocks, block=0, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_are_the_oracles_where_a_tile_holds_padding_and_queries_that_see_nothing(causal):
    # 10 queries in blocks of 4: the last tile is padded, and row 1 leads with 3 pad columns (queries
    # that see no key). Every gradient must be finite and equal the fp64 oracle's.
    B, H, Hkv, N, D, b = 2, 4, 2, 10, 4, 4
    q, k, v = _inputs(B, H, Hkv, N, N, D, D, seed=12, dtype=F64)
    offsets = torch.tensor([0, 3])
    key_mask = torch.arange(N)[None] >= offsets[:, None]
    blocks = torch.cat([_random_lists(1, N, N, b, 2, seed=13), _random_lists(1, N, N, b, 2, seed=14, offset=3)])
    weights = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(15), dtype=F64)
    grads = []
    for fn in (lambda *t: block_sparse_attention(*t, blocks, block=b, causal=causal, scale=0.5, key_mask=key_mask,
                                                 offsets=offsets),
               lambda *t: oracle(*t, blocks, block=b, causal=causal, scale=0.5, key_mask=key_mask, offsets=offsets)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        (fn(*leaves) * weights).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# the selection
# ---------------------------------------------------------------------------------------------


def test_choose_blocks_keeps_sinks_and_window_and_the_heaviest_candidates():
    rule = BlockRule(block=4, top_k=2, window=1, sinks=1, probes=2, causal=True)
    # Query block 6 of 7: forced 0 (sink), 5 and 6 (window); candidates 1..4.
    mass = torch.zeros(1, 1, 7, dtype=F64)
    mass[0, 0, [1, 2, 3, 4]] = torch.tensor([0.1, 0.5, 0.5, 0.2], dtype=F64)
    got = choose_blocks(mass, torch.tensor([[6]]), torch.tensor([7]), rule, 7)
    assert got.tolist() == [[[0, 2, 3, 5, 6]]]
    # A tie is broken towards the earlier block; block 6 cannot read 7 (causal).
    mass[0, 0, 3] = mass[0, 0, 4] = 0.1  # blocks 1, 3 and 4 tie
    mass = torch.cat([mass, torch.ones(1, 1, 1, dtype=F64)], dim=-1)
    got = choose_blocks(mass, torch.tensor([[6]]), torch.tensor([8]), rule, 8)
    assert got.tolist() == [[[0, 1, 2, 5, 6]]]
    # A mass threshold stops early: the sink and window already hold 0.5 of 1.4; block 2 (0.5) brings it to 1.0.
    heavy = BlockRule(block=4, top_k=2, window=1, sinks=1, probes=2, causal=True, mass=0.7)
    mass = torch.tensor([[[0.2, 0.1, 0.5, 0.1, 0.2, 0.1, 0.2]]], dtype=F64)
    got = choose_blocks(mass, torch.tensor([[6]]), torch.tensor([7]), heavy, 7)
    assert got.tolist() == [[[0, 2, 5, 6, -1]]]


def test_block_scores_are_the_softmax_of_quest_bounds():
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 1, 3, 3, dtype=F64, generator=g)  # 4 heads, 1 query block, 3 probes
    k = torch.randn(2, 2, 10, 3, dtype=F64, generator=g)
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[1, 4:8] = False  # row 1's block 1 has no real key
    keep[0, 2] = False
    lo, hi, has_key = key_bounds(k, keep, 4)
    assert has_key.tolist() == [[True, True, True], [True, False, True]]
    present = torch.tensor([[[True, True, True]], [[False, True, True]]])
    visible = torch.tensor([[[True, True, False]], [[True, True, True]]])
    got = bound_mass(q, present, lo, hi, visible & has_key[:, None], 0.7)
    want = torch.zeros(2, 3, dtype=F64)
    for b in range(2):
        for h in range(4):
            for p in range(3):
                if not present[b, 0, p]:
                    continue
                blocks = [j for j in range(3) if visible[b, 0, j] and keep[b, 4 * j:4 * j + 4].any()]
                bound = []
                for j in blocks:
                    keys = [n for n in range(4 * j, min(10, 4 * j + 4)) if keep[b, n]]
                    kj = k[b, h // 2, keys]  # [n, D]
                    bound.append(sum(max(float(q[b, h, 0, p, d]) * float(kj[:, d].min()),
                                         float(q[b, h, 0, p, d]) * float(kj[:, d].max())) for d in range(3)))
                    assert bound[-1] >= float((kj @ q[b, h, 0, p]).max()) - 1e-12  # an upper bound of its keys
                w = torch.softmax(0.7 * torch.tensor(bound, dtype=F64), 0)
                for n, j in enumerate(blocks):
                    want[b, j] += w[n]
    assert torch.allclose(got[:, 0], want, atol=1e-12)
    assert abs(float(got[0].sum()) - 12.0) < 1e-9 and abs(float(got[1].sum()) - 8.0) < 1e-9


RULE = BlockRule(block=4, top_k=2, window=1, sinks=1, probes=3, causal=True)


def _anchor(B, N, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, N, 8, generator=g), torch.randn(B, 2, N, 8, generator=g)


def test_prefill_selection_reads_only_earlier_probes():
    q, k = _anchor(1, 40, 13)
    sel = select_positions(q, k, None, RULE, 0.35)
    # Changing the queries of block 7 changes no block's choice up to 7 (probes come before a block).
    q2 = q.clone()
    q2[:, :, 28:32] = torch.randn(1, 4, 4, 8)
    sel2 = select_positions(q2, k, None, RULE, 0.35)
    assert torch.equal(sel[:, :8], sel2[:, :8])
    # Block 9's probes are positions 33..35: the selection follows them.
    q3 = q.clone()
    q3[:, :, 33:36] = 10 * k[:, :, 9:10].repeat_interleave(2, 1)  # every probe points at key 9 (block 2)
    k3 = k.clone()
    k3[:, :, 9] *= 3  # and key 9 stands out of its block
    assert 2 in select_positions(q3, k3, None, RULE, 0.35)[0, 9].tolist()
    assert 2 not in select_positions(q, k, None, RULE, 0.35)[0, 9].tolist()


def _in_calls(q, k, rule, split):
    """The blocks select_call gives the queries of calls of `split` tokens each, after each other."""
    state, got, done = None, [], 0
    for n in split:
        sel, state = select_call(q[:, :, done:done + n], k[:, :, : done + n], None, rule, 0.35, state)
        got.append(sel.blocks_BQK)
        done += n
    return torch.cat(got, dim=1)


@pytest.mark.parametrize("split", [[40], [17, 1, 1, 1, 20], [1] * 40, [4, 4, 32]])
def test_prefill_and_decoding_select_the_same_blocks(split):
    q, k = _anchor(2, 40, 14)
    full, _ = select_call(q, k, None, RULE, 0.35, None)
    assert torch.equal(_in_calls(q, k, RULE, split), full.blocks_BQK)


def test_decoding_keeps_block_bounds_and_a_crop_forgets_the_ones_it_cut():
    # Decoding summarises each key block once (the state's bounds); a crop across a block start, then
    # other keys there, must select what a prefill of the new sequence selects.
    q, k = _anchor(2, 40, 17)
    state, cols = select_call(q[:, :, :21], k[:, :, :21], None, RULE, 0.35, None)[1], 21
    for _ in range(4):  # across the start of block 6 (position 24): the bounds of blocks 0..5 are kept
        state = select_call(q[:, :, cols:cols + 1], k[:, :, :cols + 1], None, RULE, 0.35, state)[1]
        cols += 1
    assert state.lo_BHkvJD.shape[2] == 6
    state = state.crop(3, RULE)  # back to 22 positions: block 5 (20..23) is cut
    cols -= 3
    q2, k2 = q.clone(), k.clone()
    q2[:, :, cols:], k2[:, :, cols:] = torch.randn(2, 4, 40 - cols, 8), 4 * torch.randn(2, 2, 40 - cols, 8)
    full, _ = select_call(q2, k2, None, RULE, 0.35, None)
    for _ in range(40 - cols):
        sel, state = select_call(q2[:, :, cols:cols + 1], k2[:, :, :cols + 1], None, RULE, 0.35, state)
        assert torch.equal(sel.blocks_BQK, full.blocks_BQK[:, cols:cols + 1]), cols
        cols += 1


def test_the_hot_path_step_reads_the_row_select_call_would_and_steps_aside_elsewhere():
    """in_block_step (decoding's hot path): inside a block, the history row select_call's own list is
    and the same state after; at a block start, past a crop's columns, or with a padded row, None."""
    q, k = _anchor(2, 40, 21)
    state = select_call(q[:, :, :21], k[:, :, :21], None, RULE, 0.35, None)[1]
    for c in range(21, 40):
        got = in_block_step(q[:, :, c:c + 1], c + 1, RULE, state)
        sel, after = select_call(q[:, :, c:c + 1], k[:, :, :c + 1], None, RULE, 0.35, state)
        if c % RULE.block == 0:
            assert got is None, c
        else:
            m, hot = got
            assert m == c // RULE.block and torch.equal(state.history_BMK[:, m:m + 1], sel.blocks_BQK)
            assert len(hot.pending) == len(after.pending) and all(torch.equal(a, b) for a, b in zip(hot.pending, after.pending))
            assert torch.equal(hot.seen(), after.seen()) and hot.history_BMK is after.history_BMK
            assert in_block_step(q[:, :, c:c + 1], c + 2, RULE, state) is None  # the cache is a column ahead
        state = after
    state = state.crop(6, RULE)  # back to 34 positions: the history keeps rows for blocks 8 and 9, emptied
    assert state.history_BMK.shape[1] == 10
    for c in (34, 35):
        got = in_block_step(q[:, :, c:c + 1], c + 1, RULE, state)
        assert got is not None and got[0] == 8
        state = got[1]
    assert in_block_step(q[:, :, 36:37], 37, RULE, state) is None  # block 9 starts: a choice to make
    padded = select_call(q[:, :, :21], k[:, :, :21], torch.arange(21) >= torch.tensor([[0], [3]]), RULE, 0.35,
                         None)[1]
    assert in_block_step(q[:, :, 21:22], 22, RULE, padded) is None


@pytest.mark.parametrize("split", [[1] * 160, [9] + [1] * 151])
def test_probes_as_long_as_a_block_decode_like_a_prefill(split):
    # probes = block (the default): a block's first probe is the previous block's first query, which
    # decoding wrote into its stash one block start earlier; the others it only held since then.
    rule = BlockRule(block=4, top_k=1, window=0, sinks=1, probes=4, causal=True)
    q, k = _anchor(2, 160, 19)
    full, _ = select_call(q, k, None, rule, 0.35, None)
    assert torch.equal(_in_calls(q, k, rule, split), full.blocks_BQK)


def test_a_block_longer_than_the_stash_decodes_like_a_prefill():
    # 160-token blocks, a stash of 4 probes + 128: decoding holds the queries of a block's steps and
    # writes them into the stash once it would hold more than the stash (inside block 0), and at
    # every block start after.
    rule = BlockRule(block=160, top_k=1, window=0, sinks=1, probes=4, causal=True)
    q, k = _anchor(1, 500, 18)
    full, _ = select_call(q, k, None, rule, 0.35, None)
    sel, state = select_call(q[:, :, :10], k[:, :, :10], None, rule, 0.35, None)
    got = [sel.blocks_BQK]
    for c in range(10, 500):
        sel, state = select_call(q[:, :, c:c + 1], k[:, :, :c + 1], None, rule, 0.35, state)
        got.append(sel.blocks_BQK)
        assert len(state.pending) <= state.stash_BHWD.shape[2]
    assert torch.equal(torch.cat(got, 1), full.blocks_BQK)


def test_a_left_padded_row_selects_what_it_selects_alone_and_crop_goes_back():
    q, k = _anchor(1, 30, 15)
    alone, _ = select_call(q, k, None, RULE, 0.35, None)
    pad = 5
    qp = torch.cat([torch.randn(1, 4, pad, 8), q], dim=2)
    kp = torch.cat([torch.randn(1, 2, pad, 8), k], dim=2)
    keep = torch.ones(1, 30 + pad, dtype=torch.bool)
    keep[:, :pad] = False
    padded, state = select_call(qp[:, :, :25], kp[:, :, :25], keep[:, :25], RULE, 0.35, None)
    assert torch.equal(padded.blocks_BQK[:, pad:], alone.blocks_BQK[:, :20])
    assert bool((padded.blocks_BQK[:, :pad] == -1).all())
    cols = 25
    for _ in range(10):  # then decode one token at a time
        sel, state = select_call(qp[:, :, cols:cols + 1], kp[:, :, :cols + 1], keep[:, :cols + 1], RULE, 0.35, state)
        assert torch.equal(sel.blocks_BQK[:, 0], alone.blocks_BQK[:, cols - pad]), cols
        cols += 1
    # Drop 3 tokens (assisted decoding), decode them again: the same selection.
    state = state.crop(3, RULE)
    cols -= 3
    for _ in range(3):
        sel, state = select_call(qp[:, :, cols:cols + 1], kp[:, :, :cols + 1], keep[:, :cols + 1], RULE, 0.35, state)
        assert torch.equal(sel.blocks_BQK[:, 0], alone.blocks_BQK[:, cols - pad])
        cols += 1
    with pytest.raises(ValueError, match="at most 128 tokens"):
        state.crop(129, RULE)


def test_a_crop_into_a_rows_leading_padding_selects_like_a_prefill_of_what_is_left():
    # Row 1 leads with 12 pads; dropping all but 8 columns leaves it pads only (HF's crop allows it).
    # Continuing with 32 real tokens per row must select what one prefill of the whole result does.
    q, k = _anchor(2, 40, 21)
    keep = torch.ones(2, 40, dtype=torch.bool)
    keep[1, :12] = False
    _, state = select_call(q, k, keep, RULE, 0.35, None)
    state = state.crop(32, RULE)
    q2, k2 = _anchor(2, 40, 22)
    q2[:, :, :8], k2[:, :, :8] = q[:, :, :8], k[:, :, :8]
    keep2 = torch.ones(2, 40, dtype=torch.bool)
    keep2[1, :8] = False
    got, _ = select_call(q2[:, :, 8:], k2, keep2, RULE, 0.35, state)
    want, _ = select_call(q2, k2, keep2, RULE, 0.35, None)
    assert torch.equal(got.blocks_BQK, want.blocks_BQK[:, 8:])
    with pytest.raises(ValueError, match="cannot drop 41 tokens from a sequence of 40"):
        select_call(q, k, keep, RULE, 0.35, None)[1].crop(41, RULE)


@pytest.mark.parametrize("rule", [RULE, BlockRule(block=4, top_k=3, window=0, sinks=0, probes=4, causal=True, mass=0.5)])
@pytest.mark.parametrize("split", [[30], [17, 1, 1, 1, 10], [1] * 30, [5, 5, 20]])
def test_the_graph_selection_equals_the_cached_one(rule, split):
    # select_span (fixed-size state, no Python over the data: the exported decode step) against
    # select_call (a prefill of 20 columns, then one token at a time), row 1 left-padded by 5.
    q, k = _anchor(2, 30, 16)
    keep = torch.ones(2, 30, dtype=torch.bool)
    keep[1, :5] = False
    sel, state = select_call(q[:, :, :20], k[:, :, :20], keep[:, :20], rule, 0.35, None)
    want = [sel.blocks_BQK]
    for c in range(20, 30):
        sel, state = select_call(q[:, :, c:c + 1], k[:, :, :c + 1], keep[:, :c + 1], rule, 0.35, state)
        want.append(sel.blocks_BQK)
    stash, current, got, done = torch.zeros(2, 4, rule.probes, 8), torch.zeros(2, rule.slots, dtype=torch.long), [], 0
    for n in split:
        blocks, _, stash, current = select_span(q[:, :, done:done + n], k[:, :, :done + n], keep[:, :done + n], rule,
                                                0.35, stash, current)
        got.append(blocks)
        done += n
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))


def test_a_tie_is_broken_alike_whatever_the_rounding():
    # Zero probes (a pad token's embedding) spread their mass evenly: the sums differ in the last bits
    # between a prefill and a decoding step, and the earlier block must still win both times.
    rule = BlockRule(block=2, top_k=1, window=0, sinks=0, probes=2, causal=True)
    even = torch.full((1, 1, 7), 8 / 7, dtype=F64)
    noisy = even.clone()
    noisy[0, 0, 4] += 1.2e-7
    for mass in (even, noisy):
        assert choose_blocks(mass, torch.tensor([[6]]), torch.tensor([7]), rule, 7).tolist() == [[[0, 6]]]
    clear = even.clone()
    clear[0, 0, 4] += 1e-3  # a real difference still wins
    assert choose_blocks(clear, torch.tensor([[6]]), torch.tensor([7]), rule, 7).tolist() == [[[4, 6]]]
