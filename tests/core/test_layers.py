"""The floors of the code: the algorithm, then the models, then the app and the benches; imports only point down."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports() -> dict[str, set[str]]:
    """module -> the project's modules it imports (relative imports resolved)."""
    found = {}
    for path in [*ROOT.glob("specdec_core/**/*.py"), *ROOT.glob("app/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        name = ".".join(parts if parts[-1] != "__init__" else parts[:-1])
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                deps |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
        found[name] = deps
    return {name: {d for d in deps if d in found and d != name} for name, deps in found.items()}


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle in `graph`, or None."""
    state: dict[str, str] = {}

    def visit(name, path):
        if state.get(name) == "open":
            return [*path[path.index(name):], name]
        if name not in state:
            state[name] = "open"
            for dep in sorted(graph[name]):
                if found := visit(dep, [*path, name]):
                    return found
            state[name] = "done"
        return None

    return next((found for name in sorted(graph) if (found := visit(name, []))), None)


def test_imports_point_one_way_and_never_in_a_circle():
    graph = imports()
    assert {"specdec_core.engine", "specdec_core.models.load", "app.ui"} <= set(graph)
    for name, deps in graph.items():
        if name.startswith("specdec_core"):  # the core never reaches up into the app
            assert not any(d.startswith("app") for d in deps), name
        if name.startswith("specdec_core.") and not name.startswith(("specdec_core.models", "specdec_core.bench")):
            # the algorithm's floor knows no models and no benches (the package's front door re-exports them)
            assert not any(d.startswith(("specdec_core.models", "specdec_core.bench")) for d in deps), name
    assert circle(graph) is None, circle(graph)
    planted = {**graph, "specdec_core.events": graph["specdec_core.events"] | {"specdec_core.engine"}}
    assert circle(planted)[0] in ("specdec_core.events", "specdec_core.engine")  # a circle is found
