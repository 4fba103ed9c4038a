"""Every transformers model that generates keeps generate(): encoder-decoders that call the attention
interface although their class flag says no (BART, T5, Whisper), and decoders that compute attention
inline (Falcon: its SDPA call is intercepted where it has one; GPT-Neo: its `_attn` method; BLOOM: ALiBi, so its sites
stay exact).

For each: the report says which mechanism and install it took; cached generate() gives per-step
logits equal to one uncached forward over the generated sequence (≤ 1e-5, fp32) with a form that
really rewrites decoder self-attention from a decode state; cross-attention never gets a state layer.
"""

import inspect

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")

from attnopt.hf.cache import SiteCacheLayer  # noqa: E402

V, N, NEW, PAD = 100, 9, 5, 3


def _tiny(family):
    tf = transformers
    torch.manual_seed(0)
    if family == "falcon":  # RoPE, multi-query (1 key/value head)
        model = tf.FalconForCausalLM(tf.FalconConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, alibi=False, multi_query=True,
                                                     new_decoder_architecture=False, max_position_embeddings=128))
    elif family == "gpt_neo":  # layer 1 local (window 4): its band comes from the module's bias buffer
        model = tf.GPTNeoForCausalLM(tf.GPTNeoConfig(vocab_size=V, hidden_size=64, num_layers=2, num_heads=4,
                                                     attention_types=[[["global", "local"], 1]], window_size=4,
                                                     max_position_embeddings=128))
    elif family == "bloom":
        model = tf.BloomForCausalLM(tf.BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4))
    elif family == "bart":
        model = tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=128,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None))
    elif family == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                                                          num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                                                          eos_token_id=1))
    else:  # whisper
        model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, num_mel_bins=16, max_source_positions=16,
            max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
            suppress_tokens=None, begin_suppress_tokens=None))
    model.eval()
    gc = model.generation_config  # plain greedy for NEW tokens: no forced, suppressed or stopping tokens
    for key in ("forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens",
                "forced_decoder_ids", "eos_token_id"):
        if hasattr(gc, key):
            setattr(gc, key, None)
    return model


def _inputs(family, batch=2):
    g = torch.Generator().manual_seed(3)
    if family == "whisper":
        return {"input_features": torch.randn(batch, 16, 32, generator=g)}
    ids = torch.randint(3, V, (batch, N), generator=g)
    am = torch.ones(batch, N, dtype=torch.long)
    if family in ("falcon", "bloom", "gpt_neo"):  # the last row left-padded, as generate() takes it
        ids[-1, :PAD], am[-1, :PAD] = 0, 0
    else:  # an encoder input right-padded, as seq2seq tokenizers pad
        ids[-1, N - PAD:], am[-1, N - PAD:] = 1, 0
    return {"input_ids": ids, "attention_mask": am}


def _falcon_install() -> str:
    """Falcon's route on the installed transformers: its own SDPA call (intercepted), or the attention
    interface where its forward calls that (newer 5.x releases)."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    calls_interface = "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(FalconAttention.forward)
    return "attention-interface" if calls_interface else "sdpa-intercept"


def _compile(family, policy):
    base = _tiny(family)
    feed = _inputs(family)
    example = {**feed, "use_cache": False}
    if base.config.is_encoder_decoder:
        start = base.config.decoder_start_token_id
        example["decoder_input_ids"] = torch.tensor([[start, 5, 7, 9, 11, 13]] * 2)
    opt = attnopt.compile(base, policy, example_inputs=example, dispatch="off", e2e_tolerance=None)
    return base, opt, feed, example


@torch.no_grad()
def _generate(model, feed, **kw):
    out = model.generate(**feed, max_new_tokens=NEW, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kw)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return out.sequences, torch.stack(out.logits, 1), cache


@torch.no_grad()
def _full_logits(model, feed, seq):
    """One uncached forward over the generated sequence (positions as generate() gives them)."""
    if model.config.is_encoder_decoder:
        return model(**feed, decoder_input_ids=seq[:, :-1], use_cache=False).logits[:, -NEW:]
    am = torch.cat([feed["attention_mask"], torch.ones(seq.shape[0], NEW - 1, dtype=torch.long)], 1)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=seq[:, :-1], attention_mask=am, position_ids=pos, use_cache=False).logits[:, -NEW:]


def _check_cached_equals_uncached(opt, feed):
    seq, steps, cache = _generate(opt, feed)
    assert (steps - _full_logits(opt, feed, seq)).abs().max() < 1e-5  # measured ≤ 3e-7
    assert torch.equal(seq, _generate(opt, feed, use_cache=False)[0])
    return seq, steps, cache


@pytest.mark.parametrize("family, form", [("falcon", "linear"), ("gpt_neo", "linear"), ("bart", "window"),
                                          ("whisper", "linear")])
def test_decoder_self_attention_decodes_from_a_state_and_cached_equals_uncached(family, form, tmp_path):
    policy = {"rules": [{"form": "window", "window": 4}]} if form == "window" else form
    base, opt, feed, example = _compile(family, policy)
    rep = opt.attnopt_report
    expected_install = {"falcon": _falcon_install(), "gpt_neo": "core-method"}.get(family, "attention-interface")
    assert rep.mechanism == "hf" and {r.install for r in rep.sites} == {expected_install}
    assert rep.mechanism_text.startswith("hf (")
    decoder_self = [r for r in rep.sites if r.site.causal]
    assert len(decoder_self) == 2 and all(r.outcome.final_form == form for r in decoder_self), \
        [(r.site.id, r.outcome.reason) for r in rep.sites]
    seq, steps, cache = _check_cached_equals_uncached(opt, feed)
    own = getattr(cache, "self_attention_cache", cache)
    if family == "whisper":  # its generate() returns a cache rebuilt from each layer's keys: the
        # state layers' zero-length stand-ins (a KV cache would hold every generated token)
        assert [layer.keys.shape[-2] for layer in own.layers] == [0, 0]
    else:
        assert [type(layer) for layer in own.layers] == [SiteCacheLayer] * 2
    if hasattr(cache, "cross_attention_cache"):  # cross-attention keeps HF's own K/V of the encoder
        assert not any(isinstance(layer, SiteCacheLayer) for layer in cache.cross_attention_cache.layers)
    with torch.no_grad():  # the rewrite runs (the comparison above is not of the original with itself)
        assert (opt(**example).logits - base(**example).logits).abs().max() > 1e-4
    if family == "falcon":  # attnopt.load routes the module again: the same model, generate() included
        loaded = attnopt.load(attnopt.save(opt, tmp_path / "falcon"))
        assert [r.install for r in loaded.attnopt_report.sites] == [_falcon_install()] * 2
        with torch.no_grad():
            assert torch.equal(loaded(**example).logits, opt(**example).logits)
        assert torch.equal(_generate(loaded, feed)[0], seq)
    if family in ("falcon", "gpt_neo"):  # the left-padded row equals the row alone
        alone_seq, alone, _ = _generate(opt, {k: v[-1:, PAD:] for k, v in feed.items()})
        assert torch.equal(alone_seq[0, -NEW:], seq[-1, -NEW:]) and (alone[0] - steps[-1]).abs().max() < 1e-5
    if family == "bart":  # the padded encoder row equals the row alone
        alone = {k: v[-1:, :N - PAD] for k, v in feed.items()}
        alone_seq, alone_steps, _ = _generate(opt, alone)
        assert torch.equal(alone_seq[0], seq[-1]) and (alone_steps[0] - steps[-1]).abs().max() < 1e-5


def test_t5_relative_bias_keeps_self_attention_exact_and_cross_attention_really_rewritten():
    base, opt, feed, example = _compile("t5", "linear")
    rep = opt.attnopt_report
    by_kind = {}
    for r in rep.sites:
        by_kind.setdefault("cross" if "EncDecAttention" in r.site.module_path else "self", []).append(r)
    assert all(r.outcome.final_form == "exact" and "position_bias" in r.outcome.reason for r in by_kind["self"])
    assert all(r.outcome.final_form == "linear" for r in by_kind["cross"])
    # The cross-attention's all-zero bias is no bias: the rewrite runs (T5's output changes).
    with torch.no_grad():
        assert (opt(**example).logits - base(**example).logits).abs().max() > 1e-4
    _, _, cache = _check_cached_equals_uncached(opt, feed)
    assert not any(isinstance(layer, SiteCacheLayer) for layer in cache.self_attention_cache.layers)


def test_bloom_keeps_generate_with_its_alibi_sites_exact():
    base, opt, feed, example = _compile("bloom", "linear")
    rep = opt.attnopt_report
    assert rep.mechanism == "hf" and {r.install for r in rep.sites} == {"forward-replace"}
    assert all(r.outcome.final_form == "exact" and "position bias" in r.outcome.reason for r in rep.sites)
    seq, steps, _ = _check_cached_equals_uncached(opt, feed)
    assert torch.equal(seq, base.generate(**feed, max_new_tokens=NEW, do_sample=False))
    with torch.no_grad():  # exact sites run BLOOM's own code: the original model, bit for bit
        assert torch.equal(opt(**example).logits, base(**example).logits)
    alone_seq, alone, _ = _generate(opt, {k: v[-1:, PAD:] for k, v in feed.items()})
    assert torch.equal(alone_seq[0, -NEW:], seq[-1, -NEW:]) and (alone[0] - steps[-1]).abs().max() < 1e-5
