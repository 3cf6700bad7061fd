"""Devices and the named device mesh ``(data, pipe, tensor)``.

``configure_devices("cpu:8", 8)`` splits the host CPU into 8 logical devices (this
must happen before TensorFlow initialises its runtime; if it already has, the
existing logical devices are used when there are enough). :class:`Mesh` arranges
device names in a ``(dp, pp, tp)`` grid with fixed axis names.

Example:
    >>> mesh = Mesh.from_devices([f"/device:CPU:{i}" for i in range(8)], dp=2, pp=2, tp=2)
    >>> mesh.shape
    {'data': 2, 'pipe': 2, 'tensor': 2}
    >>> mesh.device(data=1, pipe=0, tensor=1)
    '/device:CPU:5'
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phalanx.config import Config, ConfigError, parse_devices, resolve_degrees

AXES = ("data", "pipe", "tensor")


def configure_devices(spec: str, count: int) -> list[str]:
    """Make ``count`` devices of the kind in ``spec`` available; return their names.

    ``spec``: ``auto`` (GPUs if any, else logical CPUs), ``cpu:N``, ``gpu:N``. ``count``
    is how many the run needs; for ``cpu:N``/``gpu:N`` it must equal N.
    """
    import tensorflow as tf

    kind, n = parse_devices(spec)
    if n and n != count:
        raise ConfigError("parallel.devices",
                          f"{spec!r} gives {n} devices but dp x pp x tp = {count}; use parallel.devices="
                          f"{kind}:{count} or change the degrees")
    if kind == "auto":
        kind = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    if kind == "gpu":
        gpus = tf.config.list_logical_devices("GPU")
        if len(gpus) < count:
            raise ConfigError("parallel.devices", f"{count} GPUs needed but {len(gpus)} found")
        return [d.name for d in gpus[:count]]
    return configure_logical_cpus(count)


def inter_op_threads(devices: int, cores: int) -> int:
    """Inter-op threads for ``devices`` logical CPUs on ``cores`` cores: ``min(devices,
    2 x cores)``, never fewer than TensorFlow's default of one per core.

    TensorFlow's executor runs independent ops (another device's partition, another
    micro-batch) on its inter-op pool, one thread per core by default. With more logical
    devices than cores, those threads were busy 95-97% of a dp2 x tp2 x pp2 step, and the
    partitions waited on each other's ops: with 4 threads for 8 devices on 2 cores the
    keras-hub GPT-2 step (benchmarks/bench_keras_hub_tp.py, 2026-11-26, Zen 4, load ~1.5)
    went from 1.21x to 1.10x the one-device step, tp2 from 1.05x to 1.01x.

    >>> inter_op_threads(8, 2), inter_op_threads(2, 2), inter_op_threads(8, 16)
    (4, 2, 16)
    """
    return max(cores, min(devices, 2 * cores))


def configure_logical_cpus(count: int) -> list[str]:
    """Split the host CPU into ``count`` logical devices (or reuse >= count existing ones).

    With more than one, and unless the process already chose its inter-op thread count
    (``tf.config.threading.set_inter_op_parallelism_threads``), the executor gets
    :func:`inter_op_threads` threads."""
    import os

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    if count > 1:
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
            if not tf.config.threading.get_inter_op_parallelism_threads():
                tf.config.threading.set_inter_op_parallelism_threads(
                    inter_op_threads(count, len(os.sched_getaffinity(0))))
        except RuntimeError:
            pass  # runtime already initialised: use what exists, checked below
    logical = tf.config.list_logical_devices("CPU")
    if len(logical) < count:
        raise ConfigError("parallel.devices",
                          f"{count} logical CPU devices needed but TensorFlow was already initialised with "
                          f"{len(logical)}; configure devices before any TensorFlow op runs")
    return [d.name for d in logical[:count]]


@dataclass(frozen=True)
class Mesh:
    """Device names in a ``(dp, pp, tp)`` grid; axes ``data``, ``pipe``, ``tensor``."""

    grid: np.ndarray  # dtype object, shape (dp, pp, tp)

    @classmethod
    def from_devices(cls, devices: list[str], dp: int, pp: int, tp: int) -> "Mesh":
        if len(devices) != dp * pp * tp:
            raise ConfigError("parallel.devices",
                              f"{len(devices)} devices cannot form a dp x pp x tp = {dp} x {pp} x {tp} mesh")
        return cls(np.array(devices, dtype=object).reshape(dp, pp, tp))

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(AXES, self.grid.shape))

    @property
    def dp(self) -> int:
        return self.grid.shape[0]

    @property
    def pp(self) -> int:
        return self.grid.shape[1]

    @property
    def tp(self) -> int:
        return self.grid.shape[2]

    @property
    def devices(self) -> list[str]:
        return list(self.grid.reshape(-1))

    def device(self, data: int = 0, pipe: int = 0, tensor: int = 0) -> str:
        return self.grid[data, pipe, tensor]


def build_mesh(cfg: Config, devices: list[str] | None = None) -> Mesh:
    """The mesh for ``cfg``: creates the devices unless ``devices`` is given."""
    kind, n = parse_devices(cfg.parallel.devices)
    if devices is None:
        count = n if n else _known_product(cfg)
        dp, pp, tp = resolve_degrees(cfg, count)
        devices = configure_devices(cfg.parallel.devices, dp * pp * tp)
    dp, pp, tp = resolve_degrees(cfg, len(devices))
    return Mesh.from_devices(devices, dp, pp, tp)


def _known_product(cfg: Config) -> int:
    p = cfg.parallel
    if -1 in (p.dp, p.pp, p.tp):
        raise ConfigError("parallel.devices",
                          "a degree of -1 needs an explicit device count, e.g. parallel.devices=cpu:8")
    return p.dp * p.pp * p.tp
