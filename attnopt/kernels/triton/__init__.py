"""Triton kernels for attnopt's rewrite forms, with the keyword signatures of the reference ops.

    linear_attention(q, k, v, *, feature_map="elu", causal=False, scale=None, eps=1e-6, key_mask=None)
    window_attention(q, k, v, *, window, causal, sinks=0, scale=None, key_mask=None)
    decay_attention(q, k, v, *, decay=None, feature_map="identity", normalize=False, scale=None,
                    eps=1e-6, key_mask=None)
    linear_window_attention(q, k, v, *, window, sinks=0, causal, feature_map="elu", scale=None,
                            linear_weight=1.0, key_mask=None)      (forward only)

One-token decode steps on fixed-size states (forward only, raw kernel launches):
`linear_decode_step`, `decay_decode_step` (= `attnopt.kernels.decay.decay_attention_step`),
`window_decode_step` with `init_window_cache` (S sink slots + a ring of W slots).

Layout is SDPA's: q [B, H, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] -> [B, H, Nq, Dv] in q's
dtype (fp32, bf16, fp16; fp32 accumulation). GQA reads kv head h // (H // Hkv) in the kernels,
never a repeated K/V. On CUDA each form is a `torch.library.triton_op` (namespace
`attnopt_triton`): one node under torch.export, launched directly by Inductor. With
TRITON_INTERPRET=1 the same kernels run on CPU tensors in Triton's interpreter (tests).

`is_supported(q, form=..., **kwargs)` says whether the Triton path can run a call (None) or why not
(a one-line reason); the reference ops' CUDA dispatch calls it before handing a call over.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from attnopt.kernels.triton.decay import decay_attention, decay_unsupported
from attnopt.kernels.triton.decode import (
    decay_decode_step,
    init_window_cache,
    linear_decode_step,
    window_decode_step,
)
from attnopt.kernels.triton.linear import linear_attention, linear_unsupported
from attnopt.kernels.triton.linear_window import linear_window_attention, linear_window_unsupported
from attnopt.kernels.triton.runtime import interpreting, kernel_dtype_ok
from attnopt.kernels.triton.window import window_attention, window_unsupported

__all__ = [
    "linear_attention",
    "window_attention",
    "decay_attention",
    "linear_window_attention",
    "is_supported",
    "linear_decode_step",
    "decay_decode_step",
    "window_decode_step",
    "init_window_cache",
]

_UNSUPPORTED = {
    "linear": linear_unsupported,
    "window": window_unsupported,
    "decay": decay_unsupported,
    "linear_window": linear_window_unsupported,
}


def is_supported(q: Tensor, form: str, **kwargs) -> Optional[str]:
    """None if the Triton kernels can run `form` ("linear", "window", "decay", "linear_window") on
    these arguments, else a one-line reason. kwargs: the reference op's keywords (feature_map,
    state, window, sinks, ...; unknown ones are ignored), plus optionally k= to check its length.
    It does not validate shapes: the entry points raise the reference ops' errors for those."""
    if form not in _UNSUPPORTED:
        return f"no Triton kernel for form {form!r}; known: {', '.join(_UNSUPPORTED)}"
    if not (q.is_cuda or interpreting()):
        return f"Triton kernels need CUDA tensors, got {q.device}"
    if not kernel_dtype_ok(q.dtype):
        return f"Triton kernels take fp32, bf16 or fp16, got {q.dtype}"
    k = kwargs.get("k")
    if q.dim() != 4 or q.shape[2] == 0 or (k is not None and k.shape[2] == 0):
        return "empty or non-4-D inputs run on the PyTorch path"
    return _UNSUPPORTED[form](q, **kwargs)
