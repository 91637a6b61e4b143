"""The runtime (models/runtime.py): which of the five is chosen for every combination of device,
`--exact`, Triton support and ggml availability (the probes monkeypatched: the rules, not this
machine), that the load flags it gives read back to it, that a loaded model carries it, and that
`info`, `doctor` and the engine's model info print it."""
from __future__ import annotations

import json

import pytest
import torch

from app import doctor
from app.cli import main
from app.doctor_probes import Facts, probe_runtimes
from models import runtime
from models.formats.ggml import describe_huge_pages as describe_pages
from models.runtime import Runtime, choose_runtime, runtime_of_flags
from tiny_models import TinySpec, quantize_gguf, write_tiny_gemma4

R = Runtime
# (device, exact, gguf, triton supported, ggml available) -> runtime
CASES = [
    ("cuda", False, True, True, True, R.TRITON),
    ("cuda", True, True, True, False, R.TRITON),  # --exact on Triton: float32 activations, same kernels
    ("cuda", False, False, True, False, R.TRITON),  # an HF folder on a Triton GPU too
    ("cuda", False, True, False, True, R.GPU_TORCH),  # older than sm_75 or no triton
    ("cuda", True, True, False, True, R.REFERENCE),
    ("cpu", True, True, False, True, R.REFERENCE),
    ("cpu", True, True, False, False, R.REFERENCE),
    ("cpu", False, True, False, True, R.GGML),
    ("cpu", False, True, True, True, R.GGML),  # Triton support is a CUDA matter
    ("cpu", False, True, False, False, R.CPU_TORCH),
    ("cpu", False, False, False, True, R.CPU_TORCH),  # an HF folder: no GGUF bytes for ggml
]


@pytest.mark.parametrize("device,exact,gguf,triton,ggml,expected", CASES)
def test_runtime_for_each_combination(device, exact, gguf, triton, ggml, expected):
    assert choose_runtime(device, exact, gguf=gguf, triton=triton, ggml=ggml) is expected


@pytest.mark.parametrize("device,exact,gguf,triton,ggml,expected", CASES)
def test_the_probes_decide_when_not_given(device, exact, gguf, triton, ggml, expected, monkeypatch):
    monkeypatch.setattr(runtime, "triton_available", lambda d: triton)
    monkeypatch.setattr(runtime, "ggml_available", lambda: ggml)
    assert choose_runtime(device, exact, gguf=gguf) is expected
    assert choose_runtime(torch.device(device), exact, gguf=gguf) is expected


@pytest.mark.parametrize("device,exact,gguf,triton,ggml,expected", CASES)
def test_load_flags_read_back_to_the_runtime(device, exact, gguf, triton, ggml, expected):
    """`Runtime.load_flags` (what open_model passes load_model) and `runtime_of_flags` (what
    load_model stores when given flags only) agree, so either way in the model is labelled alike."""
    flags = expected.load_flags(exact)
    assert runtime_of_flags(device, flags["weight_dtype"], flags["quantized"], flags["cpu_quant"], gguf=gguf,
                            ggml=ggml) is expected
    if expected is R.TRITON:
        assert flags["dtype"] == (torch.float32 if exact else torch.bfloat16)


def test_five_runtimes_each_with_a_line():
    assert [r.value for r in Runtime] == ["reference", "triton", "gpu_torch", "ggml", "cpu_torch"]
    assert all(r.detail and "\n" not in r.detail for r in Runtime)


def test_only_the_ggml_runtime_attends_on_ggml_unless_told_torch(monkeypatch):
    from types import SimpleNamespace

    from engine.kv.sequence import ggml_attention_for
    from kernels.env import reload

    assert [r for r in Runtime if r.attends_on_ggml()] == [R.GGML]
    assert ggml_attention_for(SimpleNamespace(runtime=R.GGML))
    assert not ggml_attention_for(SimpleNamespace(runtime=R.CPU_TORCH))
    assert not ggml_attention_for(SimpleNamespace())  # a model built without the loader: torch
    assert not ggml_attention_for(SimpleNamespace(runtime=R.GGML), backend=object())  # a kernel backend attends
    monkeypatch.setenv("EDGEGEM_CPU_ATTENTION", "torch")
    reload()
    assert not any(r.attends_on_ggml() for r in Runtime)
    assert not ggml_attention_for(SimpleNamespace(runtime=R.GGML))


@pytest.fixture(scope="module")
def tiny_q4km(tmp_path_factory):
    d = tmp_path_factory.mktemp("runtime")
    return quantize_gguf(write_tiny_gemma4(d / "f32.gguf", TinySpec(), seed=5), d / "q4km.gguf")


@pytest.mark.parametrize("exact,ggml,expected", [(True, True, R.REFERENCE), (False, False, R.CPU_TORCH),
                                                 (False, True, R.GGML)])
def test_open_model_stores_the_runtime(tiny_q4km, exact, ggml, expected, monkeypatch):
    from engine import api
    from models.formats import GGMLWeight, Int4Weight, is_ggml

    if ggml and not runtime.ggml_available():
        pytest.skip("llama.cpp's kernels are not available here")
    monkeypatch.setattr(runtime, "ggml_available", lambda: ggml)
    lm = api.open_model(tiny_q4km, exact=exact, device="cpu")
    assert lm.runtime is expected and lm.model.runtime is expected
    gate_up = lm.model.w["blk.0.ffn_gate_up.weight"] if not exact else lm.model.w["blk.0.ffn_gate.weight"]
    assert isinstance(gate_up, {R.REFERENCE: torch.Tensor, R.CPU_TORCH: Int4Weight, R.GGML: GGMLWeight}[expected])
    assert is_ggml(gate_up) is (expected is R.GGML)  # the ggml chains' one question of a weight
    client = api.start_client(lm, api.EngineOptions())
    try:
        info = client.model_info()
    finally:
        client.close()
    assert info["runtime"] == expected.value and info["runtime_detail"] == expected.detail


def test_load_model_with_flags_labels_the_model(tiny_q4km, monkeypatch):
    from models.loader import load_model

    monkeypatch.setattr(runtime, "ggml_available", lambda: False)
    assert load_model(tiny_q4km, with_tokenizer=False).runtime is R.REFERENCE
    assert load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16).runtime is R.CPU_TORCH
    fast = load_model(tiny_q4km, with_tokenizer=False, weight_dtype=torch.float16, cpu_quant=True)
    assert fast.runtime is R.CPU_TORCH and fast.model.runtime is R.CPU_TORCH


@pytest.mark.parametrize("ggml,expected", [(True, R.GGML), (False, R.CPU_TORCH)])
def test_info_prints_the_runtime(tiny_q4km, ggml, expected, monkeypatch, capsys):
    monkeypatch.setattr(runtime, "ggml_available", lambda: ggml)
    assert main(["info", str(tiny_q4km), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"runtime on cpu: {expected.value} ({expected.detail})" in out
    assert (f"  {describe_pages('auto')}\n" in out) is ggml
    assert main(["info", str(tiny_q4km), "--device", "cpu", "--exact", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"] == {"name": "reference", "detail": R.REFERENCE.detail}


def test_doctor_prints_the_runtime_per_device(monkeypatch):
    monkeypatch.setattr(runtime, "ggml_available", lambda: True)
    monkeypatch.setattr(runtime, "triton_available", lambda d: True)
    f = Facts(python=(3, 11, 0), executable="python", torch_version="2.9.0", cuda_available=True)
    probe_runtimes(f)
    pages = describe_pages("auto")  # where the matrices' bytes live
    assert f.runtimes == {"cpu": {"name": "ggml", "detail": R.GGML.detail, "weight_pages": pages},
                          "cuda": {"name": "triton", "detail": R.TRITON.detail}}
    c = doctor.check_runtime(f)
    assert c.status == doctor.OK and c.finding == f"cpu: ggml ({R.GGML.detail}); cuda: triton ({R.TRITON.detail})"
    assert "runtime" in doctor.report(doctor.evaluate(f))
    monkeypatch.setattr(runtime, "ggml_available", lambda: False)
    f = Facts(python=(3, 11, 0), executable="python", torch_version="2.9.0")
    probe_runtimes(f)
    assert doctor.check_runtime(f).finding == f"cpu: cpu_torch ({R.CPU_TORCH.detail})"
    assert doctor.check_runtime(Facts(python=(3, 11, 0), executable="x")).status == doctor.WARN
