"""The numeric check: a structural match becomes a site only if its matched pieces, replayed
through softmax(scale·q·kᵀ + mask)·v on the recorded example values, reproduce the recorded output.
What the check reads off that run (scale, heads, head dims, mask) is its `CheckResult`.

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D/Dv head dims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from attnopt.ir.site import MaskInfo, NearMiss
from attnopt.passes.candidate import Candidate, candidate_miss
from attnopt.passes.mask_proof import StructureOracle, symbolic
from attnopt.passes.mask_reading import read_mask
from attnopt.passes.replay import replay_explicit, replay_sdpa, sample_rows

_TOLERANCE = {  # (rtol, atol relative to the output's magnitude) per dtype
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@dataclass(frozen=True)
class CheckResult:
    """What a candidate that passed the numeric check measures on the example run."""

    scale: float  # the product of the scale factors (SDPA: scale= or 1/sqrt(D))
    folded_scale: float  # the factors already inside the query / key nodes (not in `scale`)
    heads: int  # H (1 for a [B*H, N, D] chain: the split is read from the graph)
    kv_heads: int  # Hkv
    mask: MaskInfo
    head_dim: int  # D
    v_head_dim: int  # Dv


def check(c: Candidate, values: dict, oracle: StructureOracle) -> Union[NearMiss, CheckResult]:
    """Replay `c` on the recorded `values` and compare with its recorded output; read its mask."""
    q, k, v, out = (values[n.name] for n in (c.query, c.key, c.value, c.output))
    if _channel_attention(c):
        return candidate_miss(c, "its head dim follows the input's length while its sequence is fixed: channel "
                                 "attention (XCiT-style softmax over a channels × channels matrix), whose cost is "
                                 "already linear in the length; kept exact", "channel attention")
    if c.key_is_transposed:
        k = k.transpose(-2, -1)
    shapes = _check_shapes(c, q, k, v, out)
    if isinstance(shapes, str):
        return candidate_miss(c, shapes, "shape")
    heads, kv_heads = shapes
    try:
        scale = _scale(c, values, q.shape[-1])
    except (TypeError, ValueError, KeyError) as exc:
        return candidate_miss(c, f"the scale could not be read as a number: {exc}", "scale")
    work = torch.promote_types(q.dtype, torch.float32)  # fp32 reference is exact enough for the tolerances
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    if c.rank == 4 and kv_heads != heads:
        kf = kf.repeat_interleave(heads // kv_heads, dim=1)
        vf = vf.repeat_interleave(heads // kv_heads, dim=1)
    if c.is_sdpa:
        # Query rows are independent: a long sequence is checked on a sample of them (O(rows·N)).
        rows = sample_rows(qf.shape[-2])
        ref = replay_sdpa(c, values, qf, kf, vf, scale, rows)
        out = out.index_select(-2, rows) if rows is not None else out
    else:
        ref = replay_explicit(c, values, qf, kf, vf)
    if c.dropout_p == 0.0:
        bad = _mismatch(out, ref)
        if bad is not None:
            return candidate_miss(c, "the matched chain does not compute softmax(scale·q·kᵀ + mask)·v on the "
                                      f"example inputs ({bad}); not rewriting it", "numeric")
    mask = read_mask(c, values, oracle, qf.shape, kf.shape)
    if isinstance(mask, NearMiss):
        return mask
    # heads and head dims are model constants: report the example's value even where export kept
    # the dim symbolic (Dim.AUTO on an input tensor the model never reshapes)
    folded = 1.0
    for f in c.folded_factors:
        folded *= f.resolve(values)
    return CheckResult(scale=scale, folded_scale=folded, heads=heads, kv_heads=kv_heads, mask=mask,
                       head_dim=int(q.shape[-1]), v_head_dim=int(v.shape[-1]))



def _channel_attention(c: Candidate) -> bool:
    """True when q's head dim is an input's token axis (a middle axis of a 3-D or larger input, kept
    symbolic by the capture) while its sequence axis is fixed: the softmax runs over channels."""
    shape = getattr(c.query.meta.get("val"), "shape", None)
    if shape is None or len(shape) < 2 or not symbolic(shape[-1]) or symbolic(shape[-2]):
        return False
    head_dim = shape[-1].node.expr
    for node in c.query.graph.nodes:
        dims = getattr(node.meta.get("val"), "shape", ()) if node.op == "placeholder" else ()
        if len(dims) >= 3 and any(symbolic(d) and d.node.expr == head_dim for d in dims[1:-1]):
            return True
    return False


def _check_shapes(c: Candidate, q, k, v, out) -> Union[str, tuple[int, int]]:
    """(H, Hkv) when q, k, v and the output line up as one attention; else why not."""
    if c.rank == 4:
        b, h, nq, d = q.shape
        bk, hkv, nk, dk = k.shape
        if bk != b or dk != d or tuple(v.shape[:3]) != (bk, hkv, nk):
            return (f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not line up as "
                    "[B, H, Nq, D], [B, Hkv, Nk, D], [B, Hkv, Nk, Dv]")
        # one key/value head broadcast over all query heads is multi-query attention (Falcon-7B
        # passes k, v as [B, 1, N, D]; matmul and SDPA broadcast the head axis)
        broadcast_mqa = hkv == 1 and c.groups == 1
        if h % hkv != 0 or (hkv != h and c.groups == 1 and not c.enable_gqa and not broadcast_mqa):
            return f"{h} query heads cannot share {hkv} key/value heads"
        if c.groups > 1 and hkv * c.groups != h:
            return f"{hkv} key/value heads repeated {c.groups}x do not give {h} query heads"
        if tuple(out.shape) != (b, h, nq, v.shape[-1]):
            return f"output {list(out.shape)} is not [B, H, Nq, Dv] = {[b, h, nq, v.shape[-1]]}"
        return h, hkv
    g, nq, d = q.shape
    if tuple(k.shape[:1]) != (g,) or k.shape[-1] != d or tuple(v.shape[:2]) != (g, k.shape[1]):
        return f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not line up as [B*H, N, D]"
    return 1, 1


def _scale(c: Candidate, values: dict, head_dim: int) -> float:
    """The scale the candidate applies to q·kᵀ, as a number on the example run."""
    if c.is_sdpa:
        s = c.sdpa_scale
        if s is None:
            return 1.0 / math.sqrt(head_dim)
        if isinstance(s, fx.Node):
            got = values[s.name]
            return float(got.item() if isinstance(got, torch.Tensor) else got)
        return float(s)
    scale = 1.0
    for f in c.factors():
        scale *= f.resolve(values)
    return scale


def _mismatch(out: torch.Tensor, ref: torch.Tensor) -> Optional[str]:
    """Why the recorded output `out` differs from the replay `ref` (None: within tolerance)."""
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {list(out.shape)} vs {list(ref.shape)}"
    rtol, atol = _TOLERANCE.get(out.dtype, (1e-3, 1e-3))
    o = out.to(ref.dtype)
    # A query whose every key is masked (a left-padded row's pad positions) has no defined output:
    # SDPA gives NaN there and the replay 0, or the other way round. Such rows say nothing either
    # way; compare the rest.
    blind = o.isnan().all(dim=-1, keepdim=True) | ref.isnan().all(dim=-1, keepdim=True)
    if bool(blind.all()):
        return "no query row sees a key on the example inputs"
    if bool(blind.any()):
        o, ref = o.masked_fill(blind, 0.0), ref.masked_fill(blind, 0.0)
    mag = float(ref[ref.isfinite()].abs().max()) if bool(ref.isfinite().any()) else 1.0
    if torch.allclose(o, ref, rtol=rtol, atol=atol * max(1.0, mag), equal_nan=True):
        return None
    diff = (o - ref).abs().nan_to_num(nan=float("inf"))
    return f"max abs difference {float(diff.max()):.3g}"
