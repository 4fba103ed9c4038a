"""The reuse form in compiled models: cached decoding equals the full forward of the reused model (per
step, with left padding), a padded row equals the row alone, the measured plan (overlap matrix,
anchors) is in the report and survives save/load, the DP planner and the overlap by hand, and each
bad input's one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import attnopt
from attnopt import PolicyError
from attnopt.forms.reuse.form import ReusedSite
from attnopt.forms.reuse.heatmap import overlap_heatmap_html
from attnopt.forms.reuse.plan import MISSED_TARGET, choose_anchors, overlap_matrix
from attnopt.forms.reuse.selection import BlockRule, select_positions

transformers = pytest.importorskip("transformers")

VOCAB = 97
SMALL = "reuse:1+block:4+every:2+probes:2"  # layers 0, 2 anchor; 1, 3 reuse; 4 exact


def _llama(layers=5, seed=0):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(b, n, seed=1):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def small(llama):
    return attnopt.compile(llama, SMALL, example_inputs={"input_ids": _ids(2, 40), "use_cache": False},
                           tolerance=10.0, e2e_tolerance=None)


def _forward(model, ids, mask):
    pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits


def test_every_third_layer_anchors_and_the_others_read_its_blocks(small):
    rep = small.attnopt_report
    # An anchor is kept exact by the form's own plan, on purpose: kept, not unsupported.
    assert [str(r.outcome.status) for r in rep.sites] == ["kept", "rewritten", "kept", "rewritten", "kept"]
    assert "layer 2 is an anchor (every 2)" in rep.sites[2].outcome.reason
    assert (rep.sites[2].outcome.planned_form, rep.sites[2].outcome.final_form) == ("reuse", "exact")
    assert rep.totals["unsupported"] == 0
    anchors = {m.geometry.site_id: m.anchor_id for m in small.modules() if isinstance(m, attnopt.forms.SiteModule)}
    ids = [r.site.id for r in rep.sites]
    assert anchors == {ids[1]: ids[0], ids[3]: ids[2]}


def test_cached_decoding_equals_the_full_forward_step_by_step_with_left_padding(llama, small):
    ids, mask = _ids(2, 30, seed=4), torch.ones(2, 30, dtype=torch.long)
    ids[1, :5], mask[1, :5] = 0, 0  # row 1 left-padded
    with torch.no_grad():
        gen = small.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(gen.logits, 1)  # what each decoding step read its token from
    full_mask = torch.cat([mask, torch.ones(2, 12, dtype=torch.long)], 1)
    full = _forward(small, gen.sequences, full_mask)[:, 29:-1]
    assert (steps - full).abs().max() < 1e-4
    # Both are the reused model, not the original (which differs), and a padded row is the row alone.
    assert (full - _forward(llama, gen.sequences, full_mask)[:, 29:-1]).abs().max() > 1e-2
    alone = _forward(small, gen.sequences[1:, 5:], full_mask[1:, 5:])[:, 24:-1]
    assert (alone - full[1:]).abs().max() < 1e-4


def test_below_min_seq_len_the_reused_model_is_the_original_and_decoding_crosses_it_like_a_prefill(llama):
    # Every layer is exact up to each row's T-th real token (anchors always, reused layers by the
    # threshold): those logits are the original's. Past T the reused layers read their lists, and
    # decoding from a prompt shorter than T, across T and several block starts, equals the full forward.
    T = 22  # (the plain form reads every block up to position 16: 4 slots of 4)
    opt = attnopt.compile(llama, SMALL + f"+min_seq_len:{T}", example_inputs={"input_ids": _ids(2, 40),
                          "use_cache": False}, tolerance=10.0, e2e_tolerance=None)
    assert all(m.min_seq_len == T and m.rule.exact_below == T for m in opt.modules() if hasattr(m, "rule"))
    ids, mask = _ids(2, 9, seed=5), torch.ones(2, 9, dtype=torch.long)
    ids[1, :3], mask[1, :3] = 0, 0  # row 1: 3 leading pads, so its T-th real token is 3 columns later
    with torch.no_grad():
        gen = opt.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
    steps = torch.stack(gen.logits, 1)
    full_mask = torch.cat([mask, torch.ones(2, 24, dtype=torch.long)], 1)
    full = _forward(opt, gen.sequences, full_mask)
    assert (steps - full[:, 8:-1]).abs().max() < 1e-4
    original = _forward(llama, gen.sequences, full_mask)
    for row, lead in enumerate((0, 3)):
        inside, past = slice(lead, lead + T), slice(lead + T, None)
        assert (full[row, inside] - original[row, inside]).abs().max() < 1e-4
        assert (full[row, past] - original[row, past]).abs().max() > 1e-2
    # One reused layer: its rows below T are exact attention (an fp64 oracle), the rest the form's rows.
    site = next(m for m in opt.modules() if isinstance(m, ReusedSite))
    g = torch.Generator().manual_seed(9)
    q, k, v, q_a, k_a = (torch.randn(2, h, 33, 8, generator=g) for h in (6, 2, 2, 6, 2))
    with torch.no_grad():
        got = site(q, k, v, anchor=(q_a, k_a))
        site.min_seq_len = 0
        form = site(q, k, v, anchor=(q_a, k_a))
        site.min_seq_len = T
    s = (q.double() @ k.double().repeat_interleave(3, 1).transpose(-1, -2)) * site.geometry.scale
    s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
    exact = s.softmax(-1) @ v.double().repeat_interleave(3, 1)
    assert (got[:, :, :T].double() - exact[:, :, :T]).abs().max() < 1e-5
    assert torch.equal(got[:, :, T:], form[:, :, T:]) and (form[:, :, :T].double() - exact[:, :, :T]).abs().max() > 1e-2


def test_a_chunked_prefill_and_beam_reordering_keep_the_selection(small):
    ids = _ids(1, 27, seed=6)
    with torch.no_grad():
        whole = small(input_ids=ids, use_cache=True)
        cache = whole.past_key_values
        nxt = small(input_ids=ids[:, :1] + 1, past_key_values=cache, use_cache=True).logits
        from attnopt.hf.cache import make_cache

        chunked = make_cache(small)
        for a, b in ((0, 10), (10, 11), (11, 27)):
            small(input_ids=ids[:, a:b], past_key_values=chunked, use_cache=True)
        nxt_c = small(input_ids=ids[:, :1] + 1, past_key_values=chunked, use_cache=True).logits
    assert (nxt - nxt_c).abs().max() < 1e-5
    state = chunked.layers[1].selection
    chunked.layers[1].batch_repeat_interleave(3)
    assert chunked.layers[1].selection.stash_BHWD.shape[0] == 3 and torch.equal(
        chunked.layers[1].selection.history_BMK[2], state.history_BMK[0])


@pytest.fixture(scope="module")
def measured(llama):
    batches = [{"input_ids": _ids(2, 48, seed=s), "use_cache": False} for s in (7, 8)]
    return attnopt.compile(llama, "reuse:1+block:4+probes:2+overlap:0.3", example_inputs=batches[0],
                           calibration=batches[1:], tolerance=10.0, e2e_tolerance=None)


def test_the_measured_plan_is_in_the_report_and_in_the_modules(measured):
    rep = measured.attnopt_report
    plan = rep.counts["verify"]["plans"]["reuse"]
    ids, overlap = plan["site_ids"], plan["overlap"]
    assert ids == [r.site.id for r in rep.sites] and plan["threshold"] == 0.3
    assert all(overlap[i][j] is None for i in range(5) for j in range(i, 5))
    assert all(0.0 <= overlap[i][j] <= 1.0 for i in range(5) for j in range(i))
    anchors, reuse = choose_anchors(overlap, 0.3)
    assert plan["reuse"] == {ids[m]: ids[a] for m, a in reuse.items()} and plan["reuse"]  # something is reused
    modules = {m.geometry.site_id: m.anchor_id for m in measured.modules() if isinstance(m, attnopt.forms.SiteModule)}
    assert modules == plan["reuse"]
    for r in rep.sites[1:-1]:
        if r.site.id not in plan["reuse"]:  # an anchor, or a layer no earlier one serves: kept on purpose
            assert "measured plan" in r.outcome.reason and str(r.outcome.status) == "kept"
    page = rep.to_html()
    assert "Cross-layer block overlap" in page and page.count('stroke="#e8590c"') == len(plan["reuse"])
    assert rep.from_dict(rep.to_dict()).counts["verify"]["plans"]["reuse"]["overlap"] == overlap


RECALL = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "recall_lm"


@pytest.mark.skipif(not (RECALL / "model.safetensors").is_file(), reason="benchmarks/data/recall_lm is not trained yet")
def test_layers_a_measured_plan_keeps_exact_are_kept_not_unsupported():
    # recall_lm's layers attend to different blocks at 256 tokens: its measured plan keeps layer 1 exact
    # (no earlier layer serves it) and makes layer 2 the anchor of layers 3 and 4.
    model = transformers.LlamaForCausalLM.from_pretrained(RECALL).eval()
    ids = transformers.AutoTokenizer.from_pretrained(RECALL)((RECALL / "heldout.txt").read_text()[:2000],
                                                             return_tensors="pt").input_ids[:, :256]
    opt = attnopt.compile(model, "reuse+block:16", example_inputs={"input_ids": ids, "use_cache": False},
                          e2e_tolerance=None)
    rep = opt.attnopt_report
    plan = rep.counts["verify"]["plans"]["reuse"]
    assert [str(r.outcome.status) for r in rep.sites] == ["kept", "kept", "kept", "rewritten", "rewritten", "kept"]
    assert set(plan["reuse"].values()) == {rep.sites[2].site.id} and rep.totals["unsupported"] == 0
    assert "measured plan keeps it exact" in rep.sites[1].outcome.reason
    assert "an anchor in the measured plan" in rep.sites[2].outcome.reason
    for r in rep.sites[1:3]:
        assert r.outcome.planned_form == "reuse" and [str(t.verdict) for t in r.outcome.tried] == ["kept_by_plan"]


def test_a_measured_plan_comes_back_from_disk(measured, tmp_path):
    ids = _ids(1, 50, seed=9)
    loaded = attnopt.load(attnopt.save(measured, tmp_path / "m"))
    got = {m.geometry.site_id: m.anchor_id for m in loaded.modules() if isinstance(m, attnopt.forms.SiteModule)}
    assert got == measured.attnopt_report.counts["verify"]["plans"]["reuse"]["reuse"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, measured(input_ids=ids).logits)


def test_choose_anchors_by_dynamic_programming():
    o = [[None] * 5, [0.9, None, None, None, None], [0.2, 0.8, None, None, None], [0.1, 0.3, 0.9, None, None],
         [0.5, 0.5, 0.5, 0.5, None]]
    # 0 anchors 1; 2 cannot read 0 (0.2): 1 would anchor 2, but then 3 (0.3 on 1) needs its own: 2 anchors 3.
    assert choose_anchors(o, 0.7) == ([0, 2], {1: 0, 3: 2})
    assert choose_anchors(o, 0.05) == ([0], {1: 0, 2: 0, 3: 0})  # the last site stays exact
    assert choose_anchors(o, 0.95) == ([], {})
    assert choose_anchors(o, 0.05, keep_last=False) == ([0], {1: 0, 2: 0, 3: 0, 4: 0})
    o[3][2] = None  # shapes that differ cannot be reused across
    assert choose_anchors(o, 0.7) == ([0], {1: 0})


def _served_by_hand(q, k, anchor_q, anchor_k, rule, scale):
    """The share of q's rows (worst head) whose heaviest block outside the anchor's lists holds less
    than MISSED_TARGET of the row's softmax, row by row (dense softmax, block sums in a loop)."""
    lists = select_positions(anchor_q, anchor_k, None, rule, scale)[0]  # [M, K], tested in tests/kernels
    N, b = q.shape[2], rule.block
    M = -(-N // b)
    worst = 1.0
    for h in range(q.shape[1]):
        served = rows = 0
        for i in range(N):
            m = i // b
            if rule.candidates(m, M) <= rule.fits:  # this block reads everything it sees
                continue
            p = torch.softmax(torch.stack([scale * (q[0, h, i].double() @ k[0, h, j].double()) for j in range(i + 1)]), 0)
            listed = {int(x) for x in lists[m] if int(x) >= 0}
            missed = max((float(p[j * b:min((j + 1) * b, i + 1)].sum()) for j in range(m + 1) if j not in listed),
                         default=0.0)
            served += missed < MISSED_TARGET
            rows += 1
        worst = min(worst, served / rows)
    return worst


def test_overlap_is_the_share_of_a_layer_s_rows_whose_target_its_anchor_s_blocks_hold():
    from attnopt.ir.calls import SiteCall

    rule = BlockRule(block=4, top_k=1, window=0, sinks=0, probes=4, causal=True)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    # c: sharper attention (scaled keys), so some rows look at one block the anchor does not list
    q2, k2 = torch.randn(1, 2, 40, 8, generator=g), 3 * torch.randn(1, 2, 40, 8, generator=g)
    calls = {s: [SiteCall(a, b, b, None, a)] for s, (a, b) in {"a": (q, k), "b": (q, k), "c": (q2, k2)}.items()}
    rules, scales, keep = ({s: rule for s in "abc"}, {s: 0.3 for s in "abc"}, {s: "true" for s in "abc"})
    o = overlap_matrix(["a", "b", "c"], calls, rules, scales, keep)
    assert o[1][0] == pytest.approx(_served_by_hand(q, k, q, k, rule, 0.3))
    assert o[2][0] == pytest.approx(_served_by_hand(q2, k2, q, k, rule, 0.3)) == pytest.approx(o[2][1])
    assert o[2][0] < o[1][0] < 1.0  # the sharp layer is served worse; the worst head is not the mean
    html = overlap_heatmap_html({"site_ids": ["a", "b", "c"], "layers": [0, 1, 2], "overlap": o,
                                 "reuse": {"b": "a"}, "threshold": 0.5, "rule": {"block": 4}}, "t")
    assert html.count("<rect") == 3 and html.count('stroke="#e8590c"') == 1


@pytest.mark.parametrize("spec, message", [
    ("reuse+anchor:0+every:2", "give anchor or every, not both"),
    ("reuse+block:8+probes:16", "probes 16 > block 8"),
    ("reuse:-1", "must be >= 0"),
    ("reuse+mass:0", "parameter .mass. got 0.0; must be > 0"),
])
def test_bad_parameters_say_what_to_change(spec, message):
    with pytest.raises(PolicyError, match=message):
        attnopt.Policy.parse(spec)


def test_a_reused_layer_called_alone_says_it_needs_its_anchor(small):
    module = next(m for m in small.modules() if isinstance(m, attnopt.forms.SiteModule))
    q = torch.randn(1, 6, 40, 8)
    k = torch.randn(1, 2, 40, 8)
    with pytest.raises(ValueError, match="needs anchor="):
        module(q, k, k)


@pytest.mark.slow
def test_minilm_keeps_its_embeddings_on_passages_compile_never_saw(minilm):
    # Bidirectional, 512 tokens, blocks of 32 (16 per row), 6 of them read per query block; anchors
    # measured on passages 0-3, cosine measured on passages 4-7.
    from pathlib import Path

    model, tok = minilm
    words = (Path(__file__).resolve().parents[2] / "benchmarks/data/passages.txt").read_text().split()
    chunks = [" ".join(words[i * 420:(i + 1) * 420]) for i in range(8)]
    enc = [dict(tok(chunks[i:i + 2], return_tensors="pt", truncation=True, max_length=512, padding="max_length"))
           for i in range(0, 8, 2)]
    opt = attnopt.compile(model, "reuse:2+block:32", example_inputs=enc[0], calibration=enc[1:2], e2e_tolerance=None,
                          dispatch="off")
    assert opt.attnopt_report.count("rewritten") >= 1
    for batch in enc[2:]:
        with torch.no_grad():
            a, b = opt(**batch).last_hidden_state, model(**batch).last_hidden_state
        w = batch["attention_mask"][..., None].double()
        cos = torch.nn.functional.cosine_similarity((a.double() * w).sum(1), (b.double() * w).sum(1), -1)
        assert float(cos.min()) >= 0.98, cos
    # Bidirectional under min_seq_len: a call shorter than it is exact attention, one as long the form.
    sites = [m for m in opt.modules() if isinstance(m, ReusedSite)]
    with torch.no_grad():
        form = opt(**enc[2]).last_hidden_state
        for m in sites:
            m.min_seq_len = 513
        exact = opt(**enc[2]).last_hidden_state
        for m in sites:
            m.min_seq_len = 512
        at_threshold = opt(**enc[2]).last_hidden_state
        original = model(**enc[2]).last_hidden_state
    assert (exact - original).abs().max() < 1e-4 < (form - original).abs().max()
    assert torch.equal(at_threshold, form)


@pytest.mark.parametrize("batch", [1, 3])
def test_decoding_from_the_gathered_slab_equals_the_full_forward_across_blocks(llama, small, batch):
    """Unpadded rows decode from each reused layer's slab (decoding.py: its blocks gathered once per
    block, then one column appended per token): 18 steps cross four blocks of 4, so the slab is
    gathered again at each block start and appended to in between."""
    from attnopt.hf.cache import make_cache

    ids = _ids(batch, 21, seed=9)
    cache = make_cache(small)
    with torch.no_grad():
        gen = small.generate(input_ids=ids, max_new_tokens=18, do_sample=False, pad_token_id=0, past_key_values=cache,
                             output_logits=True, return_dict_in_generate=True)
    slabs = [layer.slab for layer in cache.layers if getattr(layer, "slab", None) is not None]
    assert len(slabs) == 2 and all(s.covered == 21 + 17 and s.length > 4 for s in slabs)  # the slab path ran
    steps = torch.stack(gen.logits, 1)
    full = _forward(small, gen.sequences, torch.ones_like(gen.sequences))[:, 20:-1]
    assert (steps - full).abs().max() < 1e-4
    assert (full - _forward(llama, gen.sequences, torch.ones_like(gen.sequences))[:, 20:-1]).abs().max() > 1e-2


@pytest.mark.parametrize("batch", [1, 3])
def test_the_decoding_hot_path_serves_every_step_inside_a_block_and_equals_the_general_path(small, batch,
                                                                                           monkeypatch):
    """A token inside a block whose list the slab holds skips the attention function's general path
    (ReuseCacheLayer.step): it must serve exactly those steps, and give the general path's logits bit
    for bit. A forward hook on the site sends every step back through the module."""
    from attnopt.hf.cache import ReuseCacheLayer

    served = []
    step = ReuseCacheLayer.step

    def spy(self, query, key, value, *rest):
        out = step(self, query, key, value, *rest)
        if out is not None:
            served.append((id(self), key.shape[2] - 1))
        return out

    monkeypatch.setattr(ReuseCacheLayer, "step", spy)
    ids = _ids(batch, 21, seed=9)

    def generate():
        with torch.no_grad():
            return small.generate(input_ids=ids, max_new_tokens=18, do_sample=False, pad_token_id=0,
                                  output_logits=True, return_dict_in_generate=True)

    hot = generate()
    # Steps at positions 21 .. 37, blocks of 4: the first step gathers the slab, each block start
    # (24, 28, 32, 36) gathers it again; every other step is served, in both reused layers.
    expected = [p for p in range(22, 38) if p % 4]
    assert len({layer for layer, _ in served}) == 2
    assert sorted(p for _, p in served) == sorted(expected * 2)
    monkeypatch.setattr(ReuseCacheLayer, "steps", False)
    served.clear()
    general = generate()
    assert not served
    assert torch.equal(hot.sequences, general.sequences)
    assert all(torch.equal(a, b) for a, b in zip(hot.logits, general.logits))
    monkeypatch.setattr(ReuseCacheLayer, "steps", True)
    site = next(m for m in small.modules() if isinstance(m, ReusedSite))
    calls = []
    handle = site.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[2]))
    try:
        hooked = generate()
    finally:
        handle.remove()
    assert calls == [21] + [1] * 17 and torch.equal(hooked.sequences, hot.sequences)


def test_layers_reading_one_anchor_share_its_selection_state_on_the_hot_path(llama):
    """Layers 1 and 2 read anchor 0: a block's choice is made once for both, so their states must stay
    one object through the steps inside a block (each making its own would double every choice)."""
    from attnopt.hf.cache import make_cache

    opt = attnopt.compile(llama, "reuse:1+block:4+every:3+probes:2", example_inputs={"input_ids": _ids(1, 30),
                                                                                     "use_cache": False},
                          tolerance=10.0, e2e_tolerance=None)
    cache = make_cache(opt)
    with torch.no_grad():
        opt.generate(input_ids=_ids(1, 21, seed=9), max_new_tokens=10, do_sample=False, pad_token_id=0,
                     past_key_values=cache)
    reused = [layer for layer in cache.layers if getattr(layer, "slab", None) is not None]
    assert len(reused) == 2 and reused[0].slab.covered == 30
    assert reused[0].selection is reused[1].selection


def test_left_padded_rows_decode_from_slabs_of_their_own(llama, small):
    """Rows padded differently sit at different positions (their blocks start at different steps):
    each keeps a slab of its own. Per-step logits equal the full forward, and each row its row alone."""
    pads = [0, 5, 2]
    ids, mask = _ids(3, 23, seed=11), torch.ones(3, 23, dtype=torch.long)
    for r, p in enumerate(pads):
        ids[r, :p], mask[r, :p] = 0, 0
    with torch.no_grad():
        gen = small.generate(input_ids=ids, attention_mask=mask, max_new_tokens=18, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    slabs = [layer.slab for layer in gen.past_key_values.layers if getattr(layer, "slab", None) is not None]
    assert len(slabs) == 2 and all(s.rows is not None and [r.covered for r in s.rows] == [23 + 17 - p for p in pads]
                                   for s in slabs)  # the per-row slab path ran to the last step
    steps = torch.stack(gen.logits, 1)
    full_mask = torch.cat([mask, torch.ones(3, 18, dtype=torch.long)], 1)
    full = _forward(small, gen.sequences, full_mask)[:, 22:-1]
    assert (steps - full).abs().max() < 1e-4
    for r, p in enumerate(pads):
        alone = _forward(small, gen.sequences[r:r + 1, p:], full_mask[r:r + 1, p:])[:, 22 - p:-1]
        assert (alone - full[r:r + 1]).abs().max() < 1e-4


def test_a_pad_inside_the_prompt_keeps_decoding_off_the_slab_and_exact_to_the_forward(small):
    # Keys real from the offset on is what lets a step read its slab; a masked column in the middle
    # of a prompt is not, so those steps read the gathered blocks with the mask.
    ids, mask = _ids(2, 23, seed=12), torch.ones(2, 23, dtype=torch.long)
    mask[1, 9] = 0
    with torch.no_grad():
        gen = small.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    slabs = [layer.slab for layer in gen.past_key_values.layers if getattr(layer, "slab", None) is not None]
    assert slabs and all(s.block == -1 and s.rows is None for s in slabs)
    full_mask = torch.cat([mask, torch.ones(2, 10, dtype=torch.long)], 1)
    full = _forward(small, gen.sequences, full_mask)[:, 22:-1]
    assert (torch.stack(gen.logits, 1) - full).abs().max() < 1e-4


def test_the_slab_attends_over_exactly_the_listed_blocks():
    """BlockSlab against an fp64 softmax over the listed keys, written here: lists change at block starts,
    a list may skip blocks, and the own block grows column by column."""
    from attnopt.forms.reuse.decoding import BlockSlab

    g = torch.Generator().manual_seed(3)
    B, H, Hkv, D, b, N = 2, 4, 2, 8, 4, 26
    k, v, q = (torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g),
               torch.randn(B, H, N, D, generator=g))
    slab = BlockSlab()
    for n in range(9, N + 1):  # keys 0 .. n-1; the query is position n-1
        m = (n - 1) // b
        lists = []
        for r in range(B):
            earlier = sorted(torch.randperm(m, generator=torch.Generator().manual_seed(100 * m + r))[:2].tolist())
            lists.append(earlier + [m])
        ids = torch.tensor(lists)
        out = slab.attend(q[:, :, n - 1:n], k[:, :, :n], v[:, :, :n], ids, b, 0.3)
        for r in range(B):
            cols = [c for j in lists[r] for c in range(j * b, min((j + 1) * b, n))]
            kk, vv = k[r][:, cols].double().repeat_interleave(2, 0), v[r][:, cols].double().repeat_interleave(2, 0)
            w = torch.softmax(0.3 * (q[r, :, n - 1:n].double() @ kk.transpose(-1, -2)), -1)
            assert torch.allclose(out[r].double(), w @ vv, atol=1e-6), (n, r)
    assert slab.covered == N and slab.length == 2 * b + (N - 6 * b)
    # Rows listing different numbers of blocks: no slab; the caller takes the gathered path.
    assert slab.attend(q[:, :, -1:], k, v, torch.tensor([[1, 6, -1], [0, 2, 6]]), b, 0.3) is None
