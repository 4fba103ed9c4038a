"""AppendingLayer holds exactly what HF's DynamicLayer holds, through growth, crop, reorder,
selection and repetition; append_layers swaps only empty plain layers."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402

from attnopt.hf.cache import AppendingLayer, append_layers  # noqa: E402


def _kv(gen, b, t):
    return torch.randn(b, 2, t, 4, generator=gen), torch.randn(b, 2, t, 4, generator=gen)


def _same(a, b):
    assert a.keys.shape == b.keys.shape
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert a.get_seq_length() == b.get_seq_length()


@pytest.mark.parametrize("inference", [False, True])
def test_appending_layer_holds_what_dynamic_layer_holds(inference):
    gen = torch.Generator().manual_seed(0)
    ref, got = DynamicLayer(), AppendingLayer()
    with torch.inference_mode(inference):
        for t in [5] + [1] * 300 + [7]:  # past the first buffer (256 spare columns) and a multi-token step
            k, v = _kv(gen, 2, t)
            rk, rv = ref.update(k, v)
            gk, gv = got.update(k, v)
            assert torch.equal(rk, gk) and torch.equal(rv, gv)
        _same(ref, got)
        for edit in (lambda layer: layer.crop(-10), lambda layer: layer.batch_repeat_interleave(2),
                     lambda layer: layer.reorder_cache(torch.tensor([3, 1, 0, 2])),
                     lambda layer: layer.batch_select_indices(torch.tensor([0, 2])), lambda layer: layer.crop(-150)):
            edit(ref)
            edit(got)
            _same(ref, got)
            b = ref.keys.shape[0]
            for t in (1, 1, 3):
                k, v = _kv(gen, b, t)
                ref.update(k, v)
                got.update(k, v)
                _same(ref, got)
        ref.reset()
        got.reset()
        k, v = _kv(gen, 1, 4)
        assert torch.equal(ref.update(k, v)[0], got.update(k, v)[0])


def test_append_layers_swaps_only_empty_plain_layers():
    cache = DynamicCache()
    full, sliding, empty = DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4), DynamicLayer()
    full.update(*_kv(torch.Generator().manual_seed(1), 1, 3))
    cache.layers = [full, sliding, empty]
    assert append_layers(cache) == 1
    assert cache.layers[0] is full and cache.layers[1] is sliding
    assert type(cache.layers[2]) is AppendingLayer
    assert append_layers(cache) == 0
