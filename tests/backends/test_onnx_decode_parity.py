"""ONNX Runtime decoding equals torch generate(), token by token and in every step's logits: window and
window+sinks, mixed policies, GQA with several KV heads, left-padded batches (issue 39, item 3).

What broke there: a site under a dispatch threshold (min_seq_len T, measured by the automatic dispatch
or given by the policy) runs exact attention in torch for each row's first T real tokens, and the
decode graph ran the form from the first token; the tokens parted where the window first hid a key
(W + S real tokens). The graph now carries the exact prefix. Each case has thresholds that the
generation crosses, a short prompt (the window and the sinks come into play while decoding) and a
long one (they do inside the prompt), left-padded, in one call and in chunks.

Two drivers, each against torch: `ContractDriver` (test_onnx_decode: onnxruntime, numpy and the contract
in the file, no attnopt code) and `attnopt.onnx.Generator`.
"""

import copy
import warnings

import numpy as np
import pytest
import torch

import attnopt

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from test_onnx_decode import PAD, VOCAB, ContractDriver, _rel, decoder  # noqa: E402

EXAMPLE = torch.randint(1, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
NEW = 24
TOLERANCE = 1e-4


def _rule(layer, form, **params):
    return {"form": form, "params": params, "layers": [layer, layer]}


# (architecture, query heads, kv heads, rules): min_seq_len given so that generation crosses it; the
# export honours a measured one the same way (the same site attribute). A window site's threshold lies
# past W + S: below that, exact attention and the window see the same keys.
CASES = {
    "llama-window16-sinks2": ("llama", 4, 2, [_rule(i, "window", window=16, sinks=2, min_seq_len=22)
                                              for i in range(3)]),
    "llama-exact-window8-linear": ("llama", 4, 2, [_rule(0, "exact"),
                                                    _rule(1, "window", window=8, sinks=2, min_seq_len=14),
                                                    _rule(2, "linear", min_seq_len=12)]),
    "qwen2-window16-sinks2-mixed": ("qwen2", 4, 1, [_rule(0, "window", window=16, sinks=2, min_seq_len=22),
                                                     _rule(1, "exact"), _rule(2, "linear")]),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    kind, heads, kv_heads, rules = CASES[request.param]
    opt = attnopt.compile(decoder(kind, len(rules), heads=heads, kv_heads=kv_heads),
                          {"name": request.param, "rules": rules}, example_inputs={"input_ids": EXAMPLE},
                          tolerance=10.0, e2e_tolerance=None)  # every site rewritten: what is tested is the export
    assert [r.outcome.final_form for r in opt.attnopt_report.sites] == [r["form"] for r in rules]
    folder = tmp_path_factory.mktemp(request.param) / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = attnopt.export_onnx(opt, folder, {"input_ids": EXAMPLE})
    return opt, folder, result, rules


def padded_prompt(n, pads, seed):
    ids = torch.randint(1, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :pads], mask[1, :pads] = PAD, 0
    return ids.numpy(), mask.numpy()


def torch_steps(opt, ids, mask, stop_at_eos=False):
    """Greedy sequences and per-step logits of the compiled model's generate(), which stops a row at the
    model's eos only if asked. (generate() fills an eos left None in the config it is given from the
    model's own generation config: that one is cleared for the call.)"""
    config = copy.deepcopy(opt.generation_config)
    config.update(do_sample=False, max_new_tokens=NEW, pad_token_id=PAD, output_logits=True,
                  return_dict_in_generate=True)
    eos = opt.generation_config.eos_token_id
    try:
        if not stop_at_eos:
            opt.generation_config.eos_token_id = config.eos_token_id = None
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = opt.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                               generation_config=config)
    finally:
        opt.generation_config.eos_token_id = eos
    return out.sequences.numpy(), torch.stack(out.logits, 1).numpy()


def worst_step(logits, want):
    return max(_rel(logits[:, t], want[:, t]) for t in range(want.shape[1]))


@pytest.mark.parametrize("n, pads, chunks", [(8, 3, (2, 5)), (30, 7, (7, 19))],
                         ids=["short-prompt", "long-prompt"])
def test_contract_driver_and_generator_equal_torch_token_by_token(case, n, pads, chunks):
    from attnopt.onnx import Generator

    opt, folder, result, rules = case
    thresholds = [r["params"].get("min_seq_len", 0) for r in rules if r["form"] != "exact"]
    assert sorted(s["exact_below"] for s in result.sites if s["form"] != "exact") == sorted(thresholds)
    ids, mask = padded_prompt(n, pads, seed=n)
    want_seq, want_logits = torch_steps(opt, ids, mask)
    driver = ContractDriver(folder)
    for split in ((), chunks):  # the prompt in one call, then in three (row 1's first chunk all pads)
        seq, logits, _ = driver.greedy(ids, mask, NEW, chunks=split, stop=False)
        assert np.array_equal(seq, want_seq), split
        assert worst_step(logits, want_logits) <= TOLERANCE, split
    assert np.array_equal(Generator(folder).generate(ids, mask, max_new_tokens=NEW, eos_token_id=None), want_seq)
    assert mask.sum(1).min() + NEW > max(thresholds)  # every row passes every threshold


def test_generator_stops_at_the_models_eos_as_torch_does(case):
    from attnopt.onnx import Generator

    opt, folder, _, _ = case
    ids, mask = padded_prompt(8, 3, seed=8)
    want, _ = torch_steps(opt, ids, mask, stop_at_eos=True)
    assert np.array_equal(Generator(folder).generate(ids, mask, max_new_tokens=NEW), want)


def test_a_padded_row_generates_what_it_generates_alone(case):
    _, folder, _, _ = case
    ids, mask = padded_prompt(8, 3, seed=8)
    driver = ContractDriver(folder)
    seq, logits, _ = driver.greedy(ids, mask, NEW, stop=False)
    alone, alone_logits, _ = driver.greedy(ids[1:, 3:], mask[1:, 3:], NEW, stop=False)
    assert np.array_equal(alone[0, -NEW:], seq[1, -NEW:]) and _rel(alone_logits[0], logits[1]) <= TOLERANCE
