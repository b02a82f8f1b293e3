# Two commands on a fresh machine (only python3 needed): `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The declared floors (pyproject.toml): `make test-floor` tests them in a separate venv.
FLOOR_TF    := 2.16.2
FLOOR_KERAS := 3.10.0
FLOOR_VENV  := .venv-floor
FLOOR_TESTS := tests/test_schedules.py tests/test_accumulation.py tests/test_nan_guard.py tests/test_fit.py \
               tests/test_plateau_and_lr_logger.py tests/test_cli_and_launch.py

.PHONY: install demo test test-slow doctest test-floor bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[profile,plot,test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python examples/quickstart.py

# The docstring examples run as doctests (a few seconds; --timeout stops a hung one instead of waiting).
DOCTEST := -m pytest -q -ra -p no:cacheprovider --doctest-modules --timeout=60 --timeout-method=thread \
           keras_scale keras_scale_cli.py

# The suite runs in PYTEST_WORKERS processes (pytest-xdist; tests are independent, each worker has its own 2
# logical CPUs). `make test`: the doctests and every test not marked slow; `make test-slow`: the tests that start
# TensorFlow in other processes (multi-worker jobs, kills, the launcher); CI (.ci/run) runs both. Each prints its
# slowest tests and, at the end, its wall time (pass or fail).
PYTEST_WORKERS ?= 4
# the slow tests start 2-3 TensorFlow processes each: 2 of them at a time (4 at once, 12 processes on 2 cores,
# once made a worker crash in TensorFlow's collective abort path)
SLOW_WORKERS ?= 2
PYTEST := -m pytest -q -ra -p no:cacheprovider --dist worksteal --durations=15

test: install
	@start=$$(date +%s); \
	$(BIN)/python $(DOCTEST) && $(BIN)/python $(PYTEST) -n $(PYTEST_WORKERS) -m "not slow" tests; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s wall ($$(nproc) CPUs)"; exit $$rc

test-slow: install
	@start=$$(date +%s); \
	$(BIN)/python $(PYTEST) -n $(SLOW_WORKERS) -m slow tests; rc=$$?; \
	echo "make test-slow: $$(( $$(date +%s) - start )) s wall ($$(nproc) CPUs)"; exit $$rc

doctest: install
	$(BIN)/python $(DOCTEST)

# A fast subset at the lowest versions pyproject.toml allows (not run by `make test`; a few GB download).
test-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install -q "tensorflow==$(FLOOR_TF)" "keras==$(FLOOR_KERAS)" -e ".[test]"
	$(FLOOR_VENV)/bin/python -c "import tensorflow as tf, keras; print('floor: tensorflow', tf.__version__, 'keras', keras.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -q -ra -m "not slow" $(FLOOR_TESTS)

bench: install
	for f in benchmarks/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) $(FLOOR_VENV) runs build dist *.egg-info
