"""``phalanx plan --calibrate``: run a few real steps here and compare with the plan.

Builds the same engine ``phalanx train`` would (``phalanx.train.trainer.make_engine``),
runs one step to trace and allocate the persistent state, resets TensorFlow's
memory statistics where the device supports it (not the CPU in TF 2.21), then times ``steps`` more steps on one fixed random batch and reads
the peak bytes of the first device with ``tf.config.experimental.get_memory_info``.

Example (needs TensorFlow; runs real steps):
    >>> from phalanx.config import load_config                       # doctest: +SKIP
    >>> cal = calibrate(load_config(None, ["model.layers=2"]), plan)  # doctest: +SKIP
    >>> sorted(cal)                                                   # doctest: +SKIP
    ['measured_memory_bytes', 'measured_step_time_s', 'memory_error', ...]
"""

from __future__ import annotations

import time


def calibrate(cfg, plan, steps: int = 3) -> dict:
    """Predicted vs measured peak memory (device 0) and step time; errors are (predicted - measured) / measured."""
    if steps < 1:
        raise ValueError(f"--calibrate-steps must be >= 1, got {steps}")
    import os
    import sys

    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # CPU memory stats need the BFC allocator
    import numpy as np
    import tensorflow as tf

    from phalanx.train.task import GPTTask
    from phalanx.train.trainer import make_engine

    engine = make_engine(cfg, GPTTask(cfg.model, cfg.precision.policy, cfg.train.seed))
    rng = np.random.default_rng(cfg.train.seed)
    batch = tf.constant(rng.integers(0, cfg.model.vocab, (cfg.train.global_batch, cfg.model.seq_len + 1)),
                        dtype=tf.int32)
    float(engine.train_step(batch)["loss"])  # trace, allocate weights and optimizer states
    device = _first_device(tf)
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError:
        pass  # not supported on CPU in TF 2.21: the peak then also covers the first (tracing) step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(engine.train_step(batch)["loss"])  # .numpy() waits for the step to finish
        times.append(time.perf_counter() - start)
    peak = float(tf.config.experimental.get_memory_info(device)["peak"])
    measured_t = float(np.median(times))
    predicted_m = plan.memory.total
    predicted_t = plan.time.step_time_s
    return {
        "steps": steps,
        "device": device,
        "predicted_memory_bytes": predicted_m,
        "measured_memory_bytes": peak,
        "memory_error": (predicted_m - peak) / peak if peak else float("nan"),
        "predicted_step_time_s": predicted_t,
        "measured_step_time_s": measured_t,
        "step_time_error": (predicted_t - measured_t) / measured_t,
        # the --utilization that would have predicted the measured time
        "implied_utilization": plan.utilization * predicted_t / measured_t,
        "predicted_breakdown": plan.memory.to_dict(),
    }


def _first_device(tf) -> str:
    gpus = tf.config.list_logical_devices("GPU")
    return "GPU:0" if gpus else "CPU:0"
