"""Imports in `primerl/` run one way: down the layers of docs/architecture.md, by package and by module, with no
cycles (read from the source, so imports inside functions and under TYPE_CHECKING count too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "primerl"

# Lowest first: a package (or top-level module) may import its own layer or below. The entry points are the top
# layer: the top-level commands, the processes' commands in `entrypoints/`, `primerl/__main__.py` and the driver.
LAYERS = [
    ("utils",),
    ("config",),
    ("transport", "metrics"),
    ("model", "envs", "plot"),
    ("trainer", "inference", "ledger"),
    ("sft", "orchestrator"),
    ("launch",),
    ("app", "recorded", "train", "compare", "replay", "rerun", "cli", "entrypoints", "__main__"),
]
ENTRY = len(LAYERS) - 1
ENTRY_MODULES = ("launch.driver",)
# what only the entry points may import: the Hydra app (one-line config errors, `hydra_app`)
ENTRY_ONLY = ("primerl.app",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    return module.removeprefix("primerl.").split(".")[0]


def layer(module: str) -> int:
    relative = module.removeprefix("primerl.")
    if relative in ENTRY_MODULES:
        return ENTRY
    for index, names in enumerate(LAYERS):
        if package_of(module) in names:
            return index
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and to docs/architecture.md")


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


def test_imports_run_down_the_layers_by_module_and_by_package():
    """Module by module; and package by package (folder by folder, as a reader meets them): no module of a package
    imports a package above it, the driver in `launch/` aside (an entry point that imports only `launch/` and below)."""
    graph = import_graph()
    upward = [
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if layer(b) > layer(a)
    ]
    assert not upward, "\n".join(upward)
    packages: dict[str, set[str]] = {}
    for a, imported in graph.items():
        packages.setdefault(package_of(a), set()).update(package_of(b) for b in imported)
    for package, imported in packages.items():
        for other in imported - {package}:
            assert layer(f"primerl.{other}") <= layer(f"primerl.{package}"), f"package {package} imports {other}"


def test_only_entry_points_import_the_hydra_app():
    graph = import_graph()
    wrong = sorted(a for a, imported in graph.items() if layer(a) != ENTRY and imported & set(ENTRY_ONLY))
    assert not wrong, wrong


def test_library_modules_take_config_sections_not_the_whole_run():
    """Below `launch/`, no module outside `config/` imports the root schema: a function takes the sections it uses, and
    where a module reads many, it names them in a `*Sections` protocol (config/'s own checks across sections,
    `validate`, `algorithm` and `serving`, take the whole config by design)."""
    graph = import_graph()
    launch = layer("primerl.launch")
    takers = sorted(
        a
        for a, imported in graph.items()
        if package_of(a) != "config" and layer(a) < launch and "primerl.config.schema" in imported
    )
    assert not takers, takers


def section_protocols() -> dict[str, tuple[Path, str]]:
    """Every `class <Name>Sections(Protocol)` in primerl: name -> (file, module)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Sections"):
                assert [ast.unparse(b) for b in node.bases] == ["Protocol"], f"{path}: {node.name} is not a Protocol"
                found[node.name] = (path, module_name(path))
    return found


def test_section_protocols_are_sections_of_the_run_config_and_name_all_that_is_read():
    """Each `*Sections` protocol lists fields of `RunConfig` with the same types (so the composed config is what the
    entry points pass), and every `cfg.<section>` a function annotated with it reads is listed."""
    import importlib
    import typing

    from primerl.config.schema import RunConfig

    run = typing.get_type_hints(RunConfig)
    protocols = section_protocols()
    assert {"ServingSections", "SftSections", "OrchestratorSections", "RecordSections"} <= set(protocols)
    declared = {}
    for name, (_, module) in protocols.items():
        hints = typing.get_type_hints(getattr(importlib.import_module(module), name))
        wrong = {key: hint for key, hint in hints.items() if run.get(key) != hint}
        assert hints and not wrong, f"{name}: not fields of RunConfig with these types: {wrong}"
        declared[name] = set(hints)
    unlisted = []
    for path in PACKAGE.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for arg in fn.args.args:
                protocol = ast.unparse(arg.annotation).strip("\"'") if arg.annotation else ""
                if protocol not in declared:
                    continue
                unlisted += [
                    f"{path.name}:{node.lineno} {arg.arg}.{node.attr} (not in {protocol})"
                    for node in ast.walk(fn)
                    if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == arg.arg
                    and node.attr not in declared[protocol]
                ]
    assert not unlisted, unlisted


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
