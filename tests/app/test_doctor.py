"""`edgegem doctor`: verdicts on machines we do not have (hand-built probe results), the real
probes on this one, and the exit code."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest

from app import doctor, doctor_probes
from app.cli import main
from app.doctor import FAIL, OK, WARN, evaluate, torch_index
from app.doctor_probes import Facts, Gpu

GiB = 2 ** 30
LINE = re.compile(r"^(OK  |WARN|FAIL)  [a-z0-9 ]+: \S.*$")
EXE = "/opt/venv/bin/python"


def facts(**kw) -> Facts:
    """A healthy RTX 3060 box with a cu128 torch, changed by `kw`."""
    base = dict(python=(3, 11, 9), executable=EXE, torch_version="2.9.0+cu128", torch_cuda="12.8",
                torch_arch_list=["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], cuda_available=True,
                gpus=[Gpu("NVIDIA GeForce RTX 3060", (8, 6), 11 * GiB, 12 * GiB)], driver_version="570.86.10",
                driver_cuda="12.8", smi_gpus=["NVIDIA GeForce RTX 3060"], triton_version="3.5.0", triton_run="ok",
                mem_total=32 * GiB, mem_available=20 * GiB, data_dir="/home/u/.local/share/edgegem",
                models_dir="/home/u/.local/share/edgegem/models", models=["a/b/m-Q4_K_M.gguf"], disk_free=100 * GiB,
                cpu_kernels=dict(name="ggml", reason="", features={"avx2": True},
                                 detail="llama.cpp's ggml (llama-cpp-python 0.3.36; AVX2)"), cpu_threads=8,
                runtimes={"cpu": dict(name="ggml", detail="llama.cpp's ggml on the CPU"),
                          "cuda": dict(name="triton", detail="Triton kernels on CUDA")})
    base.update(kw)
    return Facts(**base)


def by_name(checks) -> dict:
    return {c.check: c for c in checks}


def test_healthy_gpu_machine_is_all_ok():
    checks = evaluate(facts())
    assert [c.status for c in checks] == [OK] * len(checks), doctor.report(checks)
    c = by_name(checks)
    assert c["gpu"].finding == "NVIDIA GeForce RTX 3060, compute capability 8.6"
    assert c["vram"].finding == "11.0 GiB free of 12.0 GiB"
    assert c["driver"].finding == "570.86.10, supports CUDA up to 12.8"
    assert doctor.exit_code(checks) == 0


def test_cpu_only_machine_warns_and_passes():
    f = facts(torch_version="2.9.0+cpu", torch_cuda=None, torch_arch_list=[], cuda_available=False, gpus=[],
              driver_version=None, driver_cuda=None, smi_gpus=[], triton_run=None)
    c = by_name(evaluate(f))
    assert c["torch"].status == OK and c["torch"].finding == "2.9.0+cpu (CPU-only build)"
    assert (c["cuda"].status, c["cuda"].finding) == (WARN, "no GPU: the CPU path will be used")
    assert c["triton"].status == WARN and c["triton"].finding.endswith("no GPU: the CPU path will be used")
    assert "gpu" not in c and c["driver"].status == WARN
    assert doctor.exit_code(list(c.values())) == 0


def test_cpu_kernels_line_says_which_kernels_run_and_why():
    c = by_name(evaluate(facts()))["cpu kernels"]
    assert (c.status, c.finding) == (OK, "llama.cpp's ggml (llama-cpp-python 0.3.36; AVX2), 8 threads (--threads N)")
    torch_only = dict(name="torch", detail="torch formats", features={},
                      reason="llama-cpp-python is not installed (pip install 'edgegem[cpu]')")
    c = by_name(evaluate(facts(cpu_kernels=torch_only)))["cpu kernels"]
    assert c.status == WARN and "not used (llama-cpp-python is not installed" in c.finding
    assert c.hint.startswith(f"{EXE} -m pip install 'edgegem[cpu]'") and "the CPU fast path" in c.hint
    forced = dict(torch_only, reason="EDGEGEM_CPU_KERNELS=torch: the torch formats are forced")
    assert by_name(evaluate(facts(cpu_kernels=forced)))["cpu kernels"].hint == "unset EDGEGEM_CPU_KERNELS"
    assert by_name(evaluate(facts(torch_version=None, cpu_kernels=None)))["cpu kernels"].status == FAIL


def test_cpu_torch_beside_an_nvidia_driver_fails_with_the_pip_command():
    f = facts(torch_version="2.9.0+cpu", torch_cuda=None, torch_arch_list=[], cuda_available=False, gpus=[],
              triton_run=None)
    c = by_name(evaluate(f))
    assert c["torch"].status == FAIL
    assert c["torch"].finding == "2.9.0+cpu is a CPU-only build, but nvidia-smi sees NVIDIA GeForce RTX 3060"
    assert c["torch"].hint == (f"install the CUDA build: {EXE} -m pip install --force-reinstall torch "
                               "--index-url https://download.pytorch.org/whl/cu128")
    assert c["cuda"].status == FAIL
    assert doctor.exit_code(list(c.values())) == 1


def test_torch_newer_than_the_driver():
    f = facts(torch_version="2.9.0+cu130", torch_cuda="13.0", cuda_available=False, gpus=[], driver_cuda="12.6",
              driver_version="560.35.03", triton_run=None)
    c = by_name(evaluate(f))
    assert c["cuda"].status == FAIL
    assert c["cuda"].finding == "not available: torch needs CUDA 13.0, the driver supports up to 12.6"
    assert c["cuda"].hint.endswith("--index-url https://download.pytorch.org/whl/cu126")


def test_old_driver_and_hidden_devices():
    c = by_name(evaluate(facts(torch_cuda="12.6", cuda_available=False, gpus=[], driver_cuda="12.2",
                               driver_version="535.1", triton_run=None)))
    assert c["driver"].status == WARN and "update the NVIDIA driver" in c["driver"].hint
    assert c["cuda"].status == FAIL and "update the NVIDIA driver" in c["cuda"].hint
    c = by_name(evaluate(facts(cuda_available=False, gpus=[], cuda_visible_devices="", triton_run=None)))
    assert c["cuda"].status == FAIL and c["cuda"].hint == "unset CUDA_VISIBLE_DEVICES (or set it to 0)"


def test_gpu_the_torch_build_has_no_kernels_for():
    f = facts(gpus=[Gpu("NVIDIA GeForce GTX 1060 6GB", (6, 1), 5 * GiB, 6 * GiB)], driver_cuda="13.0")
    c = by_name(evaluate(f))
    assert c["gpu"].status == FAIL and "this torch build has no kernels for sm_61" in c["gpu"].finding
    assert c["gpu"].hint == f"older GPUs: {EXE} -m pip install --force-reinstall torch --index-url " \
                            "https://download.pytorch.org/whl/cu126"
    ok = facts(torch_arch_list=["sm_80", "compute_80"], gpus=[Gpu("RTX 4060", (8, 9), 7 * GiB, 8 * GiB)])
    assert by_name(evaluate(ok))["gpu"].status == OK  # PTX for 8.0 runs on 8.9


@pytest.mark.parametrize("name, cap, status, finding", [
    ("RTX 3060", (8, 6), OK, "sm_86: Triton kernels, bf16 attention dots, fp8 KV cache"),
    ("GTX 1660 SUPER", (7, 5), OK, "sm_75: Triton kernels, fp16 attention dots, no fp8 KV cache "
                                   "(int8_per_token_head is the same size)"),
    ("GTX 1080", (6, 1), WARN, "sm_61: the torch path runs (older than sm_75 (Turing), the oldest GPU the Triton "
                               "kernels are built for); no fp8 KV cache (int8_per_token_head is the same size)"),
])
def test_kernels_line_names_the_arch_and_what_runs(name, cap, status, finding):
    c = by_name(evaluate(facts(gpus=[Gpu(name, cap, 5 * GiB, 6 * GiB)], torch_arch_list=[])))
    assert (c["kernels"].status, c["kernels"].finding) == (status, finding)
    assert status == OK or "Turing (GTX 16xx, RTX 20xx)" in c["kernels"].hint
    if cap < (7, 5):  # Triton is never used there: a failing probe or a missing package is no FAIL
        broken = by_name(evaluate(facts(gpus=[Gpu(name, cap, 5 * GiB, 6 * GiB)], torch_arch_list=[],
                                        triton_run="PTXASError: ...")))
        assert broken["triton"].status == OK and broken["triton"].finding == \
            "3.5.0: not used on sm_61 (the torch path runs, see the kernels line)"
    two = by_name(evaluate(facts(gpus=[Gpu(name, cap, 5 * GiB, 6 * GiB), Gpu("RTX 4060", (8, 9), 7 * GiB, 8 * GiB)],
                                 torch_arch_list=[])))
    assert two["kernels 0"].finding == finding and two["kernels 1"].finding.startswith("sm_89: Triton kernels")
    no_triton = by_name(evaluate(facts(triton_version=None, triton_error="ModuleNotFoundError: triton")))
    assert no_triton["kernels"].finding.startswith("sm_86: the torch path runs (triton is not installed)")
    assert "kernels" not in by_name(evaluate(facts(cuda_available=False, gpus=[], triton_run=None)))


def test_vram_warnings():
    c = by_name(evaluate(facts(gpus=[Gpu("GT 1030", (8, 6), 1 * GiB, 2 * GiB)])))
    assert c["vram"].status == WARN and "small for Gemma-4 E2B" in c["vram"].finding
    c = by_name(evaluate(facts(gpus=[Gpu("RTX 3060", (8, 6), 3 * GiB, 12 * GiB)])))
    assert c["vram"].status == WARN and "other processes hold 9.0 GiB" in c["vram"].finding


def test_triton_failures():
    c = by_name(evaluate(facts(triton_run="RuntimeError: PTX .version 8.7 does not support .target sm_120")))
    assert c["triton"].status == FAIL and "cannot compile and run a kernel: RuntimeError: PTX" in c["triton"].finding
    assert "--attention-backend torch" in c["triton"].hint
    c = by_name(evaluate(facts(triton_version=None, triton_error="ModuleNotFoundError: No module named 'triton'")))
    assert c["triton"].status == FAIL and "pip install triton" in c["triton"].hint


def test_torch_missing_and_folders():
    c = by_name(evaluate(facts(torch_version=None, torch_error="ImportError: libcudart.so.12", torch_cuda=None,
                               cuda_available=False, gpus=[], triton_run=None)))
    assert c["torch"].status == FAIL and c["torch"].hint.endswith("whl/cu128")
    c = by_name(evaluate(facts(data_dir_error="cannot create it in /x", models=[], mem_available=GiB)))
    assert c["data dir"].status == FAIL and "EDGEGEM_DATA_DIR" in c["data dir"].hint
    assert c["models"].status == WARN and c["models"].hint.startswith("edgegem pull ")
    assert c["host ram"].status == WARN


@pytest.mark.parametrize("driver, cap, index", [("13.0", (8, 6), "cu130"), ("13.1", (6, 1), "cu128"),
                                                ("12.9", None, "cu128"), ("12.8", None, "cu128"),
                                                ("12.6", None, "cu126"), ("12.4", None, None), (None, None, None)])
def test_torch_index_for_driver(driver, cap, index):
    assert torch_index(driver, cap) == index


def test_report_lines_and_json():
    checks = evaluate(facts(cuda_available=False, gpus=[], torch_version="2.9.0+cpu", torch_cuda=None,
                            triton_run=None))
    text = doctor.report(checks).splitlines()
    for ln in text:
        assert LINE.match(ln) or ln.startswith("      fix: "), ln
    assert sum(ln.startswith("      fix: ") for ln in text) == sum(c.status != OK and bool(c.hint) for c in checks)
    d = json.loads(doctor.report(checks, as_json=True))
    assert d["ok"] is False and {c["status"] for c in d["checks"]} >= {OK, FAIL}
    assert set(d["checks"][0]) == {"status", "check", "finding", "hint"}


def test_probe_nvidia_smi_parses_the_driver(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\nif [ -n "$1" ]; then echo "570.86.10, NVIDIA GeForce RTX 4060 Laptop GPU"; '
                   'else echo "| NVIDIA-SMI 570.86.10    Driver Version: 570.86.10    CUDA Version: 12.8     |"; fi\n')
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    f = Facts(python=(3, 11, 0), executable=EXE)
    doctor_probes.probe_nvidia_smi(f)
    assert (f.driver_version, f.driver_cuda, f.smi_gpus) == ("570.86.10", "12.8", ["NVIDIA GeForce RTX 4060 Laptop GPU"])


def test_probe_dirs(tmp_path):
    f = Facts(python=(3, 11, 0), executable=EXE)
    doctor_probes.probe_dirs(f, str(tmp_path / "data"), None)
    assert f.data_dir == str(tmp_path / "data") and f.data_dir_missing and f.data_dir_error is None
    assert f.models_dir == str(tmp_path / "data" / "models") and not (tmp_path / "data").exists()  # changes nothing
    (tmp_path / "file").write_text("")
    f = Facts(python=(3, 11, 0), executable=EXE)
    doctor_probes.probe_dirs(f, str(tmp_path / "file" / "data"), None)
    assert f.data_dir_error == f"cannot create it in {tmp_path / 'file'}"


def test_triton_probe_kernel_runs_in_the_interpreter():
    """The probe's kernel source is valid: Triton's CPU interpreter runs it (the GPU run is the same script)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    assert doctor_probes.run_triton_probe("cpu", env=env) == "ok"


def test_cli_exit_code_follows_fails(monkeypatch, tmp_path, capsys):
    def cpu_torch_with_driver(f):
        f.torch_version, f.torch_cuda, f.smi_gpus, f.driver_cuda = "2.9.0+cpu", None, ["RTX 3060"], "12.8"
    monkeypatch.setattr(doctor_probes, "probe_torch", cpu_torch_with_driver)
    monkeypatch.setattr(doctor_probes, "probe_nvidia_smi", lambda f: None)
    monkeypatch.setattr(doctor_probes, "probe_triton", lambda f: None)
    assert main(["doctor", "--data-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  torch: 2.9.0+cpu is a CPU-only build, but nvidia-smi sees RTX 3060" in out
    assert "whl/cu128" in out


def test_real_run_on_this_machine(tmp_path):
    env = {**os.environ, "EDGEGEM_DATA_DIR": str(tmp_path / "data")}
    env.pop("EDGEGEM_MODELS_DIR", None)
    r = subprocess.run([sys.executable, "-m", "app.cli", "doctor"], capture_output=True, text=True, env=env,
                       timeout=120)
    lines = r.stdout.strip().splitlines()
    assert all(LINE.match(ln) or ln.startswith("      fix: ") for ln in lines), r.stdout
    names = [ln[6:].split(":")[0] for ln in lines if LINE.match(ln)]
    assert names[:3] == ["python", "torch", "cuda"] and names[-3:] == ["host ram", "data dir", "models"]
    assert r.returncode == (1 if any(ln.startswith("FAIL") for ln in lines) else 0)
    import torch
    if not torch.cuda.is_available():
        assert "WARN  cuda: no GPU: the CPU path will be used" in lines
    r = subprocess.run([sys.executable, "-m", "app.cli", "doctor", "--json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert json.loads(r.stdout)["ok"] == (r.returncode == 0)
