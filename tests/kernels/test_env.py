"""The environment switches (kernels/env.py): each variable parses, a bad value is one line naming
it, kernels/env.py is the only reader of the EDGEGEM_* variables and kernels/triton/launch.py of
TRITON_INTERPRET, and docs/configuration.md documents every one."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.env import VARIABLES, ConfigError, Env, env, reload
from kernels.triton.launch import interpreting, reload_interpret, triton_interpret

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("app", "engine", "models", "kernels", "packaging")


def test_unset_variables_are_the_dataclass_defaults():
    assert Env.from_environ({}) == Env()
    assert Env.from_environ({name: "" for name in VARIABLES}) == Env()  # empty counts as unset


@pytest.mark.parametrize("name, raw, field, want", [
    ("EDGEGEM_CPU_KERNELS", "torch", "cpu_kernels", "torch"),
    ("EDGEGEM_CPU_KERNELS", "AUTO", "cpu_kernels", "auto"),
    ("EDGEGEM_CPU_ATTENTION", "torch", "cpu_attention", "torch"),
    ("EDGEGEM_CPU_ATTENTION", "Torch", "cpu_attention", "torch"),
    ("EDGEGEM_CPU_ATTENTION", "ggml", "cpu_attention", "ggml"),
    ("EDGEGEM_CPU_LAYER_GRAPH", "0", "cpu_layer_graph", False),
    ("EDGEGEM_CPU_LAYER_GRAPH", "off", "cpu_layer_graph", False),
    ("EDGEGEM_CPU_LAYER_GRAPH", "1", "cpu_layer_graph", True),
    ("EDGEGEM_CPU_STEP_GRAPH", "0", "cpu_step_graph", False),
    ("EDGEGEM_CPU_STEP_GRAPH", "false", "cpu_step_graph", False),
    ("EDGEGEM_CPU_STEP_GRAPH", "Yes", "cpu_step_graph", True),
    ("EDGEGEM_IMAGE_PREVIEW", "blocks", "image_preview", "blocks"),
    ("EDGEGEM_IMAGE_PREVIEW", "auto", "image_preview", "auto"),
    ("EDGEGEM_FAILPOINTS", "forward.oom@3,kv.write@1", "failpoints", "forward.oom@3,kv.write@1"),
    ("EDGEGEM_DATA_DIR", "edgegem-data", "data_dir", Path("edgegem-data")),
    ("EDGEGEM_DATA_DIR", "~/chats", "data_dir", Path("~/chats").expanduser()),
    ("EDGEGEM_MODELS_DIR", "~/gguf", "models_dir", Path("~/gguf").expanduser()),
    ("EDGEGEM_COMPILE_CACHE", "~/cc", "compile_cache", Path("~/cc")),  # not expanded, as before
    ("EDGEGEM_GEMV_SPLIT", "4", "gemv_split", 4),
    ("EDGEGEM_GEMV_SPLIT", " 64", "gemv_split", 64),
])
def test_each_variable_parses(name, raw, field, want):
    parsed = Env.from_environ({name: raw})
    assert getattr(parsed, field) == want
    assert parsed == Env(**{field: want})  # the others keep their defaults


@pytest.mark.parametrize("name, raw", [
    ("EDGEGEM_CPU_KERNELS", "ggml"),
    ("EDGEGEM_CPU_ATTENTION", "llama"),
    ("EDGEGEM_CPU_LAYER_GRAPH", "2"),
    ("EDGEGEM_CPU_STEP_GRAPH", "nope"),
    ("EDGEGEM_IMAGE_PREVIEW", "sixel"),
    ("EDGEGEM_GEMV_SPLIT", "0"),
    ("EDGEGEM_GEMV_SPLIT", "65"),
    ("EDGEGEM_GEMV_SPLIT", "four"),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, raw):
    with pytest.raises(ConfigError) as e:
        Env.from_environ({name: raw})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{name}={raw!r}: expected ")
    assert isinstance(e.value, ValueError)  # the command line's one-line error path


def test_the_command_line_says_a_bad_value_in_one_line(monkeypatch, capsys):
    from app.cli import main

    monkeypatch.setenv("EDGEGEM_CPU_ATTENTION", "llama")
    with pytest.raises(ConfigError):
        reload()
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert err == "edgegem: error: EDGEGEM_CPU_ATTENTION='llama': expected one of ggml, torch (default ggml)\n"


def test_read_once_and_reread_on_reload(monkeypatch):
    before = env()
    assert env() is before  # cached: one parse
    monkeypatch.setenv("EDGEGEM_CPU_ATTENTION", "torch" if before.cpu_attention == "ggml" else "ggml")
    assert env() is before  # a change is not seen until asked for
    after = reload()
    assert after.cpu_attention != before.cpu_attention and env() is after


def test_variables_lists_exactly_what_is_read():
    class Recording(dict):
        def get(self, key, default=None):
            asked.append(key)
            return super().get(key, default)

    asked: list = []
    Env.from_environ(Recording())
    assert sorted(asked) == sorted(VARIABLES) and len(asked) == len(set(asked))


# --- one reader ----------------------------------------------------------------------------------

def _reads(name: str) -> re.Pattern:
    """A read of `name` from the process environment: os.environ.get/[]/setdefault/pop, getenv,
    `in os.environ`. (A child's environment built with `dict(os.environ, NAME=...)` is no read.)"""
    q = r"""["']""" + re.escape(name) + r"""["']"""
    return re.compile(rf"(environ(\.get|\.setdefault|\.pop)?\s*[\[(]\s*{q}|getenv\(\s*{q}|{q}\s+(not\s+)?in\s+(os\.)?environ)")


def _readers(name: str) -> set[str]:
    pattern = _reads(name)
    return {str(p.relative_to(ROOT)) for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))
            if pattern.search(p.read_text(encoding="utf-8"))}


def test_the_read_pattern_finds_reads():
    pattern = _reads("EDGEGEM_X")
    for text in ('os.environ.get("EDGEGEM_X", "1")', "os.environ['EDGEGEM_X']", 'os.getenv("EDGEGEM_X")',
                 '"EDGEGEM_X" in os.environ', 'os.environ.setdefault("EDGEGEM_X", "0")'):
        assert pattern.search(text), text
    assert not pattern.search('env = dict(os.environ, EDGEGEM_X="1")')


@pytest.mark.parametrize("name", VARIABLES)
def test_kernels_env_is_the_only_reader(name):
    assert _readers(name) - {"kernels/env.py"} == set()  # env.py reads them by the names in VARIABLES


def test_no_edgegem_variable_is_read_anywhere_else():
    """Including a new one not yet in VARIABLES."""
    stray = re.compile(r"""(environ(\.get|\.setdefault|\.pop)?\s*[\[(]|getenv\()\s*["']EDGEGEM_""")
    found = {str(p.relative_to(ROOT)) for top in SOURCES for p in (ROOT / top).rglob("*.py")
             if stray.search(p.read_text(encoding="utf-8"))}
    assert found <= {"kernels/env.py"}


def test_triton_interpret_is_read_only_by_launch_interpreting():
    assert _readers("TRITON_INTERPRET") == {"kernels/triton/launch.py"}


# --- TRITON_INTERPRET ----------------------------------------------------------------------------

TRITON_VALUES = ["1", "true", "TRUE", "on", "yes", "Y", "0", "off", "false", "no", "2", " 1", ""]


def test_interpreting_reads_the_variable_as_triton_does(monkeypatch):
    ours = {}
    for raw in TRITON_VALUES:
        monkeypatch.setenv("TRITON_INTERPRET", raw)
        ours[raw] = reload_interpret()
        assert interpreting() is ours[raw]
    assert ours == {raw: raw.lower() in ("1", "true", "on", "yes", "y") for raw in TRITON_VALUES}
    if importlib.util.find_spec("triton") is None:
        return
    # Triton's own reading, in a process of its own: importing triton here would fix the kind of
    # triton.language's helpers for every later test in this process (kernels/triton/interpreter_compat.py).
    script = ("import json, os, sys\nfrom triton import knobs\nout = {}\n"
              "for v in json.loads(sys.argv[1]):\n    os.environ['TRITON_INTERPRET'] = v\n"
              "    out[v] = knobs.runtime.interpret\nprint(json.dumps(out))")
    run = subprocess.run([sys.executable, "-c", script, json.dumps(TRITON_VALUES)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == ours


@pytest.mark.parametrize("before", [None, "1", "0", "yes"])
def test_triton_interpret_sets_and_restores(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", before)
    for on in (False, True):
        with triton_interpret(on):
            assert interpreting() is on and os.environ["TRITON_INTERPRET"] == ("1" if on else "0")
        assert os.environ.get("TRITON_INTERPRET") == before
    with pytest.raises(RuntimeError), triton_interpret(False):
        raise RuntimeError("restored on the way out of an error too")
    assert os.environ.get("TRITON_INTERPRET") == before


def test_interpreting_is_read_once_and_switched_only_by_triton_interpret(monkeypatch):
    """The launchers ask at every launch; the variable is parsed once (the first call after a
    reload) and kept, so a write behind its back is not seen until `reload_interpret()`, while
    `triton_interpret()` switches the kept answer with the variable."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert reload_interpret() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert interpreting() is True  # kept: not re-read per call
    with triton_interpret(False):
        assert interpreting() is False
        with triton_interpret(True):
            assert interpreting() is True
        assert interpreting() is False
    assert interpreting() is False and os.environ["TRITON_INTERPRET"] == "0"  # restored from the variable
    assert reload_interpret() is False


# --- documentation -------------------------------------------------------------------------------

def test_docs_configuration_has_a_row_for_every_variable():
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([A-Z_]+)` \|", text, flags=re.M))
    assert set(VARIABLES) | {"TRITON_INTERPRET"} <= rows
    for top in ("README.md",):
        assert "docs/configuration.md" in (ROOT / top).read_text(encoding="utf-8")
