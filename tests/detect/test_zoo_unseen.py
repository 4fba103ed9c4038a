"""Architectures the detector was not written against: every site with the config's numbers, every
MoE router a near miss, no other near miss, and export failures as a CaptureError with a hint.

Expectations live in `zoo_unseen` (written from each config). Where the detector's answer is a
deliberate conservative one (an additive bias reported as arbitrary rather than causal) the
factory's docstring says why.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnopt.inspection import CaptureError, inspect
from zoo_models import site_output_error
from zoo_unseen import EAGER_NAMES, FACTORIES, TorchTransformerMaskInput, _src_tgt

MODEL_NAMES = list(FACTORIES)


@pytest.fixture(scope="module", params=MODEL_NAMES)
def inspected(request):
    try:
        case = FACTORIES[request.param]()
    except AttributeError as exc:  # this transformers has no such model class
        pytest.skip(f"transformers lacks {request.param}: {exc}")
    return case, inspect(case.model, *case.args, dynamic=False, **case.kwargs)


def test_sites_match_the_config(inspected):
    _assert_sites_match(*inspected)


@pytest.mark.parametrize("name", EAGER_NAMES)
def test_eager_attention_gives_the_same_sites(name):
    """attn_implementation="eager" spells each site as matmul/softmax/matmul: same answers."""
    case = FACTORIES[name]()
    case.model.set_attn_implementation("eager")
    inspection = inspect(case.model, *case.args, dynamic=False, **case.kwargs)
    assert {s.source for s in inspection.sites} <= {"explicit", "mha"}
    _assert_sites_match(case, inspection)


def _assert_sites_match(case, inspection):
    misses = [(m.module_path, m.code, m.reason) for m in inspection.near_misses]
    got_paths = sorted(s.module_path for s in inspection.sites)
    assert got_paths == sorted(w.module_path for w in case.sites), misses
    for want in case.sites:
        # shared-weight models (ALBERT) have several sites in one module: pair them by layer
        [site] = [s for s in inspection.sites if s.module_path == want.module_path and s.layer == want.layer]
        where = f"{case.name} {site.id}"
        module = case.model.get_submodule(want.module_path)
        assert site.module_type == type(module).__name__, where
        assert (site.batch, site.heads, site.kv_heads) == (want.batch, want.heads, want.kv_heads), where
        assert (site.q_len, site.kv_len) == (want.q_len, want.kv_len), where
        assert (site.head_dim, site.v_head_dim) == (want.head_dim, want.head_dim), where
        assert math.isclose(site.scale, want.scale, rel_tol=1e-5), f"{where}: scale {site.scale} != {want.scale}"
        assert site.causal is want.causal and site.mask.causal is want.causal, f"{where}: {site.mask}"
        assert site.window == want.window and site.mask.window == want.window, f"{where}: {site.mask}"
        assert site.mask.arbitrary is want.arbitrary, f"{where}: {site.mask}"
        assert site.mask.padding is want.padding, f"{where}: {site.mask}"
        assert site.dropout_p == 0.0 and site.dtype == "float32", where


def test_sites_rebuild_their_outputs(inspected):
    """softmax(scale q kᵀ + mask) v from each site's own nodes reproduces its output: the node
    names (MQA keys, the rank-3 MHA pooling head, pre-scaled queries) are what a rewrite reads.
    Sites whose mask is several terms with no single node (BLOOM, MPT) have nothing to rebuild from."""
    case, inspection = inspected
    kinds = {}  # one site per kind of site keeps this cheap: each rebuild runs the whole graph
    for s in inspection.sites:
        if not (s.mask.arbitrary and s.mask.node is None):
            kinds.setdefault((s.source, s.mask.kind, s.q_len, s.kv_len, s.nodes.rank), s)
    for site in kinds.values():
        error = site_output_error(inspection, site)
        assert error < 1e-4, f"{case.name} {site.id}: off by {error:.3g}"


def test_near_misses_are_exactly_the_expected_ones(inspected):
    """MoE routers are softmaxes over x·W_gate: each must be a near miss with its reason; plain
    models must have none."""
    case, inspection = inspected
    got = sorted((m.module_path, m.code) for m in inspection.near_misses)
    assert len(got) == len(case.misses), [(m.module_path, m.code, m.reason) for m in inspection.near_misses]
    for want in case.misses:
        [miss] = [m for m in inspection.near_misses if m.module_path == want.module_path]
        assert miss.code in want.codes and len(miss.reason) > 10, (miss.code, miss.reason)


def test_site_layers_follow_the_residual_stream(inspected):
    case, inspection = inspected
    by_layer = sorted(inspection.sites, key=lambda s: (s.layer, s.module_path))
    assert [s.layer for s in by_layer] == sorted(w.layer for w in case.sites)


def test_torch_transformer_data_dependent_causal_check_is_a_capture_error():
    """nn.Transformer with tgt_is_causal left to None compares the input mask with a causal one
    (data-dependent control flow): export cannot trace that, and inspect must say so cleanly."""

    class DetectsCausality(TorchTransformerMaskInput):
        def forward(self, src_BNX, tgt_BMX, tgt_mask_MM):
            return self.core(src_BNX, tgt_BMX, tgt_mask=tgt_mask_MM)

    src, tgt = _src_tgt()
    mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
    with pytest.raises(CaptureError) as info:
        inspect(DetectsCausality().eval(), src, tgt, mask, dynamic=False)
    text = str(info.value)
    assert "torch.export could not trace" in text and "data-dependent control flow" in text
    assert "tgt_is_causal" in text and "method='dynamo'" in text
    assert isinstance(info.value.__cause__, Exception)  # the export error is kept for debugging


@pytest.mark.parametrize("name", ["opt", "whisper"])
def test_scale_folded_into_the_query_is_named(name):
    """OPT / Whisper multiply q by 1/sqrt(D) before the head split: every site's scale is 1.0
    relative to its already scaled query node, and its spelling says where the factor went."""
    case = FACTORIES[name]()
    inspection = inspect(case.model, *case.args, dynamic=False, **case.kwargs)
    assert len(inspection.sites) == len(case.sites)
    for site in inspection.sites:
        assert site.scale == pytest.approx(1.0) and "scale:folded_into_query" in site.spelling, site.id


def test_rope_models_do_not_claim_a_folded_scale():
    """The tag must not fire on an unscaled q (Qwen3: q_proj, view, norm, RoPE)."""
    case = FACTORIES["qwen3"]()
    sites = inspect(case.model, *case.args, dynamic=False, **case.kwargs).sites
    assert len(sites) == 2 and all("scale:folded_into_query" not in s.spelling for s in sites)
