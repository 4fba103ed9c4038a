"""What a form hands the exporter: the custom op it adds, and one onnxscript function per target.

Targets: "ort" (ONNX Runtime's contrib kernels where they compute exactly the same thing, standard
ops elsewhere) and "onnx-std" (standard ONNX ops only). The third target, "custom", needs nothing
from the form: every site becomes one `attnopt`-domain node whose model-local function is the
form's onnx-std body (export.py builds it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

TARGETS = ("ort", "onnx-std", "custom")


@dataclass(frozen=True)
class OpLowering:
    """`op` is the torch.library name ("attnopt::linear_attention"); each function takes the op's
    arguments (tensors as ONNX values, the rest as python values) and returns the output value."""

    op: str
    by_target: Mapping[str, Callable] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The op's name without its namespace: the ONNX op_type of its custom-domain node."""
        return self.op.split("::", 1)[1]

    def torch_op(self):
        import torch

        return getattr(torch.ops.attnopt, self.name).default
