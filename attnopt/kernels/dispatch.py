"""Which implementation an op runs: its form's Triton kernels for CUDA tensors they support, else PyTorch.

The dispatch sits in each op's public function, not inside its `attnopt::` custom op, so that the
Triton ops' own autograd runs and Inductor launches their kernels directly.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

from torch import Tensor


def cuda_kernels(q: Tensor, package: str) -> Optional[ModuleType]:
    """`<package>.triton`, the calling form's kernels, when `q` lives on a CUDA device and Triton
    imports; else None (no Triton on this machine: the PyTorch path serves every device)."""
    if not q.is_cuda:
        return None
    try:
        return importlib.import_module(f"{package}.triton")
    except ImportError:
        return None
