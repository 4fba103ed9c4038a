"""attnopt.compile through torch.export graph rewriting (models that are not transformers models)."""

import math

import pytest
import torch
from torch import nn

import attnopt

B, N, C, H = 2, 37, 48, 6  # pairwise-distinct; head dim 8


class HandAttention(nn.Module):
    """Fused-qkv self-attention written out by hand, with a residual."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.qkv = nn.Linear(C, 3 * C)
        self.o = nn.Linear(C, C)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, C // H).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        if self.causal:
            keep = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        return x + self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, C))


class HandNet(nn.Module):
    def __init__(self, causal=False, layers=3):
        super().__init__()
        self.layers = nn.ModuleList([HandAttention(causal) for _ in range(layers)])
        self.head = nn.Linear(C, 5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return {"probs": self.head(x).softmax(-1), "hidden": x}


def _net(**kw):
    torch.manual_seed(0)
    return HandNet(**kw).eval()


def _x(n=N, seed=1, b=B):
    return torch.randn(b, n, C, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy, form", [("linear", "linear"), ("window:8+sinks:2", "window"), ("ssm", "ssm")])
def test_every_site_rewritten_and_model_runs_at_other_shapes(policy, form):
    net = _net(causal=True)
    opt = attnopt.compile(net, policy, example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None)
    rep = opt.attnopt_report
    assert [r.outcome.final_form for r in rep.sites] == [form] * 3
    assert [r.site.layer for r in rep.sites] == [0, 1, 2]
    assert all(r.site.causal for r in rep.sites)
    # The classifier softmax is not attention.
    assert len(rep.near_misses) == 1
    # The graph takes any length (symbolic at the sites): costs are counted at the length verified.
    assert not isinstance(rep.sites[0].site.q_len, int) and rep.forward_time.length == N
    exact = 2 * B * H * (N * N / 2) * 2 * (C // H)  # causal: half the QK^T and PV multiply-adds, 2 FLOPs each
    assert rep.totals["flops_before"][0] == 3 * exact
    assert 0 < rep.totals["flops_after"][0] and not any("cost not computed" in n for n in rep.notes)
    out = opt(_x(n=50, b=3, seed=2))  # dynamic batch and length
    assert set(out) == {"probs", "hidden"} and out["hidden"].shape == (3, 50, C)
    assert torch.isfinite(out["hidden"]).all()
    # Each rewritten site leaves one SiteModule in the graph; the softmax chains are gone.
    gm = opt.graph_module
    assert sum(1 for n in gm.graph.nodes if n.op == "call_module" and "attnopt_site" in str(n.target)) == 3
    assert sum(1 for n in gm.graph.nodes if "softmax" in str(n.target)) == 1


def test_a_window_wider_than_the_input_is_unverified_until_verified_where_it_acts():
    net = _net(causal=True)
    with pytest.warns(UserWarning, match="none was kept"):
        opt = attnopt.compile(net, "window:64", example_inputs=(_x(),))  # 37 tokens: the band covers all
    rep = opt.attnopt_report
    assert [str(r.outcome.status) for r in rep.sites] == ["unverified"] * 3
    assert all("verified from about 256 tokens" in r.outcome.reason and r.outcome.drift is None for r in rep.sites)
    # Verified where it acts (300 tokens), it is rewritten with a real drift, and at a length the band
    # covers it computes the original model.
    opt = attnopt.compile(net, "window:64", example_inputs=(_x(),), verify_inputs=[(_x(n=300, seed=3),)])
    rep = opt.attnopt_report
    assert [str(r.outcome.status) for r in rep.sites] == ["rewritten"] * 3
    assert all(r.outcome.drift.rel_rms > 1e-3 for r in rep.sites)
    x = _x(n=45, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x)["hidden"], net(x)["hidden"], rtol=1e-4, atol=1e-5)


def test_reuse_wires_the_anchor_q_and_k():
    net = _net(causal=False, layers=4)
    policy = {"rules": [{"layers": "1..2", "form": "reuse", "anchor": 0, "block": 4, "top_k": 1, "window": 0,
                         "sinks": 0}]}
    # Random weights attend almost uniformly: reading 2 of 10 blocks drifts far; the wiring is the point here.
    opt = attnopt.compile(net, policy, example_inputs=(_x(),), tolerance=10.0, e2e_tolerance=None)
    rep = opt.attnopt_report
    assert [r.outcome.status for r in rep.sites] == ["kept", "rewritten", "rewritten", "kept"]
    assert [r.outcome.drift.rel_rms > 1e-3 for r in rep.sites[1:3]] == [True, True]
    from attnopt.forms.reuse.reference import block_sparse_attention
    from attnopt.forms.reuse.selection import BlockRule, select_call

    # By hand: layers 1 and 2 attend with their own q, k, v to the blocks layer 0's q and k select.
    def heads(t, b, n):
        return t.view(b, n, 3, H, C // H).permute(2, 0, 3, 1, 4)

    rule = BlockRule(block=4, top_k=1, window=0, sinks=0, probes=4, causal=False)
    x = _x(n=29, seed=7)
    b, n, _ = x.shape
    with torch.no_grad():
        h, lists = x, None
        for i, layer in enumerate(net.layers):
            q, k, v = heads(layer.qkv(h), b, n)
            if i == 0:
                lists = select_call(q, k, None, rule, (C // H) ** -0.5, None)[0].blocks_BQK
            if i in (1, 2):
                o = block_sparse_attention(q, k, v, lists, block=4, causal=False, scale=(C // H) ** -0.5)
            else:
                o = ((q @ k.transpose(-2, -1)) / math.sqrt(C // H)).softmax(-1) @ v
            h = h + layer.o(o.transpose(1, 2).reshape(b, n, C))
        torch.testing.assert_close(opt(x)["hidden"], h, rtol=1e-5, atol=1e-5)
        assert (net(x)["hidden"] - h).abs().max() > 1e-3  # and that is not the original model

def test_exact_policy_leaves_outputs_identical_and_original_untouched():
    net = _net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    opt = attnopt.compile(net, "exact", example_inputs=(_x(),))
    x = _x(seed=7)
    with torch.no_grad():
        torch.testing.assert_close(opt(x)["probs"], net(x)["probs"], rtol=0, atol=1e-6)
    opt2 = attnopt.compile(net, "linear", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None)
    assert opt2 is not net
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_calibration_drift_is_worst_over_batches():
    net = _net(causal=True)
    alone = attnopt.compile(net, "window:8", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None)
    calib = attnopt.compile(net, "window:8", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None,
                            calibration=[(_x(seed=s),) for s in (11, 12)])
    for a, c in zip(alone.attnopt_report.sites, calib.attnopt_report.sites):
        assert c.outcome.drift.rel_rms >= a.outcome.drift.rel_rms


def test_transformer_encoder_sites_are_mha():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=C, nhead=H, dim_feedforward=64, batch_first=True, dropout=0.0)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    opt = attnopt.compile(enc, "linear:favor", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None)
    rep = opt.attnopt_report
    assert len(rep.sites) == 2
    assert all(r.site.source == "mha" and r.site.heads == H and r.site.head_dim == C // H for r in rep.sites)
    assert all(r.outcome.final_form == "linear" for r in rep.sites)
    assert opt(_x(n=20)).shape == (B, 20, C)


class PaddedMHANet(nn.Module):
    """nn.MultiheadAttention as most code calls it: need_weights left True (the [B·H, N, N] bmm
    spelling) and a key_padding_mask."""

    def __init__(self, layers=3):
        super().__init__()
        self.attn = nn.ModuleList([nn.MultiheadAttention(C, H, batch_first=True) for _ in range(layers)])

    def forward(self, x, pad):
        for attn in self.attn:
            x = x + attn(x, x, x, key_padding_mask=pad)[0]
        return x


@pytest.mark.parametrize("policy", ["reuse:1+block:8+anchor:-1+window:0+sinks:0", "window:8", "linear"])
def test_a_padded_mha_called_with_need_weights_is_rewritten_and_a_padded_row_equals_the_row_alone(policy):
    torch.manual_seed(0)
    net = PaddedMHANet().eval()
    x, pad = _x(n=64), torch.zeros(B, 64, dtype=torch.bool)
    pad[1, 48:] = True
    opt = attnopt.compile(net, policy, example_inputs=(x, pad), dispatch="off", tolerance=10.0, e2e_tolerance=None)
    statuses = [str(r.outcome.status) for r in opt.attnopt_report.sites]
    assert statuses == (["kept", "rewritten", "kept"] if policy.startswith("reuse") else ["rewritten"] * 3)
    with torch.no_grad():
        padded = opt(x, pad)[1, :48]
        alone = opt(x[1:, :48], pad[1:, :48])[0]
        original = net(x, pad)[1, :48]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)
    assert (padded - original).abs().max() > 1e-3  # the form acts: the row is not the original's


def test_a_folded_site_with_a_per_batch_mask_is_rewritten_and_a_padded_row_equals_the_row_alone():
    # DeBERTa-v2 without relative attention: scores as [B·H, N, N] bmm, its mask [B, 1, N, N] (B rows,
    # where nn.MultiheadAttention's folded mask has B·H).
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DebertaV2Config(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=48, max_position_embeddings=64, relative_attention=False)
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(cfg).eval()
    ids = torch.randint(5, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    opt = attnopt.compile(model, "linear", example_inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                          dispatch="off", tolerance=10.0, e2e_tolerance=None)
    assert [str(r.outcome.status) for r in opt.attnopt_report.sites] == ["rewritten", "rewritten"]
    mask = torch.ones_like(ids)  # padding at run time, which the example did not have
    mask[1, 30:] = 0
    with torch.no_grad():
        padded = opt(input_ids=ids, attention_mask=mask).last_hidden_state[1, :30]
        alone = opt(input_ids=ids[1:, :30], attention_mask=mask[1:, :30]).last_hidden_state[0]
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-4)


def test_torch_compile_backend_rewrites_dynamo_graphs():
    net = _net(causal=True)
    be = attnopt.backend("window:8", tolerance=0.99, e2e_tolerance=None)
    compiled = torch.compile(net, backend=be, dynamic=False)
    x = _x()
    with torch.no_grad():
        out = compiled(x)
    assert len(be.reports) >= 1
    sites = [r for rep in be.reports for r in rep.sites]
    assert len(sites) == 3 and all(r.outcome.final_form == "window" for r in sites)
    ref = attnopt.compile(net, "window:8", example_inputs=(x,), tolerance=0.99, e2e_tolerance=None)
    with torch.no_grad():
        torch.testing.assert_close(out["probs"], ref(x)["probs"], rtol=1e-4, atol=1e-5)


def test_torch_compile_backend_serves_every_length_of_a_dynamic_graph_with_one_rewrite():
    # From its second length on, Dynamo hands over a dynamic graph whose length is an int input;
    # captured as a constant, the third length used to fail.
    net = _net(causal=True)
    be = attnopt.backend("window:8", tolerance=0.99, e2e_tolerance=None, dispatch="off")
    compiled = torch.compile(net, backend=be)
    ref = attnopt.compile(net, "window:8", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None, dispatch="off")
    for n in (N, N + 6, N + 13, N + 20):
        x = _x(n=n, seed=n)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x)["probs"], ref(x)["probs"], rtol=1e-4, atol=1e-5)
    assert len(be.reports) == 2  # the first (static) graph and the dynamic one
    assert all(r.outcome.final_form == "window" for rep in be.reports for r in rep.sites)
    # the dynamic graph's sites keep the module paths the static one names
    static, dynamic = ([r.site.id for r in rep.sites] for rep in be.reports)
    assert dynamic == static and not any(i.startswith("graph") for i in static), (static, dynamic)


@pytest.mark.parametrize("options, message", [
    ({"tolerance": -1}, "tolerance must be a finite number >= 0"),
    ({"dispatch": "bogus"}, "dispatch must be 'auto'"),
    ({"e2e_tolerance": "x"}, "e2e_tolerance must be a finite number > 0"),
])
def test_torch_compile_backend_checks_its_options_when_built(options, message):
    with pytest.raises(ValueError, match=message):
        attnopt.backend("linear", **options)


class StarArgs(nn.Module):
    """A model whose forward takes *args."""

    def __init__(self):
        super().__init__()
        self.net = _net(causal=True)

    def forward(self, *args):
        return self.net(args[0])["hidden"]


def test_a_forward_taking_star_args_is_captured_with_a_dynamic_length():
    model = StarArgs().eval()
    opt = attnopt.compile(model, "linear", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None, dispatch="off")
    assert not any("dynamic export failed" in note for note in opt.attnopt_report.notes)
    x = _x(n=N + 9, seed=4)
    ref = attnopt.compile(model.net, "linear", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None, dispatch="off")
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x)["hidden"], rtol=1e-5, atol=1e-6)


def test_compiled_module_runs_under_torch_compile():
    net = _net(causal=True)
    opt = attnopt.compile(net, "linear", example_inputs=(_x(),), tolerance=0.99, e2e_tolerance=None)
    x = _x(seed=3)
    with torch.no_grad():
        eager = opt(x)["hidden"]
        out = torch.compile(opt, backend="aot_eager")(x)["hidden"]
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)


def test_form_a_site_cannot_honour_is_unsupported_and_exact():
    net = _net(causal=False)
    opt = attnopt.compile(net, "ssm", example_inputs=(_x(),))
    for r in opt.attnopt_report.sites:
        assert (r.plan.form, r.outcome.status, r.outcome.final_form) == ("ssm", "unsupported", "exact")
        assert "bidirectional" in r.outcome.reason
    x = _x(seed=9)
    with torch.no_grad():
        torch.testing.assert_close(opt(x)["hidden"], net(x)["hidden"], rtol=0, atol=1e-6)


def test_input_mask_that_looks_causal_is_not_treated_as_causal():
    class MaskedAttention(nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(2, 3, 11, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    causal_looking = torch.ones(11, 11, dtype=torch.bool).tril()
    opt = attnopt.compile(MaskedAttention(), "ssm", example_inputs=(q, k, v, causal_looking))
    (r,) = opt.attnopt_report.sites
    assert r.site.causal is False and r.outcome.status == "unsupported"


def test_a_rewritten_site_leaves_no_original_attention_in_the_graph():
    # SDPA is tagged nondeterministic_seeded (dropout), which FX's dead-code pass treats as impure:
    # without care the original attention would still run next to its rewrite.
    class Two(torch.nn.Module):
        def forward(self, q, k, v):
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            s = torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1)  # a hand-written chain
            return a + s @ v

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 8, generator=g) for _ in range(3))
    opt = attnopt.compile(Two(), "linear", example_inputs=(q, k, v), e2e_tolerance=None, tolerance=5.0)
    assert opt.attnopt_report.count("rewritten") == 2
    targets = [str(n.target) for n in opt.graph_module.graph.nodes if n.op == "call_function"]
    assert not any("scaled_dot_product_attention" in t or "softmax" in t for t in targets), targets
    assert opt.attnopt_report.counts["splice"]["removed_nodes"] > 0
