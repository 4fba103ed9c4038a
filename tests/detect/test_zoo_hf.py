"""Hugging Face models from configs: every attention layer is found with the config's numbers.

Expected sites come from `zoo_hf` (written from each config); each model is captured once per
test module with static shapes, and a few again with dynamic shapes.
"""

from __future__ import annotations

import math

import pytest

from attnopt.inspection import inspect
from zoo_hf import B, D, FACTORIES
from zoo_models import site_output_error

MODEL_NAMES = list(FACTORIES)


@pytest.fixture(scope="module", params=MODEL_NAMES)
def inspected(request):
    zoo = FACTORIES[request.param]()
    return zoo, inspect(zoo.model, *zoo.args, **zoo.kwargs, dynamic=False)


def test_sites_match_the_config(inspected):
    zoo, inspection = inspected
    found = {s.module_path: s for s in inspection.sites}
    misses = [(m.code, m.reason) for m in inspection.near_misses]
    assert sorted(found) == sorted(e.module_path for e in zoo.expected), misses
    assert len(inspection.sites) == len(zoo.expected), "two sites reported for one module"
    for want in zoo.expected:
        site = found[want.module_path]
        where = f"{zoo.name} {site.id}"
        assert site.source == zoo.source, where
        assert site.module_type == type(zoo.model.get_submodule(want.module_path)).__name__, where
        assert (site.batch, site.heads, site.kv_heads) == (B, want.heads, want.kv_heads), where
        assert (site.q_len, site.kv_len) == (want.q_len, want.kv_len), where
        assert (site.head_dim, site.v_head_dim) == (want.head_dim, want.head_dim), where
        assert math.isclose(site.scale, want.scale, rel_tol=1e-5), f"{where}: scale {site.scale} != {want.scale}"
        if want.causal is not None:
            assert site.causal is want.causal and site.mask.causal is want.causal, where
        assert site.window == want.window and site.mask.window == want.window, where
        if want.arbitrary_mask is not None:
            assert site.mask.arbitrary is want.arbitrary_mask, where
        if want.padding is not None:
            assert site.mask.padding is want.padding, f"{where}: mask {site.mask}"
        if want.layer is not None:
            assert site.layer == want.layer, where
        assert site.dropout_p == 0.0, where
        assert site.dtype == "float32", where


def test_sites_rebuild_their_outputs(inspected):
    """softmax(scale q kᵀ + mask) v from each site's own nodes reproduces the site's output."""
    zoo, inspection = inspected
    for site in inspection.sites:
        error = site_output_error(inspection, site)
        assert error < 1e-4, f"{zoo.name} {site.id}: off by {error:.3g}"


def test_no_near_misses_in_plain_models(inspected):
    zoo, inspection = inspected
    assert inspection.near_misses == [], [(m.module_path, m.code, m.reason) for m in inspection.near_misses]


def test_site_ids_are_unique_and_name_their_module(inspected):
    _, inspection = inspected
    ids = [s.id for s in inspection.sites]
    assert len(set(ids)) == len(ids)
    for site in inspection.sites:
        assert site.id.startswith(site.module_path + "#") or (site.module_path == "" and "#" in site.id)


def test_gpt2_inverse_layer_scale_differs_per_layer():
    """scale_attn_by_inverse_layer_idx: layer i is scaled by 1/(sqrt(D) * (i + 1))."""
    zoo = FACTORIES["gpt2-inverse-layer-scale"]()
    sites = sorted(inspect(zoo.model, *zoo.args, **zoo.kwargs, dynamic=False).sites, key=lambda s: s.layer)
    assert [s.layer for s in sites] == [0, 1]
    assert math.isclose(sites[0].scale, D**-0.5, rel_tol=1e-5)
    assert math.isclose(sites[1].scale, D**-0.5 / 2, rel_tol=1e-5)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "bart"])
def test_dynamic_capture_keeps_heads_scale_causality(name):
    zoo = FACTORIES[name]()
    inspection = inspect(zoo.model, *zoo.args, **zoo.kwargs, dynamic=True)
    found = {s.module_path: s for s in inspection.sites}
    assert sorted(found) == sorted(e.module_path for e in zoo.expected)
    for want in zoo.expected:
        site = found[want.module_path]
        assert (site.heads, site.kv_heads, site.head_dim) == (want.heads, want.kv_heads, want.head_dim)
        assert math.isclose(site.scale, want.scale, rel_tol=1e-5)
        if want.causal is not None:
            assert site.causal is want.causal
        assert site.window == want.window


def test_sizes_are_pairwise_distinct():
    """The zoo's point: B, H, Hkv, N, D never coincide, so swapped axes give wrong numbers."""
    for name in MODEL_NAMES:
        zoo = FACTORIES[name]()
        for want in zoo.expected:
            sizes = {B, want.heads, want.q_len, want.head_dim}
            assert len(sizes) == 4, (name, want)
            if want.kv_heads != want.heads:
                assert want.kv_heads not in sizes, (name, want)
