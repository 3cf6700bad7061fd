"""Config -> engine: the one place that decides which engine trains a model on a layout.

The model code is written for one device; this step decides how it runs on the mesh
(torchtitan's principle):

* :func:`build_engine` is what ``phalanx train`` builds from a config (and a cluster
  set up by :func:`phalanx.cluster.strategies.setup_cluster`). The built-in GPT trains on
  :class:`~phalanx.engines.keras_gpt.KerasGPTEngine` (the Keras-model engine: one device, dp,
  tp, pp with any schedule, sequence parallelism, ep, grad accumulation, mixed precision,
  ZeRO-1/2/3, recomputation, dropout, pruning; across workers with ``parallel.strategy=multi_worker``, each worker's own layout,
  :func:`_keras_gpt_across_workers`). Only
  what that engine does not run yet goes to an older engine, decided in one place:
  :meth:`phalanx.plan.engine_rules.GPTRun.engine` with its table
  :data:`~phalanx.plan.engine_rules.OLD_ENGINE_ROWS` (the parameter-server engine); a mesh spanning the workers
  (``parallel.strategy=mesh``) is driven by the chief with the same choice.
  A Keras task of the Trainer trains on tf.distribute (data parallel; across workers with
  ``setup_cluster(cfg, strategy_step=True)``);
* :func:`make_engine` applies a given mesh to a model from outside:

  - the built-in GPT (a :class:`~phalanx.engines.task.GPTTask` or a ``ModelConfig``) ->
    :func:`gpt_engine`, the same choice on that mesh;
  - a user's compiled ``keras.Model`` (with ``sample_batch``) ->
    :class:`~phalanx.engines.keras_model.KerasModelEngine` (the model's own optimizer,
    loss and metrics). :func:`phalanx.fit` does this for you.

Example:
    >>> from phalanx.config import Config
    >>> from phalanx.mesh import Mesh
    >>> from phalanx.engines.task import GPTTask
    >>> cfg = Config().replace(model={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 8},
    ...                        train={"global_batch": 2})
    >>> engine = make_engine(GPTTask(cfg.model), Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), cfg)
    >>> type(engine).__name__, engine.dp
    ('KerasGPTEngine', 1)
"""

from __future__ import annotations

import keras

from phalanx.engines.ps_gpt import GPTParameterServerEngine
from phalanx.engines.ps_gpt import refuse_unhonoured as refuse_ps_gpt
from phalanx.cluster.strategies import MULTI_WORKER, local_strategy, refuse_unhonoured
from phalanx.config import Config, ConfigError, ModelConfig, given
from phalanx.engines import keras_cluster
from phalanx.engines.keras_model import KerasModelEngine
from phalanx.engines.keras_gpt import KerasGPTEngine, wants_keras_gpt
from phalanx.engines.keras_gpt import refuse_unhonoured as keras_gpt_refusals
from phalanx.engines.strategy import StrategyEngine
from phalanx.engines.task import GPTTask, KerasTask
from phalanx.mesh import Mesh, build_mesh
from phalanx.engines.mesh import MeshEngine
from phalanx.plan.engine_rules import GPTRun


def gpt_run(cfg: Config, cluster=None, mesh: Mesh | None = None) -> GPTRun:
    """What decides the engine of ``cfg`` (:class:`~phalanx.plan.engine_rules.GPTRun`): its keys,
    the resolved degrees of ``mesh`` and the strategy ``cluster`` was set up for."""
    name = None
    if cluster is not None:
        name = "mesh" if getattr(cluster, "devices", None) else \
            "parameter_server" if getattr(cluster, "coordinator", None) is not None else getattr(cluster, "name", None)
    tp, pp = (mesh.tp, mesh.pp) if mesh is not None else (None, None)
    return GPTRun.of(cfg, tp, pp, cluster=name)


def needs_mesh_engine(cfg: Config) -> bool:
    """Whether ``phalanx train`` runs ``cfg`` (in one process) on the mesh engine."""
    return gpt_run(cfg).engine() == "mesh"


def refuse_before_build(cfg: Config, task, cluster=None) -> None:
    """The refusals of :func:`build_engine` that need no device (a ConfigError naming the key):
    ``phalanx train`` runs them before anything is written into the run directory."""
    p = cfg.parallel
    for key in ("precision.loss_scale_init", "precision.loss_scale_growth_interval"):
        if given(cfg, key) and cfg.precision.policy != "mixed_float16":  # (auto: never float16 for the GPT)
            raise ConfigError(key, f"is ignored under precision.policy={cfg.precision.policy}: loss scaling applies "
                                   f"to precision.policy=mixed_float16 only; set that, or remove {key}")
    if p.sequence_parallel and (p.ep > 1 or cfg.model.experts):
        raise ConfigError("parallel.sequence_parallel", "true: the mesh engine runs sequence parallelism for the "
                                                        "dense GPT; the mixture-of-experts GPT (model.experts, "
                                                        "parallel.ep) does not run it yet")
    across = isinstance(task, GPTTask) and _worker_group_cluster(cluster)
    if p.ep > 1 or across or (isinstance(task, GPTTask) and cluster is None and wants_keras_gpt(cfg)):
        # the GPT of parallel Keras layers on the Keras-model engine (expert parallelism included)
        if not isinstance(task, GPTTask):
            raise ConfigError("parallel.ep", f"{p.ep}: phalanx train runs expert parallelism for the "
                                             f"built-in GPT (in one process, or across workers with parallel."
                                             f"strategy=multi_worker); for another task use parallel.ep=1 (a Keras "
                                             f"model: phalanx.layers.MoE(ep=N) through phalanx.fit)")
        if across and p.ep == 1:
            # Across workers the dense GPT trains on the Keras-model engine only: what that engine does
            # not run yet (GPTRun's older-engine rows) is refused here, naming its key.
            reasons = gpt_run(cfg, cluster).old_engine_reasons()
            if reasons:
                key = reasons[0].split("=", 1)[0]
                raise ConfigError(key, f"{reasons[0].split('=', 1)[1]}; across workers (parallel.strategy="
                                       f"multi_worker) phalanx train runs the built-in GPT on the Keras-model engine "
                                       f"(each worker's own layout), which does not run it: train it in one process, "
                                       f"or across workers with parallel.strategy=mesh")
        keras_gpt_refusals(cfg)
        if across:
            refuse_unhonoured(cfg, MULTI_WORKER)  # ZeRO across workers
        if p.ep > 1 or across:
            return
    if getattr(cluster, "devices", None):  # a mesh across the workers' devices
        if isinstance(task, GPTTask) and gpt_run(cfg, cluster).engine() == "keras":
            keras_gpt_refusals(cfg)  # (else the mesh engine's own checks)
        return
    elif cluster is not None:
        refuse_unhonoured(cfg, cluster.name, strategy_step=True)
        if getattr(cluster, "coordinator", None) is not None:  # parameter servers
            if not isinstance(task, GPTTask):
                raise ConfigError("parallel.strategy", f"parameter_server: phalanx train trains the built-in GPT on "
                                                       f"parameter servers; a Keras model ({type(task).__name__}) "
                                                       f"trains there through phalanx.fit(build_model, ...) (see "
                                                       f"docs/clusters.md)")
            refuse_ps_gpt(cfg)
    else:  # (parallel.microbatches with parallel.pp=1: config.refuse_ignored; with pp=-1: at build)
        refuse_unhonoured(cfg, p.strategy)  # e.g. an explicit "mirrored" with parallel.zero=1
        if p.zero and p.dp == 1:
            raise ConfigError("parallel.zero", f"{p.zero} shards the optimizer state over the data replicas, and "
                                               f"parallel.dp=1 has one: set parallel.dp > 1, or parallel.zero=0")


def _worker_group_cluster(cluster) -> bool:
    """Whether ``cluster`` is :func:`~phalanx.cluster.strategies.setup_cluster`'s ``multi_worker``
    set-up for the Keras-model engine (every worker reads the whole batch and trains its rows)."""
    return getattr(cluster, "name", None) == MULTI_WORKER and not getattr(cluster, "devices", None) \
        and getattr(cluster, "coordinator", None) is None and getattr(cluster, "data_count", 1) == 1


def _refuse_microbatches(n: int) -> None:
    raise ConfigError("parallel.microbatches", f"{n} splits a pipeline's batch, but parallel.pp=1 trains without a "
                                               f"pipeline; use train.grad_accum={n} to split each step's batch")


def build_engine(cfg: Config, task, cluster=None):
    """The engine ``phalanx train`` runs for ``cfg``: for the built-in GPT the Keras-model
    engine (:class:`KerasGPTEngine`) unless a row of
    :data:`~phalanx.plan.engine_rules.OLD_ENGINE_ROWS` applies (then the mesh engine,
    tf.distribute's or the parameter-server engine, :meth:`GPTRun.engine`); tf.distribute for a
    Keras task. ``cluster``: what ``setup_cluster`` returned (None on one process)."""
    refuse_before_build(cfg, task, cluster)
    if cfg.parallel.ep > 1:  # expert parallelism: the GPT of parallel Keras layers on the Keras-model engine
        if cluster is None:
            return KerasGPTEngine(cfg, task, build_mesh(cfg))
        return _keras_gpt_across_workers(cfg, task, cluster)
    if isinstance(task, GPTTask) and getattr(cluster, "name", None) == MULTI_WORKER \
            and not getattr(cluster, "devices", None):
        return _keras_gpt_across_workers(cfg, task, cluster)  # each worker's own layout, the workers data parallel
    if isinstance(task, GPTTask) and cluster is None and gpt_run(cfg).engine() == "keras":
        return gpt_engine(cfg, build_mesh(cfg), task)
    if cfg.parallel.zero == 3:
        raise ConfigError("parallel.zero", "3: ZeRO-3 (sliced weights) runs on the Keras-model engine, which this "
                                           "run's other keys (pruning, dropout, a cluster strategy) do not train "
                                           "on yet; use parallel.zero=2")
    if getattr(cluster, "devices", None):  # cluster: a mesh whose devices span the workers
        mesh = build_mesh(cfg, list(cluster.devices))
        if isinstance(task, GPTTask):  # the Keras-model engine on the remote devices, or the mesh engine
            return gpt_engine(cfg, mesh, task, cluster)
        return make_mesh_engine(cfg, mesh, task)
    if cluster is not None:  # a multi-process strategy, built first (cluster.strategies.setup_cluster)
        if cluster.coordinator is not None:  # cluster: parameter servers, steps scheduled on the workers
            return GPTParameterServerEngine(cfg, task, cluster.strategy, cluster.coordinator,
                                            cluster.info.num_workers)
        if _worker_group_cluster(cluster) and cluster.info.num_workers > 1:
            raise ConfigError("parallel.strategy", f"multi_worker: this cluster was set up for the built-in GPT on "
                                                   f"the Keras-model engine (every worker reads the whole batch); "
                                                   f"a {type(task).__name__} trains on tf.distribute's step: set it "
                                                   f"up with phalanx.cluster.strategies.setup_cluster(cfg, "
                                                   f"strategy_step=True)")
        return StrategyEngine(cfg, task, cluster.strategy)
    mesh = build_mesh(cfg)
    if cfg.parallel.sequence_parallel and mesh.tp < 2:
        raise ConfigError("parallel.sequence_parallel", f"true needs tensor parallelism: parallel.tp > 1 (the "
                                                        f"layout has tp={mesh.tp})")
    if mesh.tp > 1 or mesh.pp > 1 or needs_mesh_engine(cfg):  # (mesh: -1 degrees resolved)
        return make_mesh_engine(cfg, mesh, task)
    if cfg.parallel.microbatches != 1:  # (parallel.pp=-1 filled with 1)
        _refuse_microbatches(cfg.parallel.microbatches)
    return StrategyEngine(cfg, task, local_strategy(mesh.devices))


def gpt_engine(cfg: Config, mesh: Mesh, task: GPTTask, cluster=None, stage_calls: bool = True):
    """The engine that trains the built-in GPT ``task`` on ``mesh`` (driven by this process, its
    devices local or, with a ``mesh`` ``cluster``, the workers' over gRPC):
    :class:`KerasGPTEngine`, or the mesh engine / tf.distribute's for what only they run
    (:meth:`~phalanx.plan.engine_rules.GPTRun.engine` on the mesh's resolved degrees).
    ``stage_calls=False`` inlines every pipeline stage per micro-batch (for the memory profiler,
    :mod:`phalanx.train.calibrate`)."""
    if task.cfg != cfg.model:
        raise ConfigError("model", "the GPTTask's ModelConfig differs from cfg.model; build the task from cfg.model")
    which = gpt_run(cfg, cluster, mesh=mesh).engine()
    if which == "keras":
        if cfg.parallel.sequence_parallel and mesh.tp < 2:
            raise ConfigError("parallel.sequence_parallel", f"true needs tensor parallelism: parallel.tp > 1 (the "
                                                            f"layout has tp={mesh.tp})")
        if cfg.parallel.microbatches != 1 and mesh.pp == 1:
            raise ConfigError("parallel.microbatches", f"{cfg.parallel.microbatches} splits a pipeline's batch, "
                                                       f"but parallel.pp=1 trains without a pipeline; use train."
                                                       f"grad_accum={cfg.parallel.microbatches} to split each "
                                                       f"step's batch")
        return KerasGPTEngine(cfg, task, mesh, stage_calls=stage_calls)
    if which == "mesh":
        return MeshEngine(cfg, mesh, task)
    return StrategyEngine(cfg, task, local_strategy(mesh.devices))


def _keras_gpt_across_workers(cfg: Config, task: GPTTask, cluster) -> KerasGPTEngine:
    """The built-in GPT (dense or expert-parallel) under ``cluster``
    (:func:`~phalanx.cluster.strategies.setup_cluster`'s ``multi_worker`` set-up):
    ``parallel.*`` is each worker's own layout (dp, tp, pp, ep over its devices; the experts
    sharded within a worker), and the workers are data parallel through a
    :class:`~phalanx.engines.keras_cluster.WorkerGroup`, as :func:`phalanx.fit` spans workers.
    Every worker must call it at the same point (the group's first collective runs here)."""
    key = "parallel.ep" if cfg.parallel.ep > 1 else "parallel.strategy"
    value = cfg.parallel.ep if cfg.parallel.ep > 1 else "multi_worker"
    name = getattr(cluster, "name", None)
    if name != MULTI_WORKER or getattr(cluster, "devices", None) or getattr(cluster, "coordinator", None):
        raise ConfigError(key, f"{value}: the built-in GPT on the Keras-model engine trains in one process, or "
                               f"across workers with parallel.strategy=multi_worker (each worker's own "
                               f"layout, set up by phalanx.cluster.strategies.setup_cluster); got a "
                               f"{name or type(cluster).__name__} set-up")
    if cluster.data_count != 1:  # a set-up feeding each worker a share of the batch (strategy_step=True)
        raise ConfigError(key, f"{value}: every worker of the built-in GPT's multi_worker run reads the whole "
                               f"global batch and trains its own rows of it, but this set-up feeds worker "
                               f"{cluster.data_index} of {cluster.data_count} a share; build it with "
                               f"phalanx.cluster.strategies.setup_cluster(cfg) (without strategy_step)")
    if not keras_cluster.cluster_mode(cfg, cluster.info):  # multi_worker without a cluster: this process alone
        return KerasGPTEngine(cfg, task, build_mesh(cfg))
    mesh = build_mesh(cfg, keras_cluster.local_devices(cfg, cluster.info))
    return KerasGPTEngine(cfg, task, mesh, workers=keras_cluster.WorkerGroup(cluster.info))


def make_mesh_engine(cfg: Config, mesh: Mesh, task):
    """The mesh engine for ``task`` (GPTTask or KerasTask) on ``mesh``."""
    if isinstance(task, GPTTask):
        if task.cfg != cfg.model:
            raise ConfigError("model", "the GPTTask's ModelConfig differs from cfg.model; build the task from cfg.model")
        return MeshEngine(cfg, mesh, task)
    if isinstance(task, KerasTask):
        raise ConfigError("parallel.pp", "a Keras model trains on tensor/pipeline layouts through "
                                         "phalanx.fit(model, x, y, ...) with its compiled optimizer; the "
                                         "Trainer's KerasTask supports data parallelism only")
    raise TypeError(f"make_mesh_engine takes a GPTTask, got {type(task).__name__}")


def make_engine(model_or_task, mesh: Mesh, cfg: Config, sample_batch=None):
    """An Engine that trains ``model_or_task`` on ``mesh`` as ``cfg.parallel`` says.

    Accepts a GPTTask, ``ModelConfig`` (the built-in GPT) or a compiled ``keras.Model`` with
    ``sample_batch`` = one ``(x, y, sample_weight)`` batch (its compiled optimizer, loss and
    metrics are used).
    """
    task = model_or_task
    if isinstance(model_or_task, ModelConfig):
        task = GPTTask(model_or_task, cfg.precision.policy, cfg.train.seed)
    elif isinstance(model_or_task, keras.Model):
        if sample_batch is None:
            raise ValueError("sample_batch: a Keras model needs one (x, y, sample_weight) batch to build its "
                             "compiled loss, metrics and optimizer; or train it with phalanx.fit")
        return KerasModelEngine(model_or_task, cfg, mesh, sample_batch)
    if isinstance(task, GPTTask):
        return gpt_engine(cfg, mesh, task)
    return make_mesh_engine(cfg, mesh, task)
