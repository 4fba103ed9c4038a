"""Attention that detection must not silently drop or silently freeze (issue 8).

- Inside higher-order ops (no_grad / set_grad_enabled / autocast regions under torch.export):
  every attention is a near miss `inside_higher_order_op` naming the op, never 0 sites and silence.
- A scale read from a forward argument stays a run-time input: the site says so.
- A Python-number argument frozen by export: calling with another value names the argument.
- inspect() on a Hugging Face causal LM passes use_cache=False by itself.
- Capture errors suggest only what the caller accepts.

Sizes are pairwise distinct: B=5, H=6, N=7, D=8.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnopt.inspection import inspect
from attnopt.ir.errors import CaptureError, SpecializedInputError, SpecializedShapeError
from attnopt.passes.capture import capture_dynamo, capture_export
from zoo_models import site_output_error

B, H, N, D = 5, 6, 7, 8
gen = torch.Generator().manual_seed(0)
Q, K, V = (torch.randn(B, H, N, D, generator=gen) for _ in range(3))


def explicit(q, k, v, scale=0.3):
    return ((q @ k.transpose(-1, -2)) * scale).softmax(-1) @ v


# ---- 5. higher-order ops --------------------------------------------------------------------------

class NoGradRegion(nn.Module):
    def forward(self, q, k, v):
        with torch.no_grad():
            a = explicit(q, k, v)
            b = F.scaled_dot_product_attention(q, k, a)
        return b + 1


class GradDisabledRegion(nn.Module):
    def forward(self, q, k, v):
        with torch.set_grad_enabled(False):
            a = explicit(q, k, v)
        return a * 2


class AutocastRegion(nn.Module):
    def forward(self, q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = F.scaled_dot_product_attention(q, k, v)
        return a.float() + 1


@pytest.mark.parametrize(
    "module_cls, hop, n_attention",
    [(NoGradRegion, "wrap_with_set_grad_enabled", 2), (GradDisabledRegion, "wrap_with_set_grad_enabled", 1),
     (AutocastRegion, "wrap_with_autocast", 1)],
    ids=["no_grad", "set_grad_enabled", "autocast"],
)
def test_attention_inside_higher_order_op_is_a_near_miss(module_cls, hop, n_attention):
    inspection = inspect(module_cls(), Q, K, V, dynamic=False)
    assert inspection.sites == []
    misses = inspection.near_misses
    assert [m.code for m in misses] == ["inside_higher_order_op"] * n_attention
    for m in misses:
        assert hop in m.reason and "kept exact" in m.reason
        assert m.details["higher_order_op"] == hop and m.details["submodule"].startswith("submod")
    assert inspection.counts["inside_higher_order_op"] == n_attention


class MixedRegions(nn.Module):
    """One attention outside (a site) and one inside a no_grad region (a near miss), plus a
    classifier softmax inside that keeps its own reason."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, 3)

    def forward(self, q, k, v):
        outside = explicit(q, k, v, scale=0.25)
        with torch.no_grad():
            inside = explicit(q, k, outside)
            probs = self.head(inside).softmax(-1)
        return outside + inside, probs


def test_sites_outside_and_near_misses_inside():
    inspection = inspect(MixedRegions(), Q, K, V, dynamic=False)
    [site] = inspection.sites
    assert (site.heads, site.scale) == (H, 0.25)
    assert site_output_error(inspection, site) < 1e-4
    codes = sorted(m.code for m in inspection.near_misses)
    assert codes == ["inside_higher_order_op", "no_score_matmul"]
    classifier = next(m for m in inspection.near_misses if m.code == "no_score_matmul")
    assert "inside the higher-order op 'wrap_with_set_grad_enabled'" in classifier.reason


# ---- 8. run-time inputs stay run-time inputs ------------------------------------------------------

class TensorScale(nn.Module):
    def forward(self, q, k, v, scale):
        return explicit(q, k, v, scale)


class ScaleOnQuery(nn.Module):
    def forward(self, q, k, v, temperature):
        return ((q / temperature) @ k.transpose(-1, -2)).softmax(-1) @ v


def test_tensor_scale_argument_is_a_runtime_input():
    inspection = inspect(TensorScale(), Q, K, V, torch.tensor(0.3), dynamic=False)
    [site] = inspection.sites
    assert site.runtime_inputs == ("scale",)
    assert "input 'scale'" in site.runtime_reason and "exact" in site.runtime_reason
    assert site.scale == pytest.approx(0.3, abs=1e-6)  # the example's value, for the record only


def test_factor_on_query_from_an_argument_is_a_runtime_input():
    inspection = inspect(ScaleOnQuery(), Q, K, V, torch.tensor(2.0), dynamic=False)
    [site] = inspection.sites
    assert site.runtime_inputs == ("scale",) and "input 'temperature'" in site.runtime_reason
    assert site.scale == pytest.approx(0.5, abs=1e-6)


def test_constant_scale_is_no_runtime_input():
    [site] = inspect(TensorScale(), Q, K, V, 0.3, dynamic=False).sites
    assert site.runtime_inputs == () and site.runtime_reason == ""


class FloatScaleSdpa(nn.Module):
    def forward(self, q, k, v, sc):
        return F.scaled_dot_product_attention(q, k, v, scale=sc)


def test_python_float_argument_names_itself_when_called_with_another_value():
    captured = capture_export(FloatScaleSdpa(), (Q, K, V, 0.3), dynamic=False)
    assert any("'sc'" in n and "0.3" in n for n in captured.notes)
    gm = captured.graph_module
    expected = F.scaled_dot_product_attention(Q, K, V, scale=0.3)
    assert (gm(Q, K, V, 0.3) - expected).abs().max() < 1e-6
    with pytest.raises(SpecializedInputError, match=r"sc=0\.3.*'sc' as a 0-dim tensor"):
        gm(Q, K, V, 0.4)
    with pytest.raises(AssertionError):  # still what the raw guard raised
        gm(Q, K, V, 0.5)


# ---- 10. inspect on a Hugging Face causal LM with its default use_cache ---------------------------

def test_inspect_passes_use_cache_false_to_hf_models():
    pytest.importorskip("transformers")
    from zoo_hf import llama

    zoo = llama()
    assert zoo.kwargs == {"use_cache": False}
    inspection = inspect(zoo.model, *zoo.args, dynamic=False)  # no use_cache given
    assert sorted(s.module_path for s in inspection.sites) == [e.module_path for e in zoo.expected]
    assert {(s.heads, s.kv_heads) for s in inspection.sites} == {(zoo.expected[0].heads, zoo.expected[0].kv_heads)}


class CacheAware(nn.Module):
    """Returns a non-tensor when use_cache is left on, like a DynamicCache."""

    def forward(self, q, k, v, use_cache: bool = True):
        out = explicit(q, k, v)
        return (out, object()) if use_cache else out


def test_inspect_keeps_an_explicit_use_cache():
    [site] = inspect(CacheAware(), Q, K, V, dynamic=False).sites
    assert site.scale == pytest.approx(0.3)
    with pytest.raises(CaptureError):
        inspect(CacheAware(), Q, K, V, use_cache=True, dynamic=False)


# ---- 11. capture errors suggest what the caller accepts -------------------------------------------

class Untraceable(nn.Module):
    def forward(self, q):
        return explicit(q, q, q), object()


def test_capture_error_from_inspect_suggests_inspect_dynamo():
    with pytest.raises(CaptureError) as err:
        inspect(Untraceable(), Q, dynamic=False)
    assert "inspect(..., method='dynamo')" in str(err.value)


def test_capture_error_for_compile_does_not_offer_a_method_compile_lacks():
    with pytest.raises(CaptureError) as err:
        capture_export(Untraceable(), (Q,), dynamic=False)  # what attnopt.compile calls
    msg = str(err.value)
    assert "try method='dynamo'" not in msg
    assert "attnopt.inspect(model, ..., method='dynamo')" in msg


class CheckpointedAttention(nn.Module):
    def forward(self, q, k, v):
        return torch.utils.checkpoint.checkpoint(explicit, q, k, v, use_reentrant=False)


def test_capture_error_on_the_dynamo_route_does_not_suggest_dynamo():
    try:
        graphs = capture_dynamo(CheckpointedAttention(), (Q, K, V))
    except CaptureError as err:
        assert "method='dynamo'" not in str(err)
    else:  # a torch that re-exports the checkpoint region: its attention must not go unreported
        inspection = inspect(CheckpointedAttention(), Q, K, V, method="dynamo")
        assert len(graphs) >= 1 and len(inspection.sites) + len(inspection.near_misses) >= 1


class LearnedTemperature(nn.Module):
    """A trainable temperature: constant today, but training moves it, so it is not frozen."""

    def __init__(self, trainable: bool):
        super().__init__()
        t = torch.tensor(0.5)
        if trainable:
            self.log_t = nn.Parameter(t.log())
        else:
            self.register_buffer("log_t", t.log())

    def forward(self, q, k, v):
        return explicit(q, k, v, scale=self.log_t.exp())


@pytest.mark.parametrize("trainable", [True, False], ids=["parameter", "buffer"])
def test_learned_temperature_is_a_runtime_value_but_a_buffer_is_not(trainable):
    [site] = inspect(LearnedTemperature(trainable), Q, K, V, dynamic=False).sites
    assert site.scale == pytest.approx(0.5, abs=1e-6)
    if trainable:
        assert site.runtime_inputs == ("scale",) and "parameter 'log_t'" in site.runtime_reason
    else:
        assert site.runtime_inputs == ()


class FloatScaleFixedBatch(nn.Module):
    def forward(self, q, k, v, sc):
        return F.scaled_dot_product_attention(q, k, v, scale=sc).reshape(B, -1)  # pins the batch size


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_dim_the_model_fixes_is_named_with_its_size(dynamic):
    captured = capture_export(FloatScaleFixedBatch(), (Q, K, V, 0.3), dynamic=dynamic)
    small = tuple(x[:2] for x in (Q, K, V))
    with pytest.raises(SpecializedShapeError) as err:
        captured.graph_module(*small, 0.3)
    assert str(err.value).startswith(f"this compiled FloatScaleFixedBatch was captured with input 'q' dim 0 fixed "
                                     f"at {B}, and this call has 2 there")
    assert "\n" not in str(err.value) and isinstance(err.value, ValueError)


def test_the_table_lists_runtime_inputs_and_higher_order_misses():
    text = str(inspect(TensorScale(), Q, K, V, torch.tensor(0.3), dynamic=False))
    assert "read at run time (kept exact):" in text and "graph#0 [scale]" in text
    text = str(inspect(GradDisabledRegion(), Q, K, V, dynamic=False))
    assert "0 attention site(s), 1 near miss(es)" in text and "[inside_higher_order_op]" in text
