"""``make_engine``: apply the mesh to a model from outside, and get an Engine back.

The model code is written for one device; this step decides how it runs on the mesh
(torchtitan's principle):

* the built-in GPT (a :class:`~phalanx.train.task.GPTTask`, a ``gpt.GPT`` model or a
  ``ModelConfig``) -> :class:`~phalanx.parallel.mesh_engine.MeshEngine`: tensor
  parallelism over ``tensor``, pipeline over ``pipe``, replicas over ``data``, ZeRO
  and recomputation from ``cfg.parallel``;
* a user's compiled ``keras.Model`` (with ``sample_batch``) ->
  :class:`~phalanx.engines.keras_model.KerasModelEngine` (``pipe`` x ``data``, the model's
  own optimizer, loss and metrics; ``tp`` must be 1). :func:`phalanx.fit` does this for you.

Example:
    >>> from phalanx.config import Config
    >>> from phalanx.mesh import Mesh
    >>> from phalanx.train.task import GPTTask
    >>> cfg = Config().replace(model={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 8},
    ...                        train={"global_batch": 2})
    >>> engine = make_engine(GPTTask(cfg.model), Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), cfg)
    >>> type(engine).__name__, engine.dp
    ('MeshEngine', 1)
"""

from __future__ import annotations

from phalanx.config import Config, ConfigError, ModelConfig
from phalanx.mesh import Mesh
from phalanx.models import gpt
from phalanx.train.task import GPTTask, KerasTask


def needs_mesh_engine(cfg: Config) -> bool:
    """Whether ``cfg`` asks for anything only the mesh engine does."""
    p = cfg.parallel
    return p.tp > 1 or p.pp > 1 or p.zero > 0 or p.recompute != "none" or p.strategy == "mesh"


def make_mesh_engine(cfg: Config, mesh: Mesh, task):
    """The mesh engine for ``task`` (GPTTask or KerasTask) on ``mesh``."""
    if isinstance(task, GPTTask):
        from phalanx.parallel.mesh_engine import MeshEngine

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

    Accepts a GPTTask, ``ModelConfig``, ``gpt.GPT`` (its current weights are the starting
    point) or a compiled ``keras.Model`` with ``sample_batch`` = one ``(x, y,
    sample_weight)`` batch (its compiled optimizer, loss and metrics are used).
    """
    import keras

    task = model_or_task
    start = None
    if isinstance(model_or_task, ModelConfig):
        task = GPTTask(model_or_task, cfg.precision.policy, cfg.train.seed)
    elif isinstance(model_or_task, gpt.GPT):
        task = GPTTask(model_or_task.cfg, cfg.precision.policy, cfg.train.seed)
        start = {n: v.numpy() for n, v in model_or_task.named_variables().items()}
    elif isinstance(model_or_task, keras.Model):
        from phalanx.engines.keras_model import KerasModelEngine

        if sample_batch is None:
            raise ValueError("sample_batch: a Keras model needs one (x, y, sample_weight) batch to build its "
                             "compiled loss, metrics and optimizer; or train it with phalanx.fit")
        return KerasModelEngine(model_or_task, cfg, mesh, sample_batch)
    engine = make_mesh_engine(cfg, mesh, task)
    if start is not None:
        for name, value in start.items():
            engine.params.assign_logical(name, value)
    return engine
