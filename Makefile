# Every target is self-sufficient on a fresh clone: it creates .venv, installs
# prazo (editable, with the extras the tests and demos use) and builds the C twin.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prazo-installed
EXTRAS := test,servers,clients,metrics,dev
PYTEST_ARGS ?=

.PHONY: all venv build test demo bench check sanitize clean

all: test

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "setuptools>=70" "Cython>=3.1" wheel
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[$(EXTRAS)]"
	touch $(STAMP)

venv: $(STAMP)

# Rebuilds the extension in place whenever the .pyx/.pxd/.h changed.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

test: build
	$(PY) -m pytest tests $(PYTEST_ARGS)

demo: build
	$(VENV)/bin/prazo demo

bench: build
	$(PY) -m pytest bench --benchmark-only --benchmark-columns=min,median,mean,ops,rounds --benchmark-sort=name $(PYTEST_ARGS)

check: build
	$(VENV)/bin/ruff check core bindings tests bench
	$(VENV)/bin/mypy

# The core suite against a C twin built with AddressSanitizer + UBSan (-O0 -g3),
# in build/asan so the normal build is left alone.
ASAN_DIR := build/asan
sanitize: $(STAMP)
	rm -rf $(ASAN_DIR) $(ASAN_DIR)-tmp
	PRAZO_SANITIZE=1 PRAZO_DEBUG_BUILD=1 $(PY) setup.py -q build_ext -b $(ASAN_DIR) -t $(ASAN_DIR)-tmp --force
	cp core/*.py $(ASAN_DIR)/prazo/core/
	LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1 \
		PYTHONPATH=$(ASAN_DIR) $(PY) -m pytest -p no:cacheprovider -q \
		tests/test_queue_semantics.py tests/test_queue_statemachine.py tests/test_queue_threads.py tests/test_seed_scenario.py

clean:
	rm -rf $(VENV) build *.egg-info core/_queue_c.c bindings/_wsgi_c.c core/*.so bindings/*.so .pytest_cache .hypothesis .benchmarks
