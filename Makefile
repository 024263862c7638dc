# Two commands on a fresh clone: `make demo` (venv + the demo merge) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo lint test test-fast test-no-avx512 venv clean-demo

$(VENV)/.installed: pyproject.toml setup.py $(wildcard mergepipe/*/*.c)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,workflow,bench]'
	touch $@

venv: $(VENV)/.installed

# mergekit lives in its own venv (its dependency set is large); tests compare against it.
.venv-mergekit/.installed:
	$(PYTHON) -m venv .venv-mergekit
	.venv-mergekit/bin/pip install -q torch==2.13.0 mergekit==0.1.5
	touch $@

# The demo is the build: Snakemake (profiles/default) generates the demo family, indexes
# each model, plans and merges (a no-op when nothing changed); then the output is rehashed.
demo: venv
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake merged/model.safetensors
	$(BIN)/mergepipe verify merged

# ruff's settings are in pyproject.toml ([tool.ruff]); `make test` runs it first, so CI enforces it.
LINTED := mergepipe tests bench scripts mergepipe_eval
lint: venv
	$(BIN)/ruff check $(LINTED)

test: lint .venv-mergekit/.installed
	$(BIN)/python -m pytest -q --durations=15

# The whole suite as a CPU without AVX-512 runs it: the C kernels (util/cpu.py), torch, numba,
# numpy and OpenBLAS each dispatch at most AVX2 (a test of the AVX-512 build skips, saying so).
NO_AVX512 := MERGEPIPE_CPU_LEVEL=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 NUMBA_CPU_NAME=haswell \
	NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR" OPENBLAS_CORETYPE=Haswell
test-no-avx512: venv .venv-mergekit/.installed
	$(NO_AVX512) $(BIN)/python -m pytest -q

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow"

clean-demo:
	rm -rf models/demo merged .mergepipe index plans logs
