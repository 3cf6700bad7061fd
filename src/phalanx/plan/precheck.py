"""Will this config fit in memory? Asked before anything is built.

:func:`check_fits` estimates, with the planner's own arithmetic
(:func:`phalanx.plan.memory.memory_per_device`, the engine's state bytes, stage split
and schedule), the peak bytes of the most loaded device of the configured layout, and
refuses with a :class:`~phalanx.config.ConfigError` that gives the figures (needed vs
available) and the keys that would change them, instead of a TensorFlow
out-of-memory error minutes later. ``phalanx train`` calls it first; so can any
Python caller.

Budgets:

* logical CPU devices share the host's RAM: the sum over devices, plus the whole-model
  float32 copy the engines build in host NumPy at start (``models/gpt.initial_weights``,
  4 bytes per parameter), must fit the host's available RAM (``MemAvailable``);
* GPUs: each device's estimate must fit ``device_memory_bytes`` when it is known (pass
  it; TensorFlow does not report a GPU's capacity before allocating), and the host must
  hold the start-up copy.

Activations are counted as fused kernels keep them, on every device: phalanx's GPT ops
are fused kernels on CPUs too (``models/gpt_ops.py``; checked with ``phalanx plan --calibrate``).

Example:
    >>> from phalanx.config import load_config
    >>> check_fits(load_config(None, ["model.layers=2"]), host_memory_bytes=2**34)   # 16 GiB: fits
    >>> try:
    ...     check_fits(load_config(None, ["model.d_model=1048576"]), host_memory_bytes=2**34)
    ... except Exception as err:
    ...     print(str(err)[:52])
    model: does not fit in memory: needs 826,306.8 GiB o
"""

from __future__ import annotations

import os

from phalanx.config import Config, ConfigError, parse_devices

GiB = 2**30


def host_available_bytes() -> float:
    """RAM the host can give now (``MemAvailable``), or all of it where that is unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_kind(spec: str) -> str:
    kind, _ = parse_devices(spec)
    if kind != "auto":
        return kind
    import tensorflow as tf  # listing physical devices does not start the runtime

    return "gpu" if tf.config.list_physical_devices("GPU") else "cpu"


def estimate_per_device(cfg: Config, device_count: int | None = None):
    """``(Memory of the most loaded device, devices, dp, pp, tp)`` for ``cfg``'s layout."""
    from phalanx.config import resolve_degrees
    from phalanx.plan.arithmetic import ModelSpec
    from phalanx.plan.layout import Layout
    from phalanx.plan.memory import memory_per_device

    p, t = cfg.parallel, cfg.train
    _, n = parse_devices(p.devices)
    count = device_count or n or (p.dp * p.pp * p.tp if -1 not in (p.dp, p.pp, p.tp) else None)
    if count is None:
        raise ConfigError("parallel.devices", "a degree is -1: give parallel.devices=cpu:N (or gpu:N)")
    dp, pp, tp = resolve_degrees(cfg, count)
    micro = max(t.global_batch // (dp * t.grad_accum * p.microbatches), 1)
    schedule = p.schedule if pp > 1 else "1f1b"
    lay = Layout(dp=dp, tp=tp, pp=pp, microbatches=p.microbatches, micro_batch=micro, schedule=schedule,
                 virtual_stages=p.virtual_stages if schedule == "interleaved" else 1, zero=p.zero,
                 recompute=p.recompute, policy=cfg.precision.policy, accum=t.grad_accum)
    return memory_per_device(ModelSpec.from_config(cfg.model), lay, fused=True), count, dp, pp, tp


def check_fits(cfg: Config, device_count: int | None = None, *, device_memory_bytes: float | None = None,
               host_memory_bytes: float | None = None) -> None:
    """Raise :class:`ConfigError` with the figures if ``cfg`` cannot fit; return None if it can.

    ``device_count``: devices in use (default: ``parallel.devices``' N, else dp x pp x tp).
    ``device_memory_bytes``: one accelerator's memory (GPUs; ignored for CPU devices).
    ``host_memory_bytes``: the host's available RAM (default: ``MemAvailable``).
    """
    from phalanx.plan.arithmetic import ModelSpec, param_count

    mem, count, dp, pp, tp = estimate_per_device(cfg, device_count)
    host = host_available_bytes() if host_memory_bytes is None else host_memory_bytes
    startup = 4.0 * param_count(ModelSpec.from_config(cfg.model))  # whole float32 weights in NumPy
    cpu = _device_kind(cfg.parallel.devices) == "cpu"
    if cpu:
        needed, available = mem.total * count + startup, host
        where = (f"{count} CPU device(s) sharing this host's {host / GiB:,.1f} GiB of available RAM "
                 f"(all devices {mem.total * count / GiB:,.1f} GiB + {startup / GiB:,.1f} GiB of float32 "
                 f"weights built in host memory at start)")
        per = needed
    else:
        per = mem.total
        available = device_memory_bytes if device_memory_bytes else float("inf")
        needed = mem.total
        where = f"each of {count} GPU(s) has {available / GiB:,.1f} GiB"
        if startup > host:
            needed, available, per = startup, host, startup
            where = (f"the host must build the {startup / GiB:,.1f} GiB of float32 weights at start but has "
                     f"{host / GiB:,.1f} GiB available")
    if needed <= available:
        return
    states = mem.weights + mem.gradients + mem.optimizer
    key = "model" if states >= mem.activations else "train.global_batch"
    raise ConfigError(key, (
        f"does not fit in memory: needs {mem.total / GiB:,.1f} GiB on the fullest device (pipeline rank "
        f"{mem.rank}: weights {mem.weights / GiB:,.1f}, gradients {mem.gradients / GiB:,.1f}, optimizer "
        f"{mem.optimizer / GiB:,.1f}, activations {mem.activations / GiB:,.1f}, overhead "
        f"{mem.overhead / GiB:,.1f} GiB) at dp={dp} tp={tp} pp={pp}; {per / GiB:,.1f} GiB needed in all, "
        f"but {where}. To fit: shrink the model (model.d_model, model.layers, model.vocab, model.ffn), "
        f"the activations (train.global_batch, or more parallel.microbatches / train.grad_accum, "
        f"parallel.recompute=full), shard the optimizer (parallel.zero=1 with parallel.dp > 1), or split "
        f"over more devices (parallel.tp, parallel.pp, parallel.devices); `phalanx plan --search` "
        f"proposes a layout"))
