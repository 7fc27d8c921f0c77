# make test  — set up .venv (pinned torch, tools), build the package, run the C and Python tests
# make demo  — set up, then train the small example model on 2 processes, resume its second half
#              bitwise, and leave logs and a loss curve under runs/demo/ (the main job)
# make bench — set up, run every benchmark (~20 min on 2 cores), then one table of all targets
#              (benchmarks/run_all.py; BENCH_ARGS=--full for each benchmark's own defaults)
# make fuzz FUZZ_SECONDS=N — fuzz every C target for N seconds in all (docs/security.md)
# make soak SECONDS=N — set up, then run the differential harness on new seeds for N seconds
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
TORCH   := torch==2.13.0
PYTEST_ARGS ?=
# pytest workers: the suite's multi-process tests leave about a third of 2 cores idle (serially
# 33.6 min here on 2026-12-06, with 2 workers 22.8). One worker when the machine was already
# busy as make started (1-minute load average at or above half the cores, e.g. under the
# `stress-ng --cpu 2` hog the suite must pass under), read once here, before make's own C tests
# load it. PYTEST_WORKERS=N chooses
ifeq ($(origin PYTEST_WORKERS), undefined)
PYTEST_WORKERS := $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)); print(2 if n >= 2 and os.getloadavg()[0] < n / 2 else 1)")
endif
BENCH_ARGS ?=

.PHONY: all venv install test test-c test-py fuzz-smoke demo bench fuzz fuzz-py soak clean

all: test

$(VENV)/.deps: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check $(TORCH)
	$(PIP) install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

venv: $(VENV)/.deps

# Always rebuilds (cheap when nothing changed): the extension must match the sources.
install: venv
	$(PIP) install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

test-c:
	bash tests/c/run.sh

# every C fuzz target for a few seconds (FUZZ_SMOKE_SECONDS in all): a target that stops
# building or finds a crash fails make test; the tracked corpus is left as it is
fuzz-smoke:
	FUZZ_KEEP=0 bash tests/c/fuzz.sh $(or $(FUZZ_SMOKE_SECONDS),20)

test-py: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=15 $(PYTEST_ARGS) tests

test: install test-c fuzz-smoke test-py

demo: install
	$(PY) examples/demo.py

bench: install
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# the differential harness (tests/differential) on new random cases for as long as asked;
# every failure prints the command that replays it
soak: install
	$(PY) tests/differential/run.py --seconds $(or $(SECONDS),600)

# bounded fuzzing of every C target (tests/c/fuzz.sh: libFuzzer when clang has it, else the
# built-in coverage-guided driver), under AddressSanitizer + UBSan; FUZZ_SECONDS in all, split
# between the targets (FUZZ_TARGETS="shard dlpack" picks some); inputs that reach new coverage
# are kept under tests/c/corpus/<target>/. The Python targets: make fuzz-py (docs/security.md)
fuzz:
	bash tests/c/fuzz.sh $(or $(FUZZ_SECONDS),25) $(FUZZ_TARGETS)

# long runs of the Python fuzz targets (tests/fuzz/run_py.py), one after another, each for
# FUZZ_PY_SECONDS; atheris (requirements-fuzz.txt) when FUZZ_PY_ENGINE=atheris
FUZZ_PY_TARGETS ?= config config_bytes deepspeed training_args load_state model_index zero_load_state
fuzz-py: install
	set -e; for t in $(FUZZ_PY_TARGETS); do \
	  $(PY) tests/fuzz/run_py.py --target $$t --seconds $(or $(FUZZ_PY_SECONDS),60) --engine $(or $(FUZZ_PY_ENGINE),hypothesis); \
	done

clean:
	rm -rf build tests/c/bin accelerate_c/_C*.so *.egg-info
