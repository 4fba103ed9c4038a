"""attnopt/ has no import cycle, counting imports inside functions (module-level graph from the AST)."""

import ast
from pathlib import Path

import networkx as nx

PKG = Path(__file__).resolve().parents[1] / "attnopt"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    g.add_edge(name, t)
    return g


def test_no_import_cycles_in_attnopt():
    g = import_graph()
    assert g.number_of_edges() > 50  # the walk found the imports
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_report_modules_import_in_one_direction():
    g = import_graph()
    assert g.has_edge("attnopt.report_html", "attnopt.report_text")
    for a, b in (("attnopt.report_text", "attnopt.report"), ("attnopt.report_html", "attnopt.report")):
        assert not nx.has_path(g, a, b), f"{a} reaches {b}"
