"""The package layering of docs/architecture.md, read from the source: lower layers never import higher ones
(lazy imports inside functions included), no two modules import each other in a circle, no module name is
used twice, and nothing below the CLI imports it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {  # package -> the thinkpool packages it may import
    "policies": set(),
    "tasks": {"policies"},
    "dms_runtime": set(),
    "workers": {"dms_runtime", "policies", "tasks"},
    "evaluation": {"dms_runtime", "policies", "tasks", "workers"},
    "training": {"dms_runtime", "policies", "tasks", "workers", "evaluation"},
    "orchestrator": {"dms_runtime", "policies", "tasks", "workers", "evaluation", "training"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The thinkpool modules ``path`` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name in known}


def test_lower_layers_never_import_higher_ones_and_nothing_imports_the_cli():
    known = modules()
    wrong = []
    for name, path in known.items():
        package = name.split(".")[0]
        for target in imports(path, known):
            other = target.split(".")[0]
            if other != package and other not in ALLOWED[package]:
                wrong.append(f"{name} -> {target}")
            if (target.startswith("orchestrator.commands") or target == "orchestrator.cli") and not (
                    name.startswith("orchestrator.commands") or name == "orchestrator.cli"):
                wrong.append(f"{name} -> {target} (the CLI)")
    assert not wrong


def test_no_import_circle_and_no_module_name_twice():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    # A package's __init__ importing its own submodules is how packages work, not a circle.
    graph = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in graph.items()}
    state: dict[str, str] = {}
    circles = []

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in graph[name]:
            if state.get(target) == "open":
                circles.append(trail[trail.index(target):] + [target] if target in trail else [name, target])
            elif target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
    assert not circles
    leaves = [name.split(".")[-1] for name, path in known.items() if path.name != "__init__.py"]
    assert sorted({leaf for leaf in leaves if leaves.count(leaf) > 1}) == []
