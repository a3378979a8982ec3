# make train: set up (.venv, install, digits shards) and run the main job. make test: set up and run the tests.
# make device-rehearsal: the GPU machine's stack on this CPU (benchmarks/device/rehearse.sh), before any GPU call.
# Both are idempotent: a second call reuses the environment, the shards and (train) the finished run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
# CPU: 2 ranks with cores/2 threads each; GPU: every GPU of this node
NPROC = $(shell $(PY) -c "import torch; print(torch.cuda.device_count() or 2)")
THREADS = $(shell echo $$(( $$(nproc) / $(NPROC) > 0 ? $$(nproc) / $(NPROC) : 1 )))
# no GPU: DeepSpeed's CPU accelerator, named so that every process does not warn that it found no GPU
ACCEL = $(shell $(PY) -c "import torch; print('' if torch.cuda.is_available() else 'cpu')")
# DeepSpeed's JIT-built ops in this environment's own folder (tests/conftest.py uses the same): built once, at
# set-up, not by the first job or test that needs them; two checkouts never share (and rebuild) each other's
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: train test test-slow install data clean wheels device-rehearsal
train: $(VENV)/.installed data
	OMP_NUM_THREADS=$(THREADS) $(if $(ACCEL),DS_ACCELERATOR=$(ACCEL)) $(VENV)/bin/deepspeed --log_level error --num_gpus $(NPROC) \
		train.py --config configs/digits-vit.yaml --resume latest

test: $(VENV)/.installed data
	$(PY) -m pytest -q tests

# the variants `make test` leaves out (~25 min on 2 cores); its last run: benchmarks/results/slow-tests/report.md
test-slow: $(VENV)/.installed data
	$(PY) -m pytest -q -m slow tests

# the environment alone (.venv and the pinned install): what a cluster's node runs first (launch/cluster.py)
install: $(VENV)/.installed

data: data/digits/_info.json data/digits-seg/_info.json

# the GPU machine (benchmarks/device/): .whl/, the packages it lacks; the rehearsal of its stack on this CPU
wheels: $(VENV)/.installed
	bash benchmarks/device/wheels.sh

device-rehearsal: $(VENV)/.installed data
	bash benchmarks/device/rehearse.sh

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m compat build_cpu_ops
	touch $@

data/digits/_info.json: $(VENV)/.installed data/make_shards.py
	$(PY) data/make_shards.py digits data/digits

data/digits-seg/_info.json: $(VENV)/.installed data/make_shards.py
	$(PY) data/make_shards.py digits-seg data/digits-seg

clean:
	rm -rf $(VENV) .venv-device .whl data/digits data/digits-seg runs
