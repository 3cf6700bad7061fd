"""Config -> engine: the one place that decides which engine trains a model on a layout.

The model code is written for one device; this step decides how it runs on the mesh
(torchtitan's principle):

* :func:`build_engine` is what ``phalanx train`` builds from a config (and a cluster
  set up by :func:`phalanx.cluster.strategies.setup_cluster`). The built-in GPT trains on
  :class:`~phalanx.engines.keras_gpt.KerasGPTEngine` (the Keras-model engine: one device, dp,
  tp, pp with any schedule, sequence parallelism, ep, grad accumulation, mixed precision,
  ZeRO-1/2/3, recomputation, dropout, pruning; across workers with ``parallel.strategy=multi_worker``, each worker's own layout,
  :func:`_keras_gpt_across_workers`; on a mesh spanning the workers, ``parallel.strategy=mesh``,
  driven by the chief), except under parameter servers (``parallel.strategy=parameter_server``:
  :class:`~phalanx.engines.ps_gpt.GPTParameterServerEngine`). It takes the built-in GPT only:
  a user's Keras model trains through :func:`phalanx.fit` (:func:`require_gpt_task`);
* :func:`make_engine` applies a given mesh to a model from outside:

  - the built-in GPT (a :class:`~phalanx.engines.task.GPTTask` or a ``ModelConfig``) ->
    :class:`~phalanx.engines.keras_gpt.KerasGPTEngine` on that mesh;
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
from phalanx.cluster.strategies import MULTI_WORKER, refuse_unhonoured
from phalanx.config import Config, ConfigError, ModelConfig, given
from phalanx.engines import keras_cluster
from phalanx.engines.keras_model import KerasModelEngine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines.keras_gpt import refuse_unhonoured as keras_gpt_refusals
from phalanx.engines.task import GPTTask
from phalanx.mesh import Mesh, build_mesh


def refuse_before_build(cfg: Config, task, cluster=None) -> None:
    """The refusals of :func:`build_engine` that need no device (a ConfigError naming the key,
    or a TypeError for a task other than the built-in GPT): ``phalanx train`` runs them before
    anything is written into the run directory."""
    require_gpt_task(task)
    p = cfg.parallel
    for key in ("precision.loss_scale_init", "precision.loss_scale_growth_interval"):
        if given(cfg, key) and cfg.precision.policy != "mixed_float16":  # (auto: never float16 for the GPT)
            raise ConfigError(key, f"is ignored under precision.policy={cfg.precision.policy}: loss scaling applies "
                                   f"to precision.policy=mixed_float16 only; set that, or remove {key}")
    if p.sequence_parallel and (p.ep > 1 or cfg.model.experts):
        raise ConfigError("parallel.sequence_parallel", "true: phalanx train runs sequence parallelism for the "
                                                        "dense GPT; the mixture-of-experts GPT (model.experts, "
                                                        "parallel.ep) does not run it yet")
    if getattr(cluster, "coordinator", None) is not None:  # parameter servers: that engine's refusals
        refuse_unhonoured(cfg, cluster.name)
        refuse_ps_gpt(cfg)
        return
    # every other layout trains on the Keras-model engine (any strategy it runs: one process, auto
    # or mirrored; multi_worker, each worker's own layout; a mesh across the workers' devices)
    keras_gpt_refusals(cfg)
    if cluster is None and p.zero and p.dp == 1:  # (across workers ZeRO slices over every worker's replicas)
        raise ConfigError("parallel.zero", f"{p.zero} shards the optimizer state over the data replicas, and "
                                           f"parallel.dp=1 has one: set parallel.dp > 1, or parallel.zero=0")


def _worker_group_cluster(cluster) -> bool:
    """Whether ``cluster`` is :func:`~phalanx.cluster.strategies.setup_cluster`'s ``multi_worker``
    set-up for the Keras-model engine (every worker reads the whole batch and trains its rows)."""
    return getattr(cluster, "name", None) == MULTI_WORKER and not getattr(cluster, "devices", None) \
        and getattr(cluster, "coordinator", None) is None


def require_gpt_task(task) -> None:
    """Refuse a task other than the built-in GPT: a user's Keras model trains through
    :func:`phalanx.fit` (the Keras-model engine on every layout, or the parameter-server engine).

    Example:
        >>> require_gpt_task(object())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: phalanx train (Trainer, build_engine) trains the built-in GPT (a GPTTask), got object; ...
    """
    if not isinstance(task, GPTTask):
        raise TypeError(f"phalanx train (Trainer, build_engine) trains the built-in GPT (a GPTTask), got "
                        f"{type(task).__name__}; train a Keras model with phalanx.fit(model, x, y, ...) "
                        f"(its compiled optimizer, loss and metrics, on any layout: docs/keras.md)")


def build_engine(cfg: Config, task: GPTTask, cluster=None):
    """The engine ``phalanx train`` runs for ``cfg`` and the built-in GPT ``task``: the
    Keras-model engine (:class:`KerasGPTEngine`), under parameter servers the parameter-server
    engine. ``cluster``: what ``setup_cluster`` returned (None on one process)."""
    refuse_before_build(cfg, task, cluster)
    if cluster is None:
        return KerasGPTEngine(cfg, task, build_mesh(cfg))
    if cfg.parallel.ep > 1 or _worker_group_cluster(cluster):
        # each worker's own layout (dp, tp, pp, ep over its devices), the workers data parallel
        return _keras_gpt_across_workers(cfg, task, cluster)
    if getattr(cluster, "devices", None):  # a mesh whose devices span the workers:
        # the Keras-model engine on the remote devices (ZeRO sliced over the mesh's data replicas)
        return KerasGPTEngine(cfg, task, build_mesh(cfg, list(cluster.devices)))
    if cluster.coordinator is not None:  # parameter servers, steps scheduled on the workers
        return GPTParameterServerEngine(cfg, task, cluster.strategy, cluster.coordinator, cluster.info.num_workers)
    # a one-process set-up (mirrored): the Keras-model engine on the strategy's devices
    return KerasGPTEngine(cfg, task, build_mesh(cfg, list(cluster.strategy.extended.worker_devices)))


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
    if not keras_cluster.cluster_mode(cfg, cluster.info):  # multi_worker without a cluster: this process alone
        return KerasGPTEngine(cfg, task, build_mesh(cfg))
    mesh = build_mesh(cfg, keras_cluster.local_devices(cfg, cluster.info))
    return KerasGPTEngine(cfg, task, mesh, workers=keras_cluster.WorkerGroup(cluster.info))


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
    require_gpt_task(task)
    return KerasGPTEngine(cfg, task, mesh)
