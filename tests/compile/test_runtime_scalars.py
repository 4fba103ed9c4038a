"""Non-tensor forward arguments of a graph-path model are never silently frozen (issue 18, item 5).

torch.export holds a bool / int / float / str / None argument as the constant it was captured
with. The compiled model checks each on every call: the captured value runs, any other value
raises one line naming the argument (also after attnopt.save / attnopt.load, where torch.export's
own guard function is gone). A 0-dim tensor stays a run-time input, read on every call.

Sizes are pairwise distinct: C=16 channels, H=2 heads, D=8 head dim; example batch 1, length 12.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnopt
from attnopt.ir.errors import SpecializedInputError

C, N = 16, 12


class Knobs(nn.Module):
    """Hand-written attention steered by one argument of every non-tensor kind."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.o = nn.Linear(C, C)

    def forward(self, x, scale, heads, causal, mode, bias=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, C)
        if mode == "residual":
            y = y + x
        if bias is not None:
            y = y + bias
        return self.o(y)


VALUES = {"scale": 0.35, "heads": 2, "causal": True, "mode": "residual", "bias": None}
OTHER = {"scale": 0.5, "heads": 4, "causal": False, "mode": "plain", "bias": torch.ones(C)}
ORDER = ("scale", "heads", "causal", "mode", "bias")


def _x(b=1, n=N, seed=0):
    return torch.randn(b, n, C, generator=torch.Generator().manual_seed(seed))


def _call(model, x, values, keyword):
    if keyword:
        return model(x, **values)
    return model(x, *(values[k] for k in ORDER))


@pytest.fixture(scope="module", params=["positional", "keyword"])
def compiled(request, tmp_path_factory):
    keyword = request.param == "keyword"
    torch.manual_seed(0)
    net = Knobs().eval()
    example = ((_x(),), dict(VALUES)) if keyword else ((_x(), *(VALUES[k] for k in ORDER)), {})
    opt = attnopt.compile(net, "linear", example_inputs=example, tolerance=0.99, e2e_tolerance=None)
    assert opt.attnopt_report.count("rewritten") == 1
    path = attnopt.save(opt, tmp_path_factory.mktemp(request.param) / "knobs")
    return net, opt, attnopt.load(path), keyword


@pytest.mark.parametrize("name", ORDER)
def test_another_value_of_a_non_tensor_argument_raises_one_line_naming_it(compiled, name):
    _, opt, loaded, keyword = compiled
    x = _x(3, 19, seed=1)
    with torch.no_grad():
        want = _call(opt, x, VALUES, keyword)  # the captured values run, at another batch and length
        torch.testing.assert_close(_call(loaded, x, VALUES, keyword), want, rtol=0, atol=0)
    for model in (opt, loaded):
        with pytest.raises(SpecializedInputError) as err:
            _call(model, x, {**VALUES, name: OTHER[name]}, keyword)
        text = str(err.value)
        assert "\n" not in text
        assert text.startswith(f"this compiled Knobs was captured with {name}={VALUES[name]!r}"), text
        shown = "<float32 tensor of shape (16,)>" if name == "bias" else repr(OTHER[name])
        assert f"this call passes {name}={shown}" in text


def test_a_bool_is_not_the_int_it_equals(compiled):
    _, opt, _, keyword = compiled
    with pytest.raises(SpecializedInputError, match="captured with causal=True .* passes causal=1;"):
        _call(opt, _x(), {**VALUES, "causal": 1}, keyword)


def test_the_report_says_which_arguments_are_frozen(compiled):
    _, opt, _, _ = compiled
    notes = opt.attnopt_report.notes
    for name in ("scale", "heads", "causal", "mode"):
        assert any(n.startswith(f"input {name!r} is a Python ") and "a call with another value raises" in n
                   for n in notes), notes


def test_a_tensor_scale_is_read_on_every_call():
    torch.manual_seed(0)
    net = Knobs().eval()
    with pytest.warns(UserWarning, match="none was kept"):  # a scale read at run time keeps the site exact
        opt = attnopt.compile(net, "linear", example_inputs=((_x(), torch.tensor(0.35), 2, True, "residual"), {}),
                              tolerance=0.99, e2e_tolerance=None)
    (record,) = opt.attnopt_report.sites
    assert record.site.runtime_inputs == ("scale",) and str(record.outcome.status) != "rewritten"
    x = _x(2, 9, seed=3)
    with torch.no_grad():
        for scale in (0.35, 0.9):
            torch.testing.assert_close(opt(x, torch.tensor(scale), 2, True, "residual"),
                                       net(x, scale, 2, True, "residual"), rtol=0, atol=1e-6)
