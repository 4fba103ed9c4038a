"""Per-head sites (forms/common/mixed_heads.py): the exact KV-head groups are softmax attention and the
others the form, checked against fp64 oracles written per (batch, head, query) here; a prefill then
any split into decoding steps (and the one-token stepper) equals one forward; the fit sees only the
form's own heads; the spellings, their errors, the cost model and decode memory."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import forms
from attnopt.forms.common.base import BuildContext
from attnopt.forms.common.mixed_heads import MixedHeadsSite, build_site, fit_site, site_cost, state_bytes
from attnopt.ir.calls import SiteCall
from attnopt.ir.errors import PolicyError
from attnopt.policy import Policy

B, H, HKV, N, D = 2, 6, 3, 28, 8
G = H // HKV
F64 = torch.float64


class GqaSdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.fixture(scope="module")
def site():
    q, k = torch.randn(B, H, N, D), torch.randn(B, HKV, N, D)
    (s,) = attnopt.inspect(GqaSdpa(), q, k, k, dynamic=False).sites
    assert (s.heads, s.kv_heads, s.causal) == (H, HKV, True)
    return dataclasses.replace(s, mask=dataclasses.replace(s.mask, keep_when="true"))  # masks below: bool keep


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g, dtype=F64)
    k, v = (torch.randn(B, HKV, N, D, generator=g, dtype=F64) for _ in range(2))
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :5] = False  # row 1 left-padded
    mask = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
    return q, k, v, keep, mask


def _build(site, name, params):
    form = forms.get(name)
    return build_site(form, site, form.validate(params), BuildContext()).double()


# ---------------------------------------------------------------- oracles (nothing from attnopt)


def softmax_by_hand(q_ND, k_ND, v_ND, visible, scale):
    """oᵢ = Σ_{j visible} e^{s qᵢ·kⱼ} vⱼ / Σ e^{s qᵢ·kⱼ}, one query at a time (0 when none is visible)."""
    out = torch.zeros(q_ND.shape[0], v_ND.shape[1], dtype=F64)
    for i in range(q_ND.shape[0]):
        js = [j for j in range(k_ND.shape[0]) if visible(i, j)]
        if js:
            logits = torch.tensor([scale * float(q_ND[i] @ k_ND[j]) for j in js], dtype=F64)
            w = torch.exp(logits - logits.max())
            out[i] = (w[:, None] * v_ND[js]).sum(0) / w.sum()
    return out


def elu_linear_by_hand(q_ND, k_ND, v_ND, visible):
    """oᵢ = Σ φ(qᵢ)·φ(kⱼ) vⱼ / (Σ φ(qᵢ)·φ(kⱼ) + 1e-6), φ = elu + 1 (the linear form's default map)."""
    phi = lambda x: torch.where(x > 0, x + 1.0, torch.exp(x))  # noqa: E731
    out = torch.zeros(q_ND.shape[0], v_ND.shape[1], dtype=F64)
    for i in range(q_ND.shape[0]):
        js = [j for j in range(k_ND.shape[0]) if visible(i, j)]
        w = torch.tensor([float(phi(q_ND[i]) @ phi(k_ND[j])) for j in js], dtype=F64)
        if js:
            out[i] = (w[:, None] * v_ND[js]).sum(0) / (w.sum() + 1e-6)
    return out


def oracle(name, params, q, k, v, keep, exact_kv, scale):
    """Per (batch, query head): exact heads softmax over the real causal keys; the others the form."""
    out = torch.zeros(B, H, N, D, dtype=F64)
    for b in range(B):
        real = [j for j in range(N) if keep[b, j]]
        sinks = set(real[: params.get("sinks", 0)])
        for h in range(H):
            kv = h // G  # query head h reads KV head h // G
            causal = lambda i, j: keep[b, j] and j <= i  # noqa: E731
            if kv in exact_kv:
                out[b, h] = softmax_by_hand(q[b, h], k[b, kv], v[b, kv], causal, scale)
            elif name == "window":
                W = params["window"]
                band = lambda i, j: causal(i, j) and (i - j < W or j in sinks)  # noqa: E731
                out[b, h] = softmax_by_hand(q[b, h], k[b, kv], v[b, kv], band, scale)
            else:
                out[b, h] = elu_linear_by_hand(q[b, h], k[b, kv], v[b, kv], causal)
    return out


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("name,params,exact_kv", [
    ("window", {"window": 5, "sinks": 2}, [1]),
    ("window", {"window": 4}, [0, 2]),
    ("linear", {}, [2]),
])
def test_forward_is_exact_on_the_exact_heads_and_the_form_elsewhere(site, name, params, exact_kv):
    q, k, v, keep, mask = _inputs()
    module = _build(site, name, {**params, "exact_heads": exact_kv})
    assert isinstance(module, MixedHeadsSite) and module.form == name and module.exact_heads == exact_kv
    out = module(q, k, v, mask)
    want = oracle(name, params, q, k, v, keep, exact_kv, site.scale)
    real = keep[:, None, :, None].expand_as(out)
    assert (out - want)[real].abs().max() < 1e-10
    # and the heads differ from an all-exact site where the form acts: the split is not a no-op
    exact_all = oracle(name, params, q, k, v, keep, list(range(HKV)), site.scale)
    cheap = [h for h in range(H) if h // G not in exact_kv]
    assert (out - exact_all)[:, cheap][real[:, cheap]].abs().max() > 1e-3


def _copy_per_head(full, inner, split):
    """The whole-site module given the inner module's tensors on the cheap heads (leading dim H or Hkv)."""
    state = full.state_dict()
    for name, t in inner.state_dict().items():
        rows = split.cheap_q if state[name].shape[0] == H else split.cheap_kv
        assert state[name].shape[0] in (H, HKV) and t.shape[0] == len(rows), name
        state[name][list(rows)] = t
    full.load_state_dict(state)


@pytest.mark.parametrize("name,params", [
    ("gla", {}), ("gla+window", {"window": 6, "sinks": 1}), ("delta", {}), ("ssm", {}),
    ("linear+window", {"window": 5}), ("linear", {"feature_map": "hedgehog"}),
])
def test_cheap_heads_compute_what_the_whole_site_form_computes_on_them(site, name, params):
    """Each head of a form is computed on its own: the per-head site's cheap heads equal the all-heads
    module of the form (its per-head tensors set to the inner module's) on those heads."""
    q, k, v, keep, mask = _inputs(1)
    exact_kv = [1]
    module = _build(site, name, {**params, "exact_heads": exact_kv})
    with torch.no_grad():  # tensors off their init, so a wrong row lines up with nothing
        for t in module.inner.parameters():
            t.add_(0.05 * torch.randn_like(t))
    full = _build(site, name, params)
    _copy_per_head(full, module.inner, module.split)
    out, ref = module(q, k, v, mask), full(q, k, v, mask)
    real = keep[:, None, :, None].expand_as(out)
    cheap = list(module.split.cheap_q)
    assert (out - ref)[:, cheap][real[:, cheap]].abs().max() < 1e-9
    exact = oracle("window", {"window": N}, q, k, v, keep, exact_kv, site.scale)  # exact heads: plain softmax
    assert (out - exact)[:, [2, 3]][real[:, [2, 3]]].abs().max() < 1e-10


def test_ssm_cheap_heads_keep_their_decay(site):
    """RetNet's decays are a schedule over head indices: a cheap head keeps the one it has in the site."""
    module = _build(site, "ssm", {"exact_heads": [0]})
    assert torch.allclose(module.inner.decay, 1 - 2.0 ** (-5 - torch.arange(G, H, dtype=F64)))


# ---------------------------------------------------------------- decoding


SPLITS = [[N], [9] + [1] * 19, [3, 5, 1, 1, 12, 6]]


@pytest.mark.parametrize("name,params", [
    ("window", {"window": 5, "sinks": 2}), ("linear", {"min_seq_len": 7}), ("ssm", {}), ("gla", {}),
    ("gla+window", {"window": 6, "sinks": 1, "min_seq_len": 9}), ("delta", {}), ("linear+window", {"window": 5}),
])
def test_decode_in_any_split_equals_forward(site, name, params):
    q, k, v, keep, mask = _inputs(2)
    module = _build(site, name, {**params, "exact_heads": [2]})
    ref = module(q, k, v, mask)
    real = keep[:, None, :, None].expand_as(ref)
    for splits in SPLITS:
        outs, state, i = [], None, 0
        for n in splits:
            o, state = module.decode(q[:, :, i:i + n], k[:, :, i:i + n], v[:, :, i:i + n], keep[:, i:i + n], state)
            outs.append(o)
            i += n
        out = torch.cat(outs, dim=2)
        assert (out - ref)[real].abs().max() < 1e-10, splits
        assert state.form_state.k_BKeND.shape == (B, 1, N, D)  # one exact KV head, every column
        assert state.real_B.tolist() == keep.sum(-1).tolist()


@pytest.mark.parametrize("name,params", [("gla+window", {"window": 6, "sinks": 1}), ("linear", {}), ("delta", {})])
def test_unpadded_decoding_equals_forward_with_several_exact_heads(site, name, params):
    """Without padding, a decoding step's exact heads read the cached K/V in place, each KV head's G query
    heads one SDPA call (two exact KV heads here, so a head put in another's group shows); padding
    anywhere keeps the mask from then on."""
    q, k, v, keep, _ = _inputs(4)
    module = _build(site, name, {**params, "exact_heads": [0, 2]})
    ref = module(q, k, v, None)
    out, state = module.decode(q[:, :, :9], k[:, :, :9], v[:, :, :9], None, None)
    outs = [out]
    for t in range(9, N):  # `decode` hands each step an all-ones keep, as it does after a prefill
        o, state = module.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], keep[:1].new_ones(B, 1), state)
        outs.append(o)
        assert state.form_state.all_kept
    assert (torch.cat(outs, dim=2) - ref).abs().max() < 1e-10
    padded = module.decode(q[:, :, :9], k[:, :, :9], v[:, :, :9], keep[:, :9], None)[1]
    step = module.decode(q[:, :, 9:10], k[:, :, 9:10], v[:, :, 9:10], keep[:, 9:10], padded)[1]
    assert not padded.form_state.all_kept and not step.form_state.all_kept


@pytest.mark.parametrize("name,params", [("window", {"window": 5, "sinks": 2}), ("linear", {}), ("ssm", {})])
@pytest.mark.parametrize("exact_kv", [[0], [0, 2]])
def test_token_stepper_equals_forward(site, name, params, exact_kv):
    """The cache layer's in-place one-token path (no padding) gives the forward's outputs."""
    q, k, v, _, _ = _inputs(3)
    module = _build(site, name, {**params, "exact_heads": exact_kv})
    ref = module(q, k, v, None)
    P = 10
    out, state = module.decode(q[:, :, :P], k[:, :, :P], v[:, :, :P], None, None)
    stepper = module.token_stepper(state.form_state, q[:, :, P:P + 1], k[:, :, P:P + 1])
    assert stepper is not None and stepper.state is state.form_state
    steps = [stepper(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]).transpose(1, 2) for t in range(P, N)]
    assert (torch.cat([out, *steps], dim=2) - ref).abs().max() < 1e-10
    assert stepper.state.k_BKeND.shape[2] == N


# ---------------------------------------------------------------- fitting


def test_the_fit_reads_only_the_forms_heads(site):
    """fit_site fits the inner module exactly as the form fits a site of the cheap heads alone, on
    those heads' calls: the exact heads' outputs never enter the loss."""
    q, k, v, keep, mask = _inputs(4)
    params = {"window": 6, "fit_steps": 40}
    module = _build(site, "gla+window", {**params, "exact_heads": [1]}).float()
    ref = oracle("window", {"window": N}, q, k, v, keep, [0, 1, 2], site.scale)
    call = SiteCall(q.float(), k.float(), v.float(), mask, ref.float())
    poisoned = dataclasses.replace(call, out=call.out.clone())
    poisoned.out[:, [2, 3]] = 1e6  # the exact heads' part of the reference: a fit that reads it diverges
    fit_site(forms.get("gla+window"), module, [poisoned])
    cheap_q, cheap_kv = [0, 1, 4, 5], [0, 2]
    alone_site = dataclasses.replace(site, heads=4, kv_heads=2)
    alone = forms.get("gla+window").build(alone_site, forms.get("gla+window").validate({**params, "min_seq_len": 0}),
                                          BuildContext())
    forms.get("gla+window").fit(alone, [SiteCall(call.q[:, cheap_q], call.k[:, cheap_kv], call.v[:, cheap_kv], mask,
                                                 call.out[:, cheap_q])])
    for (name, a), b in zip(module.inner.state_dict().items(), alone.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(module.inner.state_dict().values(),
                                                      _build(site, "gla+window", {**params, "exact_heads": [1]})
                                                      .float().inner.state_dict().values()))  # it did fit


# ---------------------------------------------------------------- spellings and checks


def test_spellings():
    (rule,) = Policy.parse("gla+window:64+exact_heads:0,3").rules
    assert rule.params["exact_heads"] == [0, 3] and "keep" not in rule.params
    (rule,) = Policy.parse("window:32+exact_heads:2").rules
    assert rule.params["exact_heads"] == [2]
    (rule,) = Policy.parse({"rules": [{"form": "linear", "exact_heads": [3, 1, 1], "layers": "1..2"}]}).rules
    assert rule.params["exact_heads"] == [1, 3]
    assert Policy.parse({"rules": [rule.to_dict()]}).rules[0] == rule  # a round trip through plain data
    (rule,) = Policy.parse("gla+window:64+keep:recall+exact:0.5+recall:0.9+by:layer").rules
    assert {k: rule.params[k] for k in ("keep", "exact", "recall", "by")} == \
        {"keep": "recall", "exact": 0.5, "recall": 0.9, "by": "layer"}
    (rule,) = Policy.parse("window:64").rules  # sites without per-head keys keep their params as before
    assert not set(rule.params) & {"exact_heads", "keep", "exact", "recall", "by"}


@pytest.mark.parametrize("spec,words", [
    ("exact+exact_heads:1", "every head of an exact site"),
    ("linear+exact_heads:0+keep:recall", "not both"),
    ("linear+exact:0.3", "add '+keep:recall'"),
    ("window:8+exact_heads:a", "KV-head indices"),
    ("window:8+keep:recal", "did you mean 'window:8+keep:recall'"),
    ("window:8+keep:recall+by:row", "allowed values"),
    ("window:8+keep:recall+exact:1.5", "must be <= 1"),
])
def test_bad_spellings_say_what_to_do(spec, words):
    with pytest.raises(PolicyError) as err:
        Policy.parse(spec)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_why_not_checks_the_heads_against_the_site(site):
    form = forms.get("window")
    assert "has 3 KV heads" in form.why_not(site, form.validate({"exact_heads": [3]}))
    assert "use form 'exact'" in form.why_not(site, form.validate({"exact_heads": [0, 1, 2]}))
    assert form.why_not(site, form.validate({"exact_heads": [0, 2]})) is None


# ---------------------------------------------------------------- cost and decode memory


def test_cost_and_decode_memory_count_the_exact_heads_exact(site):
    form, win = forms.get("window"), {"window": 16, "sinks": 0}
    params = form.validate({**win, "exact_heads": [0], "min_seq_len": 0})
    n, nbytes = 4096, 4
    exact_kv = 1 * n * (D + D) * nbytes  # one KV head's K and V at 4096 tokens
    window_kv = 2 * 16 * (D + D) * nbytes  # two KV heads' ring of S + W slots of keys and values
    assert state_bytes(form, site, params, n, nbytes) == exact_kv + window_kv
    full = form.cost(site, form.validate(win), 1, n, n)
    mixed = site_cost(form, site, params, 1, n, n)
    exact = forms.get("exact").cost(site, {}, 1, n, n)
    # a third of the heads exact: a third of exact's FLOPs plus two thirds of the window's
    assert math.isclose(mixed.flops, exact.flops / 3 + 2 * full.flops / 3, rel_tol=1e-9)
