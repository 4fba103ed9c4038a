"""Generation from fixed-size decode states: a per-layer hybrid (exact, window, linear) and a site
crossing its min_seq_len while decoding equal a full forward at every step; the state stays flat
as tokens are generated; beam search, sampling and several return sequences give what the uncached
model gives; and the report's decode memory is what the cache really holds."""

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")

from attnopt.hf.cache import SiteCacheLayer, decode_state_bytes, make_cache  # noqa: E402

VOCAB, PROMPT, NEW, PAD = 97, 20, 10, 4
HYBRID = {"rules": [{"layers": "0", "form": "exact"}, {"layers": "1", "form": "window", "window": 6, "sinks": 2},
                    {"form": "linear"}]}


@pytest.fixture(scope="module")
def base():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _prompt(batch=2):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (batch, PROMPT), generator=g)
    am = torch.ones(batch, PROMPT, dtype=torch.long)
    ids[-1, :PAD], am[-1, :PAD] = 0, 0  # the last row is left-padded
    return ids, am


def _compile(base, policy):
    ids, am = _prompt()
    opt = attnopt.compile(base, policy, example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False},
                          e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") >= 1
    return opt


@torch.no_grad()
def _generate(model, ids, am, **kw):
    kw.setdefault("do_sample", False)
    out = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, dim=1), getattr(out, "cache", None) or out.past_key_values


@torch.no_grad()
def _full_logits(model, seq, am):
    am = torch.cat([am, torch.ones(am.shape[0], seq.shape[1] - am.shape[1], dtype=am.dtype)], dim=1)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=seq, attention_mask=am, position_ids=pos, use_cache=False).logits
    return logits[:, PROMPT - 1: PROMPT - 1 + NEW]


def test_hybrid_with_exact_window_and_linear_layers_decodes_as_a_full_forward(base):
    opt = _compile(base, HYBRID)
    forms = [r.outcome.final_form for r in opt.attnopt_report.sites]
    assert forms == ["exact", "window", "linear", "linear"], forms
    ids, am = _prompt()
    seq, steps, cache = _generate(opt, ids, am)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicLayer"] + ["SiteCacheLayer"] * 3
    assert (steps - _full_logits(opt, seq, am)).abs().max() < 1e-5
    alone_seq, alone, _ = _generate(opt, ids[-1:, PAD:], am[-1:, PAD:])
    assert torch.equal(alone_seq[0, -NEW:], seq[-1, -NEW:])
    assert (alone[0] - steps[-1]).abs().max() < 1e-5


def test_a_site_crossing_min_seq_len_while_decoding_matches_a_full_forward(base):
    # The padded row reaches 24 real tokens two steps later than the other: rows cross at different steps.
    opt = _compile(base, {"rules": [{"form": "linear", "min_seq_len": 24}]})
    ids, am = _prompt()
    cache = make_cache(opt)
    with torch.no_grad():
        opt(input_ids=ids, attention_mask=am, past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    # The prompt lies inside the threshold: the layer holds it as plain K/V and the site ran the
    # model's own attention; the state is built from those keys on the first call past 24 columns.
    assert isinstance(layer, SiteCacheLayer) and layer.state is None and layer.kept == ids.shape[1]
    assert layer.keys.shape[-2] == ids.shape[1]
    seq, steps, cache = _generate(opt, ids, am)
    assert (steps - _full_logits(opt, seq, am)).abs().max() < 1e-5
    assert all(layer.state.prefix is None for layer in cache.layers)  # every row is past 24: prefix dropped
    # Below the threshold the compiled model is the original model, exactly.
    with torch.no_grad():
        short = dict(input_ids=ids[:1, :16], use_cache=False)
        assert (opt(**short).logits - base(**short).logits).abs().max() < 1e-6


@pytest.mark.parametrize("policy", ["linear", "ssm", "window:8+sinks:2", "linear+window:8+sinks:2"])
def test_state_does_not_grow_with_generated_tokens(base, policy):
    opt = _compile(base, policy)
    cache = make_cache(opt)
    tok = torch.randint(1, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    sizes = {}
    with torch.no_grad():
        for i in range(1, 49):
            tok = opt(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            if i in (16, 48):
                sizes[i] = sum(decode_state_bytes(cache).values())
    assert sizes[48] == sizes[16], sizes
    # The report's decode memory is what the cache holds (plus 8 bytes per layer of bookkeeping).
    mem = opt.attnopt_report.decode_memory
    predicted = sum(row[0] for row in mem.per_site.values())  # at 1k context
    assert abs(sizes[48] - predicted) <= 64 * len(cache.layers), (sizes[48], predicted)
    assert mem.original[2] > 1000 * mem.total[2]  # at 128k context


def test_beam_search_sampling_and_return_sequences_match_the_uncached_model(base):
    opt = _compile(base, HYBRID)
    ids, am = _prompt()
    with torch.no_grad():
        beams = dict(input_ids=ids, attention_mask=am, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
        assert torch.equal(opt.generate(**beams), opt.generate(**beams, use_cache=False))
        sample = dict(input_ids=ids, attention_mask=am, max_new_tokens=6, do_sample=True, num_return_sequences=2,
                      pad_token_id=0)
        torch.manual_seed(7)
        cached = opt.generate(**sample)
        torch.manual_seed(7)
        uncached = opt.generate(**sample, use_cache=False)
    assert cached.shape == (4, PROMPT + 6) and torch.equal(cached, uncached)


def test_a_state_cannot_be_cropped_and_a_cache_cannot_serve_two_models(base):
    opt = _compile(base, "linear")
    cache = make_cache(opt)
    ids, am = _prompt()
    with torch.no_grad():
        opt(input_ids=ids, attention_mask=am, past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match="linear decode state of layers 0, 1, 2, 3 cannot; compile layers 0, 1, 2, 3 as exact"):
        cache.crop(-1)
    cache.crop(0)  # what transformers calls after every step of some decoders: nothing to drop
    other = _compile(base, "linear")
    with pytest.raises(ValueError, match="belongs to another compiled model"):
        with torch.no_grad():
            other(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)



def test_a_model_that_names_its_cache_layer_past_decodes_from_the_state_too():
    # GPT-NeoX hands its attention the cache as `layer_past`, not `past_key_values` / `cache`.
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    neox = transformers.GPTNeoXForCausalLM(cfg).eval()
    opt = _compile(neox, "linear")
    ids, am = _prompt()
    seq, steps, cache = _generate(opt, ids, am)
    assert all(isinstance(layer, SiteCacheLayer) for layer in cache.layers)
    assert (steps - _full_logits(opt, seq, am)).abs().max() < 1e-5


def test_a_deep_copy_of_a_compiled_model_with_reuse_generates_like_the_original(base):
    # Hooks are copied by reference: they must find the copy's own state, and the reuse anchor's
    # (q, k) must be filed under a key that survives the copy (not id(module)).
    import copy

    policy = {"rules": [{"layers": "0", "form": "exact"},
                        {"layers": "1", "form": "reuse", "anchor": 0, "block": 2, "top_k": 1, "window": 0},
                        {"form": "linear"}]}
    opt = _compile(base, policy)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "reuse", "linear", "linear"]
    twin = copy.deepcopy(opt)
    ids, am = _prompt()
    seq, steps, _ = _generate(opt, ids, am)
    seq_t, steps_t, cache = _generate(twin, ids, am)
    assert torch.equal(seq, seq_t) and torch.equal(steps, steps_t)
    # The reuse site keeps HF's K/V plus its selection state (ReuseCacheLayer), in the cache, not on a module;
    # the anchor's full K/V layer appends as the reuse layer does.
    assert [type(layer).__name__ for layer in cache.layers] == ["AppendingLayer", "ReuseCacheLayer"] + ["SiteCacheLayer"] * 2
    assert all(layer.site_module is twin.get_submodule(f"model.layers.{i}.self_attn").attnopt_site
               for i, layer in enumerate(cache.layers) if i > 0)
    assert cache.layers[1].keys.shape[-2] == PROMPT + NEW - 1
    assert cache.layers[1].selection.seen_B.tolist() == [PROMPT + NEW - 1, PROMPT + NEW - 1 - PAD]  # the last row is padded
