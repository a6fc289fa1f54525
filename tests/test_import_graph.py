"""The import graph runs one way, with no loops:
protos < engine contracts < runtime < engine on the runtime < actors < cluster < client.

`eyas` modules outside `eyas.runtime` are split by what they reach: those that import the runtime
(directly or not: the target adapter, the engine, the proposer) sit above it, the rest (trees,
verification, publish, rounds, manifest, wire codec, traces) below it, and the contracts named in
DESIGN must stay there. Read from the sources (every import statement, those inside functions
included), so a loop cannot hide behind a lazy import. The client that applications embed loads
neither torch, transformers, Ray nor the service floors.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Bottom up. A module belongs to the floor of the longest prefix it starts with; a plain `eyas`
# module is an engine contract unless it reaches the runtime.
FLOORS = ("eyas.v1", "eyas", "eyas.runtime", "eyas on the runtime", "eyas.actors", "eyas.cluster", "eyas.client")
ON_RUNTIME = FLOORS.index("eyas on the runtime")
CONTRACTS = ("eyas.tree", "eyas.verify", "eyas.publish", "eyas.rounds", "eyas.manifest", "eyas.request", "eyas.wire", "eyas.rpc")


def reaches_runtime(module: str, edges: dict[str, set[str]]) -> bool:
    seen, todo = set(), [module]
    while todo:
        for nxt in edges[todo.pop()] - seen:
            if nxt == "eyas.runtime" or nxt.startswith("eyas.runtime."):
                return True
            seen.add(nxt)
            todo.append(nxt)
    return False


def floor_of(module: str, edges: dict[str, set[str]] | None = None) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    if best == "eyas" and edges is not None and reaches_runtime(module, edges):
        return ON_RUNTIME
    return FLOORS.index(best)


def modules() -> dict[str, Path]:
    """Every eyas module and its source file, from the package-dir mapping in pyproject.toml."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in mapping.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            found.setdefault(name, path)  # eyas/ also walks into nothing mapped elsewhere
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The eyas modules `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_floors_only_import_downward():
    edges = graph()
    floor = {name: floor_of(name, edges) for name in edges}
    upward = [
        f"{src} ({FLOORS[floor[src]]}) -> {dst} ({FLOORS[floor[dst]]})"
        for src, targets in edges.items()
        for dst in targets
        if floor[dst] > floor[src]
    ]
    assert not upward, "imports that climb a floor:\n" + "\n".join(sorted(upward))


def test_the_trainer_does_not_import_the_demo_package():
    edges = graph()
    climbing = sorted(f"{src} -> {dst}" for src, targets in edges.items() if src.startswith("eyas.train")
                      for dst in targets if dst.startswith("eyas.demo"))
    assert climbing == [], "the training code imports the demo package:\n" + "\n".join(climbing)


def test_the_engine_contracts_stay_below_the_runtime():
    edges = graph()
    assert [name for name in CONTRACTS if floor_of(name, edges) != FLOORS.index("eyas")] == []


def test_no_import_loops():
    edges = graph()
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    # A package's __init__ re-exporting its submodules is not a loop when the submodules do not import the package.
    assert not loops, f"import loops: {loops}"


def test_the_graph_sees_the_floors():
    edges = graph()
    assert "eyas.cluster.pools" in edges["eyas.cluster.service"]
    assert "eyas.actors.coordinator" in edges["eyas.cluster.service"]
    assert floor_of("eyas.runtime.kv") == FLOORS.index("eyas.runtime")
    assert floor_of("eyas.v1.round_pb2") == 0 and floor_of("eyas.tree") == 1


def test_the_client_imports_no_heavy_library():
    probe = (
        "import sys; from eyas.client import Client; "
        "print(' '.join(m for m in ('torch', 'transformers', 'ray', 'eyas.actors', 'eyas.cluster', 'eyas.engine') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == []
