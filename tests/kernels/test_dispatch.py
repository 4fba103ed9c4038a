"""The ops hand CUDA tensors to the Triton kernels when those support the call, and keep the PyTorch
path otherwise. (No GPU here: a stand-in kernels module records what it was given.)"""

import pytest
import torch

import attnopt.forms.ssm.reference as decay
import attnopt.forms.linear.reference as linear
import attnopt.forms.linear_window.reference as linear_window
import attnopt.forms.window.reference as window


class FakeKernels:
    def __init__(self, supported=True):
        self.supported = supported
        self.calls = []

    def unsupported(self, q, **kwargs):
        return None if self.supported else "not this one"

    def __getattr__(self, name):
        def kernel(q, k, v, **kwargs):
            self.calls.append((name, kwargs))
            return torch.full((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), 7.0)

        return kernel


def _qkv():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 4, 9, 6, generator=g), torch.randn(2, 2, 9, 6, generator=g), torch.randn(2, 2, 9, 5, generator=g)


CASES = [
    (linear, "linear_attention", dict(feature_map="elu", causal=True)),
    (window, "window_attention", dict(window=3, causal=True, sinks=1)),
    (decay, "decay_attention", dict(decay=0.9, feature_map="elu", normalize=True)),
    (linear_window, "linear_window_attention", dict(window=3, causal=True, sinks=1, linear_weight=0.5)),
]


@pytest.mark.parametrize("module, name, kwargs", CASES, ids=[c[1] for c in CASES])
def test_supported_calls_go_to_the_triton_kernel(monkeypatch, module, name, kwargs):
    fake = FakeKernels()
    monkeypatch.setattr(module, "cuda_kernels", lambda q, package: fake)
    out = getattr(module, name)(*_qkv(), **kwargs)
    assert [c[0] for c in fake.calls] == [name] and bool((out == 7.0).all())


@pytest.mark.parametrize("module, name, kwargs", CASES, ids=[c[1] for c in CASES])
def test_unsupported_calls_and_cpu_tensors_keep_the_pytorch_path(monkeypatch, module, name, kwargs):
    q, k, v = _qkv()
    ref = getattr(module, name)(q, k, v, **kwargs)  # CPU: cuda_kernels gives None
    fake = FakeKernels(supported=False)
    monkeypatch.setattr(module, "cuda_kernels", lambda q, package: fake)
    out = getattr(module, name)(q, k, v, **kwargs)
    assert fake.calls == [] and torch.equal(out, ref) and not bool((ref == 7.0).all())
