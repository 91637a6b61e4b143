"""Packaging: a pure-Python wheel (so `pipx install .` / `uv tool install .` compile nothing),
shell completions in step with the parser, and the desktop entry."""
from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
PACKAGES = ("app", "engine", "kernels", "models")


def _gen():
    spec = importlib.util.spec_from_file_location("gen_completions", PACKAGING / "gen_completions.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_completions_are_up_to_date():
    stale = _gen().stale()
    assert not stale, f"stale completions {stale}: run python packaging/gen_completions.py"


def test_completions_cover_every_subcommand_and_flag():
    from app.cli import _parser
    gen = _gen()
    _, cmds = gen.describe(_parser())
    texts = {n: (PACKAGING / "completions" / n).read_text() for n in ("edgegem.bash", "_edgegem", "edgegem.fish")}
    for c in cmds:
        for text in texts.values():
            assert c.name in text
        for o in c.opts:
            for flag in o.flags:
                assert f"{c.name}:{flag}" in texts["edgegem.bash"] or not o.takes_value
                assert flag in texts["_edgegem"]
    assert {"doctor", "pull", "models"} <= {c.name for c in cmds}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_completion_completes():
    script = PACKAGING / "completions" / "edgegem.bash"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    def complete(*words: str) -> list[str]:
        words_q = " ".join(f"'{w}'" for w in ("edgegem", *words))
        r = subprocess.run(["bash", "-c", f"source '{script}'; COMP_WORDS=({words_q}); COMP_CWORD={len(words)}; "
                            '_edgegem; printf "%s\\n" "${COMPREPLY[@]}"'], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return [w for w in r.stdout.splitlines() if w]

    assert complete("do") == ["doctor"]
    assert set(complete("")) >= {"pull", "models", "doctor", "chat", "--version"}
    assert complete("pull", "--no") == ["--no-draft", "--no-mmproj"]
    assert complete("chat", "--image-t") == ["--image-tokens"]
    assert complete("run", "--kv-cache-dtype", "int") == ["int8_per_token_head"]
    assert complete("models", "--device", "c") == ["cuda", "cpu"]
    assert complete("run", "--prompt", "") == []


@pytest.mark.parametrize("shell, name", [("zsh", "_edgegem"), ("fish", "edgegem.fish")])
def test_other_shells_parse(shell, name):
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell} here")
    assert subprocess.run([shell, "-n", str(PACKAGING / "completions" / name)]).returncode == 0


def test_desktop_entry_and_icon():
    cp = configparser.ConfigParser(interpolation=None)
    cp.optionxform = str
    cp.read(PACKAGING / "edgegem.desktop")
    e = cp["Desktop Entry"]
    assert (e["Type"], e["Exec"], e["Icon"], e["Terminal"]) == ("Application", "edgegem", "edgegem", "true")
    assert e["Categories"] == "Utility;Development;"
    root = ET.parse(PACKAGING / "edgegem.svg").getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and root.get("viewBox") == "0 0 128 128"


@pytest.mark.slow
def test_wheel_is_pure_python(tmp_path):
    """Build the wheel from a copy of the working tree (a build writes build/ and *.egg-info into
    the source folder) and look inside."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    src = tmp_path / "src"
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp_path / "dist").glob("edgegem-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")  # no compiled code, any platform
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in PACKAGES:
        assert f"{pkg}/__init__.py" in names
    tops = {n.split("/")[0] for n in names if not n.startswith("edgegem-")}
    assert tops == set(PACKAGES), tops  # no tests/ or packaging/ in site-packages
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dylib", ".c", ".cpp", ".cu"))]
    for py in src.glob("*/**/*.py"):
        rel = py.relative_to(src).as_posix()
        if rel.split("/")[0] in PACKAGES:
            assert rel in names, f"{rel} is missing from the wheel"
    data = [p.relative_to(src).as_posix() for pkg in PACKAGES for p in (src / pkg).rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc")]
    missing = [d for d in data if d not in names]
    assert not missing, f"package data missing from the wheel (add it to [tool.setuptools.package-data]): {missing}"
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        metadata = z.read(f"{dist_info}/METADATA").decode()
    assert "[console_scripts]" in entry_points and "edgegem = app.cli:main" in entry_points
    for dep in ("torch", "huggingface_hub", "platformdirs", "textual"):
        assert f"Requires-Dist: {dep}" in metadata.replace("huggingface-hub", "huggingface_hub")
