"""onnxscript pieces the decode-step lowerings share (forms/<form>/onnx.py DECODE_LOWERING).

A step op gets the T new tokens' q [B, H, T, D], k/v [B, Hkv, T, ·], the padding mask over every
column so far [B, N] (bool, N = P + T: P columns came before this call) and its past states; it
returns the output and the present states (forms/common/graph.py). Nothing here is O(N) except
reading the mask's last T columns.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript import opset18 as op

from attnopt.kernels.onnx.functions import (
    MS_DOMAIN,
    contrib_node,
    dim,
    i64,
    pack_heads,
    slice_axis,
    traced_graph,
    unpack_heads,
)

END = 2**62  # a Slice end past any length


def new_columns_keep(mask_BN, q_BHTD):
    """Bool [B, T]: which of the call's T new tokens are real (the mask's last T columns)."""
    return op.Slice(mask_BN, op.Neg(dim(q_BHTD, 2)), i64([END]), i64([1]))


def past_columns(mask_BN, q_BHTD):
    """P as a 1-D int64 [1]: the columns before this call."""
    return op.Sub(dim(mask_BN, 1), dim(q_BHTD, 2))


def add_real_tokens(count_B11, keep_BT):
    """The per-row count state [B, 1, 1] (int64) advanced by this call's real tokens."""
    added = op.ReduceSum(op.Cast(keep_BT, to=ir.DataType.INT64), i64([1]), keepdims=1)  # [B, 1]
    return op.Add(count_B11, op.Unsqueeze(added, i64([2])))


def arange(n_1, dtype=ir.DataType.INT64):
    """0 .. n − 1 for a 1-D [1] int64 length."""
    out = op.Range(op.Constant(value_int=0), op.Squeeze(n_1, i64([0])), op.Constant(value_int=1))
    return out if dtype == ir.DataType.INT64 else op.Cast(out, to=dtype)


def linear_attention(phi_q_BHTM, phi_k_BhTM, v_BhTW, past_state, H: int, h: int, rule: str, like, log_decay=None):
    """com.microsoft.LinearAttention from a carried state: (out [B, H, T, W], present [B, h, M, W]).

    φ is already applied (scale 1); `rule` linear or gated (log-space decay [B, T, h]). Always sets
    update_rule (the op's default is gated_delta)."""
    inputs = [pack_heads(phi_q_BHTM), pack_heads(phi_k_BhTM), pack_heads(v_BhTW), past_state]
    if log_decay is not None:
        inputs.append(log_decay)
    out, present = contrib_node(MS_DOMAIN, "LinearAttention", inputs,
                                {"q_num_heads": H, "kv_num_heads": h, "update_rule": rule, "scale": 1.0},
                                num_outputs=2, like=like)
    return unpack_heads(out, H), present


def one_token(q_BHTD):
    """Bool scalar: the call brings exactly one token (the decoding hot path)."""
    return op.Equal(op.Squeeze(dim(q_BHTD, 2), i64([0])), op.Constant(value_int=1))


def branch(condition, then_build, else_build, num_outputs: int, like, name: str):
    """An If over two traced builders, each returning `num_outputs` values."""
    then_graph = traced_graph(f"{name}_then", then_build)
    else_graph = traced_graph(f"{name}_else", else_build)
    out = contrib_node("", "If", [condition], {"then_branch": then_graph, "else_branch": else_graph},
                       num_outputs=num_outputs, like=like)
    return out


def split_last(x, first: int, total: int):
    """x[..., :first] and x[..., first:total]."""
    return slice_axis(x, -1, i64([0]), i64([first])), slice_axis(x, -1, i64([first]), i64([total]))
