"""Throughput and model FLOPs utilisation (MFU).

MFU = model FLOPs per step / step time / peak FLOP/s. Model FLOPs count the work
the model needs (the planner's :func:`phalanx.core.costs.flops_per_token`, through
:func:`phalanx.core.costs.gpt_training_flops_per_token`), not recomputation. The peak is ``train.peak_flops``
when set (accelerators: take the vendor figure), otherwise measured once per machine
and dtype by a matmul probe (:func:`phalanx.plan.hardware.measure_matmul_peak`) and
cached. MFU is never reported above 100%: a run that beats the cached peak measures the
peak again (:class:`RunPeak`), and if it still beats it the MFU is unavailable (None).

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


def peak_flops(cfg: Config, n_devices: int = 1, refresh: bool = False) -> float:
    """Peak FLOP/s of the hardware the run uses (``refresh``: measure the probe again).

    Logical CPU devices share one CPU, so a CPU run's peak is the CPU's, whatever
    the device count; GPUs add up.
    """
    if cfg.train.peak_flops > 0:
        return cfg.train.peak_flops * n_devices

    import tensorflow as tf
    gpus = len(tf.config.list_physical_devices("GPU"))
    return measure_matmul_peak(compute_dtype(cfg), refresh=refresh) * (min(n_devices, gpus) if gpus else 1)


class RunPeak:
    """The peak of one run and its MFU, never above 100%.

    A step faster than the peak allows means the peak is wrong: a probe measured while the
    machine was busy, for instance. The first time, the probe is measured again (``say`` is
    told why) and the MFU recomputed; an MFU still above 1 (or against a given
    ``train.peak_flops``, which is not measured) is None: unavailable, not a made-up figure.

    Example (a given peak of 1 GFLOP/s; the probe is never run):
        >>> from phalanx.config import load_config
        >>> run = RunPeak(load_config(None, ["train.peak_flops=1e9"]), say=print)
        >>> run.mfu(flops_per_step=5e8, step_time_s=1.0)
        0.5
        >>> run.mfu(flops_per_step=2e9, step_time_s=1.0) is None
        MFU unavailable: a step did 2e+09 FLOP/s, above train.peak_flops (1e+09 FLOP/s)
        True
    """

    def __init__(self, cfg: Config, n_devices: int = 1, say=None):
        self.cfg, self.n_devices, self.say = cfg, n_devices, say or (lambda text: None)
        self.peak = peak_flops(cfg, n_devices)
        self._measured_again = cfg.train.peak_flops > 0  # a given peak is not measured
        self._said = False

    def mfu(self, flops_per_step: float, step_time_s: float) -> float | None:
        util = mfu(flops_per_step, step_time_s, self.peak)
        if util <= 1.0:
            return util
        if not self._measured_again:
            self._measured_again = True
            self.say(f"MFU {100 * util:.0f}% against the cached matmul peak ({self.peak:.3g} FLOP/s): "
                     f"the peak probe is stale, re-measuring")
            self.peak = peak_flops(self.cfg, self.n_devices, refresh=True)
            util = mfu(flops_per_step, step_time_s, self.peak)
            if util <= 1.0:
                return util
        if not self._said:
            self._said = True
            given = "train.peak_flops" if self.cfg.train.peak_flops > 0 else "the measured matmul peak"
            self.say(f"MFU unavailable: a step did {flops_per_step / step_time_s:.3g} FLOP/s, above {given} "
                     f"({self.peak:.3g} FLOP/s)")
        return None


def mfu_text(value: float | None) -> str:
    """``MFU 41.2%``, or ``MFU n/a`` when unavailable (:class:`RunPeak`).

    >>> mfu_text(0.4123), mfu_text(None)
    ('MFU 41.2%', 'MFU n/a')
    """
    return "MFU n/a" if value is None else f"MFU {100 * value:.1f}%"
