"""Will this config fit in memory? Asked before anything is built.

:func:`check_fits` estimates, with the planner's own arithmetic
(:func:`phalanx.plan.memory.memory_per_device`, the engine's state bytes, stage split
and schedule), the peak bytes of the most loaded device of the configured layout, and
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

* the Keras-model engine (the built-in GPT's, :meth:`~phalanx.plan.engine_rules.GPTRun.engine`)
  and the mesh engine (ZeRO-2, recomputation) move weights one shard at a time:
  initial weights are made per shard (``models/init.py`` tiles), checkpoints are written
  by one thread per device holding one slot at a time and restored box by box into each
  slot (``checkpoint/sharded.py``), pruning masks are computed shard by shard
  (``phalanx.prune``). Its peak is a few copies of the largest shard (one device's part
  of the largest weight) per writer thread, never the model;
* the tf.distribute engine (parameter_server) holds whole variables, but moves
  them one at a time: initial weights are assigned one tensor at a
  time (``engines/task.py``), checkpoints are written and restored by up to
  ``MAX_THREADS`` threads each holding one variable (``checkpoint.variable_sets``; pruning
  masks are such variables too, ``prune/mask/*``, and masks are computed one weight at a
  time). Their peak is a few copies of the largest variable per thread, never the model.

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

from phalanx.checkpoint.sharded import MAX_THREADS, set_count
from phalanx.config import Config, ConfigError, parse_devices, resolve_degrees
from phalanx.core.costs import ModelSpec, param_count
from phalanx.plan.engine_rules import GPTRun
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
    micro = max(t.global_batch // (dp * t.grad_accum * p.microbatches), 1)
    schedule = p.schedule if pp > 1 else "1f1b"
    lay = Layout(dp=dp, tp=tp, pp=pp, microbatches=p.microbatches, micro_batch=micro, schedule=schedule,
                 virtual_stages=p.virtual_stages if schedule == "interleaved" else 1, zero=p.zero,
                 recompute=p.recompute, policy=cfg.precision.policy, accum=t.grad_accum)
    return memory_per_device(ModelSpec.from_config(cfg.model), lay, fused=True), count, dp, pp, tp


#: host copies of the largest slot one checkpoint writer (or restoring thread) holds at once:
#: the slot read from its device or file, TensorFlow's copy when it is assigned, and the
#: contiguous/finite-check temporaries (measured with tracemalloc at up to ~2.1 per thread:
#: tests/test_precheck_host.py)
COPIES_PER_WRITER = 3
#: host copies of the largest shard while weights are made (the shard and one tile of draws)
#: or pruning masks computed (|w| keys, comparisons, the mask): phalanx.prune works shard by shard
COPIES_PER_SHARD = 3


def runs_on_mesh(cfg: Config, tp: int, pp: int) -> bool:
    """Whether ``phalanx train`` runs ``cfg`` on an engine that moves its state one device's
    part at a time (at the resolved ``tp``, ``pp``): the Keras-model engine or the mesh engine
    (:meth:`phalanx.plan.engine_rules.GPTRun.engine`, the rule the engine factory builds by);
    otherwise tf.distribute's, which moves whole variables."""
    return GPTRun.of(cfg, tp, pp).engine() in ("keras", "mesh")


def largest_shard_elements(spec, tp: int, mesh: bool, ep: int = 1) -> int:
    """Elements of the largest part of one logical GPT weight that one device holds: each
    weight's tensor-parallel shard on the Keras-model and mesh engines (vocab rows / columns,
    q|k|v heads, MLP columns / rows split by ``tp``; position embeddings replicated; the experts'
    ``[E, d, f]`` split by ``ep`` and ``tp``), the whole tensor on the tf.distribute engines."""
    d, f, v, t = spec.d_model, spec.ffn_dim, spec.vocab, spec.seq_len
    split = tp if mesh else 1
    sizes = [v * d // split, t * d, 3 * d * d // split, d * d // split, d * f // split]
    if spec.experts:
        sizes.append(spec.experts * d * f // (ep * split if mesh else 1))
    return max(sizes)


def pruned_elements(spec) -> int:
    """Elements of all pruned weights (one mask element each): the matmul kernels of every
    block (``attn/qkv``, ``attn/out``, ``mlp/fc``, ``mlp/proj``, or the experts' ``moe/w_in``
    and ``moe/w_out``) and the head when it is untied (the rule of ``phalanx.prune.prunable``,
    which the planner may not import; tests/test_precheck_host.py checks that they agree).

    >>> pruned_elements(ModelSpec(layers=2, d_model=8, heads=2, ffn=32, vocab=10, seq_len=4))  # 2 x (4 x 64 + 2 x 256)
    1536
    """
    d, f = spec.d_model, spec.ffn_dim
    dense = spec.layers - spec.moe_layers
    return (spec.layers * 4 * d * d + dense * 2 * d * f + spec.moe_layers * spec.experts * 2 * d * f
            + (0 if spec.tie_embeddings else d * spec.vocab))


def host_peak(cfg: Config, dp: int, pp: int, tp: int, devices: int) -> tuple[float, str]:
    """``(bytes, what)``: the host NumPy memory the run needs besides the devices' state, at
    its largest moment (see the module docstring), and a description naming its parts."""

    spec = ModelSpec.from_config(cfg.model)
    mesh = runs_on_mesh(cfg, tp, pp)
    shard = 4.0 * largest_shard_elements(spec, tp, mesh, cfg.parallel.ep)  # float32 bytes
    if mesh:
        writers = max(1, min(MAX_THREADS, devices))
        io = writers * COPIES_PER_WRITER * shard
        work = COPIES_PER_SHARD * shard
        return max(io, work), (f"Keras-model or mesh engine, per shard: largest shard {shard / GiB:,.2f} GiB; checkpoint "
                               f"save/restore {writers} thread(s) x {COPIES_PER_WRITER} copies = {io / GiB:,.2f} "
                               f"GiB; initialisation and pruning {COPIES_PER_SHARD} copies = {work / GiB:,.2f} GiB")
    # Keras-model and tf.distribute engines: whole logical tensors, one at a time. Initial weights are assigned one
    # tensor at a time (GPTTask.build); a checkpoint is written and restored by up to
    # MAX_THREADS threads (one per ~64 MiB of state, checkpoint.variable_sets), each holding one
    # variable. Pruning masks (train.prune) are variables of the state too (prune/mask/*, one per
    # pruned weight, no larger than the largest variable): they only add to the state's bytes
    # that set the thread count; a mask update holds one weight, its mask and the product.
    masks = float(pruned_elements(spec)) if cfg.train.prune.target > 0 else 0.0
    writers = set_count(4.0 * (3 * float(param_count(spec)) + masks))  # weights, m, v (+ masks)
    io = writers * COPIES_PER_WRITER * shard
    work = COPIES_PER_SHARD * shard
    state = "weights, moments and pruning masks" if masks else "weights and moments"
    what = (f"Keras-model or tf.distribute engine, per variable: largest variable {shard / GiB:,.2f} GiB; checkpoint "
            f"save/restore ({state}) {writers} thread(s) x {COPIES_PER_WRITER} copies = {io / GiB:,.2f} GiB; "
            f"initialisation and pruning {COPIES_PER_SHARD} copies = {work / GiB:,.2f} GiB")
    return max(io, work), what


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
