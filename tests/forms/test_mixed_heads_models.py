"""Per-head sites in whole models: everything a site does works with exact heads among its heads.

Cached generate() equals a full forward at every step (left padding too, and a padded row equals
the row alone); threads with caches of their own; save/load on both mechanisms; ONNX prefill and
decode export (the exact heads' K/V a growing state, the rest the form's fixed state) with
attnopt.onnx.Generator giving torch's greedy tokens; the report's exact heads and layers x heads map.
"""

import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt.forms.common.mixed_heads import MixedHeadsSite

transformers = pytest.importorskip("transformers")

VOCAB, PROMPT, NEW, PAD = 97, 26, 10, 0


def decoder(layers=3, heads=4, kv_heads=2):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


EXAMPLE = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
# (the form on every head, the KV head kept exact); fit_steps: the fit itself is tested in test_mixed_heads.py
POLICIES = {
    "window": ("window:8+sinks:2", 1),
    "gla+window": ("gla+window:8+fit_steps:4", 0),
    "linear": ("linear", 1),
    "ssm": ("ssm", 0),
    "delta": ("delta+fit_steps:4", 1),
    "gla": ("gla+fit_steps:4", 0),
}
_COMPILED = {}


def compiled(name, exact=True):
    if (name, exact) not in _COMPILED:
        base, head = POLICIES[name]
        policy = f"{base}+exact_heads:{head}" if exact else base
        _COMPILED[name, exact] = attnopt.compile(decoder(), policy, example_inputs={"input_ids": EXAMPLE},
                                                 dispatch="off", tolerance=10.0, e2e_tolerance=None)
    return _COMPILED[name, exact]


def prompt():
    ids = torch.randint(3, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = PAD, 0  # row 1 left-padded
    return ids, mask


def generate(model, ids, mask, cache=None):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=PAD, eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                             **({} if cache is None else {"past_key_values": cache}))
    return out.sequences, torch.stack(out.logits, 1), getattr(out, "past_key_values", None)


def full_logits(model, seq, mask):
    am = torch.cat([mask, torch.ones(mask.shape[0], seq.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=seq, attention_mask=am, position_ids=pos, use_cache=False).logits[:, PROMPT - 1:-1]


@pytest.mark.parametrize("name", ["window", "gla+window", "linear",
                                  pytest.param("ssm", marks=pytest.mark.slow), pytest.param("delta", marks=pytest.mark.slow),
                                  pytest.param("gla", marks=pytest.mark.slow)])
def test_generate_equals_the_full_forward_at_every_step(name):
    from attnopt.hf.cache import SiteCacheLayer

    opt = compiled(name)
    records = opt.attnopt_report.sites
    assert all(r.outcome.status.value == "rewritten" and r.exact_heads for r in records)
    ids, mask = prompt()
    seq, steps, cache = generate(opt, ids, mask)
    full = full_logits(opt, seq, mask)
    assert (steps - full).abs().max() < 1e-4
    for r in records:  # each site decoded from its own layer: the form's state plus its exact heads' K/V
        layer = cache.layers[opt.get_submodule(r.site.module_path).layer_idx]
        assert isinstance(layer, SiteCacheLayer)
        assert layer.state.form_state.k_BKeND.shape[1:3] == (len(r.exact_heads), PROMPT + NEW - 1)
    alone, alone_steps, _ = generate(opt, ids[1:, 6:], mask[1:, 6:])  # the padded row, unpadded
    assert torch.equal(alone[0, -NEW:], seq[1, -NEW:]) and (alone_steps[0] - steps[1]).abs().max() < 1e-4
    # the exact heads matter: the same form on every head generates other logits
    assert (generate(compiled(name, exact=False), ids, mask)[1] - steps).abs().max() > 1e-3


def test_threads_with_caches_of_their_own():
    opt = compiled("window")
    ids, mask = prompt()
    want = generate(opt, ids, mask)[0]
    got, errors = {}, []

    def run(i):
        try:
            got[i] = generate(opt, ids, mask)[0]
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and all(torch.equal(got[i], want) for i in range(3))


def test_save_and_load_keep_the_exact_heads(tmp_path):
    opt = compiled("gla+window")
    attnopt.save(opt, tmp_path / "m")
    loaded = attnopt.load(tmp_path / "m")
    sites = [m for m in loaded.modules() if isinstance(m, MixedHeadsSite)]
    assert len(sites) == 3 and all(m.exact_heads == [0] and m.form == "gla+window" for m in sites)
    assert [r.exact_heads for r in loaded.attnopt_report.sites] == [[0]] * 3
    with torch.no_grad():
        assert torch.equal(loaded(EXAMPLE).logits, opt(EXAMPLE).logits)
    ids, mask = prompt()
    assert torch.equal(generate(loaded, ids, mask)[0], generate(opt, ids, mask)[0])


class GqaBlock(torch.nn.Module):
    """A plain module (the graph mechanism): one GQA attention with its projections."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.kv, self.o = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(B, N, 32))


def test_graph_mechanism_runs_saves_and_loads_a_per_head_site(tmp_path):
    model = GqaBlock().eval()
    x = torch.randn(2, 24, 32)
    opt = attnopt.compile(model, "window:4+exact_heads:1", example_inputs=(x,), dispatch="off", tolerance=10.0,
                          e2e_tolerance=None)
    (record,) = opt.attnopt_report.sites
    assert record.outcome.status.value == "rewritten" and record.exact_heads == [1]
    with torch.no_grad():  # by hand: heads 2, 3 (KV head 1) exact, heads 0, 1 a causal window of 4
        q = model.q(x).view(2, 24, 4, 8).transpose(1, 2)
        k, v = model.kv(x).view(2, 24, 2, 2, 8).permute(2, 0, 3, 1, 4)
        i, j = torch.arange(24)[:, None], torch.arange(24)[None, :]
        band = (j <= i) & (j > i - 4)
        heads = [F.scaled_dot_product_attention(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1],
                                                attn_mask=band if h < 2 else (j <= i)) for h in range(4)]
        want = model.o(torch.cat(heads, 1).transpose(1, 2).reshape(2, 24, 32))
        assert (opt(x) - want).abs().max() < 1e-5
    attnopt.save(opt, tmp_path / "g")
    loaded = attnopt.load(tmp_path / "g")
    with torch.no_grad():
        assert torch.equal(loaded(x), opt(x))
    assert loaded.attnopt_report.sites[0].exact_heads == [1]


def test_report_fraction_and_map():
    opt = attnopt.compile(decoder(), {"rules": [{"form": "window", "window": 8, "exact_heads": [1], "layers": 0},
                                                {"form": "exact", "layers": 1},
                                                {"form": "window", "window": 8, "layers": 2}]},
                          example_inputs={"input_ids": EXAMPLE}, dispatch="off", tolerance=10.0, e2e_tolerance=None)
    report = opt.attnopt_report
    assert [r.exact_heads for r in report.sites] == [[1], [], []]
    assert report.exact_head_fraction() == 1 / 4  # rewritten sites: layers 0 and 2, 2 KV heads each
    assert report.head_map() == [["window", "exact"], ["exact", "exact"], ["window", "window"]]
    back = attnopt.report.CompileReport.from_dict(report.to_dict())
    assert back.exact_head_fraction() == 1 / 4 and back.to_dict()["exact_head_fraction"] == 0.25
    mem = report.decode_memory  # layer 0: one KV head's whole cache, the other's window (half of layer 2's)
    kv_head = 1 * 1024 * (16 + 16) * 4
    assert mem.per_site[report.sites[0].site.id][0] == kv_head + mem.per_site[report.sites[2].site.id][0] // 2


# ---------------------------------------------------------------- ONNX


@pytest.mark.parametrize("name", ["window", pytest.param("gla+window", marks=pytest.mark.slow)])
def test_onnx_decode_export_generates_torch_greedy_tokens(name, tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from attnopt.onnx import Generator

    opt = compiled(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = attnopt.export_onnx(opt, tmp_path / "dec", {"input_ids": EXAMPLE})
    assert result.parity and all(f["same_tokens"] and f["rel_rms"] <= 1e-4 for f in result.parity)
    states = {s["past"]: s for s in result.contract["states"]}
    key = states["past_key_values.0.key"]
    assert key["shape"] == ["batch", 1, "past_sequence", 16]  # one exact KV head grows
    assert not any("past_sequence" in s["shape"] for n, s in states.items() if not n.endswith((".key", ".value")))
    ids, mask = prompt()
    want = generate(opt, ids, mask)[0].numpy()
    got = Generator(tmp_path / "dec").generate(ids.numpy(), mask.numpy(), max_new_tokens=NEW, eos_token_id=None)
    assert np.array_equal(got, want)


@pytest.mark.slow
def test_onnx_prefill_export_of_a_per_head_site(tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    opt = compiled("window")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = attnopt.export_onnx(opt, tmp_path / "m.onnx", {"input_ids": EXAMPLE}, decode=False, baseline=False)
    assert [s["form"] for s in result.sites] == ["window"] * 3
    assert all(s["site"] is not None for s in result.sites)
