"""Imports in `primerl/` run one way: down the layers of docs/architecture.md, with no cycles (read from the source, so
imports inside functions and under TYPE_CHECKING count too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "primerl"

# Lowest first. A module may import modules of its own layer or below. Each group's `config.py` is a leaf dataclass
# (it imports only utils), so `config/` composes them and every layer above may read any of them.
LAYERS = [
    ("utils",),
    ("*.config",),
    ("config",),
    ("transport", "metrics"),
    ("model", "envs"),
    ("trainer", "inference"),
    ("orchestrator", "sft", "eval", "ledger", "plot"),
    ("launch", "train", "compare", "replay", "rerun", "cli"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    relative = module.removeprefix("primerl.")
    if relative.endswith(".config") and relative != "config":
        return 1
    for index, names in enumerate(LAYERS):
        if any(relative == name or relative.startswith(f"{name}.") for name in names):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/architecture.md")


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.name != "__init__.py"}
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("primerl."):
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    imported.add(candidate if candidate in modules else node.module)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("primerl.")}
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def test_imports_run_down_the_layers():
    graph = import_graph()
    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if layer(b) > layer(a)
    ]
    assert not upward, "\n".join(upward)


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    cycles = sorted(f"{a} -> {b} -> ... -> {a}" for a in graph for b in graph[a] if a in reachable(b))
    assert not cycles, "\n".join(cycles)
    assert len(graph) > 50  # the walk found the package
