# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast golden install-demo install-test kube clean

$(PY):
	@echo "make: creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install-demo: $(PY)
	@echo "make: installing rlhf-tasks with the demo's needs into $(VENV): Ray, and torch as PyPI serves it for Linux, the CUDA build (about 4.5 GB with CUDA's libraries; the demo runs it on the CPU): a few minutes the first time"
	$(PY) -m pip install -q -e '.[demo]'

install-test: $(PY)
	@echo "make: installing rlhf-tasks with the test extras (Ray, torch, dstack, SkyPilot, pytest) into $(VENV): a few minutes the first time"
	$(PY) -m pip install -q -e '.[test]'

demo: install-demo
	@echo "make: the command is $(VENV)/bin/rlhf-tasks; 'source $(VENV)/bin/activate' puts it on this shell's PATH"
	$(VENV)/bin/rlhf-tasks launch tasks/tiny-grpo.yaml

# The Kubernetes tests' programs (etcd, kube-apiserver, ..., the KubeRay operator), built with Go
# once per version set into ~/.cache/rlhf-tasks/kube (tests/kube/README.md).
kube:
	@bash tests/kube/build.sh >/dev/null

# Three workers (pytest-xdist): the Kubernetes tests in one, first, the dstack server's in another, the rest
# wherever a worker is free, at most two cluster tests at once besides dstack's, which mostly wait
# (tests/conftest.py: CLUSTER_SLOTS); on a cold cache the Kubernetes programs build in the background meanwhile,
# at nice 19 (tests/conftest.py says which tests go together and in what order). More at once does not end sooner:
# the suite is CPU-bound (docs/development.md). The 25 longest tests are listed at the end.
PYTEST_WORKERS := -n 3 --dist loadgroup --no-loadscope-reorder

test: install-test
	@bash tests/kube/build.sh --background >/dev/null
	$(PY) -m pytest -q $(PYTEST_WORKERS) --durations=25

# While you iterate: every test that starts no cluster, namespace host, Slurm or container.
test-fast: install-test
	$(PY) -m pytest -q $(PYTEST_WORKERS) -m "not cluster"

clean:
	rm -rf $(VENV)

golden: install-test
	$(PY) tests/test_providers_render.py
