"""Each form's Triton entry point takes its reference op's keywords with the same defaults: the op's CUDA
dispatch hands a call over unchanged, and a default changed on one side only fails here.

Only these may differ: `state` (the kernels are stateless; a call with a state stays on the PyTorch
path) and `chunk_size` / `block_size` (the kernels pick their own tiles). No interpreter is needed:
the test reads signatures, and importing a form's triton module works without a GPU.
"""

import importlib
import inspect

import pytest

pytest.importorskip("triton", reason="triton is not installed")

ENTRIES = [
    ("window", "window_attention"),
    ("linear", "linear_attention"),
    ("linear_window", "linear_window_attention"),
    ("ssm", "decay_attention"),
    ("gla", "gated_linear_attention"),
    ("delta", "gated_delta_attention"),
    ("gla_window", "gla_window_attention"),
]
MAY_DIFFER = {"state", "chunk_size", "block_size"}


def _parameters(form: str, module: str, name: str) -> dict:
    fn = getattr(importlib.import_module(f"attnopt.forms.{form}.{module}"), name)
    return {p.name: (p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in MAY_DIFFER}


@pytest.mark.parametrize("form, name", ENTRIES)
def test_triton_entry_takes_the_reference_ops_keywords_and_defaults(form, name):
    reference, kernels = _parameters(form, "reference", name), _parameters(form, "triton", name)
    assert len(kernels) >= 4, kernels  # q, k, v and at least one option were read
    assert sorted(kernels) == sorted(reference), f"{form}: parameters differ: {sorted(kernels)} vs {sorted(reference)}"
    positional = [p for p, (kind, _) in kernels.items() if kind != inspect.Parameter.KEYWORD_ONLY]
    assert positional == [p for p, (kind, _) in reference.items() if kind != inspect.Parameter.KEYWORD_ONLY]
    for param, (kind, default) in kernels.items():
        assert (kind, default) == reference[param], f"{form}.{param}: triton {(kind, default)}, reference {reference[param]}"
