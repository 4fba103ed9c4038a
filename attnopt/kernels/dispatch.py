"""Which implementation an op runs: the Triton kernels for CUDA tensors they support, else PyTorch.

The dispatch sits in each op's public function, not inside its `attnopt::` custom op, so that the
Triton ops' own autograd runs and Inductor launches their kernels directly.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

from torch import Tensor


def cuda_kernels(q: Tensor) -> Optional[ModuleType]:
    """`attnopt.kernels.triton` when `q` lives on a CUDA device and Triton imports; else None."""
    if not q.is_cuda:
        return None
    try:
        import attnopt.kernels.triton as kernels
    except ImportError:  # no Triton on this machine: the PyTorch path serves every device
        return None
    return kernels
