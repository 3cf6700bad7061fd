"""Test session set-up: 8 logical CPU devices, configured before any TensorFlow op.

Every parallel layout is tested on these (ARCHITECTURE.md: logical CPUs share the
host's thread pools, so they test correctness, not speed).

``make test`` runs every test but the ``slow`` ones, ``make test-slow`` the ``slow`` ones; CI
runs both. ``@pytest.mark.slow`` marks a test that starts several processes that train together
(a launched cluster, a multi-worker strategy) or runs a command or example end to end for long.
Each target is two pytest runs: first its tests but the ``memory_peak`` ones over two
pytest-xdist workers (``-n 2 --dist worksteal -m "not slow and not memory_peak"``), each a
process with its own 8 logical CPUs; then its ``memory_peak`` ones (``-m "not slow and
memory_peak"``) in one process. Both always run.

``@pytest.mark.memory_peak`` marks every test whose assertion bounds a MEASURED memory figure:
the allocator's per-device peaks (``phalanx plan --calibrate``, ``calibrate_keras``,
``measure_step_memory``, ``get_memory_info``) or NumPy's under tracemalloc
(``helpers.peak_numpy_bytes``). Those figures follow the order the executor runs ops and
threads in, which a neighbouring worker's load moves: over two workers they failed now and then
(+16% vs a 15% bound, a tracemalloc ratio 0.404 vs 0.4), a different one in each run. A new test
of that kind takes the marker; a test that only counts the bytes of variables by their shapes
does not. (``--dist loadgroup`` with ``xdist_group`` could keep them in one worker, but pytest
9.2 with xdist 3.8 drops the groups: pytest-xdist issue 1386; and the other worker's load would
remain.) ``pytest -n 2`` without ``-m "not memory_peak"`` warns at start-up.

Any other test may run beside any other, so it takes its own temporary paths and asks the OS
for free ports. worksteal hands each worker one half of the collection in order, then moves
tests from the tail of the busy worker's queue to the idle one: each worker runs stretches of
the collection in order, so a module-scoped fixture is built once, or once per worker when the
module is split between them.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# get_memory_info('CPU:0') only reports with the BFC allocator on the CPU, which must
# be chosen before TensorFlow starts (measured on TF 2.21).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# precision.policy defaults to auto (bfloat16 on CPUs with bfloat16 units): the suite pins what
# auto means, so that its numerics and tolerances do not depend on the machine it runs on
# (tests of the detection itself pass the flags in: tests/test_precision.py).
os.environ.setdefault("PHALANX_AUTO_PRECISION", "float32")

import pytest  # noqa: E402

from phalanx.mesh import configure_logical_cpus  # noqa: E402

N_TEST_DEVICES = 8
TEST_DEVICES = configure_logical_cpus(N_TEST_DEVICES)


MEMORY_PEAK = "memory_peak"


def pytest_configure(config: pytest.Config) -> None:
    # Only the controller of an xdist run (its workers have workerinput) checks the -m expression.
    workers = getattr(config.option, "numprocesses", None)
    if workers and not hasattr(config, "workerinput") and MEMORY_PEAK not in (config.option.markexpr or ""):
        config.issue_config_time_warning(pytest.PytestWarning(
            f"the {MEMORY_PEAK} tests bound measured memory peaks and fail now and then beside another "
            f"worker's load: run them in one process (-m {MEMORY_PEAK}) and the rest with "
            f'-n {workers} -m "not {MEMORY_PEAK}", as `make test` does (tests/conftest.py)'), stacklevel=2)


@pytest.fixture(scope="session")
def devices() -> list[str]:
    """The 8 logical CPU device names."""
    return TEST_DEVICES
