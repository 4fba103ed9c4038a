"""Decoding that drops tokens from the cache (prompt lookup, assisted decoding): a reuse site crops
its block-selection state with the keys, so both give plain greedy's tokens; a site that decodes from
a fixed-size state refuses at once, in attnopt's words, naming the layers to compile as exact."""

import pytest
import torch

import attnopt

transformers = pytest.importorskip("transformers")

from attnopt.hf.cache import ReuseCacheLayer  # noqa: E402

V, NEW = 97, 10
REUSE = {"rules": [{"layers": "0", "form": "exact"},
                   {"layers": "1", "form": "reuse", "anchor": 0, "block": 2, "top_k": 1, "window": 0}]}


def _llama(seed):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def llama():
    return _llama(0)


def _prompt():
    g = torch.Generator().manual_seed(2)
    part = torch.randint(3, V, (1, 6), generator=g)
    return torch.cat([part, part, part[:, :3]], dim=1)  # repeated n-grams: prompt lookup finds drafts


def _compile(model, policy):
    ids = _prompt()
    opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids, "use_cache": False}, dispatch="off",
                          e2e_tolerance=None)
    opt.generation_config.eos_token_id = None
    return opt


def test_reuse_with_prompt_lookup_and_an_assistant_gives_greedy_tokens(llama, monkeypatch):
    opt = _compile(llama, REUSE)
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == ["exact", "reuse"]
    ids = _prompt()
    dropped = []
    crop = ReuseCacheLayer.crop

    def counting_crop(self, tokens_to_remove):
        dropped.append(-tokens_to_remove)
        crop(self, tokens_to_remove)
        assert bool((self.selection.seen() == self.keys.shape[-2]).all())  # the selection state follows the keys

    monkeypatch.setattr(ReuseCacheLayer, "crop", counting_crop)
    with torch.no_grad():
        greedy = opt.generate(ids, max_new_tokens=NEW, do_sample=False)
        lookup = opt.generate(ids, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3)
        assert sum(dropped) > 0  # drafts were rejected and their tokens cropped
        dropped.clear()
        # Another random model drafts: most of its tokens are rejected, so the cache is cropped.
        assisted = opt.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=_llama(1))
    assert sum(dropped) > 0
    assert torch.equal(lookup, greedy) and torch.equal(assisted, greedy)


def test_a_state_form_refuses_dropping_tokens_at_once_in_its_own_words(llama):
    opt = _compile(llama, "linear")
    with torch.no_grad(), pytest.raises(ValueError, match=r"^attnopt: .*decode state of layers 0, 1 cannot; compile "
                                                          r"layers 0, 1 as exact \(policy rule"):
        opt.generate(_prompt(), max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3)


@pytest.mark.parametrize("policy, what", [("linear", "layer 0 decodes from its linear state"),
                                          (REUSE, "layer 1 reuses an anchor's block selection")])
def test_a_static_cache_is_refused_in_one_line(llama, policy, what):
    # A static cache sizes layers and masks to max_cache_len: a form's layer would disagree with the
    # exact layers' masks (a left-padded batch decoded wrong before this refusal).
    opt = _compile(llama, policy)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"^attnopt: {what}.*; a static cache \(StaticLayer\) .*"
                                                          r"\(drop cache_implementation='static'\)$"):
        opt.generate(_prompt(), max_new_tokens=3, do_sample=False, cache_implementation="static")
