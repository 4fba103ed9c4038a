"""export_onnx(decode=True) for the gated forms: the exported step graph generates in ONNX Runtime the
same greedy tokens and per-step logits as the compiled model's own generate(), left-padded, with a
chunked prefill, on Llama and Qwen2. The ONNX side is driven by test_onnx_decode's ContractDriver
(onnxruntime, numpy and the folder's metadata only: no attnopt code)."""

import warnings

import numpy as np
import pytest
import torch

import attnopt

pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")

from test_onnx_decode import (  # noqa: E402
    EXAMPLE,
    VOCAB,
    ContractDriver,
    _rel,
    assert_genai_generates_like_torch,
    decoder,
    left_padded_prompt,
    torch_generate,
)

# fit_steps 3: the fitted tensors (φ, gate projection and bias, β, output scale) move off their init,
# so the export carries trained values, not the closed-form start.
# Llama: the defaults (hedgehog φ, per-channel gates; delta on hedgehog φ). Qwen2: delta on q, k
# themselves and gla with one gate per head and elu φ (LinearAttention's per-head decay layout).
LAYERS = {"llama": [("gla", {}), ("delta", {})],
          "qwen2": [("delta", {"feature_map": "identity"}), ("gla", {"gate": "head", "feature_map": "elu"})]}


def _policy(kind):
    rules = [{"form": f, "params": {"fit_steps": 3, **p}, "layers": [i, i]} for i, (f, p) in enumerate(LAYERS[kind])]
    return {"name": kind + "-gated", "rules": rules}


@pytest.fixture(scope="module", params=[("llama", "ort"), ("qwen2", "onnx-std")], ids=["llama-ort", "qwen2-onnx-std"])
def exported(request, tmp_path_factory):
    kind, target = request.param
    opt = attnopt.compile(decoder(kind, len(LAYERS[kind])), _policy(kind), example_inputs={"input_ids": EXAMPLE},
                          tolerance=10.0, e2e_tolerance=None)
    folder = tmp_path_factory.mktemp(kind) / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = attnopt.export_onnx(opt, folder, {"input_ids": EXAMPLE}, target=target)
    return kind, target, opt, folder, result


def test_gated_decode_graph_generates_like_torch(exported):
    kind, target, opt, folder, result = exported
    assert [s["form"] for s in result.sites] == [f for f, _ in LAYERS[kind]]
    if target == "ort":  # the gated rules run natively, never the op's gated_delta default by accident
        assert [s["lowering"] for s in result.sites] == ["com.microsoft.LinearAttention"] * len(LAYERS[kind])
    assert result.parity and all(p["rel_rms"] <= 1e-4 for p in result.parity)
    ids, mask = left_padded_prompt()
    new = 20
    want_seq, want_logits = torch_generate(opt, ids, mask, new)
    driver = ContractDriver(folder)
    seq, logits, sizes = driver.greedy(ids, mask, new)
    assert np.array_equal(seq, want_seq)
    assert max(_rel(logits[:, t], want_logits[:, t]) for t in range(logits.shape[1])) <= 1e-4
    seq_c, logits_c, _ = driver.greedy(ids, mask, new, chunks=(6, 9))  # row 1's first chunk is all pads
    assert np.array_equal(seq_c, want_seq) and _rel(logits_c, want_logits) <= 1e-4
    assert sizes[0] == sizes[-1]  # fixed-size states: the bytes never grow with the context
    with torch.no_grad():  # the rewrite changed the model: matching torch is not matching the original
        base = decoder(kind, len(LAYERS[kind]))
        assert not torch.allclose(opt(input_ids=torch.as_tensor(ids)).logits, base(input_ids=torch.as_tensor(ids)).logits)


def test_gated_decode_rows_are_the_rows_alone(exported):
    """A left-padded row generates in ORT exactly what it generates without its pads."""
    _kind, _target, _opt, folder, _result = exported
    ids, mask = left_padded_prompt()
    driver = ContractDriver(folder)
    seq, logits, _ = driver.greedy(ids, mask, 12, stop=False)
    alone, alone_logits, _ = driver.greedy(ids[1:, 6:], mask[1:, 6:], 12, stop=False)
    assert np.array_equal(alone[0, -12:], seq[1, -12:]) and _rel(alone_logits[0], logits[1]) <= 1e-4


# ---------------------------------------------------------------- gla+window

# gla+window:64 with and without 4 sinks in each model, both gate layouts on both targets. min_seq_len 0:
# no measured switch to exact attention below some length (the export drops it, generate() would not).
# Compiled on 160 tokens: the fit sets the gates from the look-back beyond the window (on 24 it finds none
# and picks decay 0.05, which leaves nothing of a key 64 tokens on: the gated part would go untested).
LONG = torch.randint(1, VOCAB, (1, 160), generator=torch.Generator().manual_seed(5))
GLA_WINDOW = {"llama": [{}, {"sinks": 4, "gate": "head", "feature_map": "elu"}],
              "qwen2": [{"sinks": 4}, {"gate": "head", "feature_map": "elu"}]}


def _gla_window_policy(kind):
    rules = [{"form": "gla+window", "params": {"window": 64, "min_seq_len": 0, "fit_steps": 3, **p}, "layers": [i, i]}
             for i, p in enumerate(GLA_WINDOW[kind])]
    return {"name": kind + "-gla-window", "rules": rules}


@pytest.fixture(scope="module", params=[("llama", "ort"), ("qwen2", "onnx-std")], ids=["llama-ort", "qwen2-onnx-std"])
def gla_window_exported(request, tmp_path_factory):
    kind, target = request.param
    opt = attnopt.compile(decoder(kind, 2), _gla_window_policy(kind), example_inputs={"input_ids": LONG},
                          tolerance=10.0, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 2
    for site in (m for m in opt.modules() if getattr(m, "form", None) == "gla+window"):  # keys outlive the window
        assert float(site.gates.log_gates(torch.zeros(1, 2, 1, 16)).min()) * 64 > -8.0
    folder = tmp_path_factory.mktemp(kind + "_gla_window") / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = attnopt.export_onnx(opt, folder, {"input_ids": EXAMPLE}, target=target)
    return kind, target, opt, folder, result


def _assert_generates_like_torch(opt, folder, n, new, chunkings):
    """Greedy tokens equal torch generate()'s and every step's logits match, the prompt in one call and
    in each chunking; returns the per-step state bytes."""
    ids, mask = left_padded_prompt(n=n)
    want_seq, want_logits = torch_generate(opt, ids, mask, new)
    assert want_seq.shape[1] == n + new  # no eos: every step is compared
    driver = ContractDriver(folder)
    for chunks in ((), *chunkings):
        seq, logits, sizes = driver.greedy(ids, mask, new, chunks=chunks)
        assert np.array_equal(seq, want_seq), chunks
        assert max(_rel(logits[:, t], want_logits[:, t]) for t in range(new)) <= 1e-4, chunks
    return sizes


def test_gla_window_decode_graph_generates_like_torch_across_the_window(gla_window_exported):
    """A 56-column prompt (row 1: 6 pads) then 24 new tokens: generation crosses from inside the 64-key
    window to past it (the first keys join the gated state, the sinks leave the band)."""
    kind, target, opt, folder, result = gla_window_exported
    assert [s["form"] for s in result.sites] == ["gla+window"] * 2
    if target == "ort":  # the gated part runs on the contrib op, from the carried state
        assert [s["lowering"] for s in result.sites] == ["com.microsoft.LinearAttention"] * 2
    else:
        assert [s["lowering"] for s in result.sites] == ["standard ops"] * 2
    assert result.parity and all(p["rel_rms"] <= 1e-4 for p in result.parity)
    sizes = _assert_generates_like_torch(opt, folder, 56, 24, [(6, 9), (30, 50)])  # row 1's first chunk: all pads
    assert sizes[0] == sizes[-1]  # fixed-size states: the bytes never grow with the context
    with torch.no_grad():  # the rewrite changed the model: matching torch is not matching the original
        ids = torch.as_tensor(left_padded_prompt(n=80)[0])
        assert not torch.allclose(opt(input_ids=ids).logits, decoder(kind, 2)(input_ids=ids).logits)


def test_gla_window_long_prompt_in_chunks_longer_than_the_window(gla_window_exported):
    """A 90-column prompt: one call, and chunks of 70 and 76 tokens after a past (keys leave the buffer
    inside the call, buffered ones and new ones), then decoding."""
    _kind, _target, opt, folder, _result = gla_window_exported
    _assert_generates_like_torch(opt, folder, 90, 10, [(6, 20), (14,)])


def test_gla_window_states_are_the_decode_state_at_a_fixed_size(gla_window_exported):
    """The contract's four states per site: the window buffer and slots, the gated S ‖ z per kv head, and the
    buffered keys' decayed features, packed into one recurrent_state / conv_state pair of one shape per layer
    (the layout onnxruntime-genai feeds)."""
    kind, _target, _opt, _folder, result = gla_window_exported
    M = 2 * 16  # layer 0 has hedgehog φ: 2·D features (head dim 16)
    S0 = GLA_WINDOW[kind][0].get("sinks", 0)
    packs = [(p["state"], p["shape"], p["offset"]) for s in result.contract["states"]
             if s["site"].startswith("model.layers.0.") for p in s["packs"]]
    assert packs == [("recurrent_state", ["batch", 2, S0 + 63, 32], 0),
                     ("gated_state", ["batch", 2, M, 17], 2 * (S0 + 63) * 32),
                     ("gated_keys", ["batch", 2, 63, M], 2 * (S0 + 63) * 32 + 2 * M * 17),
                     ("conv_state", ["batch", 1, S0 + 64], 0)]
    pairs = {s["past"].split(".", 2)[-1]: s["shape"] for s in result.contract["states"]}
    floats = max(2 * (S + 63) * 32 + 2 * m * 17 + 2 * 63 * m for S, m in ((S0, M), (4 - S0, 16)))  # layer 1: elu, 16
    assert pairs == {"recurrent_state": ["batch", 1, 1, floats], "conv_state": ["batch", 1, 4 + 64]}


def test_genai_drives_gla_window(gla_window_exported):
    _kind, _target, opt, folder, result = gla_window_exported
    assert_genai_generates_like_torch(opt, folder, result, n=80, new=20)  # past the 64-key window


def test_genai_drives_delta_beside_gla(exported):
    """delta's S and conv buffer beside gla's S ‖ z and count: pairs of different shapes, packed."""
    _kind, _target, opt, folder, result = exported
    assert_genai_generates_like_torch(opt, folder, result)


def test_gla_window_rows_are_the_rows_alone(gla_window_exported):
    """A left-padded row generates in ORT exactly what it generates without its pads, past the window."""
    _kind, _target, _opt, folder, _result = gla_window_exported
    ids, mask = left_padded_prompt(n=60)
    driver = ContractDriver(folder)
    seq, logits, _ = driver.greedy(ids, mask, 16, stop=False)
    alone, alone_logits, _ = driver.greedy(ids[1:, 6:], mask[1:, 6:], 16, stop=False)
    assert np.array_equal(alone[0, -16:], seq[1, -16:]) and _rel(alone_logits[0], logits[1]) <= 1e-4


def test_gla_window_of_one_key_is_refused_in_one_line(tmp_path):
    """window 1 buffers no column for the gated part: the export names the site and the fix, writes nothing."""
    opt = attnopt.compile(decoder("llama", 1), "gla+window:1+fit_steps:0+min_seq_len:0",
                          example_inputs={"input_ids": EXAMPLE}, tolerance=10.0, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 1
    with pytest.raises(ValueError) as err:
        attnopt.export_onnx(opt, tmp_path / "out", {"input_ids": EXAMPLE}, decode=True)
    msg = str(err.value)
    assert "model.layers.0.self_attn#0 (gla+window)" in msg and "use window >= 2" in msg and "\n" not in msg
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_a_wrong_gla_window_lowering_names_its_site_and_writes_no_folder(tmp_path, monkeypatch):
    """A step lowering 0.1% off: the export's check fails and localises it to the site (its step exported
    alone, where the window branch folds to a constant and is inlined), and leaves no folder behind."""
    from onnxscript import opset18 as op

    from attnopt.forms.gla_window.onnx import DECODE_LOWERING
    from attnopt.ir.errors import ParityError

    good = DECODE_LOWERING.by_target["ort"]

    def off_by_a_little(*args, **kwargs):
        out, *states = good(*args, **kwargs)
        return (op.Mul(out, op.CastLike(op.Constant(value_float=1.001), out)), *states)

    monkeypatch.setitem(DECODE_LOWERING.by_target, "ort", off_by_a_little)
    opt = attnopt.compile(decoder("llama", 1), "gla+window:8+fit_steps:0+min_seq_len:0",
                          example_inputs={"input_ids": EXAMPLE}, tolerance=10.0, e2e_tolerance=None)
    with pytest.raises(ParityError) as err:
        attnopt.export_onnx(opt, tmp_path / "bad", {"input_ids": EXAMPLE})
    text = str(err.value)
    assert "\n" not in text and "site model.layers.0.self_attn#0 (gla+window): its ONNX decode step differs" in text
    assert not (tmp_path / "bad").exists() and list(tmp_path.iterdir()) == []
