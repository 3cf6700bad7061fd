"""What ``phalanx train`` trains: the built-in GPT (:class:`GPTTask`), and the precision it computes in.

A user's Keras model is not a task: it trains through :func:`phalanx.fit` (the Keras-model
engine, or the parameter-server engine), with its own optimizer, loss and metrics.

Example:
    >>> from phalanx.config import ModelConfig
    >>> task = GPTTask(ModelConfig(layers=1, d_model=16, heads=2, ffn=32, seq_len=8))
    >>> task.tokens_per_example()
    8
"""

from __future__ import annotations

import tensorflow as tf

from phalanx.config import Config, ConfigError, ModelConfig
from phalanx.core import costs
from phalanx.models import transformer


def _tf_variable(v) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras 3 variable (Keras wraps it in ``.value``)."""
    return v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v


def for_config(task, cfg: Config):
    """``task`` as an engine trains it under ``cfg``: a task that names no precision policy
    (``GPTTask(model_cfg)``) gets ``precision.policy`` (a copy: the caller's task is left as
    it is); one that names another policy is refused, so that no engine trains in a precision
    its config does not say.

    Example:
        >>> from phalanx.config import Config
        >>> cfg = Config().replace(precision={"policy": "mixed_bfloat16"})
        >>> for_config(GPTTask(cfg.model), cfg).dtype_policy
        'mixed_bfloat16'
        >>> try:
        ...     for_config(GPTTask(cfg.model, "float32"), cfg)
        ... except ConfigError as err:
        ...     print(err.key, "|", str(err).split(":")[1].split(" its model")[0])
        precision.policy |  mixed_bfloat16, but the GPTTask was built for float32
    """
    policy = cfg.precision.policy
    if task.dtype_policy is None:
        return task.with_policy(policy)
    if task.dtype_policy != policy:
        raise ConfigError("precision.policy", f"{policy}, but the {type(task).__name__} was built for "
                                              f"{task.dtype_policy}: its model would train in {task.dtype_policy}. "
                                              f"Build the task without a policy (it then takes precision.policy) "
                                              f"or set precision.policy={task.dtype_policy}")
    return task


class GPTTask:
    """The built-in GPT (:func:`phalanx.models.transformer.gpt` at ``tp=1``) on int32 batches
    ``[b, seq_len + 1]``; its weights are named as :func:`phalanx.models.gpt.weight_shapes`
    names them.

    ``dtype_policy``: the Keras policy its layers compute in. None (the default): the
    ``precision.policy`` of the config an engine trains it under (:func:`for_config`; an engine
    refuses a task built for another policy); built outside an engine, float32."""

    def __init__(self, cfg: ModelConfig, dtype_policy: str | None = None, seed: int = 0):
        self.cfg, self.dtype_policy, self.seed = cfg, dtype_policy, seed

    def with_policy(self, dtype_policy: str) -> "GPTTask":
        """The same task computing in ``dtype_policy``."""
        return GPTTask(self.cfg, dtype_policy, self.seed)

    def build(self):
        """The one-device Keras model of the GPT, holding its initial weights (the values every
        layout starts from: :func:`phalanx.models.transformer.initialize`)."""
        return transformer.gpt(self.cfg, seed=self.seed, dtype_policy=self.dtype_policy or "float32")

    def flops_per_example(self) -> float:
        return costs.gpt_training_flops_per_token(self.cfg) * self.cfg.seq_len

    def tokens_per_example(self) -> int:
        return self.cfg.seq_len
