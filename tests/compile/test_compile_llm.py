"""attnopt.compile on random-weight decoder LLMs built from transformers configs."""

import pytest
import torch

import attnopt
from attnopt import PolicyError

transformers = pytest.importorskip("transformers")

B, N, VOCAB = 2, 40, 97


def _llama(layers=4, **kw):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, **kw,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ids(n=N, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, n), generator=g)


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kw).logits


def test_llama_window_rewrites_every_site_with_gqa(llama):
    ids = _ids()
    opt = attnopt.compile(llama, "window:8+sinks:2", example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    rep = opt.attnopt_report
    assert len(rep.sites) == 4
    for r in rep.sites:
        assert (r.site.heads, r.site.kv_heads, r.site.causal) == (6, 2, True)
        assert r.outcome.status == "rewritten" and r.outcome.final_form == "window"
        assert 0 < r.outcome.drift.rel_rms < 1.0
    assert isinstance(opt, transformers.LlamaForCausalLM)
    logits = _logits(opt, ids)
    assert logits.shape == (B, N, VOCAB)
    assert not torch.equal(logits, _logits(llama, ids))


def test_generate_is_consistent_on_rewritten_model(llama):
    ids = _ids(n=12)
    opt = attnopt.compile(llama, "window:6+sinks:1", example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    gen = opt.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    # Cached decoding must agree with re-running the rewritten model on the whole prefix.
    seq = ids
    for _ in range(6):
        nxt = _logits(opt, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(gen, seq)
    exact = attnopt.compile(llama, "exact", example_inputs={"input_ids": ids, "use_cache": False})
    assert torch.equal(
        exact.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
        llama.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0),
    )


def test_tolerance_reverts_with_reason(llama):
    ids = _ids()
    opt = attnopt.compile(llama, "linear", example_inputs={"input_ids": ids, "use_cache": False}, tolerance=1e-3)
    for r in opt.attnopt_report.sites:
        assert r.outcome.status == "reverted" and r.outcome.final_form == "exact"
        assert "tolerance 0.001" in r.outcome.reason
        assert r.outcome.drift.rel_rms > 1e-3
    assert torch.equal(_logits(opt, ids), _logits(llama, ids))


def test_length_dispatch_falls_back_to_exact_below_min_seq_len(llama):
    ids = _ids()
    policy = {"rules": [{"form": "linear", "min_seq_len": 64}]}
    opt = attnopt.compile(llama, policy, example_inputs={"input_ids": _ids(n=80), "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    assert all(r.outcome.status == "rewritten" for r in opt.attnopt_report.sites)
    torch.testing.assert_close(_logits(opt, ids), _logits(llama, ids), rtol=1e-5, atol=1e-5)  # N=40 < 64: exact
    long_ids = _ids(n=80, seed=3)
    assert not torch.allclose(_logits(opt, long_ids), _logits(llama, long_ids), atol=1e-3)


def test_hybrid_and_rules_by_layer(llama):
    ids = _ids()
    policy = {"rules": [{"layers": "0", "form": "exact"}, {"layers": "-1", "form": "exact"},
                        {"form": "ssm"}]}
    opt = attnopt.compile(llama, policy, example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    forms = [r.outcome.final_form for r in opt.attnopt_report.sites]
    assert forms == ["exact", "ssm", "ssm", "exact"]
    hybrid = attnopt.compile(_llama(layers=6), "hybrid", example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    planned = [r.plan.form for r in hybrid.attnopt_report.sites]
    assert planned[0] == "exact" and planned[-1] == "exact" and planned[1] == "window" and "linear" in planned


def test_runs_under_torch_compile(llama):
    ids = _ids()
    opt = attnopt.compile(llama, "window:8+sinks:2", example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    eager = _logits(opt, ids)
    compiled = torch.compile(opt, backend="aot_eager", fullgraph=False)
    with torch.no_grad():
        out = compiled(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "policy, words",
    [
        ("window:0", ["window", "0"]),
        ("linear:cosine", ["feature_map", "cosine", "elu"]),
        ({"rules": [{"form": "teleport"}]}, ["teleport", "linear"]),
        ({"rules": [{"form": "window", "windw": 4}]}, ["windw", "window"]),
    ],
)
def test_policy_errors_name_field_value_and_choices(llama, policy, words):
    with pytest.raises(PolicyError) as err:
        attnopt.compile(llama, policy, example_inputs={"input_ids": _ids(), "use_cache": False})
    for w in words:
        assert w in str(err.value)


def test_bad_inputs_give_clear_errors(llama):
    with pytest.raises(ValueError, match="example_inputs"):
        attnopt.compile(llama, "linear")
    with pytest.raises(TypeError, match="nn.Module"):
        attnopt.compile("not a model", "linear", example_inputs=(1,))
    with pytest.raises(ValueError, match="tolerance"):
        attnopt.compile(llama, "linear", example_inputs={"input_ids": _ids()}, tolerance=-1)


def test_gpt2_and_mistral_sites():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=6, n_positions=128)).eval()
    ids = _ids()
    opt = attnopt.compile(gpt2, "linear:favor", example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    rep = opt.attnopt_report
    assert [r.outcome.final_form for r in rep.sites] == ["linear", "linear"]
    assert all(r.site.causal for r in rep.sites)

    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, sliding_window=8, max_position_embeddings=256)).eval()
    opt = attnopt.compile(mistral, "window:16", example_inputs={"input_ids": ids, "use_cache": False})
    for r in opt.attnopt_report.sites:
        assert r.site.window == 8 and r.site.kv_heads == 3
        # The model's own window (8) is narrower than the policy's (16), so the rewrite is exact.
        assert r.outcome.status == "rewritten" and r.outcome.drift.rel_rms < 1e-5


def test_detection_survives_a_cache_output_and_falls_back_to_interface_sites(llama):
    # Called like a user would (no use_cache=False): detection still exports (cache switched off
    # for capture only); the compiled model keeps returning its cache.
    ids = _ids()
    opt = attnopt.compile(llama, "window:8", example_inputs={"input_ids": ids}, tolerance=0.99, e2e_tolerance=None)
    rep = opt.attnopt_report
    # No note but the one every decoder gets: positions derived from the mask (attnopt.hf.routes).
    assert rep.capture == "export+hf" and [n for n in rep.notes if "position_ids" not in n] == []
    assert [r.site.source for r in rep.sites] == ["sdpa"] * 4
    with torch.no_grad():
        assert opt(input_ids=ids).past_key_values is not None


def test_interface_sites_when_export_fails(llama, monkeypatch):
    import attnopt.targets.detection_memo as detection_memo
    import attnopt.targets.hf as hf_target

    def broken(*a, **k):
        raise RuntimeError("simulated export failure")

    # The transformers mechanism's capture (the sites then come from the attention calls, and are
    # planned as recorded); nothing kept from an earlier compile of this model stands in for it.
    monkeypatch.setattr(hf_target, "capture_export", broken)
    monkeypatch.setattr(detection_memo, "_kept", type(detection_memo._kept)())
    opt = attnopt.compile(llama, "window:8", example_inputs={"input_ids": _ids(), "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    rep = opt.attnopt_report
    assert "simulated export failure" in rep.notes[0]
    assert [(r.site.source, r.site.heads, r.site.kv_heads, r.site.causal) for r in rep.sites] == [("hf", 6, 2, True)] * 4
    assert [r.site.layer for r in rep.sites] == [0, 1, 2, 3]
    assert all(r.outcome.status == "rewritten" for r in rep.sites)


def test_example_inputs_the_model_rejects_get_a_clear_error(llama):
    with pytest.raises(ValueError, match="example inputs"):
        attnopt.compile(llama, "window:8", example_inputs={"input_ids": _ids().float(), "use_cache": False})


def test_reuse_decodes_consistently(llama):
    ids = _ids(n=30)
    opt = attnopt.compile(llama, "reuse:1+block:4+every:2+probes:2", example_inputs={"input_ids": _ids(),
                          "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    assert [r.outcome.status for r in opt.attnopt_report.sites] == ["kept", "rewritten", "kept", "kept"]  # 2: an anchor
    gen = opt.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    seq = ids
    for _ in range(10):  # cached decoding (the selection state in the cache) == full recompute of the prefix
        seq = torch.cat([seq, _logits(opt, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(gen, seq)


def test_exact_fallback_below_min_seq_len_is_exact_while_decoding(llama):
    # Decoding steps have one query and many cached keys: the exact fallback must align causality
    # bottom-right (SDPA's is_causal aligns top-left).
    ids = _ids(n=12)
    policy = {"rules": [{"form": "window", "window": 4, "min_seq_len": 64}]}
    opt = attnopt.compile(llama, policy, example_inputs={"input_ids": _ids(n=80), "use_cache": False}, tolerance=0.99, e2e_tolerance=None)
    assert torch.equal(
        opt.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0),
        llama.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0),
    )


def test_a_rule_that_matches_no_site_warns(llama):
    with pytest.warns(UserWarning, match="rule 0 .* matches no attention site"):
        attnopt.compile(llama, "reuse+anchor:5", example_inputs={"input_ids": _ids(), "use_cache": False})


def test_a_rule_shadowed_by_an_earlier_rule_says_which_rule_took_its_sites(llama):
    policy = {"rules": [{"form": "window", "window": 4}, {"form": "linear"}]}
    with pytest.warns(UserWarning, match=r"rule 1 .*linear.*claimed first.*rule 0 .*window.*took 4 sites") as seen:
        attnopt.compile(llama, policy, example_inputs={"input_ids": _ids(), "use_cache": False}, tolerance=0.99,
                        e2e_tolerance=None)
    assert not any("matches no attention site" in str(w.message) for w in seen)


def test_register_reuse_warns_that_it_needs_compile():
    with pytest.warns(UserWarning, match="reuse needs"):
        attnopt.hf.register("reuse")
    attnopt.hf.register("exact")


def test_softcapped_sites_are_unsupported_with_their_reason():
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attn_logit_softcapping=50.0,
    )
    torch.manual_seed(0)
    gemma = transformers.Gemma2ForCausalLM(cfg).eval()
    with pytest.warns(UserWarning, match="none was kept"):
        opt = attnopt.compile(gemma, "linear", example_inputs={"input_ids": _ids(), "use_cache": False})
    rep = opt.attnopt_report
    assert len(rep.sites) == 2
    assert [str(r.outcome.status) for r in rep.sites] == ["unsupported"] * 2
    assert all("softcap 50" in r.outcome.reason for r in rep.sites)
