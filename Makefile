# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv and install what they need (the multinode extra, NIXL, included). On a GPU host, install the CUDA build of torch
# into .venv first (or set TORCH_SPEC); the default is the CPU build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo demo-sim test bench wheel-smoke gpu-wheels clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-pin.txt
	$(BIN)/pip install -q -c $(VENV)/torch-pin.txt -e '.[test,multinode]'  # never replaces the torch build
	touch $@

install: $(BIN)/.installed

demo: install
	$(BIN)/hsd demo --out runs/demo

demo-sim: install
	rm -rf runs/demo-sim
	$(BIN)/hsd launch --config deploy/configs/demo-sim.yaml run.dir=runs/demo-sim

# Two workers (pytest-xdist): most tests wait on real processes and sockets, so two at a time
# keep the 2 cores busy; then the few marked serial, alone (they act on the whole machine's shared
# memory, or time seeded kills that the others' load and cleanups disturb). A short temporary root
# keeps the tests' ipc:// socket paths under the 100-byte limit of a Unix socket. First of all, the
# import layers (pyproject.toml's [tool.importlinter] contract): an upward import fails make test.
test: install
	$(BIN)/lint-imports --no-logo
	@tmp=$$(mktemp -d /tmp/hsdt-XXXXXX); \
	$(BIN)/pytest -q -n 2 -m "not serial" --durations=15 --basetemp=$$tmp/t; rc=$$?; \
	$(BIN)/pytest -q -m serial --basetemp=$$tmp/s; rc2=$$?; \
	rm -rf $$tmp; [ $$rc -eq 0 ] && [ $$rc2 -eq 0 ]

bench: install
	$(BIN)/hsd bench transport

# The built wheel in a fresh venv, run from outside the checkout (CI runs it after make test).
wheel-smoke:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" .ci/wheel_smoke.sh

# What a stock PyTorch image may lack to run hsd bench gpu from this checkout (it has torch and transformers, and
# with transformers numpy, safetensors, tokenizers, tqdm; no registry is reachable there): every other runtime
# dependency, as wheels for its Python (3.12) carried as .whl/ (README, docs/gpu-check.md). A test downloads the
# same list for its own interpreter and proves it enough (tests/benchmarks/test_gpu_wheels.py).
GPU_WHEELS ?= pyzmq==27.3.0 msgspec==0.23.0 msgpack==1.2.4 psutil==7.2.2 prometheus_client==0.26.0 PyYAML==6.0.4 accelerate==1.16.0
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEEL_DIR ?= .whl
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
gpu-wheels:
	rm -rf $(GPU_WHEEL_DIR) && mkdir -p $(GPU_WHEEL_DIR)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_WHEEL_DIR) $(GPU_WHEELS)
	@ls $(GPU_WHEEL_DIR)

clean:
	rm -rf runs .pytest_cache .import_linter_cache
