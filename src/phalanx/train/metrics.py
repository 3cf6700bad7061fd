"""Throughput and model FLOPs utilisation (MFU).

MFU = model FLOPs per step / step time / peak FLOP/s. Model FLOPs count the work
the model needs (the planner's :func:`phalanx.core.costs.flops_per_token`, through
:func:`phalanx.core.costs.gpt_training_flops_per_token`), not recomputation. The peak is ``train.peak_flops``
when set (accelerators: take the vendor figure), otherwise measured once per machine
and dtype by a matmul probe (:func:`phalanx.plan.hardware.measure_matmul_peak`) and
cached.

Example:
    >>> mfu(flops_per_step=1e9, step_time_s=0.5, peak=4e9)
    0.5
"""

from __future__ import annotations

from phalanx.config import Config
from phalanx.plan.hardware import measure_matmul_peak


def mfu(flops_per_step: float, step_time_s: float, peak: float) -> float:
    if step_time_s <= 0 or peak <= 0:
        return 0.0
    return flops_per_step / step_time_s / peak


def compute_dtype(cfg: Config) -> str:
    return {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}[cfg.precision.policy]


def peak_flops(cfg: Config, n_devices: int = 1) -> float:
    """Peak FLOP/s of the hardware the run uses.

    Logical CPU devices share one CPU, so a CPU run's peak is the CPU's, whatever
    the device count; GPUs add up.
    """
    if cfg.train.peak_flops > 0:
        return cfg.train.peak_flops * n_devices

    import tensorflow as tf
    gpus = len(tf.config.list_physical_devices("GPU"))
    return measure_matmul_peak(compute_dtype(cfg)) * (min(n_devices, gpus) if gpus else 1)
