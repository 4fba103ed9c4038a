"""A left-padded row equals the row alone when the compiled model is called with an attention mask
and no position_ids: positions are derived from the mask as generate() derives them, for every form
(the original only gets away without them because softmax attention sees relative positions only)."""

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")

V, N, PAD = 97, 20, 5


def _model(kind):
    torch.manual_seed(0)
    if kind == "llama":  # one layer per form
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)).eval()
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128)).eval()


def _batch():
    ids = torch.randint(1, V, (2, N), generator=torch.Generator().manual_seed(4))
    am = torch.ones(2, N, dtype=torch.long)
    ids[1, :PAD], am[1, :PAD] = 0, 0
    return ids, am


EVERY_FORM = {"rules": [{"layers": "0", "form": "linear"}, {"layers": "1", "form": "ssm"},
                        {"layers": "2", "form": "linear+window", "window": 8, "sinks": 2, "fit_steps": 5},
                        {"layers": "3", "form": "window", "window": 8, "sinks": 2}]}


@pytest.mark.parametrize("kind, policy", [("llama", EVERY_FORM), ("gpt_neox", "linear")])
def test_a_left_padded_row_equals_the_row_alone_without_position_ids(kind, policy):
    model = _model(kind)
    ids, am = _batch()
    opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids, "attention_mask": am, "use_cache": False},
                          dispatch="off", e2e_tolerance=None)
    rewritten = [r.outcome.final_form for r in opt.attnopt_report.sites]
    assert rewritten == (["linear", "ssm", "linear+window", "window"] if kind == "llama" else ["linear"] * 2), rewritten
    assert any("position_ids derived from the mask" in n for n in opt.attnopt_report.notes)
    with torch.no_grad():
        padded = opt(input_ids=ids, attention_mask=am, use_cache=False).logits[1, PAD:]
        alone = opt(input_ids=ids[1:, PAD:], use_cache=False).logits[0]
        assert (padded - alone).abs().max() < 1e-5  # measured ~1e-7; 1e-2 without derived positions
        # With a cache: the next token's mask covers the past, and its position follows the row's.
        cache = opt(input_ids=ids[:, :-1], attention_mask=am[:, :-1], use_cache=True).past_key_values
        step = opt(input_ids=ids[:, -1:], attention_mask=am, past_key_values=cache, use_cache=True).logits[1, -1]
        assert (step - alone[-1]).abs().max() < 1e-5


def test_roberta_keeps_its_own_positions_and_its_position_limit():
    # RoBERTa's positions start after padding_idx and come from the tokens: a compiled one given a
    # padded mask must compute the original's (exact policy: equal), and a form verified on longer
    # inputs must stop at the 64 positions such a table holds (66 - padding_idx 1 - 1), not 66.
    cfg = transformers.RobertaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=66)
    torch.manual_seed(0)
    model = transformers.RobertaModel(cfg).eval()
    ids = torch.randint(5, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    example = {"input_ids": ids, "attention_mask": mask}
    exact = attnopt.compile(model, "exact", example_inputs=example, dispatch="off")
    with torch.no_grad():
        assert torch.equal(exact(**example).last_hidden_state, model(**example).last_hidden_state)
    wide = attnopt.compile(model, "window:40", example_inputs=example, dispatch="off", tolerance=10.0,
                           e2e_tolerance=None)
    assert [r.outcome.final_form for r in wide.attnopt_report.sites] == ["window", "window"]
