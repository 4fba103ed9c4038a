"""A second compile of the same transformers model reuses the first's capture + detection, and only
when nothing a capture reads has changed: the model's structure, its classes' forward, its hooks, its
config, the inputs' shapes, contents and plain values."""

import warnings

import pytest
import torch

import attnopt
import attnopt.targets.detection_memo as memo

transformers = pytest.importorskip("transformers")


def decoder(layers=2):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


IDS = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))


def compiled(model, policy="window:8", ids=IDS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attnopt.compile(model, policy, example_inputs={"input_ids": ids}, dispatch="off", tolerance=10.0,
                               e2e_tolerance=None)


def reused(opt) -> bool:
    return opt.attnopt_report.counts["detect"].get("reused") == 1


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch):
    monkeypatch.setattr(memo, "_kept", type(memo._kept)())


def test_a_second_compile_with_another_policy_reuses_the_detection():
    model = decoder()
    first, second = compiled(model), compiled(model, "linear")
    assert not reused(first) and reused(second)
    assert [r.site for r in second.attnopt_report.sites] == [r.site for r in first.attnopt_report.sites]
    assert [r.outcome.final_form for r in second.attnopt_report.sites] == ["linear", "linear"]
    # what it reused is a copy: the second compile's record step changed nothing the third reads
    third = compiled(model, "ssm")
    assert reused(third) and [r.site for r in third.attnopt_report.sites] == [r.site for r in first.attnopt_report.sites]
    # new weights are the same capture
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)
    assert reused(compiled(model))


def test_anything_a_capture_reads_makes_it_capture_again(monkeypatch):
    model = decoder()
    compiled(model)
    assert not reused(compiled(model, ids=IDS[:, :20]))  # another length
    assert not reused(compiled(decoder(layers=3)))  # another structure
    attention = type(model.model.layers[0].self_attn)
    original = attention.forward
    with monkeypatch.context() as patch:
        patch.setattr(attention, "forward", lambda self, *a, **k: original(self, *a, **k))
        assert not reused(compiled(model))  # a patched forward
    handle = model.model.layers[1].register_forward_hook(lambda module, args, out: None)
    assert memo.detection_key(model, (), {"input_ids": IDS}) is None  # a model with hooks is never kept
    assert not reused(compiled(model)) and not reused(compiled(model))
    handle.remove()
    assert reused(compiled(model))
    model.config.rms_norm_eps = 1e-3
    assert not reused(compiled(model))  # the config


@pytest.mark.parametrize("pads", ["left", "right"])
def test_a_padded_example_of_one_row_is_rewritten_and_its_detection_is_not_a_clean_ones(pads):
    # One row with padding: its sites are causal + padding (once read as arbitrary: every site kept
    # exact), the padded queries' outputs do not count as drift, and the memo keys the mask's values,
    # so a clean example of the same shape is detected afresh.
    model = decoder()
    mask = torch.ones_like(IDS)
    if pads == "left":
        mask[:, :6] = 0
    else:
        mask[:, -6:] = 0

    def compile_with(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return attnopt.compile(model, "window:8", example_inputs={"input_ids": IDS * m, "attention_mask": m},
                                   dispatch="off", tolerance=0.99, e2e_tolerance=None)

    padded = compile_with(mask)
    sites = padded.attnopt_report.sites
    assert [str(r.outcome.status) for r in sites] == ["rewritten", "rewritten"], [r.outcome.reason for r in sites]
    assert all(r.site.mask.causal and r.site.mask.padding and not r.site.mask.arbitrary for r in sites)
    clean = compile_with(torch.ones_like(IDS))
    assert not reused(clean) and reused(compile_with(mask))


def test_inputs_that_are_not_tensors_or_plain_values_are_not_kept():
    model = decoder()

    class Opaque:
        pass

    assert memo.detection_key(model, (), {"input_ids": IDS}) is not None
    assert memo.detection_key(model, (), {"input_ids": IDS, "extra": Opaque()}) is None
    assert memo.detection_key(model, (), {"input_ids": IDS}) != memo.detection_key(model, (), {"input_ids": IDS.float()})
