"""SiteModule.decode: a prefill and any split into steps equal one forward, with left padding and
under min_seq_len (the first T real tokens of each row exact), for every form with a state."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import attnopt
from attnopt import forms
from attnopt.forms.common.base import BuildContext

B, H, N, D = 3, 4, 40, 8
SPLITS = [[N], [10] + [1] * 30, [3, 5, 1, 1, 20, 10], [25, 15]]


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.fixture(scope="module")
def site():
    x = torch.randn(B, H, N, D)
    (s,) = attnopt.inspect(Sdpa(), x, x, x, dynamic=False).sites
    return s


@pytest.mark.parametrize("name,params", [
    ("linear", {}), ("linear", {"feature_map": "hedgehog", "min_seq_len": 12}), ("ssm", {"min_seq_len": 20}),
    ("window", {"window": 6, "sinks": 2}), ("window", {"window": 6, "sinks": 2, "min_seq_len": 9}),
    ("linear+window", {"window": 6, "sinks": 2, "min_seq_len": 5}),
])
def test_decode_equals_forward(site, name, params):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, :7], keep[2, :30] = False, False  # left padding; row 2 has 10 real tokens only
    mask = keep[:, None, None, :] & torch.ones(N, N, dtype=torch.bool).tril()
    form = forms.get(name)
    module = form.build(site, form.validate(params), BuildContext()).double()
    module.geometry = dataclasses.replace(module.geometry, keep_when="true")  # the mask below is bool keep
    ref = module(q, k, v, mask)
    for splits in SPLITS:
        outs, state, i = [], None, 0
        for n in splits:
            o, state = module.decode(q[:, :, i:i + n], k[:, :, i:i + n], v[:, :, i:i + n], keep[:, i:i + n], state)
            outs.append(o)
            i += n
        out = torch.cat(outs, dim=2)
        assert (out - ref)[keep[:, None, :, None].expand_as(out)].abs().max() < 1e-12, splits
        T = params.get("min_seq_len", 0)
        assert (state.prefix is None) == bool((keep.sum(-1) >= T).all())  # kept while a row is inside T
        assert state.real_B.tolist() == keep.sum(-1).tolist() and state.columns == N
    if params.get("min_seq_len"):  # the first T real tokens of each row are exact attention
        exact = module.exact(q, k, v, mask)
        T = params["min_seq_len"]
        inside = keep & (keep.cumsum(-1) <= T)
        assert (ref - exact)[inside[:, None, :, None].expand_as(ref)].abs().max() < 1e-12
        outside = keep & (keep.cumsum(-1) > T)
        assert (ref - exact)[outside[:, None, :, None].expand_as(ref)].abs().max() > 1e-3
