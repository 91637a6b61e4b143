"""Nothing tracked names a folder outside the repository as input: a source tree, a venv, a home or
scratch folder. Such a path works only on the machine where it was written (a test once read
llama.cpp's converter from a source tree beside the checkout, and a new machine failed 35 tests);
what a test needs comes from the repo, a package, or the cache the suite fills (tests/llama_sdist.py).

Read as text: every tracked Python file's string constants (so a comment may still say where a
thing lives), and the Makefile, shell scripts, CI script and TOML files whole. System paths a
program reads by design (/proc, /sys, /dev, /etc, /usr/bin, ...) are not folders of a machine's
own making and are not flagged.
"""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Roots where a machine keeps its own trees and scratch: the repo must not read from any of them.
OUTSIDE = re.compile(r"(?<![\w.~$}-])/(?:work|home|root|tmp|opt|mnt|srv|scratch|data|Users|media|var/tmp"
                     r"|usr/local/src|usr/src)(?:/[^\s'\"`:;,)]*)?(?=$|[\s'\"`:;,)])")
# ... and a venv or an installed package's folder under any folder ("/.venv-x/" alone is a
# root-anchored .gitignore pattern, not a place).
TREE = re.compile(r"(?<![\w.~$})-])/(?:[\w.+-]+/)+(?:\.?venv[\w.-]*|site-packages)(?:/|\b)")
# Fake paths that are data, not places read: doctor's report is tested on a made-up machine.
FIXTURE_DATA = {
    "tests/app/test_doctor.py": {"/opt/venv/bin/python", "/home/u/.local/share/edgegem",
                             "/home/u/.local/share/edgegem/models"},
}
TEXT_FILES = ("Makefile", ".ci/run")
TEXT_SUFFIXES = (".sh", ".toml", ".cfg", ".ini", ".yml", ".yaml")


def tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):  # a source tree without git: its own files
        skip = (".venv", ".cache", ".git", "build", ".whl", ".site")
        return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                if p.is_file() and not p.relative_to(ROOT).parts[0].startswith(skip)]


def _strings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def outside_paths(rel: str, text_lines: list[tuple[int, str]]) -> list[str]:
    found = []
    for line, text in text_lines:
        for rx in (OUTSIDE, TREE):
            for m in rx.finditer(text):
                if text not in FIXTURE_DATA.get(rel, ()):
                    found.append(f"{rel}:{line}: {m.group(0)}")
    return found


def scanned(files: list[str]) -> dict[str, list[tuple[int, str]]]:
    out = {}
    for rel in files:
        path = ROOT / rel
        if not path.is_file():
            continue
        if rel == "tests/repo/test_repo_paths.py":  # its own strings are the cases the check is tested on
            continue
        if rel.endswith(".py"):
            out[rel] = _strings(path)
        elif rel in TEXT_FILES or rel.endswith(TEXT_SUFFIXES):
            out[rel] = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
    return out


def test_no_tracked_file_reads_a_folder_outside_the_repository():
    texts = scanned(tracked())
    assert "Makefile" in texts and "tests/conftest.py" in texts and "packaging/gpu_check.py" in texts
    bad = [hit for rel, lines in texts.items() for hit in outside_paths(rel, lines)]
    assert not bad, "absolute paths outside the repository:\n  " + "\n  ".join(bad)


def test_the_scan_finds_the_paths_that_broke_a_new_machine():
    """The check itself: the converter path that broke a fresh clone, a venv, a home folder and a
    scratch file are caught; system paths, URLs, API routes and regexes are not."""
    # Built from a root's name and a tail, so that this file names no such folder itself.
    cases = [("work", "src/llama_cpp_python-0.3.36/vendor/llama.cpp", 'Path("{}")'), ("root", ".venv/bin/python", "{}"),
             ("home", "me/gguf-py", "PYTHONPATH={}"), ("tmp", "model.gguf", "{}"), ("srv", "x/venv/bin/pip", "{}"),
             ("usr/local/src", "llama.cpp", "{}")]
    caught = [form.format(f"/{root}/{tail}") for root, tail, form in cases]
    fine = ["/proc/self/status", "/dev/null", "/usr/bin/env python3", "https://example.org/home/x",
            "/v1/chat/completions", "/api/tags", "a/tmp/b", "~/(?s:.*)/", "$(CURDIR)/.venv-triton36",
            "/etc/os-release", "/sys/devices/system/cpu", "/.venv-device/"]
    assert not [s for s in caught if not outside_paths("x.py", [(1, s)])]
    assert not [s for s in fine if outside_paths("x.py", [(1, s)])]


def test_fixture_data_paths_are_still_there():
    """An allowance that no longer matches anything is removed, so the list stays what it says."""
    for rel, allowed in FIXTURE_DATA.items():
        assert allowed <= {s for _, s in _strings(ROOT / rel)}, rel
