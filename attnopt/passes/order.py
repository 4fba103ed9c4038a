"""Graph analyses on the captured fx graph with networkx: ordering sites along the residual stream.

A site's layer is the longest chain of earlier sites feeding it: build the DAG of sites (edge a -> b
when a's output is an ancestor of one of b's inputs) and take the longest path ending at each.
Reachability is computed in one topological sweep with per-node bitsets of the sites that reach
it, so the cost is O(nodes + edges), not O(nodes²).
"""

from __future__ import annotations

import networkx as nx
import torch.fx as fx


def site_dag(graph: fx.Graph, outputs: list[str], inputs: list[list[str]]) -> nx.DiGraph:
    """DAG over site indices; `outputs[i]` is site i's output node, `inputs[i]` the nodes it reads."""
    bit_of = {}
    for i, name in enumerate(outputs):
        bit_of[name] = bit_of.get(name, 0) | (1 << i)
    reach: dict[str, int] = {}
    for node in graph.nodes:  # fx graphs are stored in topological order
        bits = 0
        for inp in node.all_input_nodes:
            bits |= reach.get(inp.name, 0)
        bits |= bit_of.get(node.name, 0)
        if bits:
            reach[node.name] = bits
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(outputs)))
    for j, names in enumerate(inputs):
        feeding = 0
        for name in names:
            feeding |= reach.get(name, 0)
        feeding &= ~(1 << j)
        i = 0
        while feeding:
            if feeding & 1:
                dag.add_edge(i, j)
            feeding >>= 1
            i += 1
    return dag


def longest_chain_depths(dag: nx.DiGraph) -> dict[int, int]:
    """For each site, the number of sites on the longest chain of earlier sites feeding it."""
    depth: dict[int, int] = {}
    for n in nx.topological_sort(dag):
        preds = list(dag.predecessors(n))
        depth[n] = max((depth[p] + 1 for p in preds), default=0)
    return depth


def site_layers(graph: fx.Graph, outputs: list[str], inputs: list[list[str]]) -> list[int]:
    dag = site_dag(graph, outputs, inputs)
    depth = longest_chain_depths(dag)
    return [depth[i] for i in range(len(outputs))]
