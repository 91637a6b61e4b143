# Two commands do all set-up on a fresh machine:
#   make chat   installs edgegem with the demo model and starts it
#   make test   installs edgegem with the test extras and runs the suite
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# CPU build that CI uses; a user who already has a (CUDA) torch in the venv keeps it.
TORCH_SPEC ?= torch==2.13.0

.PHONY: chat test venv torch clean gpu-check

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip

torch: $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --quiet "$(TORCH_SPEC)"

# The suite runs on llama.cpp's CPU kernels (the test extra has llama-cpp-python), then the CPU
# runtime's tests again on the torch formats a plain `pip install edgegem` runs (EDGEGEM_CPU_KERNELS=torch).
test: torch
	$(VPY) -m pip install --quiet -e ".[test,demo]"
	$(VPY) -m pytest -q $(PYTEST_ARGS)
	EDGEGEM_CPU_KERNELS=torch $(VPY) -m pytest -q -m "cpu_runtime and not cuda" $(PYTEST_ARGS)

chat: torch
	$(VPY) -m pip install --quiet -e ".[demo]"
	$(VENV)/bin/edgegem

# On a machine with an NVIDIA GPU: the CUDA tests, the decode GEMV bandwidth microbenchmark and the
# engine bench (E2B/E4B, bf16 and int8 KV) in one Markdown report (path printed; $OUT/gpu-check.md when
# $OUT is set). Runs with the machine's own python3 and its CUDA torch, not the CPU venv above; what is
# missing is installed first, from wheels in .whl/ when that folder exists (see packaging/gpu_check.py).
gpu-check:
	TRITON_INTERPRET=0 $(PY) packaging/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
