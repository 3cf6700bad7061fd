"""What is trained: a model, its named variables, its loss on a batch.

The engines are written against :class:`Task`, so the built-in GPT and any user
Keras 3 model (Sequential, Functional or subclassed, with a Keras loss) train
through the same loop.

Example:
    >>> import keras, numpy as np
    >>> task = KerasTask(lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
    ...                  keras.losses.MeanSquaredError())
    >>> model = task.build()
    >>> float(task.loss(model, (np.ones([4, 3], "float32"), np.zeros([4, 1], "float32")))) >= 0
    True
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np
import tensorflow as tf

from phalanx.config import ModelConfig
from phalanx.models import gpt


class Task(Protocol):
    def build(self) -> Any:
        """Create the model's variables (called inside the engine's strategy scope)."""

    def named_variables(self, model) -> dict[str, tf.Variable]:
        """Logical name -> trainable variable (the names checkpoints use)."""

    def loss(self, model, batch, training: bool = False) -> tf.Tensor:
        """Mean loss over the batch, float32 scalar."""

    def decays(self, name: str) -> bool:
        """Whether AdamW weight decay applies to the named variable."""

    def flops_per_example(self) -> float:
        """Training FLOPs (forward + backward) per example, for MFU; 0 if unknown."""

    def tokens_per_example(self) -> int:
        """Tokens (or samples) an example counts as, for throughput."""


class GPTTask:
    """The built-in GPT on int32 batches ``[b, seq_len + 1]``."""

    def __init__(self, cfg: ModelConfig, dtype_policy: str = "float32", seed: int = 0):
        self.cfg, self.dtype_policy, self.seed = cfg, dtype_policy, seed

    def build(self):
        model = gpt.GPT(self.cfg, self.dtype_policy)
        model.assign_weights(gpt.initial_weights(self.cfg, self.seed))
        return model

    def named_variables(self, model) -> dict[str, tf.Variable]:
        return model.named_variables()

    def loss(self, model, batch, training: bool = False) -> tf.Tensor:
        logits = model(batch[:, :-1], training=training)
        loss = gpt.lm_loss(logits, batch[:, 1:])
        return loss + gpt.aux_loss(model) if self.cfg.experts else loss

    def decays(self, name: str) -> bool:
        return gpt.decays(name)

    def stats(self, model) -> dict[str, float]:
        """Extra figures for the logs, with the names and meanings ``phalanx.fit`` uses
        (:mod:`phalanx.train.moe_stats`): the balancing loss added (``moe_aux_loss``: the sum
        over blocks of coefficient x balance), the balance before the coefficient (mean over
        blocks), the share of dropped assignments (mean) and the expert load (min and max over
        blocks) of the last training step (replica 0's micro-batch); empty for a dense GPT."""
        layers = [b.moe for b in getattr(model, "blocks", []) if getattr(b, "moe", None) is not None]
        if not layers:
            return {}
        read = lambda name: [float(getattr(m, name).numpy()) for m in layers]  # noqa: E731
        return {"moe_aux_loss": self.cfg.aux_loss_coef * float(np.sum(read("balance"))),
                "moe_balance": float(np.mean(read("balance"))), "moe_dropped": float(np.mean(read("dropped_fraction"))),
                "moe_load_min": min(read("load_min")), "moe_load_max": max(read("load_max"))}

    def flops_per_example(self) -> float:
        return gpt_training_flops_per_token(self.cfg) * self.cfg.seq_len

    def tokens_per_example(self) -> int:
        return self.cfg.seq_len


def gpt_training_flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs per token of a training step (forward + backward, no recomputation).

    The planner's arithmetic is the one definition (matmul FLOPs of attention, MLP or
    experts' active MLPs, and the head; Narayanan et al. 2021): MFU here, the planner's
    time estimates and the pipeline partitioner's costs all count the same FLOPs.
    """
    from phalanx.plan.arithmetic import ModelSpec, flops_per_token

    return flops_per_token(ModelSpec.from_config(cfg), "none")


class KerasTask:
    """Any Keras 3 model with a Keras loss, on ``(x, y)`` batches.

    ``model_fn`` builds the model (it is called inside the strategy scope, so the
    variables land on the right devices). Weights are named by their Keras path.
    """

    def __init__(self, model_fn: Callable[[], Any], loss_fn: Callable, sample_input=None):
        self.model_fn, self.loss_fn, self.sample_input = model_fn, loss_fn, sample_input

    def build(self):
        model = self.model_fn()
        if not model.built and self.sample_input is not None:
            model(self.sample_input)
        return model

    def named_variables(self, model) -> dict[str, tf.Variable]:
        names = {}
        for v in model.trainable_variables:
            names[v.path] = v.value if hasattr(v, "value") else v
        return names

    def loss(self, model, batch, training: bool = False) -> tf.Tensor:
        x, y = batch
        return tf.cast(self.loss_fn(y, model(x, training=training)), tf.float32)

    def decays(self, name: str) -> bool:
        return name.endswith("kernel") or name.endswith("embeddings")

    def flops_per_example(self) -> float:
        return 0.0

    def tokens_per_example(self) -> int:
        return 1


def split_batch(batch, parts: int):
    """Split every tensor of a (nested) batch into ``parts`` equal pieces along axis 0,
    returning a nest whose tensors have a new leading axis of size ``parts``."""
    def split(t):
        shape = tf.shape(t)
        return tf.reshape(t, tf.concat([[parts, shape[0] // parts], shape[1:]], 0))
    return tf.nest.map_structure(split, batch)


def take(batch, index):
    return tf.nest.map_structure(lambda t: t[index], batch)


def rows(batch, start, size):
    return tf.nest.map_structure(lambda t: t[start:start + size], batch)


def batch_size(batch) -> int:
    return int(tf.nest.flatten(batch)[0].shape[0])


def to_numpy(state: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in state.items()}
