"""Detect attention sites in a captured graph: match structurally, check numerically, describe.

    detect(captured) -> Detection(sites, near_misses, capture, notes, counts)

Every softmax / SDPA node is an anchor. A structural match (matchers.py) becomes a site only
after the graph has been run once on the example inputs and the matched pieces, pushed through
softmax(scale · q kᵀ + mask) v, reproduce the recorded output (numeric_check.py). Anything that fails is a NearMiss
with a reason. Attention inside a higher-order op's submodule (export's no_grad / autocast /
checkpoint regions) is matched too and reported as a near miss: the splice step cannot reach it.

Letters: B batch, H query heads, Hkv key/value heads, Nq/Nk query/key length, D/Dv head dims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections import defaultdict
from typing import Optional

import torch
import torch.fx as fx

from attnopt.ir.detection import Detection
from attnopt.ir.site import AttentionSite, Dim, MaskInfo, NearMiss, SiteNodes
from attnopt.passes import canonicalize as cz
from attnopt.passes.candidate import Candidate, candidate_miss
from attnopt.passes.capture import CapturedGraph, record_values
from attnopt.passes.mask_lengths import reread_masks
from attnopt.passes.mask_proof import StructureOracle
from attnopt.passes.matchers import ExplicitChainMatcher, LogSoftmaxMatcher, SdpaMatcher
from attnopt.passes.numeric_check import CheckResult, check
from attnopt.passes.order import site_layers


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

    checked: list[tuple[Candidate, CheckResult]] = []
    if candidates:
        with _single_thread():
            checked, failed, reread = _check_all(captured, candidates)
        misses += failed
        counts.update({f"masks_{k}": v for k, v in reread.items()})
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
                return candidate_miss(c, f"{cz.op_name(user)} ({user.name}) writes in place into {node.name}, "
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


# ---- numeric check: run the graph once, then `numeric_check.check` each candidate -------------

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


def _check_all(captured: CapturedGraph, candidates: list[Candidate]) -> tuple[list, list[NearMiss], dict]:
    """Run the graph once, then check every candidate; returns (checked, near misses, mask re-read counts)."""
    try:
        values = record_values(captured, _wanted(candidates))
    except Exception as exc:  # the numeric check is mandatory: no run, no site
        msg = f"could not run the captured graph on the example inputs to check it: {type(exc).__name__}: {exc}"
        return [], [candidate_miss(c, msg, "numeric") for c in candidates], {}
    oracle = StructureOracle(captured.graph_module.graph)
    checked, misses = [], []
    _check_each(candidates, values, oracle, checked, misses)
    # masks built from positions, read again at a longer length where their pattern may differ
    checked, reread = reread_masks(captured, checked, oracle, _wanted)
    return checked, misses, reread


def _check_each(candidates: list, values: dict, oracle: StructureOracle, checked: list, misses: list) -> None:
    """`check` every candidate into `checked` [(candidate, CheckResult)] or `misses`."""
    for c in candidates:
        try:
            got = check(c, values, oracle)
        except (RuntimeError, ValueError, IndexError, KeyError) as exc:
            # a chain whose pieces do not even combine (shapes that broadcast nowhere) is no site;
            # one odd candidate must not abort detection of the others
            got = candidate_miss(c, "replaying the matched chain on the example inputs failed "
                                     f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                     "not rewriting it", "numeric")
        if isinstance(got, NearMiss):
            misses.append(got)
        else:
            checked.append((c, got))


def _wanted(candidates: list[Candidate]) -> set[str]:
    """The names of every node whose value the numeric check reads."""
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


def _build_sites(gm: fx.GraphModule, checked: list[tuple[Candidate, CheckResult]]) -> list[AttentionSite]:
    if not checked:
        return []
    outputs = [c.output.name for c, _ in checked]
    inputs = [[c.query.name, c.key.name, c.value.name] + ([info.mask.node] if info.mask.node else [])
              for c, info in checked]
    layers = site_layers(gm.graph, outputs, inputs)
    per_module: dict[str, int] = defaultdict(int)
    sites = []
    for (c, info), layer in zip(checked, layers):
        qs, ks, vs = cz.shape(c.query), cz.shape(c.key), cz.shape(c.value)
        kd = (ks[-2], ks[-1]) if c.key_is_transposed else (ks[-1], ks[-2])  # (D, Nk)
        if c.rank == 4:
            batch, heads, kv_heads = _dim(qs[0]), int(info.heads), int(info.kv_heads)
            if c.kv_repeated > 1 and kv_heads == heads and heads % c.kv_repeated == 0:
                kv_heads //= c.kv_repeated
        else:
            batch, heads = _split_batch_heads(c)
            kv_heads = heads // _rank3_kv_repeat(c, heads) if heads > 1 else heads
        k = per_module[c.module_path]
        per_module[c.module_path] += 1
        site_id = f"{c.module_path or 'graph'}#{k}"
        mask: MaskInfo = info.mask
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
            head_dim=info.head_dim,
            v_head_dim=info.v_head_dim,
            scale=float(info.scale),
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
            folded_scale=float(info.folded_scale),
        ))
    return sites
