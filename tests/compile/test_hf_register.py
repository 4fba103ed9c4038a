"""attnopt.hf.register: `attn_implementation="attnopt"` with its mask function, planned per layer."""

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return model, path


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnopt").eval()


def test_padding_mask_reaches_the_rewritten_sites(saved_llama):
    model, path = saved_llama
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 30, dtype=torch.long)
    am[1, :7] = 0  # left padding on the second row
    attnopt.hf.register("window:64")  # wider than the sequence: exact, IF the mask arrives
    opt = _load(path)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).logits
        out = opt(input_ids=ids, attention_mask=am).logits
    # Rows of real tokens must match; without the mask function HF would pass no mask and drift.
    torch.testing.assert_close(out[0], ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1, 7:], ref[1, 7:], rtol=1e-4, atol=1e-4)


def test_rules_pick_forms_per_layer_and_generate_runs(saved_llama):
    model, path = saved_llama
    attnopt.hf.register({"rules": [{"layers": "0", "form": "exact"}, {"form": "window", "window": 8, "sinks": 2}]})
    opt = _load(path)
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        opt(input_ids=ids)
    kinds = {n: getattr(m, "attnopt_site", None) for n, m in opt.named_modules() if n.endswith("self_attn")}
    assert kinds["model.layers.0.self_attn"] is None
    assert kinds["model.layers.1.self_attn"].form == "window"
    assert kinds["model.layers.2.self_attn"].params["window"] == 8
    gen = opt.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    seq = ids
    for _ in range(4):
        with torch.no_grad():
            nxt = opt(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)


def test_auto_needs_example_inputs():
    with pytest.raises(ValueError, match="attnopt.compile"):
        attnopt.hf.register("auto")
