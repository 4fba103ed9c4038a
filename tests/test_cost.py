"""Attention cost model: hand-computed numbers for a tiny site and the scaling laws of each form."""

from __future__ import annotations

import pytest

from attnopt.analysis.cost import cost_curve, element_bytes, feature_count, site_cost
from attnopt.ir.site import AttentionSite, MaskInfo, SiteNodes

B, H, D, DV = 2, 3, 8, 4


def make_site(q_len=16, kv_len=None, causal=False, dtype="float32", heads=H, kv_heads=H, batch=B):
    return AttentionSite(
        id="m#0", module_path="m", module_type="Attn", layer=0, source="sdpa",
        batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=q_len if kv_len is None else kv_len,
        head_dim=D, v_head_dim=DV, scale=D ** -0.5, causal=causal,
        mask=MaskInfo(form="is_causal" if causal else "none", causal=causal), window=None,
        dropout_p=0.0, dtype=dtype, nodes=SiteNodes(query="q", key="k", value="v", output="o"),
    )


def test_exact_numbers_for_a_tiny_site():
    c = site_cost(make_site(q_len=16), "exact", {}, 16)
    assert c.seq_len == 16
    assert c.flops == 2 * B * H * 16 * 16 * (D + DV)  # 36864
    io = B * H * (16 * D + 16 * D + 16 * DV + 16 * DV)
    assert c.bytes == 4 * (B * H * 16 * 16 + io)
    half = site_cost(make_site(q_len=16, dtype="bfloat16"), "exact", {}, 16)
    assert half.bytes == c.bytes / 2 and half.flops == c.flops


def test_exact_scales_quadratically_linear_linearly():
    site = make_site(q_len=128)
    e1, e4 = site_cost(site, "exact", {}, 128), site_cost(site, "exact", {}, 512)
    assert e4.flops == pytest.approx(16 * e1.flops)
    l1, l4 = site_cost(site, "linear", {}, 128), site_cost(site, "linear", {}, 512)
    assert l4.flops == pytest.approx(4 * l1.flops)
    # elu, not causal: state + query reads, M = D
    assert l1.flops == 2 * B * H * 128 * D * (DV + 1) * 2


def test_causal_linear_adds_the_chunk_term_and_ssm_always_has_it():
    site = make_site(q_len=256, causal=True)
    lin = site_cost(site, "linear", {}, 256)
    base = 2 * B * H * 256 * D * (DV + 1) * 2
    assert lin.flops == base + 2 * B * H * 256 * 32 * (D + DV)  # the op's chunk for M = D <= 64 features
    bidir_ssm = site_cost(make_site(q_len=256, causal=False), "ssm", {}, 256)
    assert bidir_ssm.flops == base + 2 * B * H * 256 * 64 * (D + DV)  # the decay scan's chunk
    assert site_cost(site, "linear", {}, 1024).flops == pytest.approx(4 * lin.flops)


def test_feature_counts():
    assert feature_count("elu", 0, 16) == 16
    assert feature_count("favor", 0, 16) == 32 and feature_count("favor", 64, 16) == 64
    assert feature_count("hedgehog", 0, 16) == 32 and feature_count("hedgehog", 8, 16) == 16
    assert feature_count("taylor", 0, 4) == 21
    favor = site_cost(make_site(q_len=32), "linear", {"feature_map": "favor"}, 32)
    M = 2 * D
    assert favor.flops == 2 * B * H * M * (DV + 1) * 64 + 2 * B * H * 64 * D * M


def test_window_is_exact_below_the_window_and_linear_above():
    site = make_site(q_len=64, causal=True)
    params = {"window": 32, "sinks": 0}
    short = site_cost(site, "window", params, 16)
    assert short.flops == site_cost(site, "exact", {}, 16).flops  # every key visible
    w1, w4 = site_cost(site, "window", params, 256), site_cost(site, "window", params, 1024)
    assert w1.flops == 2 * B * H * 256 * 32 * (D + DV)
    assert w4.flops == pytest.approx(4 * w1.flops)
    # bidirectional band: 2W-1 keys, plus sinks
    bidir = site_cost(make_site(q_len=64), "window", {"window": 32, "sinks": 4}, 1024)
    assert bidir.flops == 2 * B * H * 1024 * (63 + 4) * (D + DV)


def test_cross_attention_scales_only_the_query():
    site = make_site(q_len=10, kv_len=77)
    c1, c4 = site_cost(site, "exact", {}, 10), site_cost(site, "exact", {}, 40)
    assert c1.flops == 2 * B * H * 10 * 77 * (D + DV)
    assert c4.flops == pytest.approx(4 * c1.flops)


def test_reuse_reads_its_blocks_and_scores_its_probes():
    site = make_site(q_len=64, causal=True)
    params = {"top_k": 1, "block": 8, "window": 1, "sinks": 1}  # 4 blocks of 8 read per query (causal)
    for n in (64, 256):
        M = n // 8  # query blocks; each one's 8 probes score 2 bounds of every block, per head and head dim
        want = 2 * B * H * n * 32 * (D + DV) + B * 2.0 * 8 * M * M * H * D * 2
        assert site_cost(site, "reuse", params, n).flops == pytest.approx(want)
    # Up to (sinks + window + 1 + top_k) blocks everything is read: the cost of exact attention.
    assert site_cost(site, "reuse", params, 32).flops == site_cost(site, "exact", {}, 32).flops


def test_cost_curve_and_symbolic_lengths():
    site = make_site(q_len=16)
    curve = cost_curve(site, "exact", {})
    assert [c.seq_len for c in curve] == [16, 64, 256]
    assert curve[2].flops == pytest.approx(256 * curve[0].flops)
    dyn = make_site(q_len="s0", batch="s1")
    with pytest.raises(ValueError, match="example_len"):
        cost_curve(dyn, "exact", {})
    curve = cost_curve(dyn, "exact", {}, (1, 2), example_len=16)
    assert [c.seq_len for c in curve] == [16, 32]
    assert curve[0].flops == 2 * 1 * H * 16 * 16 * (D + DV)  # symbolic batch counted as 1


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unknown dtype 'complex32'"):
        element_bytes("complex32")
    assert element_bytes("torch.float16") == 2
    with pytest.raises(ValueError, match="seq_len"):
        site_cost(make_site(), "exact", {}, 0)
    with pytest.raises(ValueError, match="unknown form"):
        site_cost(make_site(), "flash", {}, 16)
