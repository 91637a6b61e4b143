"""The layering of the packages (conventions.md): app -> engine -> models -> kernels, one way, and no
import circles between modules.

Every `import` and `from ... import` in app/, engine/, models/ and kernels/ is read with `ast`, at
any depth (a function's lazy import counts: it runs sooner or later), relative ones resolved
against the importing module. An import names the deepest module of ours it reaches
(`from engine import api` is engine.api; `from engine.bench import gpu_bench` is the package
engine.bench). Nothing is imported: the test reads the files as text.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "models", "engine", "app")  # lowest first: a package may import those before it
# Circles allowed by name (none: the command line's shared option handling is app/cli_options.py,
# which no subcommand module imports back; an entry that stops being a circle fails the test).
KNOWN_CIRCLES: list = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in LAYERS for p in sorted((ROOT / top).rglob("*.py"))}


MODULES = _modules()


def _ours(name: str) -> str | None:
    """The deepest module of ours that `name` (a dotted path, maybe ending in a non-module name) is."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in MODULES:
            return candidate
    return None


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module of ours) for every import in `path`, at any depth."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module
            # `from pkg import name`: name may be a submodule (pkg.name) or a name inside pkg
            names = [f"{root}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _ours(name)
            if target is not None and target != module:
                out.append((node.lineno, target))
    return out


def _graph() -> dict[str, list[tuple[int, str]]]:
    return {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_walk_sees_every_package_and_lazy_imports():
    """The walk itself: all four packages are read, and an import inside a function is seen."""
    assert {m.split(".")[0] for m in MODULES} == set(LAYERS)
    graph = _graph()
    # engine.api imports models.loader at the top and engine.models_dir inside open_model's helper
    assert "models.loader" in {t for _, t in graph["engine.api"]}
    assert "engine.models_dir" in {t for _, t in graph["engine.api"]}
    # a relative import from a sub-package resolves against it: engine.bench.kv_resume -> engine.scheduler
    assert "engine.scheduler" in {t for _, t in graph["engine.bench.kv_resume"]}


def test_no_layer_imports_a_layer_above_it():
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}"
             for m, imports in _graph().items() for line, t in imports if _layer(t) > _layer(m)]
    assert not wrong, "imports against app -> engine -> models -> kernels:\n" + "\n".join(wrong)


def test_app_reaches_models_and_kernels_only_through_the_engine():
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}"
             for m, imports in _graph().items() if m.startswith("app")
             for line, t in imports if _layer(t) < LAYERS.index("engine")]
    assert not wrong, "app/ imports below the engine:\n" + "\n".join(wrong)


def test_no_import_circles_between_modules():
    edges = {m: {t for _, t in imports} for m, imports in _graph().items()}
    circles = _cycles(edges)
    new = [c for c in circles if c not in KNOWN_CIRCLES]
    assert not new, "modules that import each other (directly or round a circle):\n" + \
        "\n".join(" <-> ".join(c) for c in new)
    gone = [c for c in KNOWN_CIRCLES if c not in circles]
    assert not gone, f"no longer a circle, delete it from KNOWN_CIRCLES: {gone}"


def test_the_circle_finder_finds_circles_and_only_them():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set(), "f": {"f"}}
    assert _cycles(edges) == [["a", "b", "c"]]  # d -> a is no circle; a self-import is not counted
    assert _cycles({"x": {"y"}, "y": {"x"}}) == [["x", "y"]]
