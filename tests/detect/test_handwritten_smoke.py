"""Quick checks of capture -> detect -> inspect and the `attnopt inspect` CLI, one per promise.

Sizes are pairwise distinct (B=2, H=6, Hkv=2, N=11, D=8; hidden = H*D = 48) so a detector mixing
axes reports a wrong number. The zoo files in this folder cover the many spellings; this file
covers the pipeline around them: dynamic capture, Dynamo capture, record_values, the real
MiniLM, GQA / window / cross-attention in HF models, the CLI's exits.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from attnopt.inspection import inspect
from attnopt.ir.errors import CaptureError
from attnopt.passes.capture import capture_export, record_values
from attnopt.passes.detect import detect

B, H, HKV, N, D = 2, 6, 2, 11, 8
HIDDEN = H * D
SEED = 0


def _x(n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, n, HIDDEN, generator=torch.Generator().manual_seed(seed))


class SqrtSplitCausal(nn.Module):
    """D**-0.25 on q and k, causal masked_fill from torch.tril, GQA via repeat_interleave."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HIDDEN, H * D)
        self.kv = nn.Linear(HIDDEN, 2 * HKV * D)

    def forward(self, x_BNX):
        b, n, _ = x_BNX.shape
        q = self.q(x_BNX).view(b, n, H, D).transpose(1, 2)
        k, v = self.kv(x_BNX).view(b, n, 2, HKV, D).permute(2, 0, 3, 1, 4)
        k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
        s = (q * D**-0.25) @ (k * D**-0.25).transpose(-2, -1)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).tril() == 0, float("-inf"))
        return s.softmax(-1) @ v


class PermutedKeyTrap(nn.Module):
    """kᵀ made by swapping heads and tokens, then reshaping to [B, H, D, N]: the shapes fit, the
    entries are scrambled (a reshape after a transpose moves data between axes)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(HIDDEN, 3 * H * D)

    def forward(self, x_BNX):
        b, n, _ = x_BNX.shape
        q, k, v = self.p(x_BNX).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(1, 2).reshape(b, H, D, n) * D**-0.5
        return s.softmax(-1) @ v


def test_dynamic_capture_keeps_sequence_symbolic_and_finds_gqa_causal():
    torch.manual_seed(SEED)
    ins = inspect(SqrtSplitCausal().eval(), _x(), dynamic=True)
    [site] = ins.sites
    assert ins.counts["dynamic"] is True
    assert isinstance(site.q_len, str) and site.q_len == site.kv_len  # one symbol for N
    assert (site.heads, site.kv_heads, site.head_dim) == (H, HKV, D)
    assert math.isclose(site.scale, D**-0.5, rel_tol=1e-6)
    assert site.causal and site.mask.form == "masked_fill" and site.mask.keep_when == "false"
    assert "gqa:repeat_interleave" in site.spelling and "scale:on_query" in site.spelling
    json.dumps(ins.to_dict())  # SymInts become strings


def test_reshape_posing_as_transpose_is_a_near_miss():
    torch.manual_seed(SEED)
    ins = inspect(PermutedKeyTrap().eval(), _x(), dynamic=False)
    assert ins.sites == []
    [miss] = ins.near_misses
    assert miss.code == "key_permuted" and "not transposed" in miss.reason


def test_record_values_returns_requested_nodes_only():
    torch.manual_seed(SEED)
    model = SqrtSplitCausal().eval()
    cap = capture_export(model, (_x(),), {}, dynamic=False)
    result = detect(cap)
    [site] = result.sites
    vals = record_values(cap, [site.nodes.output, site.nodes.key])
    assert set(vals) == {site.nodes.output, site.nodes.key}
    assert tuple(vals[site.nodes.key].shape) == (B, HKV, N, D)  # the un-repeated key
    assert tuple(vals[site.nodes.output].shape) == (B, H, N, D)


def test_dynamo_capture_across_a_graph_break_keeps_paths_and_order():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = SqrtSplitCausal()
            self.proj = nn.Linear(H * D, HIDDEN)
            self.second = SqrtSplitCausal()

        def forward(self, x):
            b, n, _ = x.shape
            y = self.proj(self.first(x).transpose(1, 2).reshape(b, n, H * D))
            torch._dynamo.graph_break()  # two Dynamo graphs
            return self.second(y)

    torch.manual_seed(SEED)
    ins = inspect(Outer().eval(), _x(), method="dynamo")
    assert ins.counts["graphs"] == 2
    assert [(s.module_path, s.module_type, s.layer) for s in ins.sites] == [
        ("first", "SqrtSplitCausal", 0), ("second", "SqrtSplitCausal", 1)]
    for s in ins.sites:
        assert (s.heads, s.kv_heads, s.causal) == (H, HKV, True)


def test_not_a_module_and_untraceable_model_give_clear_errors():
    with pytest.raises(TypeError, match="nn.Module"):
        inspect(lambda x: x, _x())

    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent branch: export cannot trace it
                return x.softmax(-1)
            return x

    with pytest.raises(CaptureError, match="method='dynamo'"):
        inspect(DataDependent(), _x(), dynamic=False)


def _hf(model_cls, config, impl):
    config._attn_implementation = impl
    torch.manual_seed(SEED)
    return model_cls(config).eval()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_llama_gqa_causal_dynamic(impl):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=H, num_key_value_heads=HKV, head_dim=D)
    model = _hf(transformers.LlamaModel, cfg, impl)
    ids = torch.randint(1, 64, (B, N), generator=torch.Generator().manual_seed(2))
    ins = inspect(model, ids, use_cache=False)
    assert [s.module_path for s in ins.sites] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert [s.layer for s in ins.sites] == [0, 1]
    for s in ins.sites:
        assert (s.heads, s.kv_heads, s.head_dim, s.causal, s.window) == (H, HKV, D, True, None)
        assert s.source == ("explicit" if impl == "eager" else "sdpa")
    assert ins.near_misses == []


def test_mistral_sliding_window_and_t5_cross_attention_lengths():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=H, num_key_value_heads=HKV, head_dim=D, sliding_window=4)
    ids = torch.randint(1, 64, (B, N), generator=torch.Generator().manual_seed(3))
    [site] = inspect(_hf(transformers.MistralModel, cfg, "sdpa"), ids, use_cache=False, dynamic=False).sites
    assert (site.window, site.causal, site.kv_heads, site.mask.kind) == (4, True, HKV, "window4")

    t5cfg = transformers.T5Config(vocab_size=64, d_model=HIDDEN, d_kv=D, d_ff=32, num_layers=1, num_heads=H,
                                  num_decoder_layers=1)
    dec = ids[:, :5]
    ins = inspect(_hf(transformers.T5Model, t5cfg, "eager"), input_ids=ids, decoder_input_ids=dec,
                  use_cache=False, dynamic=False)
    by_path = {s.module_path: s for s in ins.sites}
    cross = by_path["decoder.block.0.layer.1.EncDecAttention"]
    assert (cross.q_len, cross.kv_len, cross.causal) == (5, N, False)
    assert by_path["encoder.block.0.layer.0.SelfAttention"].mask.arbitrary  # relative position bias
    assert math.isclose(cross.scale, 1.0)  # T5 does not scale the logits


def test_minilm_six_sites(minilm):
    model, tok = minilm
    enc = tok(["A man is eating food.", "A cat sleeps on the warm window sill today."], padding=True,
              return_tensors="pt")
    cap = capture_export(model, (), dict(enc), dynamic=True)
    result = detect(cap)  # (its speed is measured in benchmarks/, never asserted here)
    assert len(result.sites) == 6 and result.near_misses == []
    for i, s in enumerate(result.sites):
        assert s.module_path == f"encoder.layer.{i}.attention.self" and s.layer == i
        assert (s.heads, s.kv_heads, s.head_dim, s.causal) == (12, 12, 32, False)
        assert math.isclose(s.scale, 32**-0.5, rel_tol=1e-6)
        assert s.mask.padding and not s.mask.arbitrary  # the shorter sentence is padded


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnopt", *args], capture_output=True, text=True, timeout=120)


def test_cli_bad_model_values_exit_nonzero_without_traceback(tmp_path, capsys):
    from attnopt.cli import main

    no_attn = tmp_path / "plain.py"
    no_attn.write_text("import torch\n\ndef make():\n    return torch.nn.Linear(4, 3), (torch.randn(2, 4),)\n")
    for spec, code in [("no/such/dir", 2), (str(tmp_path), 2), (f"{no_attn}:missing", 2), (f"{no_attn}:make", 4)]:
        assert main(["inspect", spec]) == code, spec
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("attnopt inspect: "), (spec, err)


def test_cli_factory_json(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import torch\n"
        "from torch import nn\n"
        "class A(nn.Module):\n"
        "    def forward(self, q, k, v):\n"
        "        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "def make():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return A(), tuple(torch.randn(2, 6, 11, 8, generator=g) for _ in range(3))\n"
    )
    done = _cli("inspect", f"{f}:make", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    [site] = data["sites"]
    assert (site["heads"], site["head_dim"], site["causal"], site["mask"]["form"]) == (6, 8, True, "is_causal")


def test_numeric_check_rejects_a_match_whose_reading_is_wrong(monkeypatch):
    """If canonicalisation misreads a spelling (here: every scale factor read twice as large), the
    numeric check catches it and the match becomes a near miss, never a site."""
    from attnopt.passes.canonicalize import Factor

    real = Factor.resolve
    monkeypatch.setattr(Factor, "resolve", lambda self, values: 2.0 * real(self, values))
    torch.manual_seed(SEED)
    ins = inspect(SqrtSplitCausal().eval(), _x(), dynamic=False)
    assert ins.sites == []
    [miss] = ins.near_misses
    assert miss.code == "numeric" and "max abs difference" in miss.reason
