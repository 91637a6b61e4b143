"""The layering of the packages (conventions.md): app -> engine -> models -> kernels, one way, and no
import circles between modules.

Every `import` and `from ... import` in app/, engine/, models/ and kernels/ is read with `ast`, at
any depth (a function's lazy import counts: it runs sooner or later), relative ones resolved
against the importing module. An import names the deepest module of ours it reaches
(`from engine import api` is engine.api; `from engine.bench import gpu_bench` is the package
engine.bench). Nothing is imported: the test reads the files as text.

Two more rules: kernels/ has one folder per toolchain (kernels/triton/, kernels/ggml/) and neither
imports the other; and no module imports another's private names (`from .x import _y`): what is
shared is public, named for what it is.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "models", "engine", "app")  # lowest first: a package may import those before it
TOOLCHAINS = ("kernels.triton", "kernels.ggml")  # kernels/ folders that must not import each other
# Private names imported from another module, allowed by (importer, module, name) with the reason
# each is tolerated for now; an entry no longer imported fails the test (as KNOWN_CIRCLES). None is
# in kernels/; each is in a module being reworked, and its reason says what ends it.
PRIVATE_IMPORTS: dict = {
    # app/cli_options.py is the shared part of the command line's subcommand modules (docs/layout.md):
    # its helpers are underscored as the command line's, not as one module's.
    **{("app.cli", "app.cli_options", n): "the command line's shared option handling" for n in (
        "_audio_args", "_engine_args", "_engine_options", "_fit_args", "_image_args", "_image_model_args",
        "_kv_session_arg", "_memory_args", "_sampling_args")},
    ("app.cli_bench", "app.cli_options", "_int_list"): "the command line's shared option handling",
    **{("app.cli_chat", "app.cli_options", n): "the command line's shared option handling" for n in (
        "_device", "_emit", "_engine_options", "_kv_note", "_kv_path", "_start_client")},
    ("app.cli_info", "app.cli_options", "_draft_path"): "the command line's shared option handling",
    **{(m, "app.cli_options", "_generation"): "the command line's shared option handling"
       for m in ("app.cli_chat", "app.cli_run")},
    **{("app.cli_run", "app.cli_options", n): "the command line's shared option handling" for n in (
        "_constraint", "_device", "_emit", "_engine_options", "_kv_note", "_kv_path", "_start_client")},
    **{("app.cli_serve", "app.cli_options", n): "the command line's shared option handling" for n in (
        "_device", "_engine_options", "_start_client")},
    ("engine.bench.spec", "engine.bench.throughput", "_sync"):
        "the benches' device sync, inside one package; public when the benches print the runtime",
    ("models.gemma4_assistant", "models.gemma4", "_per_layer"):
        "the assistant is a Gemma 4 variant of the family file; public when models/ is reworked",
    # models/ops.py is being rebuilt around a runtime decided once at load (models/runtime.py), which
    # replaces these per-op probes; until then they are the ops' own state, read where it is decided.
    ("models.gemma3_ggml", "models.ops", "_chains"): "the per-op ggml probe, replaced by the runtime",
    ("models.ops", "kernels.triton.launch", "_state"): "the per-op interpreter probe, replaced by the runtime",
}
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


def _imported(module: str, is_package: bool, source: str) -> list[tuple[int, str, str | None]]:
    """(line, dotted name, name imported from a module or None) for every import in `source`,
    the text of `module`, at any depth, relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module
            # `from pkg import name`: name may be a submodule (pkg.name) or a name inside pkg
            out += [(node.lineno, f"{root}.{alias.name}", alias.name) for alias in node.names]
    return out


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module of ours) for every import in `path`, at any depth."""
    out = []
    for line, name, _ in _imported(module, path.name == "__init__.py", path.read_text(encoding="utf-8")):
        target = _ours(name)
        if target is not None and target != module:
            out.append((line, target))
    return out


def _private_imports(module: str, is_package: bool, source: str) -> list[tuple[int, str, str]]:
    """(line, module of ours, name) for every `from <module of ours> import _name` in `source`
    (the text of `module`): a private name, or private module, of another module."""
    out = []
    for line, dotted, name in _imported(module, is_package, source):
        if name is None or not name.startswith("_") or name.startswith("__"):
            continue
        owner = _ours(dotted.rpartition(".")[0])
        if owner is not None and owner != module:
            out.append((line, owner, name))
    return out


def _toolchain(module: str) -> str | None:
    return next((t for t in TOOLCHAINS if module == t or module.startswith(t + ".")), None)


def _across_toolchains(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Imports from one kernels/ toolchain folder into another."""
    return [f"{m}:{line} imports {t}" for m, imports in graph.items() for line, t in imports
            if _toolchain(m) is not None and _toolchain(t) not in (None, _toolchain(m))]


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


def test_the_toolchain_folders_do_not_import_each_other():
    assert set(TOOLCHAINS) <= set(MODULES), "kernels/triton/ and kernels/ggml/ are packages"
    wrong = _across_toolchains(_graph())
    assert not wrong, "kernels.triton and kernels.ggml import each other:\n" + "\n".join(wrong)


def test_the_toolchain_rule_sees_a_crossing_either_way():
    graph = {"kernels.triton.qmatmul": [(3, "kernels.ggml.lib"), (4, "kernels.arch")],
             "kernels.ggml.ops": [(7, "kernels.triton"), (8, "kernels.ggml.graph")],
             "kernels.ggml": [(2, "kernels.ggml.ops")],
             "models.ops": [(9, "kernels.ggml"), (10, "kernels.triton.fused")]}
    assert _across_toolchains(graph) == ["kernels.triton.qmatmul:3 imports kernels.ggml.lib",
                                         "kernels.ggml.ops:7 imports kernels.triton"]


def test_no_module_imports_another_modules_private_names():
    found = {(m, owner, name): line for m, p in MODULES.items()
             for line, owner, name in _private_imports(m, p.name == "__init__.py", p.read_text(encoding="utf-8"))}
    new = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {owner}.{name}"
           for (m, owner, name), line in found.items() if (m, owner, name) not in PRIVATE_IMPORTS]
    assert not new, "private names imported from another module (make them public, or move them):\n" + \
        "\n".join(new)
    gone = [key for key in PRIVATE_IMPORTS if key not in found]
    assert not gone, f"no longer imported, delete from PRIVATE_IMPORTS: {gone}"
    assert all(reason for reason in PRIVATE_IMPORTS.values())


def test_the_private_name_rule_on_a_made_up_module():
    source = (
        "from .ops import _graphs, cached_graph\n"       # a neighbour's private name: caught
        "from .lib import __version__\n"                  # a dunder: not private
        "from kernels.triton.kv_store import _check\n"    # absolute: caught
        "from . import graph\n"                           # a public submodule
        "from torch.nn import _reduction\n"              # not ours
        "def f():\n"
        "    from .graph import _fns\n"                  # a lazy import counts too
        "    from kernels.ggml.attention import _own\n"   # its own private name: fine
    )
    assert _private_imports("kernels.ggml.attention", False, source) == [
        (1, "kernels.ggml.ops", "_graphs"), (3, "kernels.triton.kv_store", "_check"), (7, "kernels.ggml.graph", "_fns")]
    # in a package's face, `from . import _x` is a private name of the package's own module: fine;
    # from a neighbour module it is another's
    assert _private_imports("kernels.ggml", True, "from .ops import _norm\nfrom . import _y\n") == [
        (1, "kernels.ggml.ops", "_norm")]
    assert _private_imports("kernels.ggml.graph", False, "from . import _y\n") == [(1, "kernels.ggml", "_y")]
