"""`edgegem models` and `--model NAME`: local GGUFs listed with their plan, and names resolved."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_models import TinySpec, write_tiny_assistant, write_tiny_gemma4

from app.cli import main
from engine import api
from engine.models_dir import find_model, local_models, quant_label, quant_matches
from kernels.env import reload
from models.gguf import GGUFError

SPEC = TinySpec(d_model=64, hd_sliding=32, hd_full=64, ffn=128, ple_width=8)
REPO = "unsloth/gemma-4-E2B-it-GGUF"


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    root = tmp_path / "models"
    (root / REPO).mkdir(parents=True)
    write_tiny_gemma4(root / REPO / "gemma-4-E2B-it-Q4_K_M.gguf", SPEC, seed=1)
    write_tiny_gemma4(root / REPO / "gemma-4-E2B-it-Q8_0.gguf", SPEC, seed=2)
    write_tiny_assistant(root / REPO / "gemma-4-E2B-it-assistant-Q4_K_M.gguf", SPEC, d_model=32, ffn=64)
    write_tiny_gemma4(root / "my-finetune.gguf", SPEC, seed=3)
    (root / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    (root / REPO / "gemma-4-E2B-it-Q6_K.gguf.part").write_bytes(b"partial")  # a download in progress
    monkeypatch.setenv("EDGEGEM_MODELS_DIR", str(root))
    reload()
    return root


def test_quant_names():
    assert quant_label("gemma-4-E2B-it-UD-Q4_K_XL.gguf") == "UD-Q4_K_XL"
    assert quant_label("gemma-4-E2B-it-BF16-00001-of-00002.gguf") == "BF16"
    assert quant_label("my-finetune.gguf") is None
    assert quant_matches("gemma-4-E2B-it-Q4_K_M.gguf", "q4_k_m")
    assert not quant_matches("gemma-4-E2B-it-Q4_K_M.gguf", "Q4_K")


def test_local_models_skips_partial_downloads(models_dir):
    rels = [m.rel for m in local_models(models_dir)]
    assert rels == ["broken.gguf", "my-finetune.gguf", f"{REPO}/gemma-4-E2B-it-assistant-Q4_K_M.gguf",
                    f"{REPO}/gemma-4-E2B-it-Q4_K_M.gguf", f"{REPO}/gemma-4-E2B-it-Q8_0.gguf"]
    assert local_models(models_dir / "nothing-here") == []


def test_models_json_lists_plan_per_model(models_dir, capsys):
    assert main(["models", "--json", "--gpu-memory-budget", "1GiB", "--device", "cpu"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["models_dir"] == str(models_dir) and d["kv_format"] == "int8_per_token_head"
    assert d["budget"] == 2 ** 30 and d["budget_source"] == "--gpu-memory-budget" and d["device"] == "cpu"
    rows = {r["rel"]: r for r in d["models"] if r["rel"]}
    q4 = rows[f"{REPO}/gemma-4-E2B-it-Q4_K_M.gguf"]
    assert q4["architecture"] == "gemma4" and q4["quant"] == "F32" and q4["name"] == "gemma-4-E2B-it-Q4_K_M"
    assert q4["size"] == (models_dir / q4["rel"]).stat().st_size
    assert q4["plan"] == {"max_context": 4096, "context_length": 4096}
    draft = rows[f"{REPO}/gemma-4-E2B-it-assistant-Q4_K_M.gguf"]
    assert draft["architecture"] == "gemma4-assistant" and "assistant draft" in draft["plan"]["note"]
    assert "truncated" in rows["broken.gguf"]["error"] or "GGUF" in rows["broken.gguf"]["error"]
    demo = [r for r in d["models"] if r["name"] == "demo"]
    assert len(demo) == (api.demo_model_path() is not None)


def test_models_table_and_too_small_budget(models_dir, capsys):
    assert main(["models", "--gpu-memory-budget", "1MiB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"models in {models_dir}; context with int8_per_token_head KV on cpu, budget 1.0 MiB" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("my-finetune "))
    assert "gemma4" in line and "F32" in line and "does not fit: budget 1.0 MiB is" in line
    assert "unreadable:" in next(ln for ln in out.splitlines() if ln.strip().startswith("broken "))

    assert main(["models", "--gpu-memory-budget", "1GiB", "--device", "cpu"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "my-finetune" in ln)
    assert line.rstrip().endswith("4096 (full)")


def test_empty_models_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(api, "demo_model_path", lambda: None)
    assert main(["models", "--models-dir", str(tmp_path / "none"), "--device", "cpu"]) == 0
    assert "none yet: edgegem pull unsloth/gemma-4-E2B-it-GGUF:Q4_K_M" in capsys.readouterr().out


def test_resolve_model_by_name(models_dir, tmp_path):
    q4 = models_dir / REPO / "gemma-4-E2B-it-Q4_K_M.gguf"
    for name in ("gemma-4-E2B-it-Q4_K_M.gguf", "gemma-4-E2B-it-Q4_K_M", "GEMMA-4-e2b-IT-q4_k_m",
                 "e2b-it-q4_k_m", f"{REPO}/gemma-4-E2B-it-Q4_K_M.gguf", REPO, f"{REPO}:q4_k_m"):
        assert api.resolve_model(name) == q4, name
    assert api.resolve_model(f"{REPO}:Q8_0") == models_dir / REPO / "gemma-4-E2B-it-Q8_0.gguf"
    assert api.resolve_model("finetune") == models_dir / "my-finetune.gguf"
    assert api.resolve_model("assistant") == models_dir / REPO / "gemma-4-E2B-it-assistant-Q4_K_M.gguf"
    assert api.resolve_model("e2b-it-q4") == q4  # the draft matches too, but only a piece naming it picks it
    other = tmp_path / "elsewhere.gguf"
    other.write_bytes(b"")
    assert api.resolve_model(str(other)) == other  # an existing path wins, as before


def test_resolve_model_errors_are_one_line(models_dir):
    with pytest.raises(ValueError) as e:
        api.resolve_model("e2b")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("'e2b' matches 2 models in")
    assert f"{REPO}/gemma-4-E2B-it-Q4_K_M.gguf, {REPO}/gemma-4-E2B-it-Q8_0.gguf; give more of the name" in msg
    with pytest.raises(ValueError) as e:
        api.resolve_model("llama-70b")
    msg = str(e.value)
    assert "\n" not in msg and "no local model matches 'llama-70b'" in msg
    assert "gemma-4-E2B-it-Q4_K_M" in msg and "edgegem pull REPO:QUANT" in msg
    with pytest.raises(GGUFError, match=r"^nope\.gguf: no such file \(nor a local model of that name in "):
        api.resolve_model("/some/where/nope.gguf")
    with pytest.raises(ValueError, match=r"^google/gemma-4-E4B-it-GGUF:Q8_0 is not pulled yet \(nothing for it in .*\): "
                                         r"edgegem pull google/gemma-4-E4B-it-GGUF:Q8_0$"):
        api.resolve_model("google/gemma-4-E4B-it-GGUF:Q8_0")
    with pytest.raises(ValueError, match="none there yet"):
        find_model("x", models_dir / "empty")


def test_demo_name(monkeypatch, tmp_path):
    fake = tmp_path / "demo.gguf"
    monkeypatch.setattr(api, "demo_model_path", lambda: fake)
    assert api.resolve_model("demo") == fake and api.resolve_model(None) == fake


def test_run_takes_a_model_name(models_dir):
    env = {**os.environ, "EDGEGEM_MODELS_DIR": str(models_dir)}
    r = subprocess.run([sys.executable, "-m", "app.cli", "run", "--model", "finetune", "--prompt", "the",
                        "--max-tokens", "2", "--json", "--raw"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout.strip().splitlines()[-1])["ids"]) == 2
    r = subprocess.run([sys.executable, "-m", "app.cli", "run", "--model", "e2b", "--prompt", "the"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("edgegem: error: 'e2b' matches 2 models")
    assert len(r.stderr.strip().splitlines()) == 1


def test_info_and_draft_take_model_names(models_dir, capsys):
    from app.cli_options import _draft_path
    assert main(["info", "finetune", "--device", "cpu", "--gpu-memory-budget", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["file"] == str(models_dir / "my-finetune.gguf")
    assert _draft_path("assistant") == str(models_dir / REPO / "gemma-4-E2B-it-assistant-Q4_K_M.gguf")
    assert _draft_path(None) is None
