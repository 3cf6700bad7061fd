"""Will this config fit in memory? Asked before anything is built.

:func:`check_fits` estimates, with the planner's own arithmetic
(:func:`phalanx.plan.memory.memory_per_device`: the engine's placement, stage split,
schedule and ZeRO slices), the peak bytes of the most loaded device of the configured layout, and
refuses with a :class:`~phalanx.config.ConfigError` that gives the figures (needed vs
available) and the keys that would change them, instead of a TensorFlow
out-of-memory error minutes later. ``phalanx train`` calls it first; so can any
Python caller.

Budgets:

* logical CPU devices share the host's RAM: the sum over devices, plus the host's own
  transient peak (below), must fit the host's available RAM (``MemAvailable``);
* GPUs: each device's estimate must fit ``device_memory_bytes`` when it is known (pass
  it; TensorFlow does not report a GPU's capacity before allocating), and the host
  must hold its transient peak.

The host's transient peak (:func:`host_peak`) is what the engine that will run puts in
host NumPy memory besides the devices' own state, at its largest moment:

* the Keras-model engine (the built-in GPT's) moves weights one part at a time:
  initial weights are made per shard (``models/init.py`` tiles), checkpoints are written
  by one thread per device holding one slot at a time and restored box by box into each
  slot (``checkpoint/sharded.py``), pruning masks are computed shard by shard
  (``phalanx.prune``). Its peak is a few copies of the largest part (one device's share
  of the largest weight) per writer thread, never the model;
* the parameter-server engine holds whole variables (tp=1: a part is a variable).

Activations are counted as fused kernels keep them, on every device: phalanx's GPT ops
are fused kernels on CPUs too (``models/gpt_ops.py``; checked with ``phalanx plan --calibrate``).

Example:
    >>> from phalanx.config import load_config
    >>> check_fits(load_config(None, ["model.layers=2"]), host_memory_bytes=2**34)   # 16 GiB: fits
    >>> try:
    ...     check_fits(load_config(None, ["model.d_model=1048576"]), host_memory_bytes=2**34)
    ... except Exception as err:
    ...     print(str(err)[:36])
    model: does not fit in memory: needs
"""

from __future__ import annotations

import os

from phalanx.checkpoint.sharded import MAX_THREADS
from phalanx.config import Config, ConfigError, parse_devices, resolve_degrees
from phalanx.core.costs import ModelSpec
from phalanx.plan.layout import Layout
from phalanx.plan.memory import memory_per_device

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

    p, t = cfg.parallel, cfg.train
    _, n = parse_devices(p.devices)
    count = device_count or n or (p.dp * p.pp * p.tp if -1 not in (p.dp, p.pp, p.tp) else None)
    if count is None:
        raise ConfigError("parallel.devices", "a degree is -1: give parallel.devices=cpu:N (or gpu:N)")
    dp, pp, tp = resolve_degrees(cfg, count)
    return memory_per_device(ModelSpec.from_config(cfg.model), config_layout(cfg, dp, pp, tp), fused=True), \
        count, dp, pp, tp


def config_layout(cfg: Config, dp: int, pp: int, tp: int) -> Layout:
    """The planner's :class:`Layout` of ``cfg`` on ``dp x pp x tp`` devices (the inverse of
    :meth:`Layout.config_overrides`, the gradient reduction aside).

    Example:
        >>> from phalanx.config import load_config
        >>> config_layout(load_config(None, ["train.grad_accum=2"]), 1, 1, 1).describe()
        'dp=1 tp=1 pp=1 m=1 b=8 accum=2 1f1b zero=0 recompute=none'
    """
    p, t = cfg.parallel, cfg.train
    micro = max(t.global_batch // (dp * t.grad_accum * p.microbatches), 1)
    schedule = p.schedule if pp > 1 else "1f1b"
    return Layout(dp=dp, tp=tp, pp=pp, microbatches=p.microbatches, micro_batch=micro, schedule=schedule,
                  virtual_stages=p.virtual_stages if schedule == "interleaved" else 1, zero=p.zero,
                  recompute=p.recompute, sequence_parallel=p.sequence_parallel and tp > 1,
                  policy=cfg.precision.policy, accum=t.grad_accum, ep=p.ep,
                  parameter_server=p.strategy == "parameter_server")


#: host copies of the largest slot one checkpoint writer (or restoring thread) holds at once:
#: the slot read from its device or file, TensorFlow's copy when it is assigned, and the
#: contiguous/finite-check temporaries (measured with tracemalloc at up to ~2.1 per thread:
#: tests/test_precheck_host.py)
COPIES_PER_WRITER = 3
#: host copies of the largest shard while weights are made (the shard and one tile of draws)
#: or pruning masks computed (|w| keys, comparisons, the mask): phalanx.prune works shard by shard
COPIES_PER_SHARD = 3


def largest_shard_elements(spec, tp: int, ep: int = 1) -> int:
    """Elements of the largest part of one logical GPT weight that one device holds: each
    weight's tensor-parallel shard (vocab rows / columns, q|k|v heads, MLP columns / rows split
    by ``tp``; position embeddings replicated; the experts' ``[E, d, f]`` split by ``ep`` and ``tp``)."""
    d, f, v, t = spec.d_model, spec.ffn_dim, spec.vocab, spec.seq_len
    sizes = [v * d // tp, t * d, 3 * d * d // tp, d * d // tp, d * f // tp]
    if spec.experts:
        sizes.append(spec.experts * d * f // (ep * tp))
    return max(sizes)


def host_peak(cfg: Config, dp: int, pp: int, tp: int, devices: int) -> tuple[float, str]:
    """``(bytes, what)``: the host NumPy memory the run needs besides the devices' state, at
    its largest moment (see the module docstring), and a description naming its parts."""

    spec = ModelSpec.from_config(cfg.model)
    shard = 4.0 * largest_shard_elements(spec, tp, cfg.parallel.ep)  # float32 bytes
    writers = max(1, min(MAX_THREADS, devices))  # one writer thread per device holding state
    io = writers * COPIES_PER_WRITER * shard
    work = COPIES_PER_SHARD * shard
    return max(io, work), (f"Keras-model engine, per shard: largest shard {shard / GiB:,.2f} GiB; checkpoint "
                           f"save/restore {writers} thread(s) x {COPIES_PER_WRITER} copies = {io / GiB:,.2f} "
                           f"GiB; initialisation and pruning {COPIES_PER_SHARD} copies = {work / GiB:,.2f} GiB")


def check_fits(cfg: Config, device_count: int | None = None, *, device_memory_bytes: float | None = None,
               host_memory_bytes: float | None = None) -> None:
    """Raise :class:`ConfigError` with the figures if ``cfg`` cannot fit; return None if it can.

    ``device_count``: devices in use (default: ``parallel.devices``' N, else dp x pp x tp).
    ``device_memory_bytes``: one accelerator's memory (GPUs; ignored for CPU devices).
    ``host_memory_bytes``: the host's available RAM (default: ``MemAvailable``).
    """
    mem, count, dp, pp, tp = estimate_per_device(cfg, device_count)
    host = host_available_bytes() if host_memory_bytes is None else host_memory_bytes
    transient, what = host_peak(cfg, dp, pp, tp, count)
    cpu = _device_kind(cfg.parallel.devices) == "cpu"
    if cpu:
        needed, available = mem.total * count + transient, host
        where = (f"{count} CPU device(s) sharing this host's {host / GiB:,.1f} GiB of available RAM "
                 f"(all devices {mem.total * count / GiB:,.1f} GiB + {transient / GiB:,.2f} GiB host peak: {what})")
        per = needed
    else:
        per = mem.total
        available = device_memory_bytes if device_memory_bytes else float("inf")
        needed = mem.total
        where = f"each of {count} GPU(s) has {available / GiB:,.1f} GiB"
        if transient > host:
            needed, available, per = transient, host, transient
            where = (f"the host needs {transient / GiB:,.2f} GiB ({what}) but has {host / GiB:,.1f} GiB available")
    if needed <= available:
        return
    # The step's temporaries (weight casts, optimizer flat buffers) grow with the model's size.
    states = mem.weights + mem.gradients + mem.optimizer + mem.temporaries
    key = "model" if states >= mem.activations else "train.global_batch"
    if key == "train.global_batch":
        # One sequence per micro-batch is the least a batch can be: if that does not fit either,
        # the sequence itself is too long.
        t, p = cfg.train, cfg.parallel
        least = cfg.replace(train={"global_batch": dp * t.grad_accum * p.microbatches})
        one = estimate_per_device(least, count)[0].total
        if (one * count + transient if cpu else one) > available:
            key = "model.seq_len"
    raise ConfigError(key, (
        f"does not fit in memory: needs {mem.total / GiB:,.1f} GiB on the fullest device (pipeline rank "
        f"{mem.rank}: weights {mem.weights / GiB:,.1f}, gradients {mem.gradients / GiB:,.1f}, optimizer "
        f"{mem.optimizer / GiB:,.1f}, activations {mem.activations / GiB:,.1f}, temporaries "
        f"{mem.temporaries / GiB:,.1f}, overhead "
        f"{mem.overhead / GiB:,.1f} GiB) at dp={dp} tp={tp} pp={pp}; {per / GiB:,.1f} GiB needed in all, "
        f"but {where}. To fit: {'shorten model.seq_len (one sequence per micro-batch does not fit); ' if key == 'model.seq_len' else ''}shrink the model (model.d_model, model.layers, model.vocab, model.ffn), "
        f"the activations (train.global_batch, or more parallel.microbatches / train.grad_accum, "
        f"parallel.recompute=full), shard the optimizer (parallel.zero=1 with parallel.dp > 1), or split "
        f"over more devices (parallel.tp, parallel.pp, parallel.devices); `phalanx plan --search` "
        f"proposes a layout"))
