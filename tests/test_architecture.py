"""The tree's rules (README "Architecture"), checked on the source: no import cycle, the
runtime never imports the tools or the offline code, no module past 650 lines."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "streamrec"
RUNTIME = ("streamrec.schemas", "streamrec.models", "streamrec.cache", "streamrec.pipeline")
RUNTIME += ("streamrec.worker",)
MAX_LINES = 650


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Every streamrec module each module imports, at any depth of its code."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_no_import_cycles() -> None:
    graph = _imports(_modules())
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for target in sorted(graph[node]):
            visit(target, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


def test_the_runtime_imports_neither_tools_nor_offline_code() -> None:
    graph = _imports(_modules())
    bad = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith(RUNTIME)
        for target in targets
        if target.startswith(("streamrec.tools", "streamrec.offline"))
    }
    assert not bad, sorted(bad)


def test_no_module_is_longer_than_650_lines() -> None:
    long = {
        name: n
        for name, path in _modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_worker_app_stays_a_composition_root() -> None:
    """Issue 16: wiring plus loops; protocols live in their own classes."""
    lines = len(_modules()["streamrec.worker.app"].read_text().splitlines())
    assert lines <= 350, lines
