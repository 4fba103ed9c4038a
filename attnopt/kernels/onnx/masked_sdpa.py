"""aten SDPA with a boolean mask, as torch computes it: a query that sees no key gets zeros.

torch.onnx (opset < 23) lowers SDPA through onnxscript, which hides masked keys with the dtype's
lowest finite value. A fully masked row (a padded query) then averages every value instead of
giving torch's zeros, so a file of a padded input differs from torch in those rows. Those rows
are zeroed here after the same lowering; rows that see a key are untouched.
"""

from __future__ import annotations

from typing import Optional

import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.kernels.onnx.functions import f32, i64


def sdpa_zero_unseen_rows(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                          scale: Optional[float] = None, enable_gqa: bool = False):
    from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention

    out = aten_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                            scale=scale, enable_gqa=enable_gqa)
    if attn_mask is None or attn_mask.dtype != ir.DataType.BOOL:
        return out
    sees = op.Cast(op.ReduceMax(op.Cast(attn_mask, to=ir.DataType.INT32), i64([-1]), keepdims=1),
                   to=ir.DataType.BOOL)  # [..., Nq, 1]: the query sees some key
    return op.Where(sees, out, op.CastLike(f32(0.0), out))
