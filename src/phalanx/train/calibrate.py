"""``phalanx plan --calibrate``: run real steps here and compare each device with the plan.

Builds the engine ``phalanx train`` would build (``phalanx.engines.factory.build_engine``)
on the configured devices (``parallel.devices=cpu:N`` for N logical CPUs), runs one
step to trace and allocate (the warm-up), then profiles ``steps`` more steps and reports,
per device, the predicted and the measured peak bytes (the median over the profiled
steps, with their spread), and the median step time of ``steps`` steps.

``phalanx plan --keras --calibrate`` (:func:`calibrate_keras`) does the same for the engine
behind ``phalanx.fit`` (:class:`~phalanx.engines.keras_model.KerasModelEngine`): phalanx's GPT
as a Keras model, compiled as ``phalanx.fit`` compiles it, against
:func:`phalanx.plan.keras_memory.keras_memory_per_device`; or a user's own compiled Keras
model on one of its batches, measured per device.

How memory is measured per device. Logical CPU devices share one BFC allocator
(measured on TF 2.21: ``get_memory_info('CPU:k')`` returns the same process-wide
figure for every ``k``), so the per-device peak is reconstructed from that allocator's
own record:

* the TensorFlow profiler logs every allocation and deallocation of the BFC allocator
  with its size and, when the executor made it, the op (``MemoryAllocation`` events,
  ``tf_op`` stat); an XLA-compiled kernel's buffers (the GPT's fused LayerNorm, softmax
  and GELU) name no op: they belong to the op whose profiler event encloses them on the
  same thread (before this, they all counted on the first device);
* the partition graphs of the step's function (``RunMetadata.function_graphs``) say on
  which device every op ran;
* replaying the events in time order, each op's bytes counted on its device, gives the
  peak of every device during the step, on top of the bytes alive before it (the
  variables, counted by their own devices).

Sizes are the bytes each tensor asked for, not the allocator chunk it got: a shared BFC
allocator hands a request any free chunk up to twice its size, and which one is free
depends on the order the executor ran independent ops in on *all* logical devices; that
made one device's peak vary by 11% from step to step (tp2, 4 layers), against 2% for the
requested bytes. The chunk figure is reported beside it (``allocated_bytes``). The
sum over devices is checked against ``get_memory_info``'s process-wide peak
(``total_check``). ``TF_CPU_ALLOCATOR_USE_BFC=true`` must be set before TensorFlow
starts: :func:`phalanx.commands.plan.main` sets it for ``--calibrate`` before any import.

Example (needs TensorFlow and a fresh process; runs real steps):
    >>> from phalanx.config import load_config                                  # doctest: +SKIP
    >>> cfg = load_config(None, ["model.layers=2", "parallel.tp=2", "parallel.devices=cpu:2"])
    >>> cal = calibrate(cfg, predicted_per_device={0: 1e6, 1: 1e6})             # doctest: +SKIP
    >>> sorted(cal["devices"][0])                                               # doctest: +SKIP
    ['allocated_bytes', 'device', 'error', 'measured_bytes', 'measured_spread', 'predicted_bytes']
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from phalanx.mesh import build_mesh

# Inter-op threads of the calibration process (see prepare_devices).
INTER_OP_THREADS = 1


def prepare_devices(cfg) -> None:
    """Create the run's devices (``parallel.devices=cpu:N``: N logical CPUs) now: TensorFlow
    accepts that only before its first op, and the matmul peak probe is an op.

    The executor gets one inter-op thread (:data:`INTER_OP_THREADS`), set now for the same
    reason: with a pool, the order of independent ops (two groups' AdamW updates, two
    replicas' backwards) follows the machine's load, and so does each device's peak (one
    device of dp2 x tp2 x pp2 measured 19.3 or 21.9 MiB in steps of one run at load 7);
    with one thread the order, and every device's peak, was the same in every step.
    Kernels keep their intra-op threads.
    """
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    build_mesh(cfg)


def calibrate(cfg, plan=None, steps: int = 3, predicted_per_device: dict | None = None) -> dict:
    """Predicted vs measured peak bytes per device, and step time.

    ``predicted_per_device``: device index (in ``dp, pp, tp`` mesh order, as
    ``parallel.devices`` numbers them) -> predicted bytes; from
    :func:`phalanx.plan.keras_memory.keras_memory_per_device` (phalanx's AdamW, the stages the
    engine cut) when ``plan`` is given.
    Errors are ``(predicted - measured) / measured``.
    """
    _check_steps(steps)
    import numpy as np
    import tensorflow as tf

    from phalanx.config import ConfigError
    from phalanx.engines.task import GPTTask
    from phalanx.engines.factory import refuse_before_build
    from phalanx.engines.keras_gpt import KerasGPTEngine

    from phalanx.plan.keras_memory import check_calibrated, keras_memory_per_device

    if cfg.parallel.strategy == "parameter_server":
        raise ConfigError("parallel.strategy", f"{cfg.parallel.strategy}: --calibrate measures the Keras-model "
                                               f"engine in this process; parameter servers run across processes")
    if predicted_per_device is None and plan is not None:
        check_calibrated(cfg, cfg.parallel.dp, "phalanx")  # before building anything
    task = GPTTask(cfg.model, cfg.precision.policy, cfg.train.seed)
    refuse_before_build(cfg, task)
    mesh = build_mesh(cfg)
    # With tensor shards inside a stage call, the measured peaks of tp2 x pp2 under mixed_bfloat16
    # moved ~4 MiB from tensor rank 1 to rank 0 of the first stage against the memory model
    # (float32 matched it): the stages run inline here under tp > 1, and are planned so.
    engine = KerasGPTEngine(cfg, task, mesh, stage_calls=mesh.tp == 1)
    rng = np.random.default_rng(cfg.train.seed)
    batch = tf.constant(rng.integers(0, cfg.model.vocab, (cfg.train.global_batch, cfg.model.seq_len + 1)),
                        dtype=tf.int32)
    # the Keras-model engine with phalanx's AdamW: its moments (Keras slots, by their
    # tf.Variables) counted once beside what the engine keeps
    opt = engine.optimizer
    variables = keras_engine_variables(engine.engine)
    seen = {id(v) for v in variables}
    for slot in list(opt.m) + list(opt.v):
        tv = slot if isinstance(slot, tf.Variable) else slot.value
        if id(tv) not in seen:
            seen.add(id(tv))
            variables.append(tv)
    if predicted_per_device is None and plan is not None:
        predicted_per_device = {d: m.total for d, m in keras_memory_per_device(
            cfg, engine_blocks_per_stage(engine.engine), optimizer="phalanx",
            calls=engine.engine.stage_calls is not None).items()}
    return _calibrate_engine(engine, batch, steps, predicted_per_device, plan, variables)


def _check_steps(steps: int) -> None:
    if steps < 1:
        raise ValueError(f"--calibrate-steps must be >= 1, got {steps}")
    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # CPU memory stats need the BFC allocator


def _calibrate_engine(engine, batch, steps: int, predicted_per_device: dict | None, plan=None,
                      variables: list | None = None) -> dict:
    """Warm up, profile ``steps`` steps and time ``steps`` more of ``engine`` on ``batch``;
    ``variables``: the ``tf.Variable`` s alive between steps (default: found on the engine)."""
    import numpy as np

    device_of_op = _trace_placement(engine, batch)  # the first step: traces, places, allocates
    # Each profiled step gives every device's peak; the median over ``steps`` of them is the
    # figure (the executor orders independent ops differently from step to step).
    runs = [_measure_step(engine, batch, device_of_op, variables) for _ in range(steps)]
    total = float(np.median([r.total for r in runs]))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        float(engine.train_step(batch)["loss"])  # .numpy() waits for the step to finish
        times.append(time.perf_counter() - start)
    measured_t = float(np.median(times))
    predicted_per_device = predicted_per_device or {}
    devices = []
    for index, name in enumerate(_mesh_devices(engine)):
        short = _short(name)
        peaks = [r.requested.get(short, 0.0) for r in runs]
        measured = float(np.median(peaks))
        predicted = predicted_per_device.get(index)
        devices.append({"device": short, "predicted_bytes": predicted, "measured_bytes": measured,
                        "measured_spread": (max(peaks) - min(peaks)) / measured if measured else None,
                        "allocated_bytes": float(np.median([r.allocated.get(short, 0.0) for r in runs])),
                        "error": (predicted - measured) / measured if predicted is not None and measured else None})
    out = {"steps": steps, "devices": devices, "total_check": total,
           "unplaced_bytes": max(r.unplaced for r in runs), "measured_step_time_s": measured_t}
    if plan is not None:
        predicted_t = plan.time.step_time_s
        out.update({"predicted_step_time_s": predicted_t,
                    "step_time_error": (predicted_t - measured_t) / measured_t,
                    # the --utilization that would have predicted the measured time
                    "implied_utilization": plan.utilization * predicted_t / measured_t})
    worst = max((d for d in devices if d["error"] is not None), key=lambda d: abs(d["error"]), default=None)
    out["memory_error"] = worst["error"] if worst else None
    return out


def keras_gpt(cfg, tp: int):
    """phalanx's GPT for ``cfg.model`` as a Keras model (:func:`phalanx.models.transformer.gpt`,
    cut for ``tp`` tensor ranks, from ``train.seed``), compiled as :func:`phalanx.fit` compiles
    a model given no optimizer: Keras's AdamW from ``train.*``
    (:func:`phalanx.train.keras_api.default_optimizer`, over ``train.steps``) and the token
    cross-entropy on the logits; under ``precision.policy`` (``auto`` included: phalanx's own
    GPT takes the policy auto resolved to, as ``phalanx train`` runs it)."""
    import keras

    from phalanx.engines.keras_model import apply_precision
    from phalanx.models.transformer import gpt
    from phalanx.train.keras_api import default_optimizer

    model = gpt(cfg.model, tp=tp, seed=cfg.train.seed)
    model.compile(optimizer=default_optimizer(cfg, cfg.train.steps),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    apply_precision(model, cfg, auto_switches=True)
    return model


def calibrate_keras(cfg, model=None, x=None, y=None, steps: int = 3, predicted_per_device: dict | None = None,
                    plan=None) -> dict:
    """Per-device peak memory of ``phalanx.fit``'s steps (the Keras-model engine) on this
    machine's devices, against the planner.

    Without ``model``: phalanx's GPT for ``cfg.model`` as a Keras model (:func:`keras_gpt`) on
    random tokens of ``train.global_batch`` x ``model.seq_len``, predicted by
    :func:`phalanx.plan.keras_memory.keras_memory_per_device` (with the stages the engine
    really cut). With ``model`` (a compiled Keras model, split by its keras-hub preset
    at ``parallel.tp > 1`` as ``phalanx.fit`` does) and one global batch ``x``, ``y``: the
    measured figures, against ``predicted_per_device`` (device index -> bytes) if given.
    ``cfg``'s devices must exist already (:func:`prepare_devices`). Same report as
    :func:`calibrate`; the step time is compared only when a ``plan`` is given.

    Example (needs TensorFlow and a fresh process; runs real steps):
        >>> from phalanx.config import load_config                                 # doctest: +SKIP
        >>> cfg = load_config(None, ["model.layers=2", "parallel.tp=2", "parallel.devices=cpu:2"])  # doctest: +SKIP
        >>> prepare_devices(cfg)                                                   # doctest: +SKIP
        >>> cal = calibrate_keras(cfg)                                             # doctest: +SKIP
        >>> [d["device"] for d in cal["devices"]], abs(cal["memory_error"]) < 0.1  # doctest: +SKIP
        (['CPU:0', 'CPU:1'], True)
    """
    _check_steps(steps)
    import numpy as np
    import tensorflow as tf

    from phalanx.engines.keras_model import KerasModelEngine, apply_precision
    from phalanx.plan.keras_memory import check_calibrated, keras_memory_per_device
    from phalanx.train.keras_api import split_for_tensor_parallel

    mesh = build_mesh(cfg)
    builtin = model is None
    if builtin:
        if x is not None or y is not None:
            raise ValueError("x / y: the built-in GPT is calibrated on random tokens; pass them only with model=")
        check_calibrated(cfg, mesh.dp, "keras")  # before building anything
        model = keras_gpt(cfg, mesh.tp)
        tokens = np.random.default_rng(cfg.train.seed).integers(
            0, cfg.model.vocab, (cfg.train.global_batch, cfg.model.seq_len + 1)).astype("int32")
        x, y = tokens[:, :-1], tokens[:, 1:]
    else:
        if x is None or y is None:
            raise ValueError("x / y: calibrating your own model needs one global batch: calibrate_keras(cfg, model, "
                             "x, y)")
        split_for_tensor_parallel(model, cfg, mesh, verbose=0)
        apply_precision(model, cfg)
    batch = (tf.nest.map_structure(tf.constant, x), tf.nest.map_structure(tf.constant, y), None)
    engine = KerasModelEngine(model, cfg, mesh, batch, stage_calls=mesh.tp == 1)  # (see calibrate)
    if builtin and predicted_per_device is None:
        predicted_per_device = {d: m.total for d, m in
                                keras_memory_per_device(cfg, engine_blocks_per_stage(engine), "keras",
                                                        calls=engine.stage_calls is not None).items()}
    return _calibrate_engine(engine, batch, steps, predicted_per_device, plan, keras_engine_variables(engine))


def engine_blocks_per_stage(engine) -> list[int]:
    """Transformer blocks per pipeline rank as a Keras-model engine cut the model (by the FLOPs
    of its ops, embedding, head and loss included: for a small model not always the mesh
    engine's cut, :func:`phalanx.plan.engine_rules.stage_bounds`)."""
    from phalanx.layers import TransformerBlock

    blocks = [0] * engine.pp
    for layer in engine.model.layers:
        if isinstance(layer, TransformerBlock):  # the stage that holds the block's weights
            blocks[engine.home[id(layer.trainable_variables[0])] % engine.pp] += 1
    return blocks


def keras_engine_variables(engine) -> list:
    """Every ``tf.Variable`` a Keras-model engine keeps between steps: the model's weights and
    state, the optimizer's slots and counters, the compiled metrics' and loss tracker's
    totals, the engine's weight copies (other replicas', a mirrored tied embedding), and under
    ZeRO the slices, their optimizer's slots and ``model.optimizer``'s whole-shaped slots."""
    import tensorflow as tf

    model = engine.model
    keras_vars = list(model.variables) + list(getattr(engine.optimizer, "variables", []))
    slices = getattr(engine, "slices", None)
    if slices is not None:  # ZeRO: the slices, and model.optimizer's whole-shaped slots (on the host)
        keras_vars += list(slices.flat) + list(getattr(model.optimizer, "variables", []))
    for metric in model.metrics:
        keras_vars += list(metric.variables)
    found: dict[int, tf.Variable] = {}
    for v in keras_vars:
        tv = v.value if isinstance(getattr(v, "value", None), tf.Variable) else v
        if isinstance(tv, tf.Variable):
            found[id(tv)] = tv
    for copies in engine.copies.values():
        for c in copies:
            if c is not None:
                found[id(c)] = c
    return list(found.values())


def _short(device: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:1`` -> ``CPU:1``."""
    return device.rsplit("device:", 1)[-1]


def _mesh_devices(engine) -> list[str]:
    mesh = getattr(engine, "mesh", None)
    if mesh is not None:
        return list(mesh.devices)
    strategy = getattr(engine, "strategy", None)
    return list(strategy.extended.worker_devices) if strategy is not None else ["CPU:0"]


def run_with_metadata(run):
    """``(run(), the RunMetadata of the functions run() executed)``.

    TensorFlow's context keeps what it recorded until someone exports it, so a caller that
    enabled run metadata and never read it (a step that raised, a profiler) would leave its
    function graphs in the next caller's export: they are dropped first.

    >>> import tensorflow as tf
    >>> value, meta = run_with_metadata(lambda: tf.function(lambda: tf.constant(2.0) * 3.0)())
    >>> float(value), len(meta.function_graphs)
    (6.0, 1)
    """
    from tensorflow.python.eager import context

    context.export_run_metadata()  # clears what an earlier, unread recording left
    context.enable_run_metadata()
    try:
        result = run()
        meta = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    return result, meta


def _trace_placement(engine, batch) -> dict[str, str]:
    """Run the first step with run metadata on; return op name -> short device name.

    The partition graphs record where the placer put every op: explicitly placed ones
    where ``tf.device`` said, the others (e.g. the ops ``GradientTape.gradient`` creates,
    which carry no device) where the placer chose.
    """
    _, meta = run_with_metadata(lambda: float(engine.train_step(batch)["loss"]))
    placement: dict[str, str] = {}
    for fn in meta.function_graphs:
        for graph in fn.partition_graphs:
            for node in graph.node:
                placement.setdefault(node.name, _short(node.device))
    # The bodies of traced stage calls (parallel/stage_calls.py) are in no partition graph:
    # their ops, forward and backward, carry the call's name scope, entered here with its device;
    # an op inside that names a device of its own (a tensor shard's) is entered by its name.
    calls = getattr(getattr(engine, "engine", engine), "stage_calls", None)
    if calls is not None:
        for scope, device in calls.devices.items():
            placement[scope] = _short(device)
        for op, device in calls.op_devices.items():
            placement.setdefault(op, _short(device))
    return placement


def _device_of(op: str, device_of_op: dict[str, str]) -> str | None:
    """The device of op ``op``: by its name, by the op it was made from (the graph optimiser
    names the ops it adds under the op they replace, e.g. ``gradients/AddN_12/inputs_1``), or
    by the stage call's scope it was made in.

    >>> _device_of("gradients/AddN_12/inputs_1", {"gradients/AddN_12": "CPU:1"})
    'CPU:1'
    >>> _device_of("gradients/stage_call_0_1_True/dense/MatMul_grad/MatMul", {"stage_call_0_1_True": "CPU:1"})
    'CPU:1'
    >>> _device_of("stage_call_0_1_True/dense/MatMul/fused", {"stage_call_0_1_True": "CPU:2",
    ...                                                        "stage_call_0_1_True/dense/MatMul": "CPU:3"})
    'CPU:3'
    """
    if op in device_of_op:
        return device_of_op[op]
    parts = op.split("/")
    for end in range(len(parts) - 1, 0, -1):
        device = device_of_op.get("/".join(parts[:end]))
        if device is not None:
            return device
    for part in parts:
        if part.startswith("stage_call_") and part in device_of_op:
            return device_of_op[part]
    return None


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


def _read_profile(logdir: str):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as fh:
        space.ParseFromString(fh.read())
    return space


def allocation_events(space, device_of_op: dict[str, str]) -> tuple[list, int]:
    """``(time_ps, is_allocation, addr, requested bytes, chunk bytes, device or None)`` of
    every BFC event of a profile, in time order; and the requested bytes of allocations no
    op could be found for.

    Requested bytes are what the tensor asked for; the chunk is what the BFC allocator gave:
    up to twice the request, since it does not split a free chunk smaller than twice the
    request, and which chunk is free depends on the order the executor happened to run ops
    in, across all logical devices at once (they share one allocator). The chunk figure
    varied by 11% from step to step on one device (tp2, 4 layers), the requested one by 2%.

    An allocation names its op (``tf_op``) only when TensorFlow's executor made it. The
    buffers an XLA-compiled kernel allocates (phalanx's fused GPT ops are ``jit_compile``
    functions: their outputs are activations) carry no op; they are made on the thread
    that runs the kernel, inside that op's own profiler event (``ExecutorState::Process``
    ... ``ProcessAsync::Start`` named after the node), so the innermost enclosing event of
    a known op on the same thread gives their device.
    """
    events, unplaced = [], 0
    for plane in space.planes:
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            spans, memory, started = [], [], None
            for ev in sorted(line.events, key=lambda e: e.offset_ps):
                kind = plane.event_metadata[ev.metadata_id].name
                start = base + ev.offset_ps
                stats = {names[s.metadata_id]: _stat_value(s, names) for s in ev.stats}
                if kind in ("MemoryAllocation", "MemoryDeallocation"):
                    memory.append((start, kind == "MemoryAllocation", stats))
                    continue
                op = stats.get("name") or kind.split(":", 1)[0]
                dev = _device_of(op, device_of_op) if isinstance(op, str) else None
                if dev is None and kind.startswith("CpuExecutable::"):
                    # an XLA kernel started asynchronously runs in its own event after the
                    # op's start returned, on the same thread: the op started last is its op
                    dev = started
                elif dev is not None and kind.startswith("ExecutorState::ProcessAsync"):
                    started = dev
                if dev is not None:
                    spans.append((start, start + ev.duration_ps, dev))
            for when, is_alloc, stats in memory:
                dev = None
                if is_alloc:
                    dev = _device_of(str(stats.get("tf_op", "")), device_of_op)
                    if dev is None:
                        inside = [s for s in spans if s[0] <= when <= s[1]]
                        if inside:
                            dev = min(inside, key=lambda s: s[1] - s[0])[2]
                        else:
                            unplaced += int(stats.get("requested_bytes") or 0)
                events.append((when, is_alloc, stats.get("addr"), int(stats.get("requested_bytes") or 0),
                               int(stats.get("allocation_bytes") or 0), dev))
    events.sort(key=lambda e: (e[0], not e[1]))
    return events, unplaced


@dataclass
class StepMemory:
    """One profiled step: per-device peaks (short device name -> bytes) counted by the bytes
    each tensor asked for (``requested``) and by the BFC chunks it got (``allocated``);
    ``get_memory_info``'s process-wide peak (``total``); bytes no op could be found for."""

    requested: dict[str, float]
    allocated: dict[str, float]
    total: float
    unplaced: int


def measure_step_memory(engine, batch, device_of_op: dict[str, str]) -> tuple[dict[str, float], float]:
    """Peak bytes per device (short name) during one ``engine.train_step(batch)``, by the
    bytes the tensors asked for, and the process-wide peak ``get_memory_info`` reports."""
    step = _measure_step(engine, batch, device_of_op)
    return step.requested, step.total


def _replay(events, base: dict[str, float], first: str, field: int) -> dict[str, float]:
    """Peak of every device: the bytes alive before the step (``base``) plus the step's
    allocations on that device, replayed in time order (``field``: 3 requested, 4 chunk)."""
    current, peak = dict(base), dict(base)
    live: dict[int, tuple[str, int]] = {}
    for event in events:
        _, is_alloc, addr, dev = event[0], event[1], event[2], event[5]
        if is_alloc:
            dev = dev or first  # nothing says where: the caller's device
            live[addr] = (dev, event[field])
            current[dev] = current.get(dev, 0.0) + event[field]
            peak[dev] = max(peak.get(dev, 0.0), current[dev])
        elif addr in live:  # freed memory allocated before the trace is part of ``base``
            dev, size = live.pop(addr)
            current[dev] -= size
    return peak


def _measure_step(engine, batch, device_of_op, variables: list | None = None) -> StepMemory:
    import tensorflow as tf

    if variables is None:
        variables = []
        _variables(engine, set(), variables)
    base: dict[str, float] = {}
    for v in variables:
        # (a variable of unknown shape, e.g. ZeRO's AdamW scratch, is empty between steps)
        count = v.shape.num_elements() if v.shape.is_fully_defined() else int(tf.size(v))
        nbytes = -(-int(count) * v.dtype.size // 256) * 256  # the BFC allocator's 256-byte granule
        base[_short(v.device)] = base.get(_short(v.device), 0.0) + nbytes
    first = _short(_mesh_devices(engine)[0])
    tf.config.experimental.reset_memory_stats(first)
    logdir = tempfile.mkdtemp(prefix="phalanx-calibrate-")
    try:
        tf.profiler.experimental.start(logdir)
        float(engine.train_step(batch)["loss"])
        tf.profiler.experimental.stop()
        total = float(tf.config.experimental.get_memory_info(first)["peak"])
        space = _read_profile(logdir)
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    events, unplaced = allocation_events(space, device_of_op)
    return StepMemory(_replay(events, base, first, 3), _replay(events, base, first, 4), total, unplaced)
