# Every target is self-sufficient on a fresh clone: it creates .venv, installs
# prazo (editable, with the extras the tests and demos use) and builds the C twin.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prazo-installed
EXTRAS := test,docs,servers,clients,metrics,plot,dev,postgres,django,flask,grpc,otel
PYTEST_ARGS ?=

.PHONY: all venv build services test test-deep stress-tests demo bench check sanitize clean docs

all: test

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "setuptools>=77" "Cython>=3.1" wheel
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[$(EXTRAS)]"
	touch $(STAMP)

venv: $(STAMP)

# Rebuilds the extension in place whenever the .pyx/.pxd/.h changed.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

# The real servers the integration tests drive (PostgreSQL, HAProxy, nginx), and valgrind for
# `prazo bench instructions`' test: installed with apt-get when missing; the tests start their
# own instances on loopback.
services:
	bash .ci/ensure-services

# -ra lists every skip with its reason; under CI=true a skip that tests/support/_required.py
# does not allow fails the run (tests/conftest.py).
# Three workers (pytest-xdist) on this project's two cores: most tests wait on sockets and
# servers (the suite keeps the cores about half busy with two workers), and the suite is
# written to pass with a core taken (make stress-tests proves it with a CPU hog; three
# workers and a hog passed in 4:22, where two workers alone took 5:15). No test binds a fixed port.
# --dist loadfile keeps a file on one worker, so its module fixtures are set up once and
# its tests never race each other; each worker has its own session fixtures (its own
# PostgreSQL cluster, on a free port in its own directory). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 3
test: build services
	$(PY) -m pytest tests -ra -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The properties where the invariants live, at DEEP_FACTOR times their examples
# (HYPOTHESIS_PROFILE=deep, tests/conftest.py): the queue's policy mixes and
# lockstep state machine, and the outcome properties that drive real threads.
# CI runs it with a smaller factor to bound its time; DEEP_TESTS picks others.
DEEP_FACTOR ?= 10
DEEP_TESTS ?= tests/core/test_queue_statemachine.py tests/core/test_queue_policies_admission.py \
	tests/core/test_queue_policies_dequeue.py tests/core/test_queue_policies_combined.py tests/core/test_queue_concurrent.py \
	tests/pool/test_pool.py::test_every_submission_ends_in_exactly_one_outcome tests/dependency/test_dependency_breaker.py \
	tests/servers/test_frontdoor_policies.py::test_any_policy_mix_answers_every_request_once_and_balances
test-deep: build
	HYPOTHESIS_PROFILE=deep PRAZO_DEEP_FACTOR=$(DEEP_FACTOR) $(PY) -m pytest -q -p no:cacheprovider $(DEEP_TESTS) $(PYTEST_ARGS)

# The flake hunt: the real-time tests STRESS_RUNS times, each round in a fresh
# pytest with a CPU hog on the other core; prints each test's failure count and
# fails on any (.ci/stress_tests.py; STRESS_TESTS picks other node ids).
STRESS_RUNS ?= 20
STRESS_TESTS ?=
stress-tests: build services
	$(PY) .ci/stress_tests.py --runs $(STRESS_RUNS) $(STRESS_TESTS)

demo: build
	$(VENV)/bin/prazo demo

bench: build
	$(PY) -m pytest bench --benchmark-only --benchmark-columns=min,median,mean,ops,rounds --benchmark-sort=name $(PYTEST_ARGS)

# The same checks as .pre-commit-config.yaml, without pre-commit: lint, format, spelling
# (settings in pyproject.toml), the C's format (.clang-format), then the types. mypy and stubtest read the package as
# prazo.* through build/typecheck/prazo (pyproject.toml, [tool.mypy]); stubtest imports
# the built extensions and holds each .pyi beside them to what they really define.
# prazo's own C, held to .clang-format: every .c and .h under C_FOLDERS but the vendored
# picohttpparser and the .c that Cython generates beside each .pyx (the clang-format hook of
# .pre-commit-config.yaml names the same folders).
C_FOLDERS := core bindings tests
C_OWN = $(sort $(filter-out $(patsubst %.pyx,%.c,$(shell find $(C_FOLDERS) -name '*.pyx')), \
	$(shell find $(C_FOLDERS) -name vendor -prune -o \( -name '*.c' -o -name '*.h' \) -print)))
TYPECHECK := build/typecheck/prazo
STUBBED := prazo.core._queue_c prazo.core._histogram_c prazo.bindings._wsgi_c prazo.bindings._pool_c \
	prazo.bindings.servers.frontdoor._engine_c prazo.bindings.servers.plumbing._heads_c
check: build
	$(VENV)/bin/ruff check core bindings tests bench docs/conf.py docs/_ext
	$(VENV)/bin/ruff format --check core bindings tests bench docs/conf.py docs/_ext
	$(VENV)/bin/codespell
	$(VENV)/bin/clang-format --dry-run -Werror $(C_OWN)
	mkdir -p $(TYPECHECK)
	for folder in core bindings bench; do ln -sfn ../../../$$folder $(TYPECHECK)/$$folder; done
	$(VENV)/bin/mypy
	$(VENV)/bin/python -m mypy.stubtest --mypy-config-file pyproject.toml --allowlist .ci/stubtest-allowlist.txt $(STUBBED)

# The tests marked `compiled` (the core suite and the binding tests that run the
# compiled paths: the middleware's compiled path, the pool, the server dispatcher,
# the middleware on a real server, the front door, their subprocesses) against both extensions built with
# AddressSanitizer + UBSan (-O0 -g3), in build/asan so the normal build is left
# alone. build/asan holds a whole prazo tree and comes first on PYTHONPATH; the
# first command proves the sanitized modules are the ones imported.
# Any report fails the run: ASan aborts on its first error, UBSan halts (the
# build also compiles with -fno-sanitize-recover). --capture=sys leaves file
# descriptor 2 alone: with pytest's default fd capture the report of a process
# that dies went into a capture file and was never shown.
# detect_leaks=0: CPython never frees its own interned and static objects, so
# LeakSanitizer would report the interpreter at every exit. PYTHONMALLOC=malloc
# sends Python objects through malloc too, so ASan sees a freed object that an
# extension goes on using (pymalloc's arenas would hide it).
ASAN_DIR := build/asan
# The tests are those marked `compiled` (pyproject.toml) in the folders whose subject is
# prazo's own code; tests/integrations and tests/bench stay out: they import third-party
# extensions (grpcio, psycopg) that have no business under a preloaded ASan, and their
# compiled paths are the ones run here already. The server embeddings' suites carry no
# marker: their real-time assertions (a seed scenario at 300 ms per request) do not hold
# at ASan's speed on a loaded machine, and the queue and middleware code they run is
# covered here already. The front door's are in: its engine is C of its own, and its
# timings are generous enough for ASan.
ASAN_TESTS := tests/core tests/bindings tests/pool tests/servers
ASAN_ENV := LD_PRELOAD=$$(gcc -print-file-name=libasan.so) PYTHONPATH=$(CURDIR)/$(ASAN_DIR) PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
sanitize: $(STAMP)
	bash .ci/ensure-libasan
	PRAZO_SANITIZE=1 PRAZO_DEBUG_BUILD=1 bash .ci/build-extensions-beside $(ASAN_DIR) $(PY)
	$(ASAN_ENV) $(PY) .ci/check_extensions_from.py $(ASAN_DIR)
	$(ASAN_ENV) $(PY) -m pytest -p no:cacheprovider -q --capture=sys -m compiled $(ASAN_TESTS) $(PYTEST_ARGS)

# The sdist and the wheel as a package index would serve them, built from the files a
# fresh clone holds (.ci/dist_check.py): the wheel holds every module of the tree and no
# plots or notes, and installed in a fresh virtualenv with the extras the tests use, every
# module imports, `prazo` runs (serve on each server, demo, bench) and the whole suite runs
# from a copy of the tests where the repository is not on sys.path; the sdist and the
# Python twin alone run the shorter suites. Any setuptools warning in the build fails it.
# The extras are those of `make test` (EXTRAS): every optional package the suite and the
# benchmarks import (bench/test_bench_histogram.py's baseline hdrhistogram is in dev).
DIST_DIR := build/dist-check
.PHONY: dist-check test-versions
dist-check: $(STAMP) services
	$(PY) .ci/dist_check.py $(DIST_DIR) --extras $(EXTRAS)

# Every other CPython that requires-python claims, from pyenv: a wheel built from the sdist
# with each, installed with EXTRAS, every module imported, the core, bindings and docs
# suites run. A version pyenv lacks fails the target (the machine image carries them).
PYTHON_VERSIONS ?= 3.10,3.12,3.13
test-versions: $(STAMP) services
	$(PY) .ci/dist_check.py $(DIST_DIR)-versions --extras $(EXTRAS) --pythons $(PYTHON_VERSIONS)

# Free-threaded CPython (PEP 703): a 3.13 built with --disable-gil, once, outside the clone
# (.ci/ensure-freethreaded-python builds it from Debian's source package, about 10 minutes;
# FT_PREFIX picks another place). Its own virtualenv, the extensions built for it beside the
# 3.11 ones (their file names carry the ABI, cpython-313t), then: every prazo module imported
# with -W error::RuntimeWarning and no forcing, the GIL still off after (tests/freethreaded);
# the concurrent suites with PYTHON_GIL=0, so a module that asked for the GIL would be a
# race here, not a silent serialisation. The packages installed are the suites' own: some
# extras have no free-threaded wheels (psycopg2-binary, grpcio), and their suites stay out.
# hypothesis after 6.155.7 has no cp313t wheel and its sdist needs Rust crates.
FT_PREFIX ?= $(HOME)/.cache/prazo/cpython-3.13t
FT_VENV   := .venv-ft
FT_PY     := $(FT_VENV)/bin/python
FT_STAMP  := $(FT_VENV)/.prazo-installed
FT_PACKAGES := "setuptools>=77" "Cython>=3.1" wheel "pytest>=8" "hypothesis>=6.100,<=6.155.7" "h11>=0.14" \
	"pytest-benchmark>=4" "pytest-xdist>=3.5" "pytest-timeout>=2.3" "werkzeug>=3.0" "waitress>=3.0" "gunicorn>=27,<28" "cheroot>=10" "setproctitle>=1.3" \
	"requests>=2.31" "httpx>=0.27" "urllib3>=2.0" "prometheus_client>=0.20" pyyaml \
	"opentelemetry-api>=1.20" "opentelemetry-sdk>=1.20" "flask>=3.0" "django>=4.2"
# Two workers: without the GIL its threads really take both cores.
FT_WORKERS ?= 2
FT_TESTS ?= tests/freethreaded tests/core tests/pool tests/bindings tests/dependency tests/servers
.PHONY: test-freethreaded
$(FT_STAMP): pyproject.toml setup.py
	bash .ci/ensure-freethreaded-python $(FT_PREFIX)
	$(FT_PREFIX)/bin/python3.13t -m venv $(FT_VENV)
	$(FT_PY) -m pip install -q --disable-pip-version-check $(FT_PACKAGES)
	$(FT_PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $(FT_STAMP)

test-freethreaded: $(FT_STAMP) services
	$(FT_PY) setup.py -q build_ext --inplace
	$(FT_PY) -W error::RuntimeWarning -m prazo.bindings.freethreading --check-imports
	PYTHON_GIL=0 $(FT_PY) -m pytest $(FT_TESTS) -ra -n $(FT_WORKERS) --dist loadfile $(PYTEST_ARGS)

# ThreadSanitizer over the compiled paths with threads truly in parallel: a free-threaded
# CPython built with --with-thread-sanitizer (once, outside the clone, like FT_PREFIX's),
# prazo's extensions built with -fsanitize=thread beside it (PRAZO_TSAN=1), and the tests
# marked `compiled` of the concurrent suites with PYTHON_GIL=0 (not the Python twin's runs of
# a compiled module's tests: no C of prazo's for TSan there, and at its speed their real-time
# bounds do not hold). Any report fails the run
# (halt_on_error); each suppression in .ci/tsan-suppressions.txt says why it is one, and
# CPython's own list of races inside the interpreter (its Tools/tsan) is applied too.
# A bounded subset (TSAN_TESTS): TSan runs Python 5-15 times slower, and these are the
# tests that drive the queue, the pool, the middleware and the front door from many threads.
TSAN_PREFIX ?= $(HOME)/.cache/prazo/cpython-3.13t-tsan
# Its virtualenv holds only PyPI's test packages (prazo comes from TSAN_DIR on PYTHONPATH),
# so it lives beside the interpreter and is reused by every clone; pip under TSan is slow.
TSAN_VENV   := $(TSAN_PREFIX)-venv
TSAN_PY     := $(TSAN_VENV)/bin/python
TSAN_STAMP  := $(TSAN_VENV)/.installed-$(shell echo '$(FT_PACKAGES)' | md5sum | cut -c1-12)
TSAN_DIR    := build/tsan
TSAN_TESTS  ?= tests/core/test_queue_concurrent.py tests/core/test_queue_threads.py tests/core/test_histogram.py \
	tests/pool/test_future_condition.py tests/pool/test_pool.py tests/bindings/test_wsgi_fast_path.py \
	tests/servers/test_frontdoor.py
TSAN_ENV := PYTHONPATH=$(CURDIR)/$(TSAN_DIR) PYTHON_GIL=0 \
	TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(CURDIR)/$(TSAN_DIR)/suppressions.txt"
.PHONY: tsan
$(TSAN_STAMP):
	bash .ci/ensure-freethreaded-python $(TSAN_PREFIX) --tsan
	$(TSAN_PREFIX)/bin/python3.13t -m venv $(TSAN_VENV)
	$(TSAN_PY) -m pip install -q --disable-pip-version-check $(FT_PACKAGES)
	touch $(TSAN_STAMP)

# After `build`: the C that Cython generated for the 3.11 build is the same for this one
# and newer than the TSan venv's Cython, so it is not generated again under TSan (minutes).
tsan: $(TSAN_STAMP) services build
	PRAZO_TSAN=1 bash .ci/build-extensions-beside $(TSAN_DIR) $(TSAN_PY)
	# CPython's own known races (Tools/tsan, kept beside the interpreter), then ours.
	cat $(TSAN_PREFIX)/share/cpython-tsan-suppressions.txt .ci/tsan-suppressions.txt > $(TSAN_DIR)/suppressions.txt
	$(TSAN_ENV) $(TSAN_PY) .ci/check_extensions_from.py $(TSAN_DIR)
	$(TSAN_ENV) $(TSAN_PY) -m pytest -p no:cacheprovider -q --capture=sys -m "compiled and not python_twin" $(TSAN_TESTS) $(PYTEST_ARGS)

# Fuzzing (tests/fuzz, atheris from the optional extra `fuzz`). `make fuzz` runs
# each target FUZZ_SECONDS; `make fuzz-ci` runs them all in about a minute. Any
# crash fails the run; its input lands in $(FUZZ_DIR)/crashes, the full log in
# $(FUZZ_DIR)/TARGET.log. Inputs found on the way go to $(FUZZ_DIR)/corpus (kept
# between runs): the committed seeds in tests/fuzz/corpus are only read.
# An input running longer than FUZZ_TIMEOUT seconds is a finding too, saved as
# TARGET-timeout-*: short enough that a hang is reported within a few seconds
# rather than stopping the job, long enough for any input on a busy machine
# (each takes milliseconds; the timer checks every FUZZ_TIMEOUT / 2 + 1 s).
# A failed target prints the end of its log, its exit status and every input it
# saved, in base64, so a CI log alone is enough to replay it
# (base64 -d > FILE; PYTHONPATH=tests .venv/bin/python -m fuzz TARGET FILE).
# The front door's C engine has a libFuzzer harness of its own (tests/fuzz/c):
# atheris only sees the Python around it, and the engine is C that parses what
# any client sends. It is built with clang (gcc has no libFuzzer; .ci/ensure-clang
# installs it on a fresh machine) with ASan + UBSan, and runs FUZZ_C_SECONDS /
# FUZZ_CI_C_SECONDS over its own seeds (framing cases) in tests/fuzz/c/corpus.
FUZZ_TARGETS    := headers proxy_headers server_head middleware
FUZZ_SECONDS    ?= 60
FUZZ_CI_SECONDS ?= 11
FUZZ_C_SECONDS    ?= 300
FUZZ_CI_C_SECONDS ?= 15
FUZZ_TIMEOUT    ?= 3
FUZZ_DIR        := build/fuzz
FUZZ_STAMP      := $(VENV)/.prazo-fuzz-installed
FUZZ_C          := $(FUZZ_DIR)/frontdoor-c
PICO_DIR        := bindings/vendor/picohttpparser

.PHONY: fuzz fuzz-ci

$(FUZZ_STAMP): $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e ".[$(EXTRAS),fuzz]"
	touch $@

# -O1 -g: fast enough for millions of inputs, and a report names the line.
# -fno-sanitize-recover: a UBSan finding stops the run like an ASan one.
# -D_GNU_SOURCE: the harness includes pfd.h, which needs the POSIX socket types (the engine's
# files define it themselves, in pfd_internal.h).
FRONTDOOR_DIR   := bindings/servers/frontdoor/engine
FRONTDOOR_C     := $(wildcard $(FRONTDOOR_DIR)/*.c)
$(FUZZ_C): tests/fuzz/c/fuzz_frontdoor.c $(FRONTDOOR_C) $(wildcard $(FRONTDOOR_DIR)/*.h) core/prazo_line.h core/prazo_sync.h \
		core/prazo_policy.h core/prazo_budget.h $(PICO_DIR)/picohttpparser.c
	bash .ci/ensure-clang
	@mkdir -p $(FUZZ_DIR)
	clang -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -Wall -Wextra \
		-Wno-unused-function -I$(FRONTDOOR_DIR) -Icore -I$(PICO_DIR) tests/fuzz/c/fuzz_frontdoor.c \
		$(FRONTDOOR_C) $(PICO_DIR)/picohttpparser.c -lm -lpthread -o $@

fuzz: FUZZ_TIME = $(FUZZ_SECONDS)
fuzz: FUZZ_C_TIME = $(FUZZ_C_SECONDS)
fuzz-ci: FUZZ_TIME = $(FUZZ_CI_SECONDS)
fuzz-ci: FUZZ_C_TIME = $(FUZZ_CI_C_SECONDS)
fuzz fuzz-ci: $(FUZZ_STAMP) build $(FUZZ_C)
	@mkdir -p $(FUZZ_DIR)/crashes $(FUZZ_DIR)/corpus/frontdoor-c
	@failed=""; \
	report() { tail -n 40 $(FUZZ_DIR)/$$1.log; echo "fuzz $$1: exit status $$2"; \
		find $(FUZZ_DIR)/crashes -name "$$1-*" -newer $(FUZZ_DIR)/$$1.started -type f | while read -r input; do \
			echo "fuzz $$1: saved $$input, base64: $$(base64 -w0 "$$input")"; done; }; \
	for target in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ_DIR)/corpus/$$target; touch $(FUZZ_DIR)/$$target.started; \
		PYTHONPATH=tests $(PY) -m fuzz $$target -max_total_time=$(FUZZ_TIME) -timeout=$(FUZZ_TIMEOUT) -print_final_stats=1 \
			-dict=tests/fuzz/tokens.dict -artifact_prefix=$(FUZZ_DIR)/crashes/$$target- \
			$(FUZZ_DIR)/corpus/$$target tests/fuzz/corpus/$$target > $(FUZZ_DIR)/$$target.log 2>&1 \
			|| { status=$$?; failed="$$failed $$target"; report $$target $$status; }; \
		echo "fuzz $$target: $$(sed -n 's/^stat::number_of_executed_units: *//p' $(FUZZ_DIR)/$$target.log) execs (time limit $(FUZZ_TIME) s)"; \
	done; \
	touch $(FUZZ_DIR)/frontdoor-c.started; \
	$(FUZZ_C) -max_total_time=$(FUZZ_C_TIME) -timeout=$(FUZZ_TIMEOUT) -print_final_stats=1 -dict=tests/fuzz/c/frontdoor.dict \
		-artifact_prefix=$(FUZZ_DIR)/crashes/frontdoor-c- $(FUZZ_DIR)/corpus/frontdoor-c tests/fuzz/c/corpus \
		> $(FUZZ_DIR)/frontdoor-c.log 2>&1 || { status=$$?; failed="$$failed frontdoor-c"; report frontdoor-c $$status; }; \
	echo "fuzz frontdoor-c: $$(sed -n 's/^stat::number_of_executed_units: *//p' $(FUZZ_DIR)/frontdoor-c.log) execs (time limit $(FUZZ_C_TIME) s)"; \
	test -z "$$failed" || { echo "fuzz: crash in$$failed (inputs in $(FUZZ_DIR)/crashes)"; exit 1; }

clean:
	rm -rf $(VENV) $(FT_VENV) build *.egg-info core/_queue_c.c core/_histogram_c.c bindings/_wsgi_c.c bindings/_pool_c.c bindings/servers/frontdoor/_engine_c.c \
		bindings/servers/plumbing/_heads_c.c core/*.so bindings/*.so bindings/servers/*/*.so .pytest_cache .hypothesis .benchmarks

# The documentation site (docs/, Sphinx + MyST + furo) into build/docs/html. Every
# warning fails it (-W; --keep-going reports them all first), broken links between pages
# included. Nothing is fetched: no intersphinx, no link check. The reference
# tables are read from the code at build time (docs/_ext/prazo_reference.py), so the
# C twins are built first for autodoc.
DOCS_OUT := build/docs
docs: build
	rm -rf $(DOCS_OUT)
	$(PY) -m sphinx -W --keep-going -q -b html -d $(DOCS_OUT)/doctrees docs $(DOCS_OUT)/html
