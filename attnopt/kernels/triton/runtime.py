"""Where the Triton kernels run, and the few host helpers every kernel file shares.

Two launch paths, chosen per call:

* CUDA tensors (a real driver): each kernel runs inside a `torch.library.triton_op` through
  `wrap_triton`, so `torch.export` keeps one node and Inductor launches the kernel itself.
* `TRITON_INTERPRET=1`: the raw kernels run on CPU tensors in Triton's interpreter. A triton_op
  cannot be used there: export and opcheck hand it fake tensors, which the interpreter cannot read.

Nothing here touches a driver at import time, so importing a form's `triton` module works on a CPU-only
machine; a call without either path raises one clear line (`require_runtime`).

Besides the paths: the checks every form's entry point makes (`checked_call`, `shared_checks`), the
default scale, and the host side of a launch (`dims`, `row_strides`, `keep_arg`, `launch`).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

import torch
import triton
from torch import Tensor

from attnopt.kernels.layout import check_causal_inputs, check_sdpa_inputs

FMAP_CODES = {"identity": 0, "elu": 1, "relu": 2}  # the maps fused into the kernels' loads


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_runtime(who: str, q: Tensor) -> None:
    """The one-line error for a call that has neither a GPU tensor nor the interpreter."""
    if interpreting():
        if q.is_cuda:
            raise RuntimeError(f"{who}: TRITON_INTERPRET=1 runs the kernels on CPU tensors; got a CUDA tensor")
        return
    if not q.is_cuda:
        raise RuntimeError(
            f"{who}: the Triton kernels need CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 "
            "before importing triton to run them on the CPU interpreter"
        )


def checked_call(who: str, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                 reason: Callable[[], Optional[str]], causal: Optional[str] = None) -> None:
    """What every entry point checks before it launches, in this order: the SDPA layout (and Nq <= Nk
    for a causal op, `causal` naming what it computes), a launch path, then the kernels' own limits
    (`reason()`, asked only once the layout holds). Each failure raises one line."""
    if causal is None:
        check_sdpa_inputs(who, q, k, v, key_mask)
    else:
        check_causal_inputs(who, causal, q, k, v, key_mask)
    require_runtime(who, q)
    why = reason()
    if why:
        raise ValueError(why)


def shared_checks(own: Callable[..., Optional[str]]) -> Callable[..., Optional[str]]:
    """A form's `unsupported(q, **kwargs)`: the checks every form's kernels share (`call_unsupported`),
    then the form's own limits `own(q, **kwargs)`; None when the kernels can run the call."""

    def unsupported(q: Tensor, **kwargs) -> Optional[str]:
        return call_unsupported(q, kwargs.get("k")) or own(q, **kwargs)

    unsupported.__doc__ = (f"None if these kernels can run the reference op's call (its keywords, plus k= to "
                           f"check the key length), else a one-line reason: `call_unsupported`, then `{own.__name__}`.")
    return unsupported


def scale_or_default(q: Tensor, scale: Optional[float]) -> float:
    """The score scale: 1/sqrt(D) unless given."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def dims(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int, int, int]:
    """(B, H, Hkv, Nq, Nk, D, Dv) of SDPA-layout inputs (Hkv: k's heads; D: q's and k's last dim)."""
    B, H, Nq, D = q.shape
    return B, H, k.shape[1], Nq, k.shape[2], D, v.shape[3]


def row_strides(*tensors: Tensor) -> tuple[int, ...]:
    """Each [B, heads, N, dim] tensor's batch, head and row strides, in order: the kernels' s_xb, s_xh,
    s_xn arguments (the last dim is contiguous)."""
    return tuple(s for t in tensors for s in t.stride()[:3])


def keep_arg(key_mask: Optional[Tensor], like: Tensor) -> tuple[Tensor, bool]:
    """(KEEP, HAS_KEEP): the key mask as int8 [B, Nk], or without one `like`, which the kernels never read."""
    if key_mask is None:
        return like, False
    return key_mask.to(torch.int8).contiguous(), True


def launch(op: str, forward: Callable, *args):
    """The result of the op `attnopt_triton::<op>` on the path this call takes: under the interpreter
    `forward(*args, wrap=False)` launches the raw kernels, on CUDA the registered triton_op runs."""
    if interpreting():
        return forward(*args, wrap=False)
    return getattr(torch.ops.attnopt_triton, op)(*args)


def launcher(kernel, wrap: bool):
    """`kernel` itself (interpreter) or its `wrap_triton` handle (inside a triton_op)."""
    if wrap:
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    return kernel


def pow2(n: int, lo: int = 16) -> int:
    """Block width for a dimension: a power of two, >= 16 (tl.dot's smallest tile)."""
    return max(lo, triton.next_power_of_2(int(n)))


def low_precision(dtype: torch.dtype) -> int:
    """The kernels' LOWP flag: 0 fp32 inputs (IEEE fp32 dots), 1 bf16/fp16 inputs (dot operands in
    the input dtype: tensor cores), 2 the same rounding emulated with fp32 dots -- Triton's
    interpreter (3.9) returns garbage from tl.dot on bf16 operands."""
    if dtype not in (torch.float16, torch.bfloat16):
        return 0
    return 2 if interpreting() and dtype == torch.bfloat16 else 1


def concrete(t: Tensor) -> bool:
    """False for the fake tensors of torch.export / torch.compile tracing: their values are unknown,
    so value checks (decays in (0, 1], weights >= 0) are skipped there, as the reference ops do."""
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(t)


def kernel_dtype_ok(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float16, torch.bfloat16)


def call_unsupported(q: Tensor, k: Optional[Tensor] = None) -> Optional[str]:
    """The checks every form's kernels share (device, dtype, non-empty 4-D inputs), or None.

    It does not validate shapes: the entry points raise the reference ops' errors for those."""
    if not (q.is_cuda or interpreting()):
        return f"Triton kernels need CUDA tensors, got {q.device}"
    if not kernel_dtype_ok(q.dtype):
        return f"Triton kernels take fp32, bf16 or fp16, got {q.dtype}"
    if q.dim() != 4 or q.shape[2] == 0 or (k is not None and k.shape[2] == 0):
        return "empty or non-4-D inputs run on the PyTorch path"
    return None
