"""The package's imports run only down the layers, and no two modules import each other (even lazily,
even for type hints): the folder tree is the architecture (docs/structure.md)."""
from __future__ import annotations

import ast
from pathlib import Path

import csmserve

ROOT = Path(csmserve.__file__).parent
# a module may import its own top-level part, or a part of a lower rank
RANK = {
    "config": 0, "extras": 0, "sampling": 0.5,  # records and constants every layer shares
    "prompt": 1, "audio": 1, "kernels": 1,  # text -> frames; PCM <-> containers; Triton kernels
    "models": 2,  # math only: CSM, Mimi, the reference generator, the torch sampler
    "engine": 3,  # scheduling and execution: requests in, chunks out
    "api": 4, "voices": 4,  # CSM, the one builder of requests; the voice store
    "csmserve": 4.5,  # the package's facade: `from csmserve import CSM`
    "server": 5,  # the HTTP / WebSocket edge
    "ray": 6, "integrations": 6,  # the server on Ray Serve; csmserve inside voice-agent frameworks
    "apps": 7,  # the command line, talk, the benchmarks
    "__main__": 8,  # python -m csmserve
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["csmserve", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every csmserve module `name` imports: top level, inside functions, under TYPE_CHECKING."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                out.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {t for t in out if t in mods and t != name}


def _part(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "csmserve"


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_every_part_has_a_rank():
    assert {_part(n) for n in _graph()} <= set(RANK), {_part(n) for n in _graph()} - set(RANK)


def test_imports_run_only_down_the_layers():
    up = sorted(f"{a} -> {b}" for a, targets in _graph().items() for b in targets
                if _part(a) != _part(b) and RANK[_part(b)] >= RANK[_part(a)])
    assert not up, up


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_checks_see_an_upward_import(tmp_path):
    """The walker resolves relative, lazy and TYPE_CHECKING imports (else the checks above could not fail)."""
    src = tmp_path / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..api import CSM\n"
                   "def f():\n    from csmserve.server import app\n    import csmserve.engine.engine\n")
    mods = _modules()
    got = _imports("csmserve.models.mod", src, mods)
    assert got == {"csmserve.api", "csmserve.server.app", "csmserve.engine.engine"}, got
