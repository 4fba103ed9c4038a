"""Every hand-written spelling of attention is one site with exactly the attributes it computes.

The truth of each spelling is written from its construction and cross-checked against an SDPA
recomputation (test_truth_table_describes_the_module), so a failure in the detector tests below is
a detector disagreeing with what the module provably computes.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from attnopt.inspection import inspect
from zoo_models import (
    B,
    D,
    H,
    HIDDEN,
    HKV,
    M,
    N,
    SPELLINGS,
    CrossAttention,
    ProjectedAttention,
    WeightsReturned,
    assert_site_matches,
    hidden_states,
    reference_output,
    site_output_error,
)

TOLERANCE = 1e-4  # float32 graph values against a float64 rebuild

BY_NAME = {s.name: s for s in SPELLINGS}


# the fused-qkv spellings have no separate projections to rebuild from; the numeric check on
# their site (test_spelling_is_one_exact_site) covers them
@pytest.mark.parametrize(
    "spelling", [s for s in SPELLINGS if issubclass(s.module_cls, ProjectedAttention)], ids=lambda s: s.name
)
def test_truth_table_describes_the_module(spelling):
    module = spelling.build()
    inputs = spelling.inputs()
    with torch.no_grad():
        torch.testing.assert_close(module(*inputs), reference_output(spelling, module, inputs))


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: s.name)
def test_spelling_is_one_exact_site(spelling):
    module = spelling.build()
    inspection = inspect(module, *spelling.inputs(), dynamic=False)
    assert len(inspection.sites) == 1, [s.id for s in inspection.sites]
    assert inspection.near_misses == [], [(m.code, m.reason) for m in inspection.near_misses]
    site = inspection.sites[0]
    assert_site_matches(site, spelling.truth)
    assert site.module_path == ""
    assert site.module_type == spelling.module_cls.__name__
    assert site.layer == 0
    assert site.id.endswith("#0"), site.id
    assert site_output_error(inspection, site) < TOLERANCE


def test_numeric_rebuild_catches_wrong_attributes():
    """The rebuild used above has teeth: a site with a wrong scale, causality or key orientation
    no longer reproduces its output."""
    spelling = BY_NAME["masked_fill_tril"]
    inspection = inspect(spelling.build(), *spelling.inputs(), dynamic=False)
    [site] = inspection.sites
    assert site_output_error(inspection, site) < TOLERANCE
    wrong_nodes = dataclasses.replace(site.nodes, key_is_transposed=not site.nodes.key_is_transposed)
    for wrong in (
        dataclasses.replace(site, scale=site.scale * 1.5),
        dataclasses.replace(site, causal=False, mask=dataclasses.replace(site.mask, node=None, causal=False)),
    ):
        assert site_output_error(inspection, wrong) > 1e-3
    with pytest.raises(RuntimeError):  # [B, H, N, D] @ [B, H, N, D] does not even multiply
        site_output_error(inspection, dataclasses.replace(site, nodes=wrong_nodes))


@pytest.mark.parametrize(
    "name", ["div_sqrt", "sdpa_enable_gqa", "repeat_kv_gqa", "masked_fill_tril", "sliding_window_built", "mul_scale"]
)
def test_dynamic_capture_keeps_static_attributes(name):
    """With dynamic batch and length, heads, head dim, scale, causality and window stay exact."""
    spelling = BY_NAME[name]
    truth = spelling.truth
    inspection = inspect(spelling.build(), *spelling.inputs(), dynamic=True)
    [site] = inspection.sites
    assert (site.heads, site.kv_heads, site.head_dim, site.v_head_dim) == (
        truth.heads,
        truth.kv_heads,
        truth.head_dim,
        truth.v_head_dim,
    )
    assert math.isclose(site.scale, truth.scale, rel_tol=1e-5)
    assert site.causal is truth.causal
    assert site.window == truth.window
    assert isinstance(site.q_len, (int, str)) and isinstance(site.batch, (int, str))


def test_input_mask_that_looks_causal_is_not_called_causal():
    """The additive mask is an input: causal on this example, unknown on the next call."""
    spelling = BY_NAME["additive_mask_input"]
    [site] = inspect(spelling.build(), *spelling.inputs(), dynamic=False).sites
    assert site.causal is False and site.mask.causal is False
    assert site.mask.arbitrary is True
    assert site.mask.node is not None and site.nodes.mask == site.mask.node
    assert site.mask.keep_when == "zero"
    assert site.mask.kind == "arbitrary"


def test_padding_mask_input_is_read_as_keep_when_true():
    spelling = BY_NAME["sdpa_padding_input"]
    [site] = inspect(spelling.build(), *spelling.inputs(), dynamic=False).sites
    assert site.mask.padding is True and site.mask.causal is False
    assert site.mask.keep_when == "true"
    assert site.mask.node is not None
    assert tuple(site.mask.shape) == (B, 1, 1, N)
    assert site.mask.kind == "padding"


def test_sliding_window_kind_names_the_window():
    spelling = BY_NAME["sliding_window_built"]
    [site] = inspect(spelling.build(), *spelling.inputs(), dynamic=False).sites
    assert site.mask.kind == f"window{spelling.truth.window}"


def test_bmm_spelling_records_rank_three_nodes():
    spelling = BY_NAME["bmm_3d"]
    [site] = inspect(spelling.build(), *spelling.inputs(), dynamic=False).sites
    assert site.nodes.rank == 3
    members = set(site.nodes.members)
    assert {site.nodes.output} <= members
    assert len({site.nodes.query, site.nodes.key, site.nodes.value}) == 3


def test_cross_attention_lengths_differ():
    spelling = BY_NAME["cross_attention"]
    [site] = inspect(spelling.build(), *spelling.inputs(), dynamic=False).sites
    assert (site.q_len, site.kv_len) == (N, M)
    assert spelling.module_cls is CrossAttention


# ---------------------------------------------------------------------------------------------
# torch.nn building blocks


def _mha() -> nn.MultiheadAttention:
    torch.manual_seed(0)
    return nn.MultiheadAttention(HIDDEN, H, batch_first=True).eval()


def test_multihead_attention_without_weights_is_a_site():
    x = hidden_states()
    inspection = inspect(_mha(), x, x, x, need_weights=False, dynamic=False)
    [site] = inspection.sites
    assert site.source == "mha"
    assert site.module_type == "MultiheadAttention"
    assert (site.batch, site.heads, site.kv_heads, site.q_len, site.kv_len) == (B, H, H, N, N)
    assert (site.head_dim, site.v_head_dim) == (D, D)
    assert math.isclose(site.scale, D**-0.5, rel_tol=1e-5)
    assert site.causal is False and site.window is None


def test_multihead_attention_cross_lengths():
    x, memory = hidden_states(), hidden_states(M, seed=2)
    [site] = inspect(_mha(), x, memory, memory, need_weights=False, dynamic=False).sites
    assert (site.q_len, site.kv_len) == (N, M)


def test_multihead_attention_returning_weights_is_a_near_miss():
    """need_weights=True (the default) returns the head-averaged probabilities, so the softmax
    output leaves the chain: replacing it would change a returned tensor."""
    x = hidden_states()
    inspection = inspect(_mha(), x, x, x, dynamic=False)
    assert inspection.sites == []
    [miss] = inspection.near_misses
    assert miss.code == "weights_reused", (miss.code, miss.reason)
    assert miss.reason


class _CausalEncoder(nn.Module):
    """nn.TransformerEncoder with its causal mask generated inside forward (so it is provable)."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        layer = nn.TransformerEncoderLayer(HIDDEN, H, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x_BNX):
        if not self.causal:
            return self.encoder(x_BNX)
        mask = nn.Transformer.generate_square_subsequent_mask(x_BNX.shape[1])
        return self.encoder(x_BNX, mask=mask, is_causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_transformer_encoder_two_layers(causal):
    torch.manual_seed(0)
    model = _CausalEncoder(causal).eval()
    inspection = inspect(model, hidden_states(), dynamic=False)
    sites = sorted(inspection.sites, key=lambda s: s.layer)
    assert [s.module_path for s in sites] == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert [s.layer for s in sites] == [0, 1]
    for site in sites:
        assert site.source == "mha"
        assert (site.batch, site.heads, site.kv_heads, site.q_len, site.head_dim) == (B, H, H, N, D)
        assert math.isclose(site.scale, D**-0.5, rel_tol=1e-5)
        assert site.causal is causal
        assert site.dropout_p == 0.0  # eval mode: the layer's 0.1 dropout is off


# ---------------------------------------------------------------------------------------------
# The report objects


def test_str_and_json_name_every_site_and_near_miss():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.good = BY_NAME["sdpa_enable_gqa"].module_cls()
            self.bad = WeightsReturned()

        def forward(self, x):
            out, weights = self.bad(x)
            return self.good(x) + out, weights

    torch.manual_seed(0)
    inspection = inspect(Both().eval(), hidden_states(), dynamic=False)
    [site] = inspection.sites
    [miss] = inspection.near_misses
    assert site.module_path == "good" and site.kv_heads == HKV
    assert miss.module_path == "bad" and miss.code == "weights_reused"
    text = str(inspection)
    assert site.id in text and miss.reason in text
    data = json.loads(json.dumps(inspection.to_dict()))
    assert [s["id"] for s in data["sites"]] == [site.id]
    assert data["sites"][0]["kv_heads"] == HKV
    assert data["sites"][0]["mask"]["kind"] == site.mask.kind
    assert [m["code"] for m in data["near_misses"]] == ["weights_reused"]
