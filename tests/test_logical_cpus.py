"""Logical CPU devices and the executor's inter-op threads (phalanx.mesh.configure_logical_cpus).

Each case needs a fresh process: TensorFlow takes its devices and thread pools once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from phalanx.mesh import inter_op_threads

PROBE = """
import sys
import tensorflow as tf
from phalanx.mesh import configure_logical_cpus
if sys.argv[2] != "0":
    tf.config.threading.set_inter_op_parallelism_threads(int(sys.argv[2]))
names = configure_logical_cpus(int(sys.argv[1]))
tf.constant(1.0)  # the runtime starts with the settings it has now
print(len(tf.config.list_logical_devices("CPU")), tf.config.threading.get_inter_op_parallelism_threads())
"""


def _probe(count: int, preset: int) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(count), str(preset)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert out.returncode == 0, out.stderr[-2000:]
    devices, threads = out.stdout.split()
    return int(devices), int(threads)


@pytest.mark.parametrize("count, preset", [(8, 0), (8, 1), (1, 0)])
def test_logical_cpus_get_inter_op_threads_unless_the_process_chose(count, preset):
    cores = len(os.sched_getaffinity(0))
    expected = preset or (inter_op_threads(count, cores) if count > 1 else 0)  # 0: TensorFlow's default
    assert _probe(count, preset) == (count, expected)
    assert inter_op_threads(8, 2) == 4 and inter_op_threads(4, 2) == 4 and inter_op_threads(2, 2) == 2
    assert inter_op_threads(3, 4) == 4 and inter_op_threads(64, 4) == 8
