"""Models attnopt cannot run or rewrite are reported in one line: weights on the meta device raise
before any capture, and a model without attention compiles with a warning, not in silence."""

import pytest
import torch
from torch import nn

import attnopt


def test_a_meta_device_model_is_refused_in_one_line_naming_the_weight():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ValueError) as err:
        attnopt.compile(model, "linear", example_inputs=(torch.randn(2, 8),))
    text = str(err.value)
    assert "'0.weight' is on the meta device" in text and "load_state_dict" in text and "\n" not in text


def test_a_meta_device_transformers_model_is_refused_too():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    with pytest.raises(ValueError, match="is on the meta device"):
        attnopt.compile(model, "linear", example_inputs={"input_ids": torch.ones(1, 4, dtype=torch.long)})


def test_a_model_without_attention_warns_that_nothing_was_found():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).eval()
    with pytest.warns(UserWarning, match=r"found no attention in this model"):
        opt = attnopt.compile(model, "linear", example_inputs=(torch.randn(2, 8),))
    assert opt.attnopt_report.sites == []
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(opt(x), model(x))


def test_an_attention_module_shared_by_layers_is_kept_exact_saying_so():
    # ALBERT calls one attention module once per layer: a site module there would serve them all.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AlbertConfig(vocab_size=97, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AlbertModel(cfg).eval()
    ids = torch.randint(5, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning):
        opt = attnopt.compile(model, "linear", example_inputs={"input_ids": ids}, dispatch="off")
    sites = opt.attnopt_report.sites
    assert len(sites) == 3 and all(str(r.outcome.status) == "unsupported" for r in sites)
    assert all("serves 3 layers" in r.outcome.reason and "not reached" not in r.outcome.reason for r in sites)
    with torch.no_grad():
        assert torch.equal(opt(input_ids=ids).last_hidden_state, model(input_ids=ids).last_hidden_state)
