# phalanx: two commands on a fresh machine with Python 3.11, pip and make.
#   make demo   creates .venv, installs phalanx, trains the demo model
#   make test   creates/uses .venv, runs the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# keras-hub's models are tested as user models; --no-deps because its tensorflow-text
	# requirement would pull the CUDA TensorFlow wheel (its backbones need only regex).
	$(BIN)/python -m pip install --quiet --no-deps 'keras-hub==0.32.*' regex
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/phalanx train configs/demo.yaml

# One process: over two pytest-xdist workers (`-n 2 --dist worksteal`, installed with the test
# tools) the suite takes ~25 min instead of ~38, but the tests that bound measured memory peaks
# failed beside the other worker's load (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q --timeout=900 --durations=25

# By hand, not in CI. keras-hub (installed with the test tools) is the peer of bench_gpt.py.
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_gpt.py --onednn on
	$(BIN)/python benchmarks/bench_parallel.py
	$(BIN)/python benchmarks/bench_cluster.py
	$(BIN)/python benchmarks/bench_export.py

clean:
	rm -rf $(VENV) runs build src/*.egg-info
