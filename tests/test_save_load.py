"""attnopt.save / attnopt.load: saved here, loaded in a fresh process, same outputs and same report."""

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import attnopt
from attnopt.saving import HEADER_FILE
from attnopt.targets.hf import SITE_STATE_FILE
from attnopt.ir.errors import SaveError

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
B, N, VOCAB = 2, 40, 97

# Run in a fresh interpreter: first plain transformers (attnopt not imported, so its attention
# names are not registered), then attnopt.load; outputs and the report go to a file.
FRESH_LOAD = r"""
import json, sys, torch
path, inputs_file, out_file = sys.argv[1:4]
result = {}
import transformers
config = transformers.AutoConfig.from_pretrained(path)
def plain():
    try:
        getattr(transformers, config.architectures[0]).from_pretrained(path)
        return "loaded"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
result["plain"] = plain()
import attnopt
model = attnopt.load(path)
result["plain after attnopt registered"] = plain()
inputs = torch.load(inputs_file, weights_only=True)
with torch.no_grad():
    out = model(**inputs["call"])
result["class"] = type(model).__name__
result["output"] = out[inputs["key"]]
if inputs.get("generate") is not None:
    result["generate"] = model.generate(inputs["generate"], max_new_tokens=4, do_sample=False, pad_token_id=0)
result["report"] = model.attnopt_report.to_json()
torch.save(result, out_file)
"""


def _fresh(code, *args, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]


def _load_fresh(tmp_path, saved, call, key, generate=None):
    torch.save({"call": call, "key": key, "generate": generate}, tmp_path / "inputs.pt")
    _fresh(FRESH_LOAD, saved, tmp_path / "inputs.pt", tmp_path / "out.pt")
    return torch.load(tmp_path / "out.pt", weights_only=True)


def _statuses(report):
    return [(r.site.id, str(r.outcome.status), r.outcome.final_form) for r in report.sites]


# ---------------------------------------------------------------- transformers decoder


@pytest.fixture(scope="module")
def llama_compiled():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(1))
    # One site per kind of saved state: none (exact), a fitted hedgehog map + β, a reuse anchor layer
    # (its anchor a rewritten site), and a buffer rebuilt from params (ssm's decay, not persistent).
    policy = {"name": "mixed", "rules": [
        {"form": "exact", "layers": [0, 0]},
        {"form": "linear+window", "params": {"window": 8, "sinks": 2, "fit_steps": 20}, "layers": [1, 1]},
        {"form": "reuse", "params": {"anchor": -1, "block": 4, "top_k": 2}, "layers": [2, 2]},
        {"form": "ssm", "layers": [3, 3]},
    ]}
    opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99,
                          e2e_tolerance=None)
    return model, opt, ids


def test_llama_loads_in_a_fresh_process_with_the_same_logits_generation_and_report(llama_compiled, tmp_path):
    model, opt, ids = llama_compiled
    assert _statuses(opt.attnopt_report) == [
        ("model.layers.0.self_attn#0", "kept", "exact"), ("model.layers.1.self_attn#0", "rewritten", "linear+window"),
        ("model.layers.2.self_attn#0", "rewritten", "reuse"), ("model.layers.3.self_attn#0", "rewritten", "ssm")]
    saved = attnopt.save(opt, tmp_path / "llama")
    with torch.no_grad():
        logits = opt(input_ids=ids, use_cache=False).logits
        original = model(input_ids=ids, use_cache=False).logits
    generated = opt.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)

    got = _load_fresh(tmp_path, saved, {"input_ids": ids, "use_cache": False}, "logits", generate=ids)
    assert got["class"] == "LlamaForCausalLM"
    assert torch.equal(got["output"], logits)
    assert not torch.allclose(got["output"], original, atol=1e-3)  # the rewrite is what came back
    assert torch.equal(got["generate"], generated)  # cached decoding, the reuse anchor and selection state included
    assert got["report"] == opt.attnopt_report.to_json()
    # Plain transformers refuses the directory, naming attnopt, instead of returning the exact model;
    # also in a process where attnopt has registered its own attention implementations.
    for case in ("plain", "plain after attnopt registered"):
        assert got[case].startswith('ValueError: Specified `attn_implementation="use_attnopt_load"` is not supported'), got[case]

    header = json.loads((saved / HEADER_FILE).read_text())
    assert [(s["site_id"], s["form"], s["accepted"], s["state"]) for s in header["sites"]] == [
        ("model.layers.1.self_attn#0", "linear+window", True, {"log_beta": [6], "feature_map.weight_HDP": [6, 8, 8]}),
        ("model.layers.2.self_attn#0", "reuse", True, {"anchor_layer": []}),
        ("model.layers.3.self_attn#0", "ssm", True, {}),
    ]
    assert header["policy"] == opt.attnopt_report.policy.to_dict()
    # The model's own weights carry no site module keys; those live in attnopt_sites.safetensors only.
    from safetensors.torch import load_file

    weights = load_file(str(saved / "model.safetensors"))
    assert set(weights) == set(model.state_dict()) and not any("attnopt" in k for k in weights)
    assert len(load_file(str(saved / SITE_STATE_FILE))) == 3
    # Saving left the compiled model whole.
    with torch.no_grad():
        assert torch.equal(opt(input_ids=ids, use_cache=False).logits, logits)


def test_load_in_this_process_restores_the_policy_object(llama_compiled, tmp_path):
    _, opt, ids = llama_compiled
    loaded = attnopt.load(attnopt.save(opt, tmp_path / "llama"))
    assert isinstance(loaded.attnopt_report.policy, attnopt.Policy)
    assert loaded.attnopt_report.policy.to_dict() == opt.attnopt_report.policy.to_dict()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, use_cache=False).logits, opt(input_ids=ids, use_cache=False).logits)


def test_delta_convolution_taps_and_their_absence_load_exactly(tmp_path):
    """A delta site with learnt short-convolution taps and one without (conv:0) come back identical."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, N), generator=torch.Generator().manual_seed(2))
    policy = {"name": "deltas", "rules": [{"form": "delta", "params": {"fit_steps": 0}, "layers": [0, 0]},
                                          {"form": "delta", "params": {"fit_steps": 0, "conv": 0}, "layers": [1, 1]}]}
    opt = attnopt.compile(transformers.LlamaForCausalLM(cfg).eval(), policy, example_inputs={"input_ids": ids,
                          "use_cache": False}, tolerance=10.0, e2e_tolerance=None, dispatch="off")
    sites = [m for m in opt.modules() if isinstance(m, attnopt.forms.SiteModule)]
    assert [m.conv_HkvWK is None for m in sites] == [False, True]
    with torch.no_grad():
        sites[0].conv_HkvWK.add_(0.3 * torch.randn(sites[0].conv_HkvWK.shape, generator=torch.Generator().manual_seed(3)))
    loaded = attnopt.load(attnopt.save(opt, tmp_path / "deltas"))
    again = [m for m in loaded.modules() if isinstance(m, attnopt.forms.SiteModule)]
    assert torch.equal(again[0].conv_HkvWK, sites[0].conv_HkvWK) and again[1].conv_HkvWK is None
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, use_cache=False).logits, opt(input_ids=ids, use_cache=False).logits)


def test_a_model_cast_to_bfloat16_loads_bit_for_bit_with_its_rope_buffer_in_bfloat16(llama_compiled, tmp_path):
    # .to(bfloat16) casts RoPE's inv_freq, a buffer save_pretrained leaves out and from_pretrained
    # rebuilds in float32: without its recorded dtype the loaded model computed other logits.
    _, opt, ids = llama_compiled
    cast = copy.deepcopy(opt).to(torch.bfloat16)
    loaded = attnopt.load(attnopt.save(cast, tmp_path / "bf16"))
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids, use_cache=False).logits, cast(input_ids=ids, use_cache=False).logits)


def test_a_model_that_slides_its_own_window_loads_with_its_window(tmp_path):
    # Mistral: the exact layer keeps the model's own window (no site module); the rewritten one its form.
    cfg = transformers.MistralConfig(vocab_size=89, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     sliding_window=16)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    ids = torch.randint(1, 89, (2, 20), generator=torch.Generator().manual_seed(3))
    policy = {"name": "middle", "rules": [{"form": "linear", "layers": [1, 1]}]}
    opt = attnopt.compile(model, policy, example_inputs={"input_ids": ids, "use_cache": False}, tolerance=0.99,
                          e2e_tolerance=None)
    saved = attnopt.save(opt, tmp_path / "mistral")
    entries = json.loads((saved / HEADER_FILE).read_text())["sites"]
    assert [(e["form"], e["accepted"]) for e in entries] == [("linear", True)]
    loaded = attnopt.load(saved)
    assert _statuses(loaded.attnopt_report) == _statuses(opt.attnopt_report)
    # Decoding past the 16-key window: the same tokens and logits step by step.
    a, b = (m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                       return_dict_in_generate=True) for m in (opt, loaded))
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


# ---------------------------------------------------------------- real MiniLM


def test_minilm_window_sinks_loads_in_a_fresh_process(minilm, english_256, tmp_path):
    model, _ = minilm
    batch = {k: v[:2] for k, v in english_256.items()}
    opt = attnopt.compile(model, "window:64+sinks:4", example_inputs=batch)
    assert [s for _, s, _ in _statuses(opt.attnopt_report)] == ["rewritten"] * 6
    saved = attnopt.save(opt, tmp_path / "minilm")
    with torch.no_grad():
        hidden = opt(**batch).last_hidden_state
    got = _load_fresh(tmp_path, saved, batch, "last_hidden_state")
    assert got["class"] == "BertModel"
    assert torch.equal(got["output"], hidden)
    assert got["report"] == opt.attnopt_report.to_json()
    assert "use_attnopt_load" in got["plain"] and "use_attnopt_load" in got["plain after attnopt registered"]


# ---------------------------------------------------------------- errors


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


def test_saving_a_model_that_was_not_compiled_says_so(tmp_path):
    with pytest.raises(SaveError, match="was not compiled by attnopt.compile") as e:
        attnopt.save(nn.Linear(2, 2), tmp_path / "x")
    _one_line(e)
    assert not (tmp_path / "x").exists()


def test_saving_to_a_file_or_under_a_file_says_so(llama_compiled, tmp_path):
    _, opt, _ = llama_compiled
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SaveError, match="exists and is not a directory") as e:
        attnopt.save(opt, file)
    _one_line(e)
    with pytest.raises(SaveError, match="cannot create the directory") as e:
        attnopt.save(opt, file / "below")
    _one_line(e)


def test_loading_a_directory_without_attnopt_json_or_from_the_future_says_so(llama_compiled, tmp_path):
    model, _, _ = llama_compiled
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(SaveError, match="has no attnopt.json") as e:
        attnopt.load(tmp_path / "plain")
    _one_line(e)
    with pytest.raises(SaveError, match="is not a directory"):
        attnopt.load(tmp_path / "missing")
    future = tmp_path / "future"
    future.mkdir()
    (future / HEADER_FILE).write_text(json.dumps({"format_version": 99, "mechanism": "hf",
                                                  "versions": {"attnopt": "9.0"}}))
    with pytest.raises(SaveError, match="format 99, newer than this attnopt reads \\(up to 3\\); upgrade") as e:
        attnopt.load(future)
    _one_line(e)


# ---------------------------------------------------------------- graph path (torch.export)

C, H = 48, 6


class HandAttention(nn.Module):
    """Fused-qkv causal self-attention written out by hand, with a residual."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.o = nn.Linear(C, C)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, C // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, C))


class HandNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([HandAttention() for _ in range(2)])
        self.head = nn.Linear(C, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return {"probs": self.head(x).softmax(-1), "hidden": x}


def _hand_net():
    torch.manual_seed(0)
    return HandNet().eval()


def _x(n=37, b=2, seed=1):
    return torch.randn(b, n, C, generator=torch.Generator().manual_seed(seed))


# The fresh process has neither HandNet nor this file: the directory holds the program as data.
FRESH_GRAPH = r"""
import sys, torch
path, inputs_file, out_file = sys.argv[1:4]
import attnopt
inputs = torch.load(inputs_file, weights_only=True)
model = attnopt.load(path)
result = {}
with torch.no_grad():
    result["outputs"] = [model(x) for x in inputs]
result["report"] = model.attnopt_report.to_json()
result["class"] = type(model).__name__
torch.save(result, out_file)
"""


@pytest.fixture(scope="module")
def favor_graph():
    # FAVOR+: a stateful site module (its random projection is a buffer) with no fit to wait for.
    net = _hand_net()
    return net, attnopt.compile(net, "linear:favor", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None)


def test_graph_module_loads_in_a_fresh_process_with_the_same_outputs_and_report(favor_graph, tmp_path):
    net, opt = favor_graph
    assert [s for _, s, _ in _statuses(opt.attnopt_report)] == ["rewritten"] * 2
    saved = attnopt.save(opt, tmp_path / "graph")
    inputs = [_x(), _x(n=50, b=3, seed=2)]  # the example shape and another (the graph is dynamic)
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = [opt(x) for x in inputs]
    _fresh(FRESH_GRAPH, saved, tmp_path / "inputs.pt", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["class"] == "CompiledModule"
    assert got["report"] == opt.attnopt_report.to_json()
    for out, ref in zip(got["outputs"], expected):
        assert set(out) == {"probs", "hidden"}
        assert torch.equal(out["hidden"], ref["hidden"]) and torch.equal(out["probs"], ref["probs"])
    header = json.loads((saved / HEADER_FILE).read_text())
    assert header["mechanism"] == "graph" and header["format_version"] == 3
    # Data only: a torch.export archive (a zip of JSON and raw tensors) and safetensors, no pickle.
    assert sorted(p.name for p in saved.iterdir()) == [HEADER_FILE, "attnopt_program.pt2", "attnopt_sites.safetensors"]
    assert [(e["name"], e["form"], e["state"]) for e in header["sites"]] == [
        ("attnopt_site_0", "linear", {"feature_map.omega_DM": [8, 16]}),
        ("attnopt_site_1", "linear", {"feature_map.omega_DM": [8, 16]})]
    # Saving left the compiled module whole, torch.export's own guard function still in its InputGuard.
    assert opt.graph_module._guards_fn._export_guard


def test_graph_state_dict_has_the_original_keys(favor_graph):
    net = _hand_net()
    opt = attnopt.compile(net, "window:8+sinks:2", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None)
    state = opt.state_dict()
    assert list(state) == list(net.state_dict())
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    # And back: the original module's state loads into the compiled one (here: other weights).
    torch.manual_seed(5)
    other = HandNet().eval()
    opt.load_state_dict(other.state_dict())
    assert torch.equal(opt.graph_module.head.weight, other.head.weight)
    # A stateful site module adds its own keys under its graph name; nothing else changes.
    fitted = favor_graph[1]
    extra = sorted(set(fitted.state_dict()) - set(net.state_dict()))
    assert extra == ["attnopt_site_0.feature_map.omega_DM", "attnopt_site_1.feature_map.omega_DM"]
    assert set(net.state_dict()) <= set(fitted.state_dict())
    # Inside a parent module the keys keep the same names below the parent's prefix, both ways.
    parent = nn.ModuleDict({"net": opt})
    assert list(parent.state_dict()) == ["net." + k for k in net.state_dict()]
    parent.load_state_dict({"net." + k: v for k, v in net.state_dict().items()})
    assert torch.equal(opt.graph_module.head.weight, net.head.weight)
    with pytest.raises(RuntimeError, match="Unexpected key.*graph_module.stray"):
        opt.load_state_dict({**net.state_dict(), "stray": torch.zeros(1)})


def test_a_graph_model_saves_its_current_weights_and_a_loaded_one_saves_again(favor_graph, tmp_path):
    import copy
    import io

    _, compiled = favor_graph
    opt = copy.deepcopy(compiled)  # the fixture's model stays as compiled
    torch.manual_seed(5)
    opt.load_state_dict(HandNet().state_dict(), strict=False)  # other weights after compile: those are saved
    x = _x(n=45, b=3, seed=7)
    once = attnopt.load(attnopt.save(opt, tmp_path / "once"))
    twice = attnopt.load(attnopt.save(once, tmp_path / "twice"))
    with torch.no_grad():
        want = opt(x)["hidden"]
        assert not torch.allclose(want, compiled(x)["hidden"])
        assert torch.equal(once(x)["hidden"], want) and torch.equal(twice(x)["hidden"], want)
    # A pickled copy (the user's own, trusted) drops the captured program: saving it says so.
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    unpickled = torch.load(buffer, weights_only=False)  # this test's own pickle
    with pytest.raises(SaveError, match="holds no captured program .*compile the model again") as e:
        attnopt.save(unpickled, tmp_path / "unpickled")
    _one_line(e)


def test_the_input_contract_round_trips_through_json_with_every_constant_type():
    from attnopt.passes.input_guard import InputContract, InputRule, contract_from_dict, contract_to_dict

    rules = (InputRule("x", "tensor", ("s0", 16), why={1: "the model reshapes by it"}),
             InputRule("n", "any"),
             *(InputRule(f"c{i}", "constant", value=v) for i, v in
               enumerate([None, True, 3, 0.1, float("nan"), float("-inf"), "mean"])))
    contract = InputContract("Net", rules, {"s0": (2, None), "s1": (0, 64)})
    back = contract_from_dict(json.loads(json.dumps(contract_to_dict(contract), allow_nan=False)))
    assert back.model_name == "Net" and back.ranges == contract.ranges
    for got, want in zip(back.rules, rules):
        assert (got.name, got.kind, got.sizes, got.why) == (want.name, want.kind, want.sizes, want.why)
        assert type(got.value) is type(want.value)
        assert got.value == want.value or (got.value != got.value and want.value != want.value)  # nan == nan
    with pytest.raises(ValueError, match="input 'd' was captured as the constant torch.float16 of type dtype"):
        contract_to_dict(InputContract("Net", (InputRule("d", "constant", value=torch.float16),)))
    with pytest.raises(ValueError, match="input rule 0 has a int constant holding str"):
        contract_from_dict({"model_name": "Net", "ranges": {}, "rules": [
            {"name": "c", "kind": "constant", "sizes": [], "why": {}, "value": {"type": "int", "value": "3"}}]})


# ---------------------------------------------------------------- every form on the graph path

# Fits cut to a few steps: what is checked is that the loaded model computes what the saved one
# computes, not the quality of the fit.
GRAPH_FORMS = {
    "linear": {"form": "linear"},
    "window": {"form": "window", "params": {"window": 8, "sinks": 2}},
    "linear+window": {"form": "linear+window", "params": {"window": 8, "fit_steps": 3}},
    "gla": {"form": "gla", "params": {"fit_steps": 3}},
    "gla+window": {"form": "gla+window", "params": {"window": 8, "fit_steps": 3}},
    "delta": {"form": "delta", "params": {"fit_steps": 3}},
    "ssm": {"form": "ssm"},
    "reuse": {"form": "reuse", "params": {"anchor": -1, "block": 4, "top_k": 1}, "layers": [1, 1]},
    "exact": {"form": "exact"},
    # exact below 24 query positions, the form past them: both branches must come back
    "linear below 24 exact": {"form": "linear", "params": {"min_seq_len": 24}},
}


@pytest.mark.parametrize("form", list(GRAPH_FORMS))
def test_every_form_round_trips_exactly_on_the_graph_path_at_other_batches_and_lengths(form, tmp_path):
    net = _hand_net()
    opt = attnopt.compile(net, {"rules": [GRAPH_FORMS[form]]}, example_inputs=(_x(n=37, b=2),), tolerance=10.0,
                          e2e_tolerance=None, dispatch="off")
    rewritten = [f for _, s, f in _statuses(opt.attnopt_report) if s == "rewritten"]
    assert rewritten == {"reuse": ["reuse"], "exact": []}.get(form, [GRAPH_FORMS[form]["form"]] * 2)
    # Each site tensor moved off any value a fresh build would give (sign kept: gates stay gates), so
    # only the saved tensors can reproduce these outputs.
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for m in opt.modules():
            if isinstance(m, attnopt.forms.SiteModule):
                for t in m.state_dict().values():
                    if t.is_floating_point():
                        t.mul_(1 + 0.05 * torch.rand(t.shape, generator=gen))
    loaded = attnopt.load(attnopt.save(opt, tmp_path / "saved"))
    assert loaded.attnopt_report.to_json() == opt.attnopt_report.to_json()
    assert [(m.form, m.params) for m in loaded.modules() if isinstance(m, attnopt.forms.SiteModule)] == \
        [(m.form, m.params) for m in opt.modules() if isinstance(m, attnopt.forms.SiteModule)]
    with torch.no_grad():
        for b, n in ((3, 50), (1, 9), (2, 37)):  # batch and length the example did not have, and the example's
            x = _x(n=n, b=b, seed=n)
            got, want = loaded(x), opt(x)
            assert torch.equal(got["hidden"], want["hidden"]) and torch.equal(got["probs"], want["probs"]), (b, n)
    if form != "exact":  # the rewrite is what came back
        with torch.no_grad():
            assert not torch.allclose(loaded(_x(n=50, b=3))["hidden"], net(_x(n=50, b=3))["hidden"], atol=1e-5)


class OddNet(nn.Module):
    """What a captured program may hold besides weights: a no_grad region (a higher-order op), float
    and str constant inputs, a lifted tensor constant, tied weights, a bf16 parameter."""

    def __init__(self):
        super().__init__()
        self.attn = HandAttention()
        self.out, self.out2 = nn.Linear(C, C), nn.Linear(C, C)
        self.out2.weight = self.out.weight
        self.register_buffer("shift", torch.randn(4, C)[1])
        self.bias = nn.Parameter(torch.randn(C).to(torch.bfloat16))

    def forward(self, x, scale: float = 1.0, mode: str = "plus"):
        with torch.no_grad():
            x = x + self.shift
        y = self.attn(x) * scale
        y = self.out(y) + self.out2(y) + self.bias.float() + torch.tensor([0.5] * C)
        return y if mode == "plus" else -y


def test_a_graph_program_with_constants_ties_views_and_a_no_grad_region_round_trips(tmp_path):
    torch.manual_seed(0)
    net = OddNet().eval()
    opt = attnopt.compile(net, "linear", example_inputs=((_x(),), {"scale": 0.5, "mode": "minus"}), tolerance=10.0,
                          e2e_tolerance=None, dispatch="off")
    assert [f for _, _, f in _statuses(opt.attnopt_report)] == ["linear"]
    loaded = attnopt.load(attnopt.save(opt, tmp_path / "odd"))
    with torch.no_grad():
        for b, n in ((3, 50), (1, 6)):
            x = _x(n=n, b=b, seed=n)
            assert torch.equal(loaded(x, scale=0.5, mode="minus"), opt(x, scale=0.5, mode="minus")), (b, n)
    assert loaded.graph_module.bias.dtype == torch.bfloat16
    with pytest.raises(attnopt.ir.errors.SpecializedInputError, match="captured with mode='minus'"):
        loaded(_x(), scale=0.5, mode="plus")


def test_a_parameter_viewing_a_larger_storage_is_written_as_its_own_bytes_and_read_back(tmp_path):
    from attnopt.targets.program_archive import read_program, write_program

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.arange(12.0).reshape(3, 4)[1])

        def forward(self, x):
            return x * self.w

    program = torch.export.export(Scale(), (torch.ones(4),))
    assert program.state_dict["w"].untyped_storage().nbytes() == 48  # still a view after export
    write_program(program, tmp_path / "scale.pt2")
    back = read_program(tmp_path / "scale.pt2")
    assert isinstance(back.state_dict["w"], nn.Parameter) and back.state_dict["w"].untyped_storage().nbytes() == 16
    assert torch.equal(back.module()(torch.ones(4)), torch.arange(4.0, 8.0))


def test_a_transformers_model_on_the_graph_path_round_trips_with_padding_and_a_constant_input(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()

    def batch(b, n, seed):
        ids = torch.randint(1, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # row 0 left-padded
        return {"input_ids": ids, "attention_mask": mask, "use_cache": False}

    opt = attnopt.compile(model, "linear", example_inputs=batch(2, 24, 1), tolerance=10.0, e2e_tolerance=None,
                          method="graph", dispatch="off")
    assert [f for _, _, f in _statuses(opt.attnopt_report)] == ["linear"]
    saved = attnopt.save(opt, tmp_path / "llama_graph")
    inputs = json.loads((saved / HEADER_FILE).read_text())["inputs"]
    assert [(r["name"], r["kind"], r["value"]) for r in inputs["rules"]] == [
        ("input_ids", "tensor", None), ("attention_mask", "tensor", None),
        ("use_cache", "constant", {"type": "bool", "value": False})]
    loaded = attnopt.load(saved)
    with torch.no_grad():
        for b, n in ((3, 40), (1, 7)):
            call = batch(b, n, n)
            assert torch.equal(loaded(**call).logits, opt(**call).logits), (b, n)
    # The input contract came back: a call with another constant is named in one line.
    with pytest.raises(attnopt.ir.errors.SpecializedInputError, match="captured with use_cache=False"):
        loaded(**{**batch(2, 24, 1), "use_cache": True})
