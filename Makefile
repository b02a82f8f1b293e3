# Two commands on a fresh machine (only python3 needed): `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[profile,plot,test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python examples/quickstart.py

test: install
	$(BIN)/python -m pytest -q -ra tests

test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not slow" tests

bench: install
	for f in benchmarks/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) runs build *.egg-info
