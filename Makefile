# Quickstart: `make demo` runs the demo, `make test` the tests. Both set up .venv themselves.
PY := .venv/bin/python
# torch==2.13.0 is a CPU build already on disk here; installed only when torch is missing,
# so a machine that has a CUDA torch keeps it.
TORCH_PIN := torch==2.13.0
# The kernels are written and tested against Triton 3.6 (the H200 image's); Triton 3.9's
# interpreter rejects their masks (29 CPU kernel tests fail), so a fresh .venv gets 3.6.0.
TRITON_PIN := triton==3.6.0

.PHONY: setup demo test bench
setup: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q $(TRITON_PIN)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(PY) -m mha_compile.demo

test: setup
	TRITON_INTERPRET=1 $(PY) -m pytest -q

bench: setup
	$(PY) -m bench
