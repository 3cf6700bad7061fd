"""``parallelize``: apply the mesh to a model from outside, and get an Engine back.

The model code is written for one device; this step decides how it runs on the mesh
(torchtitan's principle):

* the built-in GPT (a :class:`~phalanx.train.task.GPTTask`, a ``gpt.GPT`` model or a
  ``ModelConfig``) -> :class:`~phalanx.parallel.mesh_engine.MeshEngine`: tensor
  parallelism over ``tensor``, pipeline over ``pipe``, replicas over ``data``, ZeRO
  and recomputation from ``cfg.parallel``;
* a Keras Sequential/Functional chain (a :class:`~phalanx.train.task.KerasTask`, or a
  compiled ``keras.Model``) -> :class:`~phalanx.parallel.keras_pipeline.KerasPipelineEngine`
  (``pipe`` x ``data``; ``tp`` must be 1).

Example:
    >>> from phalanx.config import Config
    >>> from phalanx.mesh import Mesh
    >>> from phalanx.train.task import GPTTask
    >>> cfg = Config().replace(model={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 8},
    ...                        train={"global_batch": 2})
    >>> engine = parallelize(GPTTask(cfg.model), Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), cfg)
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
        from phalanx.parallel.keras_pipeline import KerasPipelineEngine

        return KerasPipelineEngine(cfg, mesh, task)
    raise TypeError(f"make_mesh_engine takes a GPTTask or a KerasTask, got {type(task).__name__}")


def parallelize(model_or_task, mesh: Mesh, cfg: Config):
    """An Engine that trains ``model_or_task`` on ``mesh`` as ``cfg.parallel`` says.

    Accepts a GPTTask, KerasTask, ``ModelConfig``, ``gpt.GPT`` (its current weights are
    the starting point) or a compiled ``keras.Model`` (its compiled loss is used).
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
        model = model_or_task
        loss = getattr(model, "loss", None)
        if loss is None:
            raise ValueError(f"model {model.name!r} has no loss: compile it with a loss, or pass "
                             f"KerasTask(model_fn, loss_fn)")
        loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
        task = KerasTask(lambda: model, loss_fn)
    engine = make_mesh_engine(cfg, mesh, task)
    if start is not None:
        for name, value in start.items():
            engine.params.assign_logical(name, value)
    return engine
