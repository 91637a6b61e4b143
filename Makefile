# Two commands do all set-up on a fresh machine:
#   make chat   installs edgegem with the demo model and starts it
#   make test   installs edgegem with the test extras and runs the suite
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# CPU build that CI uses; a user who already has a (CUDA) torch in the venv keeps it.
TORCH_SPEC ?= torch==2.13.0

.PHONY: chat test test-suite test-triton36-idle venv torch deps clean gpu-check gpu-dry-run wheels test-triton36 t36-venv oterm-venv compile-check

# Byte-code as it is used: pip installs without compiling (its ahead-of-time pass over every file of
# torch, transformers and the rest is ~40% of an install's time) and Python writes a module's
# byte-code the first time a process imports it, so PYTHONDONTWRITEBYTECODE is not passed on.
unexport PYTHONDONTWRITEBYTECODE
PIP := -m pip install --quiet --no-compile --disable-pip-version-check

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip

torch: $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) $(PIP) "$(TORCH_SPEC)"

# ruff first (pyproject.toml's rules; under a second for the whole tree). The suite runs on
# llama.cpp's CPU kernels (the test extra has llama-cpp-python), then the CPU
# runtime's tests again on the torch formats a plain `pip install edgegem` runs (EDGEGEM_CPU_KERNELS=torch).
# TEST_WORKERS pytest-xdist workers, each test module on one of them (its module fixtures built
# once), each worker with its share of the cores (tests/conftest.py); TEST_WORKERS=0 runs in one.
TEST_WORKERS ?= 2
# A worker that dies (out of memory) ends the run at once: xdist would otherwise restart it and
# could leave the rest of its module unscheduled, waiting for ever.
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --max-worker-restart 0)
# The installs run side by side: the project's (one core: pip, or llama-cpp-python's build from
# source where pip has no wheel of it yet), the triton 3.6 venv's and oterm's (test_server_oterm.py)
# on the core it leaves idle.
# The torch pass collects only the files that use the marker.
CPU_RUNTIME_TESTS = $(shell git grep -l "mark.cpu_runtime" -- 'tests/*.py')
test:
	$(MAKE) --no-print-directory -j3 $(DEPS) t36-venv oterm-venv
	$(VPY) -m ruff check --quiet .
	$(MAKE) --no-print-directory -j2 test-suite test-triton36-idle
	EDGEGEM_CPU_KERNELS=torch $(VPY) -m pytest -q $(XDIST) -m "cpu_runtime and not cuda" $(PYTEST_ARGS) \
		$(CPU_RUNTIME_TESTS)

test-suite:
	$(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The triton 3.6 pass beside the suite at the lowest priority (nice 19): it runs on the cycles the
# suite leaves idle (~6% of two cores: workers waiting on a server, a UI, a subprocess) and on the
# core the suite's last module leaves free; its output goes to .cache/test-triton36.log, its
# summary (the log's end when it fails) is printed when it ends.
test-triton36-idle: t36-venv
	@mkdir -p .cache; nice -n 19 $(MAKE) --no-print-directory test-triton36 > .cache/test-triton36.log 2>&1; \
		rc=$$?; tail -n $$([ $$rc = 0 ] && echo 2 || echo 80) .cache/test-triton36.log; exit $$rc

# The project with its test and demo extras, again when pyproject.toml changes.
DEPS := $(VENV)/.deps
deps: $(DEPS)
$(DEPS): pyproject.toml | torch
	$(VPY) $(PIP) -e ".[test,demo]"
	touch $@

oterm-venv:
	$(PY) tests/oterm_venv.py

# The kernel tests again under triton 3.6, the version GPU machines carry (with numpy >= 2.3, as
# pip picks it), so the code the GPU compiles is the code the CPU tests. A second,
# small venv, made after .venv (so llama-cpp-python comes from the wheel pip built for it): the CPU
# torch as above, triton 3.6 and what the kernel tests import. ~30 s to make, ~2 min to run.
T36 := .venv-triton36
T36PY := $(T36)/bin/python
TRITON36_SPEC ?= triton==3.6.*
T36_DEPS := numpy pytest pytest-asyncio pytest-xdist gguf tokenizers jinja2 safetensors platformdirs pillow
T36_LLAMA := llama-cpp-python==0.3.36
# The kernel tests are the folder tests/kernels/triton/ (the compile check and the ggml tests sit
# beside it in tests/kernels/: they do not depend on the triton version run here, and the compile
# check alone is ~275 s cold), plus the batched decoder on the triton backend.
KERNEL_TESTS := tests/kernels/triton tests/engine/test_batch_decode.py::test_triton_backend_batched_equals_reference

# llama-cpp-python last, once .venv has it (pip then has the wheel it built: never two builds at once).
$(T36)/.base:
	$(PY) -m venv $(T36)
	$(T36PY) $(PIP) "$(TORCH_SPEC)" "$(TRITON36_SPEC)" $(T36_DEPS)
	touch $@

$(T36)/.ready: $(T36)/.base $(DEPS)
	$(T36PY) $(PIP) $(T36_LLAMA)
	touch $@

t36-venv: $(T36)/.ready

test-triton36: t36-venv
	PYTHONPATH=$(CURDIR) $(T36PY) -m pytest -q -p no:cacheprovider $(XDIST) $(KERNEL_TESTS)

# The full compile check: every launch of E2B and E4B, five KV formats, six archs (~2,000 compiles,
# about an hour of CPU from a cold cache; `make test` runs the core of it: tests/kernels/test_kernel_compile.py).
# Run it when a kernel, its launcher or its launch parameters change.
compile-check: torch
	$(VPY) $(PIP) -e ".[test]"
	EDGEGEM_COMPILE_CHECK=full $(VPY) -m pytest -q -s tests/kernels/test_kernel_compile.py

chat: torch
	$(VPY) $(PIP) -e ".[demo,preview]"
	$(VENV)/bin/edgegem

# On a machine with an NVIDIA GPU: the decode GEMV bandwidth table, an engine bench and the CUDA tests,
# in that order, in one Markdown report rewritten after every part (path printed; $OUT/gpu-check.md
# when $OUT is set), each part's output in <part>.log beside it. Quick by default: E2B's GEMV table and
# one E2B bench, inside 440 s (GPU_CHECK_ARGS= for the full check: E2B/E4B, bf16 and int8 KV).
# Runs with the machine's own python3 and its CUDA torch, not the CPU venv above; what the GPU parts
# import and the machine lacks is installed first into .site/, from the wheels in .whl/ when that
# folder exists (`make wheels` fills it here).
GPU_CHECK_ARGS ?= --quick
gpu-check:
	TRITON_INTERPRET=0 $(PY) packaging/gpu_check.py $(GPU_CHECK_ARGS)

# .whl/ for a GPU machine without a package index: gguf and diskcache for its Python (3.12), from
# pip's cache; llama-cpp-python as the wheel pip built for `make test` (packaging/gpu_install.py).
wheels: $(VPY)
	$(VPY) packaging/gpu_check.py wheels

# The GPU machine's Python without the GPU: a venv holding only what that machine has of ours
# (python 3.12, torch 2.11 and triton 3.6 as PyPI ships them, numpy, jinja2, tokenizers, pytest)
# in which `gpu_check.py --quick --dry-run` runs the real install from .whl/ and imports everything
# the GPU parts import, so a wheel missing from .whl/ fails here, not on the GPU. 4.7 GB and ~2 min
# to make (PyPI's torch is the CUDA build, as there); the dry run itself ~2 min on 2 busy cores.
# The first python3.12 that runs (on PATH, else a pyenv install of it), else python3.
DEVICE_PY ?= $(firstword $(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null) \
	$(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3)
DEVICE_SPEC ?= torch==2.11.* triton==3.6.* numpy jinja2 tokenizers pytest
DEV := .venv-device
DEVPY := $(DEV)/bin/python

$(DEVPY):
	$(DEVICE_PY) -m venv $(DEV)
	$(DEVPY) -m pip install --quiet $(DEVICE_SPEC)

gpu-dry-run: $(DEVPY)
	@test -d .whl || $(MAKE) --no-print-directory wheels
	rm -rf .cache/gpu-dry-run
	$(DEVPY) packaging/gpu_check.py --quick --dry-run --out .cache/gpu-dry-run/gpu-check.md \
		--site .cache/gpu-dry-run/site

clean:
	rm -rf $(VENV) $(T36) $(DEV) .site build *.egg-info
