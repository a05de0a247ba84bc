# swiftspec-mpi: two commands for a fresh machine (Debian, Python 3.11):
#   make run    # venv + embedded Qwen2.5-Coder 0.5B->1.5B pair (Q4_K_M GGUF, run with packed
#               # 4-bit weights; QUANT=none converts once to bf16 and runs that) + an async run
#   make chat   # the same models, an interactive chat session (type, Enter; Ctrl-D ends)
#   make test   # venv + the test suite (the command CI runs)
# Every target (re)creates .venv idempotently from requirements/cpu.txt and the project files.

VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
export SWIFTSPEC_CACHE ?= $(CURDIR)/.cache/models
NP ?= 2
MAX_NEW_TOKENS ?= 128
DTYPE ?= bfloat16
QUANT ?= auto
PROMPT ?= Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.
PYTEST_ARGS ?=

.PHONY: run chat test venv models bench clean

$(VENV)/.installed: requirements/cpu.txt setup.py setup.cfg pyproject.toml scheduler/tree.pyx
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

venv: $(VENV)/.installed

models: venv
	$(BIN)/swiftspec models prepare default $(if $(filter none,$(QUANT)),,--gguf-only)

run: models
	mkdir -p runs
	$(BIN)/mpiexec -n $(NP) $(BIN)/swiftspec run --mode async --chat --dtype $(DTYPE) --quant $(QUANT) \
	    --max-new-tokens $(MAX_NEW_TOKENS) --prompt "$(PROMPT)" --out runs/run.h5 --overwrite
	$(BIN)/swiftspec analyze runs/run.h5

chat: models
	mkdir -p runs
	$(BIN)/mpiexec -n $(NP) $(BIN)/swiftspec run --interactive --mode async --chat --dtype $(DTYPE) --quant $(QUANT) \
	    --max-new-tokens $(MAX_NEW_TOKENS) --out runs/chat.h5 --overwrite

test: venv
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

clean:
	rm -rf build dist *.egg-info swiftspec_mpi/*.so swiftspec_mpi/*/*.so swiftspec_mpi/packed/_cpu_gemm.c scheduler/*.c
