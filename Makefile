# phalanx: two commands on a fresh machine with Python 3.11, pip and make.
#   make demo   creates .venv, installs phalanx, trains the demo model
#   make test   creates/uses .venv, runs the test suite but the tests marked slow
#   (make test-slow runs those; CI runs both)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,test]'
	# keras-hub's models are tested as user models; --no-deps because its tensorflow-text
	# requirement would pull the CUDA TensorFlow wheel (its backbones need only regex).
	$(BIN)/python -m pip install --quiet --no-deps 'keras-hub==0.32.*' regex
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/phalanx train configs/demo.yaml

# `make test` runs every test but those marked slow (several processes training together, or a
# long end-to-end run of a command or example); `make test-slow` runs the slow ones. CI
# (.ci/run) runs both and fails if either fails. Each is two pytest runs: its tests but the
# memory_peak ones over two pytest-xdist workers (installed with the test tools), then its
# memory_peak ones in one process on an otherwise idle suite: a measured peak follows the
# executor's order, which a neighbour's load moves (tests/conftest.py). Both runs always run;
# the target fails if either does (exit status 5, "no tests collected", counts as a pass).
PYTEST := $(BIN)/python -m pytest -q --timeout=900
define two_runs
	$(PYTEST) --durations=25 -n 2 --dist worksteal -m "$(1) and not memory_peak"; parallel=$$?; \
	$(PYTEST) --durations=10 -m "$(1) and memory_peak"; serial=$$?; \
	echo "make $@: pytest exit status $$parallel ($(1), not memory_peak, 2 workers), $$serial ($(1), memory_peak, 1 process)"; \
	{ test $$parallel -eq 0 || test $$parallel -eq 5; } && { test $$serial -eq 0 || test $$serial -eq 5; }
endef

test: $(STAMP)
	$(call two_runs,not slow)

test-slow: $(STAMP)
	$(call two_runs,slow)

# By hand, not in CI. keras-hub (installed with the test tools) is the peer of bench_gpt.py.
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_gpt.py --onednn on
	$(BIN)/python benchmarks/bench_parallel.py
	$(BIN)/python benchmarks/bench_cluster.py
	$(BIN)/python benchmarks/bench_export.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info
