"""The pack's modules stay readable at once and import one another without a cycle (a cycle works only
while every name is looked up late, and breaks on the first import moved up); the layers import down
only (the library never the nodes, the benchmarks or the test helpers; the kernels never the library);
a kernel file uses another's public names only (what one shares is its interface, not its internals)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES, KERNELS, FASTAR = ROOT / "nodes", ROOT / "kernels", ROOT / "fastar"
MAX_LINES = {NODES: 300, FASTAR: 400}
# what each layer must never import: the library stands beneath the nodes, benchmarks and test helpers, the
# kernels beneath the library
BELOW = {FASTAR: {"nodes", "bench", "testing"}, KERNELS: {"fastar", "nodes", "bench", "testing"}}


def module_name(package: Path, path: Path) -> str:
    """A file's module within ``package``: ``rollout``, ``models.wan``; a subpackage's ``__init__`` is the
    subpackage (``models``), the package's own ``__init__``."""
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def imports(package: Path) -> dict[str, set[str]]:
    """Module -> what it imports, anywhere in the file (a function's import, or one under ``if
    TYPE_CHECKING:``, closes a cycle as surely as a module-level one once it runs), as dotted paths from
    the package's parent: ``fastar.models.wan``, ``kernels.rows``; ``from X import a`` counts ``X.a``
    where ``a`` is a module file, else ``X``."""
    top = package.parent
    found = {}
    for path in sorted(package.rglob("*.py")):
        here = list(path.relative_to(top).parts[:-1])  # the file's package, from the top
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here[:len(here) - (node.level - 1)] if node.level - 1 <= len(here) else []
                base = base + (node.module.split(".") if node.module else [])
                for alias in node.names:
                    sub = base + [alias.name]
                    is_module = (top.joinpath(*sub).with_suffix(".py").is_file()
                                 or top.joinpath(*sub, "__init__.py").is_file())
                    targets.add(".".join(sub if is_module else base))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):  # absolute: only the repository's own count
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    parts = name.split(".")
                    if parts[0] == "comfyui_fastar":
                        targets.add(".".join(parts[1:]))
        found[module_name(package, path)] = targets
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (subpackages' included, by ``module_name``)."""
    prefix = package.name + "."
    found = imports(package)
    graph = {}
    for name, targets in found.items():
        edges = set()
        for target in targets:
            if target == package.name:
                edges.add("__init__")
            elif target.startswith(prefix):
                parts = target[len(prefix):].split(".")
                while parts and ".".join(parts) not in found:  # a name inside a module: the module
                    parts.pop()
                edges.add(".".join(parts) if parts else "__init__")
        graph[name] = edges - {name}
    return graph


def back_arrows(package: Path, below: set[str]) -> dict[str, set[str]]:
    """Module -> what it imports of the layers ``below`` must never be imported from ``package``."""
    found = {name: {t for t in targets if t.split(".")[0] in below} for name, targets in imports(package).items()}
    return {name: targets for name, targets in found.items() if targets}


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


def lengths_over(package: Path, limit: int) -> dict[str, int]:
    lengths = {module_name(package, p): len(p.read_text().splitlines()) for p in package.rglob("*.py")}
    assert len(lengths) > 1
    return {name: n for name, n in lengths.items() if n > limit}


def test_no_nodes_module_is_over_300_lines():
    assert lengths_over(NODES, MAX_LINES[NODES]) == {}


def test_no_library_module_is_over_400_lines():
    assert lengths_over(FASTAR, MAX_LINES[FASTAR]) == {}


def test_the_nodes_modules_import_without_a_cycle():
    graph = import_graph(NODES)
    assert graph["samplers"] >= {"engines", "patching", "prompts", "settings"}  # the graph sees the imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_library_imports_without_a_cycle():
    graph = import_graph(FASTAR)
    # the graph sees subpackages, imports up out of one, and function-level imports
    assert {"models.wan", "models.matrix_game", "models"} <= set(graph)
    assert "errors" in graph["models.wan"] and "rollout" in graph["__init__"]
    assert "models" in graph["world_demo"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_layers_import_down_only():
    assert back_arrows(FASTAR, BELOW[FASTAR]) == {}
    assert back_arrows(KERNELS, BELOW[KERNELS]) == {}
    assert "kernels.rows" in imports(FASTAR)["parallel"]  # the library's imports of kernels are seen


def test_a_cycle_is_found(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "c.py").write_text("from .a import g\nfrom ..fastar import x\n")
    (tmp_path / "d.py").write_text("from .a import g\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert back_arrows(tmp_path, {"fastar"}) == {"c": {"fastar"}}
    (tmp_path / "c.py").write_text("from ..fastar import x\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_a_cycle_through_a_subpackage_and_a_typing_import_is_found(tmp_path):
    """``from ..x import``, ``from .sub.y import``, ``from . import sub`` and an import under ``if
    TYPE_CHECKING:`` are each an edge."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("from .sub.y import f\n")
    (tmp_path / "sub" / "__init__.py").write_text("from .y import f\n")
    (tmp_path / "sub" / "y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from ..b import B\n")
    (tmp_path / "b.py").write_text("def g():\n    from . import a\n")
    (tmp_path / "c.py").write_text("from . import sub\nfrom .a import f\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"sub.y"}, "sub": {"sub.y"}, "sub.y": {"b"}, "b": {"a"}, "c": {"sub", "a"}}
    assert find_cycle(graph) == ["a", "sub.y", "b", "a"]


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
