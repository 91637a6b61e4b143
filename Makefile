# Two commands do all set-up on a fresh machine:
#   make chat   installs edgegem with the demo model and starts it
#   make test   installs edgegem with the test extras and runs the suite
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# CPU build that CI uses; a user who already has a (CUDA) torch in the venv keeps it.
TORCH_SPEC ?= torch==2.13.0

.PHONY: chat test venv torch clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip

torch: $(VPY)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --quiet "$(TORCH_SPEC)"

test: torch
	$(VPY) -m pip install --quiet -e ".[test,demo]"
	$(VPY) -m pytest -q $(PYTEST_ARGS)

chat: torch
	$(VPY) -m pip install --quiet -e ".[demo]"
	$(VENV)/bin/edgegem

clean:
	rm -rf $(VENV) build *.egg-info
