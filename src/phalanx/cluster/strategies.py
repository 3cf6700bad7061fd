"""tf.distribute strategies for ``parallel.strategy`` across processes.

``parallel.strategy``:

* ``mirrored`` -- one process on this host's devices: the run ``auto`` makes without a
  cluster (``phalanx train`` and ``phalanx.fit`` place the model on the configured layout with
  the Keras-model engine, every ``parallel.*`` key honoured); a TF_CONFIG naming several
  workers is refused. :func:`make_strategy` gives it as a ``OneDeviceStrategy`` or
  ``MirroredStrategy`` over the first ``parallel.dp`` devices, whose devices
  :func:`phalanx.engines.factory.build_engine` places the engine on;
* ``multi_worker`` -- data parallel across the workers of a TF_CONFIG cluster with
  ``MultiWorkerMirroredStrategy`` (ring all-reduce on CPU, NCCL-capable ``AUTO`` on
  GPUs) set up for the Keras-model engine (below);
* ``parameter_server`` -- ``ParameterServerStrategy``: variables live on the ps
  tasks, the chief (coordinator) runs the loop and schedules steps on the workers
  through a ``ClusterCoordinator`` (a Keras model's own steps:
  :mod:`phalanx.engines.ps`, the built-in GPT's included); worker and ps tasks only serve
  (:func:`serve_if_server_task`);
* ``auto`` -- ``parameter_server`` when TF_CONFIG has ps tasks, ``multi_worker`` when
  it names several workers, ``mesh`` when ``parallel.tp``/``pp`` > 1, else ``mirrored``;
* ``mesh`` -- placed by the engine itself (the Keras-model engine for the built-in GPT),
  not here; under a TF_CONFIG cluster
  :func:`setup_cluster` joins it and names the mesh's devices on every task, which the
  chief's engine places on (:mod:`phalanx.cluster.mesh_cluster`).

``phalanx train``'s ``multi_worker`` run of the built-in GPT (dense or mixture-of-experts)
trains on the Keras-model engine (:mod:`phalanx.engines.keras_gpt`), not on the strategy's
step: ``parallel.*`` is each worker's own layout (its devices made here, ``dp``/``tp``/``pp``/
``ep`` over them), every worker reads the whole global batch and trains its rows of it, and
the workers are data parallel (:class:`phalanx.engines.keras_cluster.WorkerGroup`). The
strategy is still created, for what its constructor sets up (the collectives, the
coordination service). Experts are sharded within a worker, never across workers: with
``parallel.ep > 1``, ``mesh`` and ``parameter_server`` clusters are refused.

Keras 3 ``model.fit`` fails under both multi-process strategies (keras-team/keras#20585,
#18624); phalanx runs its own steps (the Keras-model engine across workers, the
parameter-server engine's scheduled steps).

Order matters in a training process: MultiWorkerMirroredStrategy configures the
collective ops, which TensorFlow allows only before its runtime starts (any earlier TF
op, e.g. building a tf.data pipeline, makes it fail with "Collective ops must be
configured at program startup"). :func:`setup_cluster` does it all in order::

    setup = setup_cluster(cfg)              # FIRST, before any other TF op
    # = info = cluster_info_from_env(); serve_if_server_task(info)  (ps-mode worker/ps
    #   tasks serve here and never return); strategy = make_strategy(cfg, info);
    #   check_batch(cfg, strategy); coordinator = make_coordinator(strategy)
    datasets = make_datasets(cfg)           # every process reads the whole global batch

Example (one process, one device):
    >>> from phalanx.config import Config
    >>> from phalanx.cluster.tf_config import ClusterInfo
    >>> strategy = make_strategy(Config(), ClusterInfo.single_process(), devices=["/device:CPU:0"])
    >>> strategy.num_replicas_in_sync
    1
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import tensorflow as tf

from phalanx.cluster.tf_config import ClusterInfo, cluster_info_from_env
from phalanx.config import ConfigError, parse_devices, resolve_degrees
from phalanx.cluster.mesh_cluster import serve_until_chief_exits, setup_mesh_cluster

LOCAL = "mirrored"
MULTI_WORKER = "multi_worker"
PARAMETER_SERVER = "parameter_server"
MESH = "mesh"


def resolve_strategy_name(cfg: Any, info: ClusterInfo) -> str:
    """``parallel.strategy`` with ``auto`` resolved, checked against the cluster
    (``multi_worker`` is each worker's own layout on the Keras-model engine: tp/pp allowed).

    >>> from phalanx.config import Config
    >>> resolve_strategy_name(Config(), ClusterInfo.single_process())
    'mirrored'
    """
    p = cfg.parallel
    name = p.strategy
    several = info.is_distributed and (info.num_workers > 1 or info.num_ps > 0)
    if name == "auto":
        if p.ep > 1 and several and not info.num_ps:  # the expert-parallel GPT: each worker's own layout
            name = MULTI_WORKER
        elif p.tp > 1 or p.pp > 1:
            name = MESH
        elif info.num_ps:
            name = PARAMETER_SERVER
        elif info.num_workers > 1:
            name = MULTI_WORKER
        else:
            name = LOCAL
    if p.ep > 1 and several and name in (MESH, PARAMETER_SERVER):
        raise ConfigError("parallel.strategy", f"{name}{' (TF_CONFIG has ps tasks)' if p.strategy == 'auto' else ''}: "
                                               f"expert parallelism (parallel.ep={p.ep}) trains on the Keras-model "
                                               f"engine, which spans the workers of a cluster with parallel.strategy="
                                               f"multi_worker only (launch without --ps): parallel.* is then each "
                                               f"worker's own layout, the experts sharded within a worker and the "
                                               f"workers data parallel")
    if name == PARAMETER_SERVER and (p.tp > 1 or p.pp > 1):
        raise ConfigError("parallel.strategy", f"{name} is data parallel only; parallel.tp={p.tp} and "
                                               f"parallel.pp={p.pp} need parallel.strategy=mesh or multi_worker "
                                               f"(each worker's own layout)")
    if name == LOCAL and info.num_workers > 1:
        raise ConfigError("parallel.strategy", f"mirrored trains in one process, but TF_CONFIG names "
                                               f"{info.num_workers} workers; use multi_worker (or parameter_server "
                                               f"with ps tasks), or run without TF_CONFIG")
    if name == MULTI_WORKER and info.num_ps:
        raise ConfigError("parallel.strategy", f"multi_worker does not use parameter servers, but TF_CONFIG has "
                                               f"{info.num_ps} ps task(s); use parameter_server, or launch without --ps")
    if name == PARAMETER_SERVER and not info.num_ps:
        raise ConfigError("parallel.strategy", "parameter_server needs a cluster with ps tasks and a chief; e.g. "
                                               "phalanx launch --workers 2 --ps 1 -- phalanx train "
                                               "parallel.strategy=parameter_server (or set TF_CONFIG)")
    refuse_unhonoured(cfg, name)
    return name


def refuse_unhonoured(cfg: Any, name: str) -> None:
    """Raise :class:`ConfigError` for a ``parallel.*`` value the strategy ``name`` would ignore.

    Only ``parameter_server`` refuses any: it runs a Keras model's whole step on one worker
    (:mod:`phalanx.engines.ps`): whole optimizer states on the ps tasks, no activation
    recomputation, no pipeline micro-batches, the devices the strategy finds; silently dropping
    ``parallel.zero``, ``parallel.recompute``, ``parallel.microbatches`` or ``parallel.devices``
    would train with more memory than asked, or differently, without a word. Every other
    strategy trains on the Keras-model engine, which honours them: ``mirrored`` and ``auto`` in
    one process, ``mesh``, and ``multi_worker`` (each worker's own layout, ZeRO sliced over
    every worker's replicas), whose own refusals apply
    (:func:`phalanx.engines.keras_gpt.refuse_unhonoured`).

    >>> from phalanx.config import Config
    >>> refuse_unhonoured(Config().replace(parallel={"zero": 3}), "multi_worker")  # the Keras-model engine's
    >>> refuse_unhonoured(Config().replace(parallel={"dp": 2, "recompute": "full"}), "mirrored")
    >>> refuse_unhonoured(Config().replace(parallel={"zero": 1}), "parameter_server")
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    phalanx.config.ConfigError: parallel.zero: 1 is not honoured by parallel.strategy=parameter_server (...
    """
    if name != PARAMETER_SERVER:
        return
    p = cfg.parallel
    hint = ("the Keras-model engine honours it: parallel.strategy=mesh (one process, or across workers under "
            "phalanx launch)")
    if p.zero:
        raise ConfigError("parallel.zero", f"{p.zero} is not honoured by parallel.strategy={name} "
                                           f"(ParameterServerStrategy keeps whole optimizer states on the ps "
                                           f"tasks); {hint}; or set parallel.zero=0")
    if p.recompute != "none":
        raise ConfigError("parallel.recompute", f"{p.recompute!r} is not honoured by parallel.strategy={name} "
                                                f"(ParameterServerStrategy runs Keras's own forward and "
                                                f"backward); {hint}; or set parallel.recompute=none")
    if p.microbatches != 1:
        raise ConfigError("parallel.microbatches", f"{p.microbatches} is not honoured by parallel.strategy={name} "
                                                   f"(no pipeline to feed); use train.grad_accum="
                                                   f"{p.microbatches} to split each step's batch, or "
                                                   f"parallel.strategy=mesh with parallel.pp > 1")
    if p.devices != "auto":
        raise ConfigError("parallel.devices", f"{p.devices!r} is not honoured by parallel.strategy={name}: each "
                                              f"task trains on the devices it finds (its GPUs, else its CPU); "
                                              f"set parallel.devices=auto")


def make_strategy(cfg: Any, info: ClusterInfo | None = None,
                  devices: Sequence[str] | None = None) -> tf.distribute.Strategy:
    """The strategy for ``cfg.parallel.strategy`` in this process.

    ``info`` defaults to ``$TF_CONFIG``; ``devices`` (``mirrored`` only) defaults to the
    first ``parallel.dp`` logical devices (GPUs if any, else CPUs). Call it before any
    other TensorFlow op: the multi-worker strategies configure the runtime.
    """
    info = cluster_info_from_env() if info is None else info
    name = resolve_strategy_name(cfg, info)
    if name == MESH:
        raise ConfigError("parallel.strategy", "mesh (tensor/pipeline parallel) is placed by the engine "
                                               "itself (the Keras-model engine), not by a tf.distribute strategy")
    if name == LOCAL:
        return local_strategy(devices if devices is not None else _default_devices(cfg.parallel.dp))
    if name == MULTI_WORKER:
        return multi_worker_strategy(info)
    return parameter_server_strategy(info)


def local_strategy(devices: Sequence[str]) -> tf.distribute.Strategy:
    """OneDeviceStrategy for one device, MirroredStrategy for several (one host)."""
    if not devices:
        raise ConfigError("parallel.devices", "no devices to train on")
    if len(devices) == 1:
        return tf.distribute.OneDeviceStrategy(devices[0])
    # Logical CPUs have no NCCL; a reduction through one device works everywhere.
    return tf.distribute.MirroredStrategy(list(devices), cross_device_ops=tf.distribute.ReductionToOneDevice())


def _default_devices(dp: int) -> list[str]:
    gpus = tf.config.list_logical_devices("GPU")
    found = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
    want = len(found) if dp == -1 else dp
    if want > len(found):
        raise ConfigError("parallel.dp", f"{dp} replicas need {dp} devices, but only {len(found)} exist; "
                                         f"set parallel.devices=cpu:{dp} or lower parallel.dp")
    return found[:want]


def cluster_resolver(info: ClusterInfo) -> tf.distribute.cluster_resolver.ClusterResolver:
    """A resolver for ``info`` (so a ClusterInfo from any source works, not only $TF_CONFIG)."""
    if not info.is_distributed:
        raise ValueError("cluster_resolver needs a cluster (TF_CONFIG); got a single process")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(info.cluster_spec_dict()), task_type=info.task_type, task_id=info.task_index,
        rpc_layer=info.rpc_layer)


def multi_worker_strategy(info: ClusterInfo) -> tf.distribute.MultiWorkerMirroredStrategy:
    """MultiWorkerMirroredStrategy over ``info``'s workers: RING all-reduce on CPU
    (the only collective implementation there), AUTO (NCCL) when GPUs exist.

    Without a cluster it is a one-worker strategy on this process's device(s).
    """
    impl = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=impl.AUTO if tf.config.list_physical_devices("GPU") else impl.RING)
    if not info.is_distributed:
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=cluster_resolver(info),
                                                     communication_options=options)


def parameter_server_strategy(info: ClusterInfo, variable_partitioner: Any = None
                              ) -> tf.distribute.experimental.ParameterServerStrategy:
    """ParameterServerStrategy, for the chief (coordinator) task only.

    ``variable_partitioner`` (e.g. ``tf.distribute.experimental.partitioners.MinSizePartitioner``)
    shards large variables across the ps tasks; None keeps each variable whole on one ps.
    """
    if not info.num_ps or not info.has_chief:
        raise ConfigError("parallel.strategy", "parameter_server needs a TF_CONFIG cluster with ps tasks and a chief")
    if info.task_type != "chief":
        raise RuntimeError(f"ParameterServerStrategy runs on the chief; task {info.task_name} must call "
                           f"serve_if_server_task() before building a strategy")
    return tf.distribute.experimental.ParameterServerStrategy(cluster_resolver(info),
                                                              variable_partitioner=variable_partitioner)


def serve_if_server_task(info: ClusterInfo, start_server: Callable[..., Any] | None = None,
                         wait: Callable[[Any, str], None] | None = None) -> None:
    """In a parameter-server cluster, turn a worker or ps task into a gRPC server that
    runs what the chief schedules; there it never returns: the process exits 0 once the
    chief has gone (:func:`phalanx.cluster.mesh_cluster.serve_until_chief_exits`; SIGTERM
    waits for that too, since the chief reads the ps variables to checkpoint). Returns at
    once in any other task. ``start_server``/``wait`` replace the server and the waiting (tests).
    """
    if not info.is_server_task:
        return
    # Errors on this task go back to the coordinator, which decides (TF's PS recipe).
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    start_server = start_server or tf.distribute.Server
    server = start_server(tf.train.ClusterSpec(info.cluster_spec_dict()), job_name=info.task_type,
                          task_index=info.task_index, protocol=info.rpc_layer, start=True)
    if wait is None:
        wait = serve_until_chief_exits
    wait(server, info.cluster["chief"][0])


def make_coordinator(strategy: tf.distribute.Strategy) -> Any:
    """The ClusterCoordinator of a ParameterServerStrategy (None for the other strategies),
    whose stop never waits for a dead worker (:func:`stop_without_waiting`)."""
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return None
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    handler = getattr(getattr(coordinator, "_cluster", None), "failure_handler", None)
    if handler is not None:
        stop_without_waiting(handler)
    return coordinator


#: seconds the coordinator's stop waits for its failure handler before leaving it behind
STOP_WAIT_S = 1.0


def stop_without_waiting(handler: Any, wait_s: float = STOP_WAIT_S) -> bool:
    """Make ``handler.stop()`` (a ClusterCoordinator's worker-failure handler) return within
    ``wait_s`` seconds even when a worker is dead; returns False if ``handler`` is not the
    kind this knows (its own stop is then kept).

    Why: when a worker dies, TensorFlow's failure-handler thread holds its
    ``_cluster_update_lock`` while it waits, without end, for the worker to come back
    (``update_server_def``). The coordinator's ``__del__`` (at the chief's exit) calls
    ``stop()``, which takes that lock: the chief finished, saved its checkpoint, and then
    hung in garbage collection until ``phalanx launch`` killed it after ``--grace`` seconds
    (measured: 40.4 s with ``--grace 40``), and only then could the cluster restart. Here
    ``stop()`` tells the thread to end and sets its event only if the lock comes free in
    time; otherwise it leaves the (daemon) thread to end with the process.

    Example:
        >>> import threading
        >>> class Handler:   # the attributes TensorFlow's handler has (tests check they still do)
        ...     def __init__(self):
        ...         self._cluster_update_lock = threading.Lock()
        ...         self._cluster_due_for_update_or_finish = threading.Event()
        ...         self._should_preemption_thread_run = True
        >>> h = Handler()
        >>> stop_without_waiting(h, wait_s=0.01), h._cluster_update_lock.acquire()   # a thread holds the lock
        (True, True)
        >>> h.stop(); h._should_preemption_thread_run, h._cluster_due_for_update_or_finish.is_set()
        (False, False)
    """
    lock = getattr(handler, "_cluster_update_lock", None)
    event = getattr(handler, "_cluster_due_for_update_or_finish", None)
    if lock is None or event is None or not hasattr(handler, "_should_preemption_thread_run"):
        return False

    def stop() -> None:
        poller = getattr(handler, "_task_state_poller_thread", None)
        if poller is not None:
            poller.stop()
        handler._should_preemption_thread_run = False
        if lock.acquire(timeout=wait_s):
            try:
                event.set()
            finally:
                lock.release()
        else:
            print("[phalanx.cluster] a worker is unreachable: not waiting for it to come back", file=sys.stderr,
                  flush=True)

    handler.stop = stop
    return True


def check_batch(cfg: Any, strategy: tf.distribute.Strategy) -> int:
    """Check the batch and ``parallel.dp`` against the strategy's replica count; returns
    this worker's share of the global batch (rows it must feed per step).

    Across workers the data-parallel degree is the cluster's: ``parallel.dp`` may stay 1
    (unset) or -1, or must equal it.
    """
    replicas = strategy.num_replicas_in_sync
    dp, t = cfg.parallel.dp, cfg.train
    is_ps = isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy)
    multi = is_ps or isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    if dp not in (-1, replicas) and not (multi and dp == 1):
        raise ConfigError("parallel.dp", f"{dp} does not match the {replicas} replicas of the "
                                         f"{type(strategy).__name__}; set parallel.dp={replicas} or -1")
    if t.global_batch % (replicas * t.grad_accum):
        raise ConfigError("train.global_batch", f"{t.global_batch} is not divisible by replicas x train.grad_accum "
                                                f"= {replicas} x {t.grad_accum}; use a multiple of "
                                                f"{replicas * t.grad_accum}")
    if is_ps:
        return t.global_batch  # the coordinator feeds whole steps; the ps strategy has no batch split
    workers = _num_workers(strategy)
    return t.global_batch // workers


def _num_workers(strategy: tf.distribute.Strategy) -> int:
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return 1
    spec = resolver.cluster_spec().as_dict()
    return len(spec.get("worker", [])) + len(spec.get("chief", []))


def is_chief(info: ClusterInfo) -> bool:
    """Whether this task writes checkpoints, metrics and logs (every task must still
    take part in collective ops such as a synchronised save)."""
    return info.is_chief


@dataclass(frozen=True)
class ClusterSetup:
    """Everything a training process needs from the cluster, built in the right order.

    Every process that feeds data reads the whole global batch: the parameter-server chief
    feeds every step itself, the chief of a mesh across workers drives every device, and every
    worker of a ``multi_worker`` run trains its own rows of the whole batch (the engine takes
    them and checks that the workers had the same batch: :func:`_keras_engine_setup`).
    ``is_chief``: this process writes checkpoints, metrics and logs.
    """

    info: ClusterInfo
    strategy: tf.distribute.Strategy
    coordinator: Any
    name: str
    #: mesh across workers (chief only): the mesh's device names, on every task of the cluster
    devices: tuple[str, ...] | None = None

    @property
    def is_chief(self) -> bool:
        return self.info.is_chief


def needs_cluster(cfg: Any, info: ClusterInfo | None = None) -> bool:
    """Whether this process is part of a multi-process run, so that :func:`setup_cluster`
    must come first: a multi-process strategy is asked for, or TF_CONFIG names a cluster
    (``auto`` and ``mesh`` then span its tasks).

    >>> from phalanx.config import Config
    >>> needs_cluster(Config(), ClusterInfo.single_process())
    False
    """
    info = cluster_info_from_env() if info is None else info
    if cfg.parallel.strategy in (MULTI_WORKER, PARAMETER_SERVER):
        return True
    return cfg.parallel.strategy in ("auto", MESH) and info.is_distributed and (info.num_workers > 1 or info.num_ps > 0)


def setup_cluster(cfg: Any, info: ClusterInfo | None = None, devices: Sequence[str] | None = None
                  ) -> ClusterSetup:
    """Serve (ps-mode worker/ps tasks, and non-chief tasks of a mesh across workers: never
    returns), then build and check the strategy (or, for ``mesh``, join the cluster and
    name the mesh's devices in ``ClusterSetup.devices``).

    ``multi_worker`` is set up for ``phalanx train``'s built-in GPT on the Keras-model engine
    (:func:`_keras_engine_setup`: each worker's own devices, the whole batch on every worker).

    Call it first in a training process, before any other TensorFlow op.
    """
    info = cluster_info_from_env() if info is None else info
    name = resolve_strategy_name(cfg, info)  # config errors before a server starts
    if name == MESH and info.is_distributed:
        # The mesh's devices span the tasks; non-chief tasks serve in here and never return.
        devices = setup_mesh_cluster(cfg, info)
        return ClusterSetup(info=info, strategy=None, coordinator=None, name=name, devices=tuple(devices))
    if name == MULTI_WORKER:
        return _keras_engine_setup(cfg, info)
    serve_if_server_task(info)
    strategy = make_strategy(cfg, info, devices)
    check_batch(cfg, strategy)
    return ClusterSetup(info=info, strategy=strategy, coordinator=make_coordinator(strategy), name=name)


def _keras_engine_setup(cfg: Any, info: ClusterInfo) -> ClusterSetup:
    """``multi_worker`` for the built-in GPT on the Keras-model engine (module docstring): this worker's own
    devices for its ``parallel.*`` layout (logical CPUs split before the runtime starts), then
    a MultiWorkerMirroredStrategy for what its constructor sets up (the collectives, the
    coordination service), as :func:`phalanx.init` does for ``phalanx.fit``. Every worker
    reads the whole global batch: the engine takes this worker's rows and checks that every
    worker had the same batch."""
    p = cfg.parallel
    kind, count = parse_devices(p.devices)
    if not count:
        if -1 in (p.dp, p.pp, p.tp):
            raise ConfigError("parallel.devices", "a degree of -1 needs each worker's device count, e.g. "
                                                  "parallel.devices=cpu:2 (parallel.* is each worker's own layout)")
        count = p.dp * p.pp * p.tp
    dp, _, _ = resolve_degrees(cfg, count)
    rows = info.num_workers * dp * cfg.train.grad_accum * p.microbatches
    if cfg.train.global_batch % rows:
        raise ConfigError("train.global_batch", f"{cfg.train.global_batch} is not divisible by workers x parallel.dp "
                                                f"x train.grad_accum x parallel.microbatches = {info.num_workers} x "
                                                f"{dp} x {cfg.train.grad_accum} x {p.microbatches}; use a multiple "
                                                f"of {rows}")
    if count > 1 and (kind == "cpu" or (kind == "auto" and not tf.config.list_physical_devices("GPU"))):
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()
                                                             for _ in range(count)])
        except RuntimeError:
            pass  # the runtime has started (one process, devices made before): the engine's mesh checks the count
    strategy = multi_worker_strategy(info)
    return ClusterSetup(info=info, strategy=strategy, coordinator=None, name=MULTI_WORKER)
