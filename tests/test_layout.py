"""The node pack's modules stay readable at once and import one another without a cycle (a cycle
works only while every name is looked up late, and breaks on the first import moved up); a kernel
file uses another's public names only (what one shares is its interface, not its internals)."""
from __future__ import annotations

import ast
from pathlib import Path

NODES = Path(__file__).resolve().parents[1] / "nodes"
KERNELS = NODES.parent / "kernels"
MAX_LINES = 300


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (relative imports, anywhere in the file: a function's
    import closes a cycle as surely as a module-level one once it runs)."""
    modules = {p.stem for p in package.glob("*.py")}
    graph = {}
    for name in modules:
        edges = set()
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            if node.module is None:  # from . import a, b: the package's submodules a and b
                edges |= {alias.name for alias in node.names if alias.name in modules}
            elif node.module.split(".")[0] in modules:
                edges.add(node.module.split(".")[0])
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None: a depth-first walk that
    meets a module still on its path."""
    done: set[str] = set()

    def visit(path):
        for other in sorted(graph[path[-1]]):
            if other in path:
                return path[path.index(other):] + [other]
            if other not in done:
                cycle = visit(path + [other])
                if cycle:
                    return cycle
        done.add(path[-1])
        return None

    for name in sorted(graph):
        cycle = None if name in done else visit([name])
        if cycle:
            return cycle
    return None


def test_no_nodes_module_is_over_300_lines():
    lengths = {p.name: len(p.read_text().splitlines()) for p in NODES.glob("*.py")}
    assert len(lengths) > 1
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_the_nodes_modules_import_without_a_cycle():
    graph = import_graph(NODES)
    assert graph["samplers"] >= {"engines", "patching", "prompts", "settings"}  # the graph sees the imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_a_cycle_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "c.py").write_text("from .a import g\nfrom ..fastar import x\n")
    (tmp_path / "d.py").write_text("from .a import g\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    (tmp_path / "c.py").write_text("from ..fastar import x\n")
    assert find_cycle(import_graph(tmp_path)) is None


def private_imports(package: Path) -> dict[str, list[str]]:
    """Module -> the underscored names it imports from the package's other modules (anywhere in the file)."""
    found = {}
    for path in package.glob("*.py"):
        names = [f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
                 for alias in node.names if alias.name.startswith("_")]
        if names:
            found[path.stem] = names
    return found


def test_no_kernel_file_imports_another_ones_private_names(tmp_path):
    assert private_imports(KERNELS) == {}
    (tmp_path / "a.py").write_text("def f():\n    from .b import _g, h\n")
    assert private_imports(tmp_path) == {"a": ["b._g"]}
