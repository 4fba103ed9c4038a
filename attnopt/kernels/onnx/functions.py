"""onnxscript building blocks the per-form lowerings share (trace mode: each call records nodes).

The lowerings run inside `torch.onnx.export`'s translation step, where `op.X(...)` appends a node
to the exporter's recorder and returns its output value. `contrib_node` does the same for ops
onnx.defs has no schema for (com.microsoft contrib ops, the `attnopt` custom domain).

Letters: B batch, H query heads, Hkv key/value heads, Hf the heads keys are featurised on, G =
H // Hkv, N sequence length, D head dim, Dv value head dim, M feature count, W = Dv + 1 (a value
column of ones carries the normaliser), C chunk. Values are [B, H, N, D] unless a name says
otherwise; python ints in names (C, M) are static sizes.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np
import onnx_ir as ir
import onnxscript
from onnxscript import opset18 as op

# The ORT contrib domain (LinearAttention, GroupQueryAttention) and attnopt's own domain.
MS_DOMAIN = "com.microsoft"
ATTNOPT_DOMAIN = "attnopt"

# Causal chunk length of the std decompositions: the C×C in-chunk block against the carried
# state; 64 matches the torch kernels' measured best on CPU.
CHUNK = 64


def i64(values: Sequence[int]):
    """A 1-D int64 constant (shapes, axes, pads)."""
    return op.Constant(value=ir.tensor(np.asarray(list(values), dtype=np.int64)))


def f32(array) -> object:
    """A float32 constant of any shape."""
    return op.Constant(value=ir.tensor(np.asarray(array, dtype=np.float32)))


def static_dim(x, axis: int, what: str) -> int:
    """A dim that must be known when exporting (head counts and head dims are)."""
    d = x.shape[axis] if x.shape is not None else None
    if not isinstance(d, int):
        raise ValueError(f"ONNX lowering needs a static {what} (axis {axis} of a {list(x.shape or [])} tensor)")
    return d


def head_dims(q, k, v) -> tuple[int, int, int, int]:
    """(H, Hkv, D, Dv) of q [B, H, N, D], k [B, Hkv, N, D], v [B, Hkv, N, Dv]: static when exporting."""
    return static_dim(q, 1, "H"), static_dim(k, 1, "Hkv"), static_dim(q, 3, "D"), static_dim(v, 3, "Dv")


def check_self_attention(q, k, form: str) -> None:
    """Causal lowerings pair query i with key i: the export is a prefill, Nq = Nk."""
    if q.shape is not None and k.shape is not None and q.shape[2] != k.shape[2]:
        raise ValueError(f"ONNX lowering of {form}: causal export needs as many queries as keys (a prefill), "
                         f"got {q.shape[2]} and {k.shape[2]}")


def causal_prefill_dims(q, k, v, form: str) -> tuple[int, int, int, int]:
    """(H, Hkv, D, Dv) of a causal lowering's call, checked to pair query i with key i."""
    check_self_attention(q, k, form)
    return head_dims(q, k, v)


def dim(x, axis: int):
    """One dim of x as a 1-D int64 [1] tensor (symbolic dims stay symbolic)."""
    return op.Shape(x, start=axis, end=axis + 1)


def contrib_node(domain: str, op_type: str, inputs: Sequence, attributes: dict, num_outputs: int = 1,
                 like=None) -> list:
    """Record a node with no onnx.defs schema on the exporter's recorder; returns its outputs.

    Outputs take `like`'s dtype (shape left to the runtime's inference).
    """
    recorder = onnxscript.evaluator.default()
    if not hasattr(recorder, "nodes"):
        raise RuntimeError("contrib_node must run inside torch.onnx.export's translation step")
    value_type = type(like) if like is not None else ir.Value
    outputs = [value_type(recorder.opset) if like is not None else ir.Value() for _ in range(num_outputs)]
    if like is not None:
        for o in outputs:
            o.dtype = like.dtype
    node = ir.Node(domain, op_type, inputs=list(inputs), attributes=ir.convenience.convert_attributes(attributes),
                   outputs=outputs)
    recorder.nodes.append(node)
    return list(node.outputs)


_BRANCH_IDS = itertools.count()


def traced_graph(name: str, build):
    """The nodes `build()` records, as a subgraph (an If branch) returning its output (or the tuple of
    outputs it returns). Traced into
    a fresh node list and constant cache, so nothing it makes is shared with the enclosing graph;
    values of the enclosing graph it reads stay outer-scope references, as ONNX subgraphs allow."""
    recorder = onnxscript.evaluator.default()
    saved = recorder.nodes, recorder.constant_farm
    recorder.nodes, recorder.constant_farm = [], {}
    try:
        out = build()
        nodes = recorder.nodes
    finally:
        recorder.nodes, recorder.constant_farm = saved
    for i, value in enumerate(v for node in nodes for v in node.outputs):
        if not value.name:  # unique names: a branch the exporter folds away (a static condition) is inlined
            value.name = f"{name}_{next(_BRANCH_IDS)}_{i}"
    return ir.Graph([], list(out) if isinstance(out, (tuple, list)) else [out], nodes=nodes, name=name)


# ---------------------------------------------------------------- layout


def pack_heads(x_BHND):
    """[B, H, N, D] -> [B, N, H·D], the packed layout of ORT's attention contrib ops."""
    return op.Reshape(op.Transpose(x_BHND, perm=[0, 2, 1, 3]), i64([0, 0, -1]))


def unpack_heads(x_BNX, H: int):
    """[B, N, H·D] -> [B, H, N, D]."""
    return op.Transpose(op.Reshape(x_BNX, i64([0, 0, H, -1])), perm=[0, 2, 1, 3])


def expand_heads(x_BhND, h: int, H: int, D: int):
    """Repeat each of h heads H/h times (head h' reads head h' // (H/h), as HF's repeat_kv); D its last dim."""
    if h == H:
        return x_BhND
    x5 = op.Unsqueeze(x_BhND, i64([2]))
    return op.Reshape(op.Expand(x5, i64([1, 1, H // h, 1, 1])), i64([0, H, -1, D]))


def keep_BN1(keep_BN, dtype_like):
    """Bool key keep [B, N] -> [B, 1, N, 1] in the compute dtype (1 keep, 0 drop)."""
    return op.Unsqueeze(op.CastLike(keep_BN, dtype_like), i64([1, 3]))


def pad_axis(x, axis: int, rank: int, multiple: int):
    """Zero-pad `axis` at its end up to a multiple of `multiple` (the length stays dynamic)."""
    n = dim(x, axis)
    pad = op.Mod(op.Sub(i64([multiple]), op.Mod(n, i64([multiple]))), i64([multiple]))
    before_and_after_ends = [i64([0] * (rank + axis)), pad, i64([0] * (rank - axis - 1))]
    pads = op.Concat(*[p for p, size in zip(before_and_after_ends, (rank + axis, 1, rank - axis - 1)) if size], axis=0)
    return op.Pad(x, pads)


def slice_axis(x, axis: int, start, end):
    """x[..., start:end, ...] along `axis`; start/end 1-D int64 [1] tensors."""
    return op.Slice(x, start, end, i64([axis]))


def with_ones_column(v_BHND):
    """[v, 1]: the extra value column makes each product carry the normaliser φ(q)ᵀz with it."""
    ones = op.Expand(f32(np.ones((1, 1, 1, 1))), op.Concat(op.Shape(v_BHND, start=0, end=3), i64([1]), axis=0))
    return op.Concat(v_BHND, op.CastLike(ones, v_BHND), axis=-1)


def safe_ratio(num_BHNW, den_BHN1, eps: float):
    """num / (den + eps); with eps below the dtype's tiny a zero denominator gives 0, as the kernels."""
    den = op.Add(den_BHN1, op.CastLike(f32(eps), den_BHN1))
    if eps < float(np.finfo(np.float32).tiny):
        zero = op.Equal(den, op.CastLike(f32(0.0), den))
        den = op.Where(zero, op.CastLike(f32(1.0), den), den)
    return op.Div(num_BHNW, den)


# ---------------------------------------------------------------- feature maps φ


def elu1(x):
    return op.Add(op.Elu(x), op.CastLike(f32(1.0), x))


def feature_count(name: str, D: int, weight) -> int:
    """M, φ's width, from the map's name, the head dim and its weight's static shape."""
    if name in ("identity", "elu", "relu"):
        return D
    if name == "favor":
        return static_dim(weight, 1, "FAVOR+ feature count")
    if name == "hedgehog":
        return 2 * static_dim(weight, 2, "hedgehog width")
    if name == "taylor":
        return 1 + D + D * D
    raise ValueError(f"ONNX lowering: unknown feature map {name!r}")


def features(name: str, x_BHND, scale: float, weight, D: int):
    """Raw φ(x) [B, H, N, M] for the maps without stabilisers (all but FAVOR+'s keys and queries)."""
    if name == "identity":
        return x_BHND
    if name == "elu":
        return elu1(x_BHND)
    if name == "relu":
        return op.Relu(x_BHND)
    if name == "hedgehog":
        proj = op.MatMul(op.Mul(x_BHND, op.CastLike(f32(math.sqrt(scale)), x_BHND)), op.Unsqueeze(weight, i64([0])))
        return op.Concat(op.Softmax(proj, axis=-1), op.Softmax(op.Neg(proj), axis=-1), axis=-1)
    if name == "taylor":
        outer = op.Reshape(op.Mul(op.Unsqueeze(x_BHND, i64([4])), op.Unsqueeze(x_BHND, i64([3]))), i64([0, 0, 0, D * D]))
        ones = op.Expand(op.CastLike(f32(np.ones((1, 1, 1, 1))), x_BHND),
                         op.Concat(op.Shape(x_BHND, start=0, end=3), i64([1]), axis=0))
        return op.Concat(ones, op.Mul(x_BHND, op.CastLike(f32(math.sqrt(scale)), x_BHND)),
                         op.Mul(outer, op.CastLike(f32(scale / math.sqrt(2.0)), x_BHND)), axis=-1)
    raise ValueError(f"ONNX lowering: unknown feature map {name!r}")


def favor_exponent(x_BHND, scale: float, omega_DM):
    """ωᵀx' − ‖x'‖²/2 with x' = s^½·x: the log of √M·φ(x)."""
    x = op.Mul(x_BHND, op.CastLike(f32(math.sqrt(scale)), x_BHND))
    sq = op.ReduceSum(op.Mul(x, x), i64([-1]), keepdims=1)
    return op.Sub(op.MatMul(x, op.CastLike(omega_DM, x)), op.Mul(sq, op.CastLike(f32(0.5), x)))


def query_key_features(name: str, q_BHND, k_BhND, scale: float, weight, keep_BN, H: int, Hkv: int, D: int):
    """φ(q) [B, H, N, M], φ(k) [B, Hf, N, M] and FAVOR+'s key log-scale [B, Hf, 1, 1] (else None).

    As kernels.feature_maps.query_key_features: per-head maps featurise keys per query head;
    dropped keys get φ = 0; FAVOR+ stabilises each query row by its own max and all keys of a
    (batch, head) by one shared max (a per-key constant would reweight keys).
    """
    if name == "hedgehog":
        k_BhND = expand_heads(k_BhND, Hkv, H, D)
    if name != "favor":
        phi_q, phi_k = features(name, q_BHND, scale, weight, D), features(name, k_BhND, scale, weight, D)
        if keep_BN is not None:
            phi_k = op.Mul(phi_k, keep_BN1(keep_BN, phi_k))
        return phi_q, phi_k, None
    M = static_dim(weight, 1, "FAVOR+ feature count")
    inv_sqrt_m = 1.0 / math.sqrt(M)
    a_q = favor_exponent(q_BHND, scale, weight)
    phi_q = op.Mul(op.Exp(op.Sub(a_q, op.ReduceMax(a_q, i64([-1]), keepdims=1))), op.CastLike(f32(inv_sqrt_m), a_q))
    a_k = favor_exponent(k_BhND, scale, weight)
    if keep_BN is not None:
        keep = op.Unsqueeze(keep_BN, i64([1, 3]))
        a_k = op.Where(keep, a_k, op.CastLike(f32(-np.inf), a_k))
    c_k = op.ReduceMax(a_k, i64([2, 3]), keepdims=1)
    finite = op.Not(op.IsInf(c_k))
    c_k = op.Where(finite, c_k, op.CastLike(f32(0.0), c_k))  # no kept key: nothing to scale
    phi_k = op.Mul(op.Exp(op.Sub(a_k, c_k)), op.CastLike(f32(inv_sqrt_m), a_k))
    return phi_q, phi_k, c_k


# ---------------------------------------------------------------- causal linear, chunked


def causal_linear_chunks(phi_q_BHNM, phi_k_BHNM, v1_BHNW, M: int, W: int, C: int = CHUNK):
    """Σ_{j ≤ i} (φ(q_i)·φ(k_j)) v1_j for every i, [B, H, N, W]; all heads already aligned (H).

    N is zero-padded to nC·C; the state entering chunk c is an exclusive cumsum of the per-chunk
    states φ(K_c)ᵀV_c over chunks ([B, H, nC, M, W], N/C of them, never one per position), and
    the in-chunk part is the tril-masked C×C block. O(N·C·(M + W) + N·M·W) per head.
    """
    N = dim(phi_q_BHNM, 2)
    fq = op.Reshape(pad_axis(phi_q_BHNM, 2, 4, C), i64([0, 0, -1, C, M]))
    fk = op.Reshape(pad_axis(phi_k_BHNM, 2, 4, C), i64([0, 0, -1, C, M]))
    vc = op.Reshape(pad_axis(v1_BHNW, 2, 4, C), i64([0, 0, -1, C, W]))
    fk_T = op.Transpose(fk, perm=[0, 1, 2, 4, 3])  # [B, H, nC, M, C]
    chunk_state = op.MatMul(fk_T, vc)  # [B, H, nC, M, W]
    prefix = op.CumSum(chunk_state, op.Constant(value_int=2), exclusive=1)  # state entering each chunk
    tril = op.CastLike(f32(np.tril(np.ones((C, C)))), fq)
    intra = op.MatMul(op.Mul(op.MatMul(fq, fk_T), tril), vc)
    out = op.Add(op.MatMul(fq, prefix), intra)  # [B, H, nC, C, W]
    return slice_axis(op.Reshape(out, i64([0, 0, -1, W])), 2, i64([0]), N)


def ratio_of_ones_column(out_BHNW, W: int, eps: float):
    """Split [num, den] (the ones column) and divide: [B, H, N, W] -> [B, H, N, W − 1]."""
    num = slice_axis(out_BHNW, 3, i64([0]), i64([W - 1]))
    den = slice_axis(out_BHNW, 3, i64([W - 1]), i64([W]))
    return safe_ratio(num, den, eps)
