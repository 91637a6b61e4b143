"""oterm (PyPI, a Textual client for Ollama) in a venv of its own under `.cache/oterm-venv`: it pins
its own pydantic/huggingface_hub versions, so it never touches the project's environment.

`tests/server/test_server_oterm.py` makes it on first use; `make test` makes it beforehand, beside the
project's own install (`python3 tests/oterm_venv.py`), on the core that install leaves idle. Only
the standard library here: the Makefile runs it with the machine's python3."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".cache" / "oterm-venv"
OTERM_SPEC = "oterm==0.26.1"


def oterm_exe(python: str = sys.executable) -> Path:
    """The venv's `oterm`, installed first when missing (pip's byte-compile skipped: oterm's ~300 MB
    of dependencies compile as they are imported)."""
    exe = VENV / "bin" / "oterm"
    if not exe.exists():
        subprocess.run([python, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile",
                        "--disable-pip-version-check", OTERM_SPEC], check=True, timeout=1200)
    return exe


if __name__ == "__main__":
    print(oterm_exe())
