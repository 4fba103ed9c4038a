"""Splice pass (graph path): replace each accepted site in a captured FX graph by a call to its module.

The transformers path installs the same site modules on the attention modules instead
(`attnopt.hf.install`). A reuse site's module is also handed its anchor's q and k nodes (`anchor=`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Splice:
    """The rewritten graph module and what the splice did."""

    graph_module: torch.fx.GraphModule
    counts: dict = field(default_factory=dict)  # "spliced" sites, "removed_nodes"


def splice_graph(graph_module: torch.fx.GraphModule, sites: list, modules: dict) -> Splice:
    """Replace each site whose id is in `modules` (site id -> SiteModule) in place; dead chains removed."""
    by_id = {s.id: s for s in sites}
    nodes = {n.name: n for n in graph_module.graph.nodes}
    graph = graph_module.graph
    before = len(graph.nodes)
    for i, (site_id, module) in enumerate(modules.items()):
        sn = by_id[site_id].nodes
        out = nodes[sn.output]
        mask = nodes[sn.mask] if sn.mask else None
        name = f"attnopt_site_{i}"
        graph_module.add_submodule(name, module)
        with graph.inserting_before(out):
            q, k = _query_key(graph, nodes, by_id[site_id])
            extra = {"anchor": _query_key(graph, nodes, by_id[module.anchor_id])} if module.uses_anchor_qk else {}
            new = graph.call_module(name, (q, k, nodes[sn.value], mask), extra)
        new.meta.update({key: val for key, val in out.meta.items() if key in ("nn_module_stack", "stack_trace", "val")})
        out.replace_all_uses_with(new)
    # The replaced chains are dead now, but FX keeps impure-looking nodes: SDPA is tagged
    # nondeterministic_seeded (for its dropout), so the original attention would still run next
    # to the rewrite. A spliced site has dropout 0, so its own chain nodes are pure here.
    replaced = {name for site_id in modules for name in by_id[site_id].nodes.members} | {
        by_id[site_id].nodes.output for site_id in modules}
    graph.eliminate_dead_code(is_impure_node=lambda n: n.name not in replaced and n.is_impure())
    graph.lint()
    graph_module.recompile()
    return Splice(graph_module, {"spliced": len(modules), "removed_nodes": before - len(graph.nodes) + len(modules)})


def _query_key(graph: torch.fx.Graph, nodes: dict, site) -> tuple:
    """A site's q and k nodes, k in [.., N, D] (a chain that multiplies by kᵀ keeps k transposed)."""
    q, k = nodes[site.nodes.query], nodes[site.nodes.key]
    if site.nodes.key_is_transposed:
        k = graph.call_function(torch.ops.aten.transpose.int, (k, -2, -1))
    return q, k
