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
    ContractDriver,
    _rel,
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


def test_gla_window_is_refused_by_the_decode_export_in_one_line(tmp_path):
    """gla+window has no exported decode step yet: the export says so, names the site and writes nothing."""
    opt = attnopt.compile(decoder("llama", 1), "gla+window:8+fit_steps:0", example_inputs={"input_ids": EXAMPLE},
                          tolerance=10.0, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 1
    with pytest.raises(ValueError) as err:  # export_onnx's one line (it re-raises CannotGenerate as ValueError)
        attnopt.export_onnx(opt, tmp_path / "out", {"input_ids": EXAMPLE}, decode=True)
    msg = str(err.value)
    assert "model.layers.0.self_attn#0" in msg and "'gla+window' has no decode step" in msg and "\n" not in msg
    assert not (tmp_path / "out" / "model.onnx").exists()
