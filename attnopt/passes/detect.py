"""Detect attention sites in a captured graph: match structurally, check numerically, describe.

    detect(captured) -> Detection(sites, near_misses, capture, notes, counts)

Every softmax / SDPA node is an anchor. A structural match (matchers.py) becomes a site only
after the graph has been run once on the example inputs and the matched pieces, pushed through
softmax(scale · q kᵀ + mask) v, reproduce the recorded output. Anything that fails is a NearMiss
with a reason. Attention inside a higher-order op's submodule (export's no_grad / autocast /
checkpoint regions) is matched too and reported as a near miss: the splice step cannot reach it.

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D/Dv head dims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import time
from collections import defaultdict
from typing import Optional, Union

import torch
import torch.fx as fx

from attnopt.ir.detection import Detection
from attnopt.ir.masks import ADDITIVE_HIDE_BELOW
from attnopt.ir.site import AttentionSite, Dim, MaskInfo, NearMiss, SiteNodes
from attnopt.passes import canonicalize as cz
from attnopt.passes.capture import CapturedGraph, record_values
from attnopt.passes.mask_proof import (
    KeepPattern,
    StructureOracle,
    as_arbitrary,
    classify_bias,
    classify_keep,
)
from attnopt.passes.matchers import (
    Candidate,
    ExplicitChainMatcher,
    LogSoftmaxMatcher,
    SdpaMatcher,
)
from attnopt.passes.order import site_layers

_TOLERANCE = {  # (rtol, atol relative to the output's magnitude) per dtype
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def detect(captured: CapturedGraph) -> Detection:
    """Find every attention site of `captured.graph_module`; report the rest as near misses."""
    t0 = time.perf_counter()
    gm = captured.graph_module
    counts = {"softmax": 0, "sdpa": 0, "log_softmax": 0, "inside_higher_order_op": 0}
    candidates, misses = _match_graph(gm.graph, counts)
    misses += _inside_higher_order_ops(gm, counts)
    mutated = {id(c): _mutated_outside_chain(c) for c in candidates}
    misses += [m for m in mutated.values() if m is not None]
    candidates = [c for c in candidates if mutated[id(c)] is None]
    t_match = time.perf_counter()

    checked: list[tuple[Candidate, dict]] = []
    if candidates:
        with _single_thread():
            checked, failed = _check_all(captured, candidates)
        misses += failed
    t_check = time.perf_counter()

    sites = _build_sites(gm, checked)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    misses.sort(key=lambda m: order.get(m.node, 0))
    counts.update(
        sites=len(sites),
        near_misses=len(misses),
        seconds_match=round(t_match - t0, 4),
        seconds_check=round(t_check - t_match, 4),
        seconds_total=round(time.perf_counter() - t0, 4),
    )
    return Detection(sites, misses, captured.method, list(captured.notes), counts)


def detect_all(captures: list, method: str, seconds_capture: float = 0.0) -> Detection:
    """Detection over every graph of one capture (Dynamo may split a model into several), merged."""
    t0 = time.perf_counter()
    found = Detection(capture=method, notes=[n for c in captures for n in c.notes])
    counts: dict = {"softmax": 0, "sdpa": 0, "log_softmax": 0, "inside_higher_order_op": 0}
    for i, cap in enumerate(captures):
        result = detect(cap)
        sites = result.sites
        if len(captures) > 1:
            # Dynamo split the model: its graphs run one after another, so a later graph's sites
            # sit deeper along the residual stream; ids must stay unique across graphs
            taken = {s.id for s in found.sites}
            offset = max((s.layer for s in found.sites), default=-1) + 1
            sites = [dataclasses.replace(s, layer=s.layer + offset, id=s.id if s.id not in taken else f"{s.id}@graph{i}")
                     for s in sites]
        found.sites += sites
        found.near_misses += result.near_misses
        for key in counts:
            counts[key] += result.counts.get(key, 0)
    counts.update(sites=len(found.sites), near_misses=len(found.near_misses), method=method,
                  dynamic=any(c.dynamic for c in captures), graphs=len(captures), notes=list(found.notes),
                  seconds_capture=round(seconds_capture, 3), seconds_detect=round(time.perf_counter() - t0, 3))
    found.counts = counts
    return found


_MATCHERS = (ExplicitChainMatcher(), SdpaMatcher(), LogSoftmaxMatcher())
_COUNT_KEY = ("softmax", "sdpa", "log_softmax")


def _match_graph(graph: fx.Graph, counts: dict) -> tuple[list[Candidate], list[NearMiss]]:
    """Run every matcher on its anchors in `graph` (structure only; the numeric check comes later)."""
    candidates: list[Candidate] = []
    misses: list[NearMiss] = []
    for node in graph.nodes:
        name = cz.op_name(node)
        if name is None:
            continue
        for matcher, key in zip(_MATCHERS, _COUNT_KEY):
            if name in matcher.anchors:
                counts[key] += 1
                got = matcher.match(node)
                if isinstance(got, Candidate):
                    candidates.append(got)
                elif got is not None:
                    misses.append(got)
                break
    return candidates, misses


def _mutated_outside_chain(c: Candidate) -> Optional[NearMiss]:
    """An in-place op outside the matched chain that writes a tensor the site reads: the chain as
    matched would not be what runs (and the recorded values would be the mutated ones)."""
    chain = {n.name for n in c.members}
    read = list(c.members) + [c.query, c.key, c.value] + [t.node for t in c.mask_terms]
    read += [c.sdpa_mask] if c.sdpa_mask is not None else []
    for node in read:
        if not isinstance(node, fx.Node):
            continue
        for user in node.users:
            schema = getattr(user.target, "_schema", None)
            if (user.name not in chain and schema is not None and schema.is_mutable and user.args
                    and user.args[0] is node):
                return _candidate_miss(c, f"{cz.op_name(user)} ({user.name}) writes in place into {node.name}, "
                                          "which the attention reads, outside the matched chain",
                                       "mutated_in_place", node=node.name, writer=user.name)
    return None


# ---- higher-order ops: export moves no_grad / autocast / checkpoint regions into submodules ------

def _higher_order_calls(gm: fx.GraphModule):
    """(call node, op name, [(submodule attribute, GraphModule)]) for each higher-order op call."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        subs = []
        for arg in list(node.args) + list(node.kwargs.values()):
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                try:
                    sub = operator.attrgetter(arg.target)(gm)
                except AttributeError:
                    continue
                if isinstance(sub, fx.GraphModule):
                    subs.append((str(arg.target), sub))
        yield node, getattr(node.target, "__name__", str(node.target)), subs


def _inside_higher_order_ops(gm: fx.GraphModule, counts: dict, outer: str = "") -> list[NearMiss]:
    """Every attention inside a higher-order op's submodule, as a near miss: the splice step cannot
    rewrite inside one yet, so such a site is kept exact -- reported, never silently dropped."""
    misses: list[NearMiss] = []
    for call, hop, subs in _higher_order_calls(gm):
        for attr, sub in subs:
            where = f"{outer}{attr}"
            inner_counts = {k: 0 for k in _COUNT_KEY}
            candidates, inner_misses = _match_graph(sub.graph, inner_counts)
            for k in _COUNT_KEY:
                counts[k] += inner_counts[k]
            counts["inside_higher_order_op"] += len(candidates)
            details = {"higher_order_op": hop, "submodule": where, "call": call.name}
            for c in candidates:
                misses.append(NearMiss(
                    node=call.name, module_path=c.module_path, code="inside_higher_order_op",
                    reason=(f"attention ({c.source}, {cz.op_name(c.anchor)} '{c.anchor.name}') runs inside the "
                            f"higher-order op '{hop}' (submodule '{where}'), which torch.export makes of "
                            "no_grad / set_grad_enabled, autocast and checkpoint regions; it is kept exact "
                            "because the splice step cannot rewrite inside a higher-order op yet"),
                    details=dict(details, inner_node=c.anchor.name)))
            for m in inner_misses:
                misses.append(dataclasses.replace(
                    m, node=call.name, reason=f"inside the higher-order op '{hop}' (submodule '{where}'): {m.reason}",
                    details=dict(m.details, **details, inner_node=m.node)))
            misses += _inside_higher_order_ops(sub, counts, outer=f"{where}.")
    return misses


# ---- numeric check ------------------------------------------------------------------------------

@contextlib.contextmanager
def _single_thread():
    """The example inputs are tiny: one thread avoids OpenMP spin-waits that cost seconds on a
    busy machine (measured 8 s -> 0.2 s for a 24-layer Llama on 2 loaded cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _check_all(captured: CapturedGraph, candidates: list[Candidate]) -> tuple[list, list[NearMiss]]:
    """Run the graph once, then check every candidate; returns (checked, near misses)."""
    try:
        values = record_values(captured, _wanted(candidates))
    except Exception as exc:  # the numeric check is mandatory: no run, no site
        msg = f"could not run the captured graph on the example inputs to check it: {type(exc).__name__}: {exc}"
        return [], [_candidate_miss(c, msg, "numeric") for c in candidates]
    oracle = StructureOracle(captured.graph_module.graph)
    checked, misses = [], []
    for c in candidates:
        try:
            got = _check(c, values, oracle)
        except (RuntimeError, ValueError, IndexError, KeyError) as exc:
            # a chain whose pieces do not even combine (shapes that broadcast nowhere) is no site;
            # one odd candidate must not abort detection of the others
            got = _candidate_miss(c, "replaying the matched chain on the example inputs failed "
                                     f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                     "not rewriting it", "numeric")
        if isinstance(got, NearMiss):
            misses.append(got)
        else:
            checked.append((c, got))
    return checked, misses


def _wanted(candidates: list[Candidate]) -> set[str]:
    names: set[str] = set()
    for c in candidates:
        names.update(n.name for n in (c.query, c.key, c.value, c.output))
        if c.sdpa_mask is not None:
            names.add(c.sdpa_mask.name)
        if isinstance(c.sdpa_scale, fx.Node):
            names.add(c.sdpa_scale.name)
        for f in c.factors() + c.folded_factors:
            if isinstance(f.value, fx.Node):
                names.add(f.value.name)
        for kind, x in c.score_steps + c.prob_steps:
            if kind == "reshape":
                names.add(x.name)
            elif kind == "term":
                names.add(x.node.name)
    return names


def _candidate_miss(c: Candidate, reason: str, code: str, **details) -> NearMiss:
    return NearMiss(node=c.anchor.name, module_path=c.module_path, reason=reason, code=code, details=details)


def _check(c: Candidate, values: dict, oracle: StructureOracle) -> Union[NearMiss, dict]:
    q, k, v, out = (values[n.name] for n in (c.query, c.key, c.value, c.output))
    if c.key_is_transposed:
        k = k.transpose(-2, -1)
    shapes = _check_shapes(c, q, k, v, out)
    if isinstance(shapes, str):
        return _candidate_miss(c, shapes, "shape")
    heads, kv_heads = shapes
    try:
        scale = _scale(c, values, q.shape[-1])
    except (TypeError, ValueError, KeyError) as exc:
        return _candidate_miss(c, f"the scale could not be read as a number: {exc}", "scale")
    work = torch.promote_types(q.dtype, torch.float32)  # fp32 reference is exact enough for the tolerances
    qf, kf, vf = q.to(work), k.to(work), v.to(work)
    if c.rank == 4 and kv_heads != heads:
        kf = kf.repeat_interleave(heads // kv_heads, dim=1)
        vf = vf.repeat_interleave(heads // kv_heads, dim=1)
    if _is_sdpa(c):
        # Query rows are independent: a long sequence is checked on a sample of them (O(rows·N)).
        rows = _sample_rows(qf.shape[-2])
        ref = _replay_sdpa(c, values, qf, kf, vf, scale, rows)
        out = out.index_select(-2, rows) if rows is not None else out
    else:
        ref = _replay_explicit(c, values, qf, kf, vf)
    if c.dropout_p == 0.0:
        bad = _mismatch(out, ref)
        if bad is not None:
            return _candidate_miss(c, "the matched chain does not compute softmax(scale·q·kᵀ + mask)·v on the "
                                      f"example inputs ({bad}); not rewriting it", "numeric")
    mask = _mask_info(c, values, oracle, qf.shape, kf.shape)
    if isinstance(mask, NearMiss):
        return mask
    # heads and head dims are model constants: report the example's value even where export kept
    # the dim symbolic (Dim.AUTO on an input tensor the model never reshapes)
    folded = 1.0
    for f in c.folded_factors:
        folded *= f.resolve(values)
    return {"scale": scale, "folded_scale": folded, "heads": heads, "kv_heads": kv_heads, "mask": mask,
            "head_dim": int(q.shape[-1]), "v_head_dim": int(v.shape[-1])}


def _is_sdpa(c: Candidate) -> bool:
    return cz.op_name(c.anchor) in cz.SDPA_OPS


def _check_shapes(c: Candidate, q, k, v, out) -> Union[str, tuple[int, int]]:
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
    if _is_sdpa(c):
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


def _replay_explicit(c: Candidate, values: dict, qf, kf, vf, zero_scores: bool = False):
    s = qf @ kf.transpose(-2, -1)
    for f in c.qk_factors:
        s = s * f.resolve(values)
    if zero_scores:
        s = torch.zeros_like(s)
    s = _apply_steps(c.score_steps, values, s)
    if zero_scores:
        return s
    p = torch.softmax(s, dim=-1)
    for _, node in c.prob_steps:
        p = p.reshape(values[node.name].shape)
    return p @ vf


def _apply_steps(steps: list, values: dict, s):
    for kind, x in steps:
        if kind == "scale":
            s = s * x.resolve(values)
        elif kind == "reshape":
            s = s.reshape(values[x.name].shape)
        else:
            t = values[x.node.name]
            if x.kind == "additive":
                s = s + (t.to(s.dtype) if t.dtype != torch.bool else t)
            elif x.kind == "masked_fill":
                s = s.masked_fill(t.bool(), x.fill)
            elif x.kind == "where_keep":
                s = torch.where(t.bool(), s, torch.tensor(x.fill, dtype=s.dtype))
            else:
                s = torch.where(t.bool(), torch.tensor(x.fill, dtype=s.dtype), s)
    return s


# Beyond this many queries the numeric replay of an SDPA site checks an evenly spaced sample.
REPLAY_ROWS = 256


def _sample_rows(nq: int) -> Optional[torch.Tensor]:
    if nq <= REPLAY_ROWS:
        return None
    return torch.linspace(0, nq - 1, REPLAY_ROWS).round().long().unique()


def _replay_sdpa(c: Candidate, values: dict, qf, kf, vf, scale: float, rows: Optional[torch.Tensor] = None):
    nq, nk = qf.shape[-2], kf.shape[-2]
    q_rows = qf if rows is None else qf.index_select(-2, rows)
    s = (q_rows @ kf.transpose(-2, -1)) * scale
    if c.sdpa_mask is not None:
        m = values[c.sdpa_mask.name]
        if rows is not None and m.dim() >= 2 and m.shape[-2] == nq:
            m = m.index_select(-2, rows)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    if c.is_causal:  # SDPA's is_causal is top-left aligned
        i = torch.arange(nq) if rows is None else rows
        keep = torch.arange(nk)[None, :] <= i[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ vf


def _mismatch(out: torch.Tensor, ref: torch.Tensor) -> Optional[str]:
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


# ---- masks --------------------------------------------------------------------------------------

def _dims_of(node: fx.Node) -> Optional[tuple]:
    s = cz.shape(node)
    return None if s is None else tuple(d if isinstance(d, int) else str(d) for d in s)


def _mask_info(c: Candidate, values: dict, oracle: StructureOracle, q_shape, k_shape) -> Union[MaskInfo, NearMiss]:
    if c.is_causal:
        return MaskInfo(form="is_causal", causal=True)
    if _is_sdpa(c):
        if c.sdpa_mask is None:
            return MaskInfo()
        m = values[c.sdpa_mask.name]
        frame = tuple(q_shape[:-1]) + (k_shape[-2],)
        m_full = _unbroadcast(m.expand(frame)) if m.dim() <= len(frame) else m
        if m.dtype == torch.bool:
            pattern = classify_keep(_as_bhqk(m_full))
            form, keep_when = "bool", "true"
        else:
            pattern = classify_bias(_as_bhqk(m_full))
            form, keep_when = "additive", "zero"
        return _finish_mask(pattern, [c.sdpa_mask], form, keep_when, oracle, c.sdpa_mask)
    terms = c.mask_terms
    if not terms:
        return MaskInfo()
    bias = _replay_explicit(c, values, torch.zeros(q_shape, dtype=torch.float64),
                            torch.zeros(k_shape, dtype=torch.float64), None, zero_scores=True)
    pattern = classify_bias(_as_bhqk(bias))
    effective = [t for t in terms if not _no_effect(t, values)]
    if len(effective) > 1:
        # several terms (MPT: ALiBi added, then a causal masked_fill) have no single node a rewrite
        # could apply: arbitrary, but which keys they hide is still read; a causal / window claim
        # must then hold for every term that hides keys (an ALiBi bias built from positions must
        # not vouch for an input mask that happens to look causal)
        hiding = [t for t in effective if _hides_keys(t, values)] or effective
        return _finish_mask(as_arbitrary(pattern), [t.node for t in hiding],
                            "+".join(t.form for t in effective), "zero", oracle, None)
    term = effective[0] if effective else terms[0]
    return _finish_mask(pattern, [term.node], term.form, term.keep_when, oracle, term.node)


def _unbroadcast(x: torch.Tensor) -> torch.Tensor:
    """Keep one slice of every leading dim the mask only broadcasts over (stride 0): HF's
    [B, 1, N, N] mask expanded over heads is classified once, not once per head."""
    for dim in range(x.dim() - 2):
        if x.stride(dim) == 0 and x.shape[dim] > 1:
            x = x.narrow(dim, 0, 1)
    return x


def _as_bhqk(x: torch.Tensor) -> torch.Tensor:
    """Softmax-frame tensors to [B, H, Nq, Nk] ([B*H, Nq, Nk] becomes [B*H, 1, Nq, Nk])."""
    if x.dim() == 3:
        return x.unsqueeze(1)
    if x.dim() == 2:
        return x[None, None]
    return x


def _no_effect(term, values: dict) -> bool:
    t = values[term.node.name]
    if term.kind == "additive":
        return t.dtype != torch.bool and bool((t == 0).all())
    if term.kind == "masked_fill" or term.kind == "where_drop":
        return not bool(t.bool().any())
    return bool(t.bool().all())


def _hides_keys(term, values: dict) -> bool:
    t = values[term.node.name]
    if term.kind == "additive":
        return t.dtype == torch.bool or bool((t.double() <= ADDITIVE_HIDE_BELOW).any())
    return not _no_effect(term, values)


def _finish_mask(pattern: KeepPattern, nodes: list, form: str, keep_when: str, oracle: StructureOracle,
                 mask_node: Optional[fx.Node]) -> MaskInfo:
    """MaskInfo from a numeric pattern, downgraded where the structure does not prove it.

    `nodes` are all mask tensors that fed the scores; `mask_node` the one a rewrite can apply
    (None when several terms combine and no single node holds the mask)."""
    from_positions, from_inputs = True, False
    for n in nodes:
        p, i = oracle.sources(n.name)
        from_positions &= p
        from_inputs |= i
    if (pattern.causal or pattern.window is not None) and not from_positions:
        # causal-looking on this example only: an input could carry anything next call
        pattern = KeepPattern(arbitrary=True)
    padding = pattern.padding
    if from_inputs and not pattern.arbitrary and not padding:
        # an input-driven mask that keeps everything today may pad tomorrow
        padding = True
    return MaskInfo(
        form=form,
        causal=pattern.causal,
        window=pattern.window,
        padding=padding,
        arbitrary=pattern.arbitrary,
        node=mask_node.name if isinstance(mask_node, fx.Node) else None,
        keep_when=keep_when,
        shape=_dims_of(mask_node) if isinstance(mask_node, fx.Node) else None,
    )


# ---- sites --------------------------------------------------------------------------------------

def _dim(x) -> Dim:
    return x if isinstance(x, int) else str(x)


def _split_batch_heads(c: Candidate) -> tuple[Dim, int]:
    """[B*H, N, D] operands: find the [B, H, ...] tensor they were flattened from, if any."""
    g = cz.shape(c.query)[0]
    for start, walk_back in ((c.query, True), (c.output, False)):
        cur = start
        for _ in range(6):
            if walk_back:
                if cz.op_name(cur) not in cz.RESHAPE_OPS and cz.op_name(cur) not in cz.COPY_OPS:
                    break
                cur = cur.args[0]
            else:
                users = cz.real_users(cur)
                if len(users) != 1 or cz.op_name(users[0]) not in cz.RESHAPE_OPS | cz.COPY_OPS:
                    break
                cur = users[0]
            s = cz.shape(cur)
            if s is not None and len(s) == 4 and isinstance(s[1], int) and cz.same_dim(s[0] * s[1], g):
                return _dim(s[0]), int(s[1])
    for operand in (c.key, c.value):  # q may be flattened from [B, N, H*D]; k or v may still show H
        lifted = cz.unflatten_heads(operand)
        s = cz.shape(lifted[0]) if lifted is not None else None
        if s is not None and isinstance(s[1], int):
            return _dim(s[0]), int(s[1])
    split = _head_split_view(c.query, g)
    return split if split is not None else (_dim(g), 1)


def _rank3_kv_repeat(c: Candidate, heads: int) -> int:
    """How often k and v repeat each kv head before being flattened to [B*H, N, D] (1: not seen)."""
    repeats = []
    for operand in (c.key, c.value):
        lifted = cz.unflatten_heads(operand)
        if lifted is None or cz.shape(lifted[0])[1] != heads:
            return 1
        repeats.append(cz.head_repeat(lifted[0], 1))
    r = repeats[0]
    return r if r == repeats[1] and r > 1 and heads % r == 0 else 1


def _head_split_view(query: fx.Node, g) -> Optional[tuple[Dim, int]]:
    """nn.MultiheadAttention's weights path never has a [B, H, N, D] tensor: it views the projection
    [N, B, H*D] as [N, B*H, D] and transposes. Find that view: (..., B, H*D) -> (..., B*H, D)."""
    cur = query
    for _ in range(8):
        name = cz.op_name(cur)
        if name in ("view", "reshape", "_unsafe_view"):
            si, so = cz.shape(cur.args[0]), cz.shape(cur)
            if (si is not None and so is not None and len(si) == len(so) >= 2 and isinstance(si[-1], int)
                    and isinstance(so[-1], int) and so[-1] > 0 and si[-1] % so[-1] == 0
                    and all(map(cz.same_dim, si[:-2], so[:-2])) and cz.same_dim(so[-2], g)):
                heads = si[-1] // so[-1]
                if heads > 1 and cz.same_dim(si[-2] * heads, g):
                    return _dim(si[-2]), heads
        if name not in cz.RESHAPE_OPS and name not in cz.COPY_OPS and name not in ("transpose", "permute"):
            return None
        cur = cur.args[0]
    return None


def _values_behind(node: fx.Node, limit: int = 4096) -> list[str]:
    """What `node`'s value is read from at run time: graph inputs ("input 'x'") and trainable
    parameters ("parameter 'w'"), through values and sizes alike (a scale computed from a dynamic
    dim changes with the input as much as one passed as an argument). Buffers and literals are
    constants and are not listed."""
    gm = node.graph.owning_module
    seen, stack, found = {node.name}, [node], []
    while stack and len(seen) < limit:
        cur = stack.pop()
        if cur.op == "placeholder":
            found.append(f"input '{cur.target}'")
            continue
        if cur.op == "get_attr":
            try:
                attr = operator.attrgetter(cur.target)(gm)
            except AttributeError:
                attr = None
            if isinstance(attr, torch.nn.Parameter) and attr.requires_grad:
                found.append(f"parameter '{cur.target}'")
            continue
        for inp in cur.all_input_nodes:
            if inp.name not in seen:
                seen.add(inp.name)
                stack.append(inp)
    return sorted(set(found))


def _runtime_inputs(c: Candidate) -> tuple[tuple, str]:
    """("scale",) and a reason when a factor of the scores is read from the graph's inputs or
    trainable parameters rather than being a constant of the graph."""
    nodes = [f.value for f in c.factors() + c.folded_factors if isinstance(f.value, fx.Node)]
    if isinstance(c.sdpa_scale, fx.Node):
        nodes.append(c.sdpa_scale)
    sources = sorted({src for n in nodes for src in _values_behind(n)})
    if not sources:
        return (), ""
    return ("scale",), (f"the scale is computed at run time from {', '.join(sources)}; the site's scale is "
                        "only the example's value, so the site must stay exact")


def _build_sites(gm: fx.GraphModule, checked: list[tuple[Candidate, dict]]) -> list[AttentionSite]:
    if not checked:
        return []
    outputs = [c.output.name for c, _ in checked]
    inputs = [[c.query.name, c.key.name, c.value.name] + ([info["mask"].node] if info["mask"].node else [])
              for c, info in checked]
    layers = site_layers(gm.graph, outputs, inputs)
    per_module: dict[str, int] = defaultdict(int)
    sites = []
    for (c, info), layer in zip(checked, layers):
        qs, ks, vs = cz.shape(c.query), cz.shape(c.key), cz.shape(c.value)
        kd = (ks[-2], ks[-1]) if c.key_is_transposed else (ks[-1], ks[-2])  # (D, Nk)
        if c.rank == 4:
            batch, heads, kv_heads = _dim(qs[0]), int(info["heads"]), int(info["kv_heads"])
            if c.kv_repeated > 1 and kv_heads == heads and heads % c.kv_repeated == 0:
                kv_heads //= c.kv_repeated
        else:
            batch, heads = _split_batch_heads(c)
            kv_heads = heads // _rank3_kv_repeat(c, heads) if heads > 1 else heads
        k = per_module[c.module_path]
        per_module[c.module_path] += 1
        site_id = f"{c.module_path or 'graph'}#{k}"
        mask: MaskInfo = info["mask"]
        members = tuple(n.name for n in c.members)
        runtime, runtime_reason = _runtime_inputs(c)
        sites.append(AttentionSite(
            id=site_id,
            module_path=c.module_path,
            module_type=c.module_type,
            layer=layer,
            source=c.source,
            batch=batch,
            heads=heads,
            kv_heads=kv_heads,
            q_len=_dim(qs[-2]),
            kv_len=_dim(kd[1]),
            head_dim=info["head_dim"],
            v_head_dim=info["v_head_dim"],
            scale=float(info["scale"]),
            causal=mask.causal,
            mask=mask,
            window=mask.window,
            dropout_p=float(c.dropout_p),
            dtype=str(cz.val(c.query).dtype).replace("torch.", ""),
            nodes=SiteNodes(query=c.query.name, key=c.key.name, value=c.value.name, output=c.output.name,
                            key_is_transposed=c.key_is_transposed, mask=mask.node, members=members,
                            rank=c.rank, kv_repeated=heads // kv_heads if c.rank == 3 else
                            (c.kv_repeated if kv_heads != heads else 1)),
            spelling=tuple(c.spelling) + (("mask:" + mask.form,) if mask.form != "none" else ()),
            runtime_inputs=runtime,
            runtime_reason=runtime_reason,
            folded_scale=float(info["folded_scale"]),
        ))
    return sites
