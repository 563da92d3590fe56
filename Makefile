# serving-truth: see README.md. Every target works from a clean clone.
PYTHON  ?= python3
VENV    ?= .venv
PIN     ?= v0.33.0
RUNTIME ?= local
SYSTEMS ?= all
LAYOUTS ?= all
BIN     := $(VENV)/bin

.PHONY: setup env audit render diff test bench pins clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

# Build (once, cached under ~/.cache/serving-truth) the environment holding the pinned vLLM wheel.
env: setup
	$(BIN)/serving-truth env $(PIN)

audit: setup
	$(BIN)/serving-truth audit $(PIN) --runtime $(RUNTIME) --systems $(SYSTEMS) --layouts $(LAYOUTS)

# Re-render a ledger from a run directory's evidence: make render RUN=~/.cache/serving-truth/runs/...
render: setup
	$(BIN)/serving-truth render $(RUN)

# reports/diffs/<FROM>..<TO>.md from two audited pins: make diff FROM=v0.30.0 TO=v0.33.0
diff: setup
	$(BIN)/serving-truth diff $(FROM) $(TO)

pins: setup
	$(BIN)/serving-truth pins

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python benchmarks/bench_audit.py --pin $(PIN)

clean:
	rm -rf $(VENV) build *.egg-info
