"""Step time of keras-hub GPT-2 under tensor parallelism over its one-device step (issue 10, "Done when").

The model is a keras-hub ``GPT2CausalLM`` (``preprocessor=None``) with a small random
GPT-2 config that trains in minutes on 2 cores: 4 layers, hidden 256, 4 heads (head 64),
intermediate 1024, vocabulary 4096, sequence 128 (4.24 M parameters), float32, dropout 0,
Adam 1e-3, ``SparseCategoricalCrossentropy(from_logits=True)`` + weighted accuracy. Data:
``--samples`` random token sequences (``token_ids`` + an all-ones ``padding_mask``, the
labels the ids shifted by one), batch 8.

Contenders, all in this one process (the same oneDNN setting, thread pools and machine
load), each with its own model (same seed, same initial weights):

* ``keras``: Keras's own ``model.fit`` on one device;
* ``phalanx``: ``phalanx.fit`` on one device (the plain keras-hub layers);
* ``phalanx tp2``: ``parallel.devices=cpu:2 parallel.tp=2`` (phalanx splits the model with
  its keras-hub preset on the first fit: attention by heads, the MLP by columns then rows,
  the token embedding and tied head by vocabulary);
* ``phalanx dp2 x tp2 x pp2``: ``parallel.devices=cpu:8 parallel.dp=2 parallel.tp=2
  parallel.pp=2 parallel.microbatches=M`` (``--microbatches``, default 2: each of the 2 data
  replicas cuts its 4 rows into 2 micro-batches of 2);
* diagnostic rows (``--diagnostics``, on by default), to tell the cost of the
  tensor-parallel *layers* from the cost of running them on two devices:
  ``phalanx tp1 layers`` = the model after ``phalanx.parallelize(model, 1)`` (one-shard
  layers) on one device, and ``phalanx tp2 layers, 1 device`` = after
  ``phalanx.parallelize(model, 2)`` (two shards per layer) on one device; and
  ``phalanx dp2 x pp2`` (the plain model on ``cpu:4``, same micro-batches), the
  dp2 x tp2 x pp2 layout without its tensor axis.

The process makes ``--devices`` logical CPUs once at start (``phalanx.init`` with
``parallel.devices=cpu:8``); every fit picks its layout through ``overrides=`` and uses the
first devices it needs (a ``cpu:2`` layout runs on CPU:0-1 of the 8). Logical CPUs share the
same 2 cores and thread pools, so a layout gives no speed-up: the rows measure the overhead
of the layout, as the ratio of its step time to the one-device step.

Each round calls every contender's fit once with ``--epochs`` epochs, in an order that
rotates every round; the first epoch of every call (tracing, building, the split) is
discarded. Time per step = (``on_epoch_end`` - ``on_epoch_begin``) / steps from a callback
every fit runs; the process CPU time (user + system, all threads) per step is recorded the
same way. On a machine shared with other work, a layout that keeps more threads busy can
take a larger share of the cores than the one-device run, which lowers its wall-clock
ratio: the CPU-time ratio is the check on that. Reported: medians over all measured
epochs, the ratio to phalanx's and to Keras's one-device medians, and the median of the
same-round ratios.

With ``--ops``, the engine's traced step (``engine._train_fn``) of the one-device, tp2 and
dp2 x tp2 x pp2 layouts is also counted by op type, before Grappler and as TensorFlow runs
it (the partition graphs, after Grappler and oneDNN's rewrites, with the ``_Send``/``_Recv``
pairs it inserts between devices), and written as a table.

With ``--profile``, one training step of each of the one-device, tp2 and dp2 x tp2 x pp2
engines is recorded ``--profile-steps`` times with the TensorFlow profiler (the layouts
interleaved, after warm-up steps) and the executed ops are summed by type: the median over
the recorded steps of each type's count and time, and of the step's total op time. With
``--inter-op 1`` no two ops overlap, so an op's time is its own work (with TensorFlow's
default inter-op threads, ops on the 2 cores share them and each one's time is inflated).

Usage::

    python benchmarks/bench_keras_hub_tp.py                      # rewrites benchmarks/results/keras_hub_tp.md
    python benchmarks/bench_keras_hub_tp.py --rounds 1 --epochs 2 --output -   # a smoke run
    python benchmarks/bench_keras_hub_tp.py --ops --rounds 0 --output -        # op counts only
    python benchmarks/bench_keras_hub_tp.py --profile --inter-op 1 --rounds 0 --output -   # op times only
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = Path(__file__).resolve().parent / "results" / "keras_hub_tp.md"
LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 4, 256, 4, 1024, 4096, 128, 8

ALL = ("keras", "phalanx", "phalanx tp2", "phalanx dp2 x tp2 x pp2")
DIAGNOSTIC = ("phalanx tp1 layers", "phalanx tp2 layers, 1 device", "phalanx dp2 x pp2")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs per fit call; the first is discarded (default: 3)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"global batch (default: {BATCH})")
    parser.add_argument("--samples", type=int, default=64, help="sequences per epoch (default: 64 = 8 steps of 8)")
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches of the dp2 x tp2 x pp2 row (default: 2)")
    parser.add_argument("--devices", type=int, default=8,
                        help="logical CPUs made at start (default: 8; with fewer the dp2 x tp2 x pp2 row is skipped)")
    parser.add_argument("--onednn", choices=("on", "off", "default"), default="on",
                        help="TF_ENABLE_ONEDNN_OPTS for every contender (default: on, as the phalanx command sets it)")
    parser.add_argument("--no-diagnostics", action="store_true", help="skip the tp1-layers / tp2-layers-one-device rows")
    parser.add_argument("--only", default="", help="comma-separated contender names to run (default: all)")
    parser.add_argument("--ops", action="store_true", help="also count the traced step's ops per layout")
    parser.add_argument("--profile", action="store_true", help="also profile one step per layout (op time by type)")
    parser.add_argument("--profile-steps", type=int, default=5, help="profiled steps per layout (default: 5)")
    parser.add_argument("--inter-op", type=int, default=0,
                        help="inter_op_parallelism_threads for the whole run (default 0: TensorFlow's default)")
    parser.add_argument("--output", default=str(RESULTS), help=f"markdown file to write, or - (default: {RESULTS})")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: the first epoch of every call is discarded")
    if args.samples % args.batch:
        parser.error(f"--samples must be a multiple of the batch ({args.batch})")
    return args


ARGS = parse_args()
BATCH = ARGS.batch
if ARGS.onednn != "default":
    # Must be set before TensorFlow is imported; every contender lives in this process.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if ARGS.onednn == "on" else "0"

import phalanx  # noqa: E402

if ARGS.inter_op:
    import tensorflow as _tf

    _tf.config.threading.set_inter_op_parallelism_threads(ARGS.inter_op)

# Devices first, once: the 8 logical CPUs of the dp2 x tp2 x pp2 row (the others use the first 1 or 2).
phalanx.init(f"parallel.devices=cpu:{ARGS.devices}", f"parallel.dp={ARGS.devices}")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from machine_report import load, machine  # noqa: E402
import tensorflow as tf  # noqa: E402


TP2 = ("parallel.devices=cpu:2", "parallel.tp=2")


def dtp_layout() -> tuple[str, ...]:
    return ("parallel.devices=cpu:8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
            f"parallel.microbatches={ARGS.microbatches}")


def layouts() -> dict[str, tuple[str, ...]]:
    out = {"keras": (), "phalanx": (), "phalanx tp2": TP2}
    if ARGS.devices >= 8:
        out["phalanx dp2 x tp2 x pp2"] = dtp_layout()
    if not ARGS.no_diagnostics:
        out["phalanx tp1 layers"] = ()
        out["phalanx tp2 layers, 1 device"] = ()
        out["phalanx dp2 x pp2"] = ("parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2",
                                    f"parallel.microbatches={ARGS.microbatches}")
    if ARGS.only:
        wanted = [w.strip() for w in ARGS.only.split(",")]
        unknown = [w for w in wanted if w not in out]
        if unknown:
            raise SystemExit(f"--only: unknown contender(s) {unknown}; known: {list(out)}")
        out = {k: v for k, v in out.items() if k in wanted or k in ("keras", "phalanx")}
    return out


def data(samples: int):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (samples, SEQ + 1)).astype("int32")
    return {"token_ids": tokens[:, :-1], "padding_mask": np.ones((samples, SEQ), "int32")}, tokens[:, 1:]


def gpt2(name: str = "keras") -> keras.Model:
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS,
                                             hidden_dim=HIDDEN, intermediate_dim=FFN, max_sequence_length=SEQ,
                                             dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    if name == "phalanx tp1 layers":
        phalanx.parallelize(model, 1)
    elif name == "phalanx tp2 layers, 1 device":
        phalanx.parallelize(model, 2)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=["accuracy"])
    return model


class EpochTimer(keras.callbacks.Callback):
    """Wall and process CPU time and step count of every epoch."""

    def __init__(self):
        super().__init__()
        self.epochs: list[tuple[float, float, int]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._cpu, self._steps = time.perf_counter(), time.process_time(), 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((time.perf_counter() - self._start, time.process_time() - self._cpu, self._steps))


class Contender:
    def __init__(self, name: str, layout: tuple[str, ...], x, y, workdir: Path):
        self.name, self.layout, self.x, self.y, self.workdir = name, layout, x, y, workdir
        self.model = gpt2(name)
        self.step_times: list[float] = []    # wall seconds per step, one per measured epoch
        self.cpu_times: list[float] = []     # process CPU seconds per step, one per measured epoch
        self.round_medians: list[float] = []
        self.first: list[float] = []         # the first epoch's extra wall time (tracing, the split)
        self.calls = 0

    def fit(self, epochs: int) -> None:
        timer = EpochTimer()
        if self.name == "keras":
            self.model.fit(self.x, self.y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[timer])
        else:
            self.calls += 1
            run_dir = self.workdir / f"{self.name.replace(' ', '-').replace(',', '')}-{self.calls}"
            phalanx.fit(self.model, self.x, self.y, batch_size=BATCH, epochs=epochs, callbacks=[timer], verbose=0,
                        overrides=(*self.layout, f"run.dir={run_dir}"))
        assert len(timer.epochs) == epochs, (self.name, timer.epochs)
        measured = timer.epochs[1:]  # the first epoch traces and builds: discarded
        self.step_times += [wall / steps for wall, _, steps in measured]
        self.cpu_times += [cpu / steps for _, cpu, steps in measured]
        self.round_medians.append(statistics.median(wall / steps for wall, _, steps in measured))
        self.first.append(timer.epochs[0][0] - statistics.median(wall for wall, _, _ in measured))

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_times)


# -- op counts of the traced step -----------------------------------------------------------


def make_engine(name: str, layout: tuple[str, ...], x, y):
    """The engine ``phalanx.fit`` would build for ``layout`` (a keras-hub model is split by its
    preset when ``parallel.tp > 1``, as fit does), and one batch as tensors."""
    from phalanx.api import _config, _mesh
    from phalanx.engines.keras_model import KerasModelEngine, _as_tensors
    from phalanx.layers.sharding import ShardedLayer

    model = gpt2(name)
    cfg = _config(None, layout)
    mesh = _mesh(cfg, layout)
    if mesh.tp > 1 and not any(isinstance(layer, ShardedLayer) for layer in model._flatten_layers()):
        phalanx.parallelize(model, mesh.tp)
    batch = ({k: v[:BATCH] for k, v in x.items()}, y[:BATCH], None)
    return KerasModelEngine(model, cfg, mesh, batch), batch, _as_tensors(batch)


def traced_step_ops(name: str, layout: tuple[str, ...], x, y) -> dict:
    """Op counts of the engine's training step for ``layout``: the traced graph (before
    Grappler) and the partition graphs TensorFlow runs (after Grappler, oneDNN's rewrites and
    placement, one per device, with the _Send/_Recv pairs between them)."""
    from tensorflow.python.eager import context

    engine, batch, tensors = make_engine(name, layout, x, y)
    graph = engine._train_fn.get_concrete_function(*tensors).graph
    before = collections.Counter(op.type for op in graph.get_operations())
    ctx = context.context()
    ctx.enable_graph_collection()  # the function's partition graphs, recorded when it is instantiated
    try:
        engine.train_step(batch)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
    step = max(metadata.function_graphs, key=lambda f: sum(len(p.node) for p in f.partition_graphs))
    after = collections.Counter(node.op for p in step.partition_graphs for node in p.node)
    devices = {node.device for p in step.partition_graphs for node in p.node if node.device}
    return {"before": before, "after": after, "partitions": len(step.partition_graphs), "devices": len(devices)}


def read_trace(logdir: str) -> collections.Counter:
    """(op type -> [count, ms]) of the TensorFlow ops executed in the newest profile under
    ``logdir`` (events named ``<op name>:<op type>`` on the executor threads)."""
    import glob

    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as fh:
        space.ParseFromString(fh.read())
    out: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                full = plane.event_metadata[event.metadata_id].name
                name, sep, op_type = full.rpartition(":")
                if not sep or "::" in full or not op_type or " " in op_type:
                    continue
                out[op_type][0] += 1
                out[op_type][1] += event.duration_ps / 1e9
    return out


def profile_layouts(x, y) -> dict:
    """Per layout: the median over ``--profile-steps`` profiled steps of each op type's
    [count, ms], of the step's summed op time and of its wall time."""
    layouts_ = {"phalanx": (), "phalanx tp2": TP2}
    if ARGS.devices >= 8:
        layouts_["phalanx dp2 x tp2 x pp2"] = dtp_layout()
    engines = {}
    for name, layout in layouts_.items():
        engine, batch, _ = make_engine(name, layout, x, y)
        for _ in range(3):  # trace, optimise, warm up
            float(engine.train_step(batch)["loss"])
        engines[name] = (engine, batch)
    records: dict[str, list] = {name: [] for name in engines}
    names = list(engines)
    for r in range(ARGS.profile_steps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            engine, batch = engines[name]
            float(engine.train_step(batch)["loss"])
            with tempfile.TemporaryDirectory() as logdir:
                tf.profiler.experimental.start(logdir)
                start = time.perf_counter()
                float(engine.train_step(batch)["loss"])
                wall = time.perf_counter() - start
                tf.profiler.experimental.stop()
                records[name].append((wall, read_trace(logdir)))
    out = {}
    for name, recs in records.items():
        types = set().union(*(ops for _, ops in recs))
        out[name] = {
            "wall": statistics.median(w for w, _ in recs),
            "total": statistics.median(sum(v[1] for v in ops.values()) for _, ops in recs),
            "types": {t: (statistics.median(ops[t][0] if t in ops else 0 for _, ops in recs),
                          statistics.median(ops[t][1] if t in ops else 0.0 for _, ops in recs)) for t in types},
        }
    return out


def profile_table(prof: dict, top: int = 22) -> list[str]:
    names = list(prof)
    ref = prof[names[0]]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
             "| profiled step wall, ms | " + " | ".join(f"{1e3 * prof[n]['wall']:.0f} ({prof[n]['wall'] / ref['wall']:.2f}x)"
                                                   for n in names) + " |",
             "| summed op time, ms | " + " | ".join(f"{prof[n]['total']:.0f} ({prof[n]['total'] / ref['total']:.2f}x)"
                                               for n in names) + " |"]
    everything = set().union(*(p["types"] for p in prof.values()))
    ranked = sorted(everything, key=lambda t: -max(p["types"].get(t, (0, 0.0))[1] for p in prof.values()))
    for t in ranked[:top]:
        cells = []
        for n in names:
            count, ms = prof[n]["types"].get(t, (0, 0.0))
            cells.append(f"{ms:.1f} ms / {count:.0f}" + (f" ({1e3 * ms / count:.0f} us)" if count else ""))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


OP_GROUPS = {
    "all ops": None,
    "MatMul / BatchMatMul / Einsum (incl. fused, oneDNN)": ("MatMul", "BatchMatMul", "_MklMatMul", "_MklBatchMatMul",
                                                   "_FusedMatMul", "_MklFusedMatMul", "_MklNativeFusedMatMul",
                                                   "_MklNativeMatMul", "BatchMatMulV2", "BatchMatMulV3",
                                                   "_MklBatchMatMulV2", "_MklFusedBatchMatMulV2", "Einsum", "_MklEinsum"),
    "_Send / _Recv": ("_Send", "_Recv", "_HostSend", "_HostRecv"),
    "Unpack / Pack": ("Unpack", "Pack"),
    "Cast": ("Cast",),
    "Identity / IdentityN": ("Identity", "IdentityN"),
    "Reshape": ("Reshape", "_MklReshape"),
    "Transpose": ("Transpose", "_MklTranspose", "ConjugateTranspose"),
    "ConcatV2 / Split / Slice / StridedSlice": ("ConcatV2", "_MklConcatV2", "Split", "SplitV", "Slice",
                                               "StridedSlice", "StridedSliceGrad"),
    "AddN / AddV2": ("AddN", "AddV2", "_MklAddN", "_MklAddV2", "Add"),
    "ReadVariableOp": ("ReadVariableOp",),
    "Const": ("Const", "HostConst"),
}


def op_table(counts: dict[str, dict]) -> list[str]:
    names = list(counts)
    lines = ["| op type | " + " | ".join(f"{n}: traced | {n}: run (after Grappler)" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for group, types in OP_GROUPS.items():
        row = []
        for n in names:
            for stage in ("before", "after"):
                c = counts[n][stage]
                row.append(str(sum(c.values()) if types is None else sum(c[t] for t in types)))
        lines.append(f"| {group} | " + " | ".join(row) + " |")
    lines.append("| partition graphs (devices) | " + " | ".join(f"- | {counts[n]['partitions']} ({counts[n]['devices']})"
                                                             for n in names) + " |")
    return lines


# -- machine and report ---------------------------------------------------------------------




def main() -> None:
    x, y = data(ARGS.samples)
    info = machine(keras_hub=keras_hub.__version__)
    load_before = load()
    started = time.perf_counter()
    contenders = []
    with tempfile.TemporaryDirectory(prefix="bench_keras_hub_tp_") as tmp:
        workdir = Path(tmp)
        contenders = [Contender(name, layout, x, y, workdir) for name, layout in layouts().items()] \
            if ARGS.rounds else []
        for r in range(ARGS.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c in order:
                c.fit(ARGS.epochs)
            print(f"round {r + 1}/{ARGS.rounds} (load {load()}): " +
                  ", ".join(f"{c.name} {1e3 * c.round_medians[-1]:.0f} ms" for c in contenders),
                  file=sys.stderr, flush=True)
        ops = {}
        if ARGS.ops:
            for name, layout in (("phalanx", ()), ("phalanx tp2", TP2),
                                 *((("phalanx dp2 x tp2 x pp2", dtp_layout()),) if ARGS.devices >= 8 else ())):
                ops[name] = traced_step_ops(name, layout, x, y)
        prof = profile_layouts(x, y) if ARGS.profile else {}
    elapsed = time.perf_counter() - started
    report(contenders, ops, prof, info, load_before, load(), elapsed)


def report(contenders, ops, prof, info, load_before, load_after, elapsed) -> None:
    today = datetime.date.today().isoformat()
    steps = ARGS.samples // BATCH
    measured = ARGS.rounds * (ARGS.epochs - 1)
    argv = " ".join(sys.argv[1:])
    lines = [
        "# keras-hub GPT-2 under tensor parallelism: step time over the one-device step",
        "",
        f"Written by `python benchmarks/bench_keras_hub_tp.py {argv}` on {today}.",
        "",
        f"Model: keras-hub `GPT2CausalLM` (no preprocessor), {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, "
        f"intermediate {FFN}, vocabulary {VOCAB}, sequence {SEQ}, dropout 0, float32 "
        f"({contenders[0].model.count_params() if contenders else 4240896:,} parameters); Adam 1e-3, sparse "
        f"categorical cross-entropy from logits + weighted accuracy; {ARGS.samples} random sequences, batch {BATCH} "
        f"({steps} steps an epoch). dp2 x tp2 x pp2: {ARGS.microbatches} micro-batches per replica "
        f"({BATCH // 2 // ARGS.microbatches} rows each). {ARGS.rounds} rounds (order rotating) x {ARGS.epochs} "
        f"epochs per fit call, the first epoch of every call discarded: {measured} measured epochs per contender, "
        f"medians. One process with {ARGS.devices} logical CPUs (`phalanx.init(\"parallel.devices=cpu:"
        f"{ARGS.devices}\")`); each fit's layout through `overrides=`.",
        "",
        f"Machine: {info['model']}, {info['cores']} cores ({info['flags']}); TensorFlow {info['tf']}, "
        f"Keras {info['keras']}, keras-hub {info['keras_hub']}; TF_ENABLE_ONEDNN_OPTS={info['onednn']}; load "
        f"average (1/5/15 min) {load_before} before, {load_after} after; {elapsed:.0f} s.",
        "",
    ]
    if contenders:
        one = next(c for c in contenders if c.name == "phalanx")
        keras_c = contenders[0]

        def round_ratio(c, ref):
            ratios = [a / b for a, b in zip(c.round_medians, ref.round_medians)]
            return f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"

        lines += [
            "| contender | layout | median ms / step | min ms / step | vs phalanx one device | vs Keras | "
            "same-round ratio to phalanx one device, median (min-max) | CPU s / step | CPU vs phalanx one device | "
            "first epoch extra, s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in contenders:
            layout = " ".join(c.layout) or "one device"
            if c.name in DIAGNOSTIC:
                layout += " (diagnostic: " + ("parallelize(model, 1)" if "tp1" in c.name else
                                              "parallelize(model, 2)" if "tp2" in c.name else "no tp") + ")"
            lines.append(f"| {c.name} | {layout} | {1e3 * c.median:.0f} | {1e3 * min(c.step_times):.0f} | "
                         f"{c.median / one.median:.3f}x | {c.median / keras_c.median:.3f}x | {round_ratio(c, one)} | "
                         f"{c.cpu:.3f} | {c.cpu / one.cpu:.3f}x | {statistics.median(c.first):.1f} |")
        targets = [c for c in contenders if c.name in ("phalanx tp2", "phalanx dp2 x tp2 x pp2")]
        lines += [
            "",
            "Target (issue 10): tp2 and dp2 x tp2 x pp2 step time / one-device step <= 1.15x: " +
            ", ".join(f"{c.name} **{c.median / one.median:.3f}x** (over Keras {c.median / keras_c.median:.3f}x)"
                      for c in targets) + ".",
            "",
            "\"CPU s / step\" is the process's CPU time (all threads, user + system) per step: on a loaded "
            "machine a layout with more busy threads can take a larger share of the cores, which the wall-clock "
            "ratio hides and the CPU ratio shows.",
            "",
        ]
    if prof:
        lines += [f"Profiled training steps (median of {ARGS.profile_steps} per layout, interleaved; inter-op threads: "
                  f"{ARGS.inter_op or 'TensorFlow default'}): each op type's summed time / count (mean per op):", "",
                  *profile_table(prof), ""]
    if ops:
        lines += ["Op counts of the engine's traced training step (`engine._train_fn`), before Grappler and as run "
                  "(the partition graphs):", "", *op_table(ops), ""]
    text = "\n".join(lines)
    if ARGS.output == "-":
        print(text)
    else:
        Path(ARGS.output).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.output).write_text(text)
        print(text)
        print(f"wrote {ARGS.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
