# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test golden install-demo install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install-demo: $(PY)
	$(PY) -m pip install -q -e '.[demo]'

install-test: $(PY)
	$(PY) -m pip install -q -e '.[test]'

demo: install-demo
	$(VENV)/bin/rlhf-tasks launch tasks/tiny-grpo.yaml

test: install-test
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs

golden: install-test
	$(PY) tests/test_providers_render.py
