"""Test session set-up: 8 logical CPU devices, configured before any TensorFlow op.

Every parallel layout is tested on these (ARCHITECTURE.md: logical CPUs share the
host's thread pools, so they test correctness, not speed).

``make test`` runs the suite in one process. It also runs over two pytest-xdist workers
(``pytest -n 2 --dist worksteal``: ~25 min instead of ~38 on 2 cores), each a process with its
own 8 logical CPUs, but there the tests that bound measured memory peaks (the allocator's per
device, or NumPy's under tracemalloc) failed now and then beside the other worker's load, so CI
does not use it yet. A test may run beside any other, so it takes
its own temporary paths and asks the OS for free ports. worksteal hands each worker one
half of the collection in order, then moves tests from the tail of the busy worker's queue
to the idle one: each worker runs stretches of the collection in order, so a module-scoped
fixture is built once, or once per worker when the module is split between them. (``--dist loadgroup`` would group
them explicitly, but with pytest 9.2 xdist 3.8 drops the groups: pytest-xdist issue 1386.)
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


@pytest.fixture(scope="session")
def devices() -> list[str]:
    """The 8 logical CPU device names."""
    return TEST_DEVICES
