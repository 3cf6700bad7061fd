"""``phalanx plan --calibrate``: run real steps here and compare each device with the plan.

Builds the engine ``phalanx train`` would build (``phalanx.train.trainer.make_engine``)
on the configured devices (``parallel.devices=cpu:N`` for N logical CPUs), runs one
step to trace and allocate, then measures one more step and reports, per device,
the predicted and the measured peak bytes, and the median step time of ``steps`` steps.

How memory is measured per device. Logical CPU devices share one BFC allocator
(measured on TF 2.21: ``get_memory_info('CPU:k')`` returns the same process-wide
figure for every ``k``), so the per-device peak is reconstructed from that allocator's
own record:

* the TensorFlow profiler logs every allocation and deallocation of the BFC allocator
  with its size and the op that made it (``MemoryAllocation`` events, ``tf_op`` stat);
* the partition graphs of the step's function (``RunMetadata.function_graphs``) say on
  which device every op ran;
* replaying the events in time order, each op's bytes counted on its device, gives the
  peak of every device during the step, on top of the bytes alive before it (the
  variables, counted by their own devices).

The sum over devices is checked against ``get_memory_info``'s process-wide peak
(``total_check``). ``TF_CPU_ALLOCATOR_USE_BFC=true`` must be set before TensorFlow
starts: :func:`phalanx.plan.cli.main` sets it for ``--calibrate`` before any import.

Example (needs TensorFlow and a fresh process; runs real steps):
    >>> from phalanx.config import load_config                                  # doctest: +SKIP
    >>> cfg = load_config(None, ["model.layers=2", "parallel.tp=2", "parallel.devices=cpu:2"])
    >>> cal = calibrate(cfg, predicted_per_device={0: 1e6, 1: 1e6})             # doctest: +SKIP
    >>> sorted(cal["devices"][0])                                               # doctest: +SKIP
    ['device', 'error', 'measured_bytes', 'predicted_bytes']
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time


def prepare_devices(cfg) -> None:
    """Create the run's devices (``parallel.devices=cpu:N``: N logical CPUs) now: TensorFlow
    accepts that only before its first op, and the matmul peak probe is an op."""
    from phalanx.mesh import build_mesh

    build_mesh(cfg)


def calibrate(cfg, plan=None, steps: int = 3, predicted_per_device: dict | None = None) -> dict:
    """Predicted vs measured peak bytes per device, and step time.

    ``predicted_per_device``: device index (in ``dp, pp, tp`` mesh order, as
    ``parallel.devices`` numbers them) -> predicted bytes; from
    :func:`phalanx.plan.engine_memory.engine_memory_per_device` when ``plan`` is given.
    Errors are ``(predicted - measured) / measured``.
    """
    if steps < 1:
        raise ValueError(f"--calibrate-steps must be >= 1, got {steps}")
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
    device_of_op = _trace_placement(engine, batch)  # the first step: traces, places, allocates
    per_device, total = measure_step_memory(engine, batch, device_of_op)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(engine.train_step(batch)["loss"])  # .numpy() waits for the step to finish
        times.append(time.perf_counter() - start)
    measured_t = float(np.median(times))
    if predicted_per_device is None and plan is not None:
        from phalanx.plan.engine_memory import engine_memory_per_device

        predicted_per_device = {d: m.total for d, m in engine_memory_per_device(cfg).items()}
    predicted_per_device = predicted_per_device or {}
    devices = []
    for index, name in enumerate(_mesh_devices(engine)):
        measured = per_device.get(_short(name), 0.0)
        predicted = predicted_per_device.get(index)
        devices.append({"device": _short(name), "predicted_bytes": predicted, "measured_bytes": measured,
                        "error": (predicted - measured) / measured if predicted is not None and measured else None})
    out = {"steps": steps, "devices": devices, "total_check": total,
           "measured_step_time_s": measured_t}
    if plan is not None:
        predicted_t = plan.time.step_time_s
        out.update({"predicted_step_time_s": predicted_t,
                    "step_time_error": (predicted_t - measured_t) / measured_t,
                    # the --utilization that would have predicted the measured time
                    "implied_utilization": plan.utilization * predicted_t / measured_t})
    worst = max((d for d in devices if d["error"] is not None), key=lambda d: abs(d["error"]), default=None)
    out["memory_error"] = worst["error"] if worst else None
    return out


def _short(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:1`` -> ``CPU:1``."""
    return device.rsplit("device:", 1)[-1]


def _mesh_devices(engine) -> list[str]:
    mesh = getattr(engine, "mesh", None)
    if mesh is not None:
        return list(mesh.devices)
    strategy = getattr(engine, "strategy", None)
    return list(strategy.extended.worker_devices) if strategy is not None else ["CPU:0"]


def _trace_placement(engine, batch) -> dict[str, str]:
    """Run the first step with run metadata on; return op name -> short device name.

    The partition graphs record where the placer put every op: explicitly placed ones
    where ``tf.device`` said, the others (e.g. the ops ``GradientTape.gradient`` creates,
    which carry no device) where the placer chose.
    """
    from tensorflow.python.eager import context

    context.enable_run_metadata()
    try:
        float(engine.train_step(batch)["loss"])
        meta = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    placement: dict[str, str] = {}
    for fn in meta.function_graphs:
        for graph in fn.partition_graphs:
            for node in graph.node:
                placement.setdefault(node.name, _short(node.device))
    return placement


def _variables(obj, seen: set, out: list, depth: int = 0) -> None:
    """Every ``tf.Variable`` reachable from ``obj``'s attributes, lists and dicts (each
    distributed variable as its per-device components)."""
    import tensorflow as tf

    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, tf.distribute.DistributedValues):
        for v in obj.values:
            _variables(v, seen, out, depth + 1)
        return
    if isinstance(obj, tf.Variable):
        out.append(obj)
        return
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif type(obj).__module__.startswith("phalanx.") and hasattr(obj, "__dict__"):
        items = vars(obj).values()
    else:
        return
    for item in items:
        _variables(item, seen, out, depth + 1)


def _stat_value(stat, names: dict):
    kind = stat.WhichOneof("value")
    if kind == "ref_value":  # interned strings (op names) point into the plane's stat names
        return names.get(stat.ref_value, "")
    return getattr(stat, kind) if kind else None


def measure_step_memory(engine, batch, device_of_op: dict[str, str]) -> tuple[dict[str, float], float]:
    """Peak bytes per device (short name) during one ``engine.train_step(batch)``, and
    the process-wide peak ``get_memory_info`` reports (the check on the sum)."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    variables: list = []
    _variables(engine, set(), variables)
    base: dict[str, float] = {}
    for v in variables:
        # the BFC allocator hands out multiples of 256 bytes
        # (a variable of unknown shape, e.g. ZeRO's AdamW scratch, is empty between steps)
        count = v.shape.num_elements() if v.shape.is_fully_defined() else int(tf.size(v))
        nbytes = -(-int(count) * v.dtype.size // 256) * 256
        base[_short(v.device)] = base.get(_short(v.device), 0.0) + nbytes
    logdir = tempfile.mkdtemp(prefix="phalanx-calibrate-")
    try:
        tf.profiler.experimental.start(logdir)
        float(engine.train_step(batch)["loss"])
        tf.profiler.experimental.stop()
        total = float(tf.config.experimental.get_memory_info(_short(_mesh_devices(engine)[0]))["peak"])
        files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
        space = xplane_pb2.XSpace()
        with open(files[-1], "rb") as fh:
            space.ParseFromString(fh.read())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    events = []
    for plane in space.planes:
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                kind = plane.event_metadata[ev.metadata_id].name
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {names[s.metadata_id]: _stat_value(s, names) for s in ev.stats}
                when = line.timestamp_ns * 1000 + ev.offset_ps
                events.append((when, kind == "MemoryAllocation", stats))
    events.sort(key=lambda e: (e[0], not e[1]))
    current = dict(base)
    peak = dict(base)
    live: dict[int, tuple[str, int]] = {}
    default = _short(_mesh_devices(engine)[0])  # allocations outside any op: the caller's device
    for _, is_alloc, stats in events:
        addr = stats.get("addr")
        if is_alloc:
            dev = device_of_op.get(str(stats.get("tf_op", "")), default)
            size = int(stats.get("allocation_bytes") or 0)
            live[addr] = (dev, size)
            current[dev] = current.get(dev, 0.0) + size
            peak[dev] = max(peak.get(dev, 0.0), current[dev])
        elif addr in live:  # freed memory allocated before the trace is part of ``base``
            dev, size = live.pop(addr)
            current[dev] -= size
    return peak, total
