"""``phalanx.fit`` of a Keras model on every worker of a TF_CONFIG cluster (``multi_worker``).

Run the same script in every process (``phalanx launch --workers 2 -- python train.py``)::

    cfg = phalanx.init("parallel.strategy=multi_worker")   # first: joins the cluster
    model = build_and_compile()
    phalanx.fit(model, x, y, batch_size=64, epochs=3, config=cfg)

What happens, and why the numbers equal Keras's own one-device ``model.fit`` on the whole
global batch:

* **Set-up** (:func:`setup`, from :func:`phalanx.init`): a ``MultiWorkerMirroredStrategy``
  is created first, exactly as ``phalanx train`` does, to configure TensorFlow's collective
  ops and the coordination service before the runtime starts; its devices are then this
  worker's own. ``parallel.*`` describes each worker's *local* layout (``parallel.pp``,
  ``parallel.dp``, ``parallel.devices``, ``train.grad_accum``, micro-batches over its own
  devices); the workers multiply data parallelism. ``parallel.ep`` groups a worker's own
  replicas: every worker holds all the experts of an ``MoE(ep=...)`` model (shard j with
  its replica j), tokens travel to their expert inside the worker only, and the workers
  are data parallel over the experts as over every other weight (the MoE figures of the
  rows are the whole global batch's: their step totals are summed across workers).
  Experts sharded across workers are not built: ep must divide each worker's
  ``parallel.dp``, and the error says so. No strategy object is kept: the fit
  re-derives its place in the cluster from TF_CONFIG (:func:`join`) and talks to the
  other workers with TensorFlow's collective ops directly (:class:`WorkerGroup`).
* **Start** of every fit: the workers check that they hold the same model (variable
  shapes), then every weight, optimizer slot and the resume point (epochs done and
  history) are broadcast from the chief, which alone reads the run directory. Each
  process may thus build its model with its own random initialisation.
* **Data.** Every worker reads the same global batches (``batch_size`` stays the global
  batch; arrays and seeded shuffles are identical everywhere; a ``tf.data.Dataset`` must
  yield the same batches on every worker) and each worker trains on its own consecutive rows:
  ``B // W`` each, the first ``B % W`` workers one more (a last batch of any size, as in
  Keras; a batch with fewer rows than workers is refused, see :mod:`phalanx.data.keras_inputs`).
  A fingerprint of each global batch (shape, first and last row) is compared across
  workers every step: different data is an error, not silent drift.
* **Step.** Each worker weights each micro-batch's mean loss by its share of the global
  batch's rows (``1 / (W x local micro-batches)`` when they divide evenly), so the sum over
  workers is the gradient of the global batch's mean loss, and sums its gradients locally;
  the dense gradients are then summed across workers in one packed all-reduce per dtype,
  and ``IndexedSlices`` (an embedding's gradient) are all-gathered, rows in worker order —
  the rows one tape over the global batch gives, so Keras's optimizers treat them as on
  one device — except a lookup whose indices are the same in every micro-batch (a
  position table), whose values are summed in the all-reduce (:mod:`phalanx.parallel.gradients`). Every worker then applies the model's
  own optimizer to the same gradients (identical updates, no broadcast needed).
* **ZeRO** (``parallel.zero=1|2|3``): the slices span every data replica of the run, ``W x dp``
  of each weight, worker ``w``'s replica ``k`` holding slice ``w dp + k``
  (:mod:`phalanx.parallel.keras_zero`); each worker applies its optimizer on its own slices
  after the exchange above (each device keeping its slice of the summed gradient), and the
  slices are joined across workers with one all-gather per dtype (:meth:`WorkerGroup.concat_all`).
* **Metrics.** The loss tracker and the compiled metrics accumulate additive states
  (totals and counts): each worker's change of every metric variable during the step
  is summed across workers in the same all-reduce, so every worker's logs are the global
  values. (A custom metric whose state is not a sum, e.g. a running maximum, would be
  wrong.) Callbacks therefore see the same logs on every worker: ``EarlyStopping``,
  ``ReduceLROnPlateau`` and ``model.stop_training`` stop or change all workers alike.
* **Non-trainable state** is joined across workers after each step by the rule that joins
  a worker's own replicas (:mod:`phalanx.parallel.replica_state`): BatchNormalization's
  moving statistics averaged, as Keras's MirroredStrategy does, MoE step totals summed; each
  worker normalises its rows with their own batch statistics, so dp2 in one process and 2
  workers x dp1 give the same statistics. Dropout draws each worker's masks from its own
  copy of the seed state (the same seeds on every worker, as on every replica).
* **Writes.** Only the chief (``worker:0``, or the ``chief`` task) writes the run
  directory (lock, ``config.yaml``, checkpoints, ``metrics.jsonl``), prints progress and
  runs the callbacks that only write files (``ModelCheckpoint``, ``CSVLogger``,
  ``TensorBoard``); every other callback runs on every worker.
* **Evaluation and prediction** (``validation_data``, :func:`phalanx.evaluate`,
  :func:`phalanx.predict`) run the whole batch on every worker's local layout: no
  communication, the same numbers everywhere.

A worker that stops early (a crash, a dataset shorter on one worker) leaves the others
blocked in the next collective; ``phalanx launch`` then stops the cluster.
``parameter_server`` fits run on the chief instead (:mod:`phalanx.train.keras_ps`).

Example (one process: no cluster, nothing to join):
    >>> from phalanx.config import Config
    >>> from phalanx.cluster.tf_config import ClusterInfo
    >>> cluster_mode(Config().replace(parallel={"strategy": "multi_worker"}), ClusterInfo.single_process())
    False
"""

from __future__ import annotations

import json
import secrets
import zlib
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from phalanx.cluster.strategies import multi_worker_strategy
from phalanx.cluster.tf_config import ClusterInfo, cluster_info_from_env
from phalanx.config import Config, ConfigError, parse_devices
from phalanx.engines.keras_model import row_plan
from phalanx.parallel.gradients import SparseGradient

#: Group key of the one collective every fit starts with (agreeing on a fresh group key).
_BOOTSTRAP_GROUP = 0x7068
#: Callbacks that only write files: they run on the chief only.
CHIEF_ONLY_CALLBACKS = ("ModelCheckpoint", "CSVLogger", "TensorBoard")
# Dtypes the CPU collectives sum natively; others travel as one of these (exactly).
_WIRE = {tf.float32: tf.float32, tf.float64: tf.float64, tf.int32: tf.int32, tf.int64: tf.int64,
         tf.float16: tf.float32, tf.bfloat16: tf.float32, tf.uint8: tf.int32, tf.int8: tf.int32,
         tf.int16: tf.int32, tf.uint16: tf.int32, tf.uint32: tf.int64, tf.bool: tf.int32}


# -- which processes take part --------------------------------------------------------------


def cluster_mode(cfg: Config, info: ClusterInfo | None = None) -> bool:
    """Whether a Keras fit with ``cfg`` spans the workers of the TF_CONFIG cluster.

    ``multi_worker`` (or ``auto``) with several workers: yes. Without a cluster, or with
    one worker, the fit runs in this process. ``parameter_server`` (or ``auto`` with ps
    tasks), ``mirrored`` or ``mesh`` under a cluster of several workers are refused.
    """
    info = cluster_info_from_env() if info is None else info
    name = cfg.parallel.strategy
    several = info.is_distributed and info.num_workers > 1
    if name == "parameter_server" or (name == "auto" and info.num_ps):
        raise ConfigError("parallel.strategy", f"{name!r}{' (TF_CONFIG has ps tasks)' if name == 'auto' else ''}: "
                                               f"fit of a Keras model does not run on parameter servers. Use "
                                               f"parallel.strategy=multi_worker under a cluster of workers only "
                                               f"(phalanx launch --workers N, without --ps): every worker holds "
                                               f"the model and its optimizer, gradients are all-reduced")
    if not several:
        return False
    if info.task_type not in ("chief", "worker"):
        raise ConfigError("parallel.strategy", f"task {info.task_name}: fit of a Keras model runs on the chief and "
                                               f"worker tasks only")
    if name in ("multi_worker", "auto"):
        return True
    raise ConfigError("parallel.strategy", f"{name!r} under a TF_CONFIG cluster of {info.num_workers} workers: fit of "
                                           f"a Keras model spans workers with parallel.strategy=multi_worker (each "
                                           f"worker runs parallel.dp/pp over its own devices); or run one process "
                                           f"without TF_CONFIG")


def _runtime_started() -> bool:
    from tensorflow.python.eager import context
    return context.context()._context_handle is not None  # noqa: SLF001 (no public way that does not start it)


def _task_prefix(info: ClusterInfo) -> str:
    return f"/job:{info.task_type}/replica:0/task:{info.task_index}/"


def _joined(info: ClusterInfo) -> bool:
    return any(d.name.startswith(_task_prefix(info)) for d in tf.config.list_logical_devices())


def _local_count(cfg: Config) -> int:
    kind, n = parse_devices(cfg.parallel.devices)
    if n:
        return n
    p = cfg.parallel
    if -1 in (p.dp, p.pp, p.tp):
        raise ConfigError("parallel.devices", "a degree of -1 needs an explicit device count, e.g. "
                                              "parallel.devices=cpu:2 (each worker's own devices)")
    return p.dp * p.pp * p.tp


def setup(cfg: Config, info: ClusterInfo | None = None, init_line: str = "phalanx.init(...)") -> bool:
    """Join the cluster if ``cfg`` asks for it (see :func:`cluster_mode`); returns whether
    it did. Must run before any other TensorFlow work; calling it again is harmless."""
    info = cluster_info_from_env() if info is None else info
    if not cluster_mode(cfg, info):
        return False
    if _runtime_started():
        if _joined(info):
            return True
        raise ConfigError("parallel.strategy", f"multi_worker: TensorFlow was already initialised in this process "
                                               f"before it joined the cluster of TF_CONFIG. Move `{init_line}` to "
                                               f"the top of your script, right after `import phalanx` and before "
                                               f"any dataset, model or tensor is made")
    kind, _ = parse_devices(cfg.parallel.devices)
    count = _local_count(cfg)
    if count > 1 and (kind == "cpu" or (kind == "auto" and not tf.config.list_physical_devices("GPU"))):
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()
                                                         for _ in range(count)])
    # Created for what its constructor does (collective ops, coordination service, the
    # server of this task), as phalanx train does first; fit uses the collectives directly.
    multi_worker_strategy(info)
    return True


def local_devices(cfg: Config, info: ClusterInfo) -> list[str]:
    """This worker's own devices for its local layout (after :func:`setup`)."""
    if not _joined(info):
        raise ConfigError("parallel.strategy", "multi_worker: this process has not joined the cluster of TF_CONFIG; "
                                               "call `cfg = phalanx.init(...)` first, at the top of your script, "
                                               "and pass config=cfg")
    kind, _ = parse_devices(cfg.parallel.devices)
    if kind == "auto":
        kind = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    mine = [d.name for d in tf.config.list_logical_devices(kind.upper()) if d.name.startswith(_task_prefix(info))]
    count = _local_count(cfg)
    if len(mine) < count:
        raise ConfigError("parallel.devices", f"each worker's layout needs {count} {kind.upper()} devices but this "
                                              f"worker has {len(mine)}; set parallel.devices={kind}:{count} in the "
                                              f"config given to phalanx.init")
    return sorted(mine, key=lambda name: int(name.rsplit(":", 1)[1]))[:count]


def join(cfg: Config) -> "WorkerGroup | None":
    """This process's :class:`WorkerGroup` for a fit under ``cfg``, or None for one process.
    Every worker must call it at the same point (it runs one collective)."""
    info = cluster_info_from_env()
    if not cluster_mode(cfg, info):
        return None
    local_devices(cfg, info)  # joined?
    return WorkerGroup(info)


def is_chief(cfg: Config) -> bool:
    """Whether this process writes the run directory and prints (True outside a cluster)."""
    info = cluster_info_from_env()
    return not cluster_mode(cfg, info) or info.is_chief


def chief_callbacks_only(callbacks: Sequence[Any] | None) -> list:
    """``callbacks`` without those that only write files (for the non-chief workers)."""
    return [c for c in (callbacks or []) if type(c).__name__ not in CHIEF_ONLY_CALLBACKS]


# -- the collectives --------------------------------------------------------------------------


def _fingerprint(batch) -> int:
    """A cheap fingerprint of a global batch: shapes, dtypes, first and last rows."""
    crc = 0
    for leaf in tf.nest.flatten(batch):
        if leaf is None:
            continue
        array = leaf if isinstance(leaf, np.ndarray) else None
        if array is None:
            first, last = np.asarray(leaf[:1]), np.asarray(leaf[-1:])
        else:
            first, last = array[:1], array[-1:]
        crc = zlib.crc32(repr((tuple(leaf.shape), str(first.dtype))).encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(first).tobytes(), crc)
        crc = zlib.crc32(np.ascontiguousarray(last).tobytes(), crc)
    return crc & 0x3FFFFFFF


def _wire_groups(tensors: Sequence[tf.Tensor], verb: str) -> dict[tf.DType, list[int]]:
    """The positions of ``tensors`` by the dtype each travels as (``_WIRE``)."""
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dtype not in _WIRE:
            raise TypeError(f"cannot {verb} a {t.dtype.name} tensor across workers")
        groups.setdefault(_WIRE[t.dtype], []).append(i)
    return groups


def _rows(batch, start: int, size: int):
    return tf.nest.map_structure(lambda t: None if t is None else t[start:start + size], batch)


class WorkerGroup:
    """This worker among the ``size`` workers of a fit: its rows of each batch, and the
    collectives of a step (see the module docstring). Every method that communicates must
    be called by every worker, in the same order."""

    def __init__(self, info: ClusterInfo):
        self.info = info
        self.size, self.rank, self.is_chief = info.num_workers, info.worker_index, info.is_chief
        self.device = _task_prefix(info) + "device:CPU:0"
        with tf.init_scope(), tf.device(self.device):
            # Ordering token: collectives of one worker run in program order.
            self._token = tf.Variable(0.0, trainable=False, name="phalanx_collective_order")
            # Instance keys: unique per collective call, in the same sequence on every worker.
            self._next_key = tf.Variable(0, dtype=tf.int32, trainable=False, name="phalanx_collective_key")
            self._fingerprint = tf.Variable(0, dtype=tf.int64, trainable=False, name="phalanx_batch_fingerprint")
            self._fingerprint_sum = tf.Variable(0, dtype=tf.int64, trainable=False, name="phalanx_batch_check")
        self.group_key = _BOOTSTRAP_GROUP
        # A fresh group for this fit: its instance keys start at 1 whatever ran before.
        mine = secrets.randbelow(1 << 29) + (1 << 20) if self.is_chief else 0
        with tf.device(self.device):
            agreed = tf.raw_ops.CollectiveReduceV2(
                input=tf.constant([mine], tf.int64), group_size=self.size, group_key=_BOOTSTRAP_GROUP,
                instance_key=1, ordering_token=[], merge_op="Add", final_op="Id", communication_hint="ring")
        self.group_key = int(agreed.numpy()[0])

    # -- primitives (eager or inside a tf.function) -----------------------------------------

    def _key(self):
        return self._next_key.assign_add(1)

    def _sum(self, t):
        with tf.device(self.device):
            return tf.raw_ops.CollectiveReduceV2(
                input=t, group_size=self.size, group_key=self.group_key, instance_key=self._key(),
                ordering_token=[self._token.handle], merge_op="Add", final_op="Id", communication_hint="ring")

    def _gather(self, t):
        with tf.device(self.device):
            return tf.raw_ops.CollectiveGatherV2(
                input=t, group_size=self.size, group_key=self.group_key, instance_key=self._key(),
                ordering_token=[self._token.handle], communication_hint="ring")

    def sum_all(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor summed across workers: one all-reduce per wire dtype, packed flat."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        out: list[tf.Tensor | None] = [None] * len(tensors)
        for wire, members in _wire_groups(tensors, "sum").items():
            with tf.device(self.device):
                flat = tf.concat([tf.reshape(tf.cast(tensors[i], wire), [-1]) for i in members], 0)
                total = self._sum(flat)
                if all(tensors[i].shape.is_fully_defined() for i in members):
                    sizes = [tensors[i].shape.num_elements() for i in members]
                else:
                    sizes = tf.stack([tf.size(tensors[i]) for i in members])
                for i, piece in zip(members, tf.split(total, sizes, num=len(members))):
                    shape = tensors[i].shape if tensors[i].shape.is_fully_defined() else tf.shape(tensors[i])
                    out[i] = tf.cast(tf.reshape(piece, shape), tensors[i].dtype)
        return out

    def concat_all(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Each 1-D tensor (of the same length on every worker) concatenated along axis 0 in
        worker order: one all-gather per wire dtype, packed flat (ZeRO's slices joined)."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        out: list[tf.Tensor | None] = [None] * len(tensors)
        for wire, members in _wire_groups(tensors, "gather").items():
            with tf.device(self.device):
                sizes = [int(tensors[i].shape[0]) for i in members]
                flat = tf.concat([tf.cast(tensors[i], wire) for i in members], 0)
                table = tf.reshape(self._gather(flat), [self.size, sum(sizes)])  # row w: worker w's
                for i, piece in zip(members, tf.split(table, sizes, axis=1, num=len(members))):
                    out[i] = tf.cast(tf.reshape(piece, [-1]), tensors[i].dtype)
        return out

    def gather_rows(self, tensors: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Tensors with the same number of rows on one worker (that may differ between
        workers), each concatenated along axis 0 in worker order."""
        with tf.device(self.device):
            count = tf.shape(tensors[0], out_type=tf.int32)[:1]
            counts = self._gather(count)
            longest = tf.reduce_max(counts)
            keep = tf.reshape(tf.sequence_mask(counts, longest), [-1])
            out = []
            for t in tensors:
                pad = [[0, longest - count[0]]] + [[0, 0]] * (t.shape.rank - 1)
                out.append(tf.boolean_mask(self._gather(tf.pad(t, pad)), keep))
            return out

    # -- a fit ----------------------------------------------------------------------------------

    def local_rows(self, batch, rows: int):
        """This worker's consecutive rows of a global batch of ``rows`` rows (``rows // size``,
        the first ``rows % size`` workers one more: the replicas' rule, :func:`row_plan`),
        after remembering its fingerprint (checked in :meth:`check_batch`)."""
        self._fingerprint.assign(_fingerprint(batch))
        counts = [sum(map(sum, steps)) for steps in row_plan(rows, self.size, 1, 1)]
        return _rows(batch, sum(counts[:self.rank]), counts[self.rank])

    def check_batch(self) -> None:
        """Raise if the last step's global batch differed between workers."""
        if int(self._fingerprint_sum.numpy()) != self.size * int(self._fingerprint.numpy()):
            raise ValueError("x: the workers trained on different global batches. Every worker must read the same "
                             "data in the same order (NumPy arrays, or a tf.data.Dataset without unseeded shuffling);"
                             " each takes its own rows of every batch")

    def start(self, model, optimizer, resume: dict) -> dict:
        """Check that every worker holds the same model, then broadcast every weight and
        optimizer variable and ``resume`` (JSON) from the chief; returns the chief's ``resume``."""
        variables = list(model.variables) + list(optimizer.variables if optimizer is not None else [])
        signature = json.dumps([[v.path.split("/")[-1], list(v.shape), str(v.dtype)] for v in variables])
        mine = np.array([1, zlib.crc32(signature.encode()) & 0x3FFFFFFF, len(variables)], np.int64)
        total = self.sum_all([tf.constant(mine)])[0].numpy()
        if not np.array_equal(total, mine * self.size):
            raise ValueError(f"model: the workers built different models ({len(variables)} variables here); every "
                             f"worker must build and compile the same model")
        encoded = np.frombuffer(json.dumps(resume).encode(), np.uint8).astype(np.int32) if self.is_chief else \
            np.zeros([0], np.int32)
        length = int(self.sum_all([tf.constant([encoded.size], tf.int64)])[0].numpy()[0])
        if not self.is_chief:
            encoded = np.zeros([length], np.int32)
        resume = json.loads(self.sum_all([tf.constant(encoded)])[0].numpy().astype(np.uint8).tobytes().decode())
        values = [v.value if hasattr(v, "value") else v for v in variables]
        sent = [tf.convert_to_tensor(t) if self.is_chief else tf.zeros_like(t) for t in values]
        for v, value in zip(values, self.sum_all(sent)):
            v.assign(value)
        return resume

    # -- inside the step (traced) ---------------------------------------------------------

    def read_metrics(self, model) -> list[tf.Tensor]:
        """The metric variables before the step's updates."""
        return [v.value.read_value() for v in model.metrics_variables]

    def exchange(self, model, grads: list, metrics_before: list, state: list, loss_sum,
                 rules: Sequence[str] | None = None):
        """The step's all-reduce: gradients summed (sparse ones: rows gathered, lookups with the
        same indices everywhere summed; :class:`~phalanx.parallel.gradients.SparseGradient`), metric
        variables set to their global values, ``state`` (the changed non-trainable values)
        joined by ``rules`` (:mod:`phalanx.parallel.replica_state`: ``sum``, ``mean``; ``first``
        is kept, equal on every worker), the loss sum and the batch fingerprint summed. Returns
        ``(grads, state, loss_sum)``."""
        metric_vars = list(model.metrics_variables)
        dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, (tf.IndexedSlices,
                                                                                         SparseGradient))]
        sparse = [i for i, g in enumerate(grads) if isinstance(g, (tf.IndexedSlices, SparseGradient))]
        # A sparse gradient's lookups with the same indices on every worker are summed like dense
        # gradients; its other rows are gathered (parallel.gradients: what one device's tape gives).
        grads = [SparseGradient(g.dense_shape, rows=[g]) if isinstance(g, tf.IndexedSlices) else
                 SparseGradient(g.dense_shape, dict(g.shared), list(g.rows)) if isinstance(g, SparseGradient) else g
                 for g in grads]  # copies: filled in below
        shared = [(i, key) for i in sparse for key in grads[i].shared]
        if rules is None:
            rules = ["mean" if tf.as_dtype(s.dtype).is_floating else "first" for s in state]
        # "first": worker 0's value (integer state is equal everywhere: kept as it is).
        floating = [i for i, (rule, s) in enumerate(zip(rules, state))
                    if rule in ("sum", "mean") or tf.as_dtype(s.dtype).is_floating]
        state = [s if rules[i] != "first" or i not in floating or self.rank == 0 else tf.zeros_like(s)
                 for i, s in enumerate(state)]
        deltas = [v.value.read_value() - before for v, before in zip(metric_vars, metrics_before)]
        with tf.control_dependencies(deltas):
            fingerprint = self._fingerprint.read_value()
        summed = self.sum_all([grads[i] for i in dense] + [grads[i].shared[key].values for i, key in shared] +
                              deltas + [state[i] for i in floating] + [tf.cast(loss_sum, tf.float32), fingerprint])
        grads = list(grads)
        for i, g in zip(dense, summed[:len(dense)]):
            grads[i] = g
        rest = summed[len(dense):]
        for (i, key), values in zip(shared, rest[:len(shared)]):
            piece = grads[i].shared[key]
            grads[i].shared[key] = tf.IndexedSlices(values, piece.indices, piece.dense_shape)
        rest = rest[len(shared):]
        for v, before, total in zip(metric_vars, metrics_before, rest[:len(deltas)]):
            v.value.assign(before + total)
        rest = rest[len(deltas):]
        state = list(state)
        for i, total in zip(floating, rest[:len(floating)]):
            state[i] = total / tf.cast(self.size, total.dtype) if rules[i] == "mean" else total
        loss_sum, fingerprint_sum = rest[len(floating):]
        self._fingerprint_sum.assign(fingerprint_sum)
        for i in sparse:
            g = grads[i]
            if g.rows:
                rows = SparseGradient(g.dense_shape, rows=g.rows).slices()
                values, indices = self.gather_rows([rows.values, rows.indices])
                g.rows = [tf.IndexedSlices(values, indices, g.dense_shape)]
        return grads, state, loss_sum
