"""Train any Keras 3 model with phalanx's loop: :func:`fit`.

Keras 3 ``model.fit`` fails as soon as a second worker joins
(MultiWorkerMirroredStrategy, keras-team/keras#20585); this runs the same model
through phalanx's custom training loop instead, with its data parallelism,
gradient accumulation, mixed precision, AdamW, clipping, checkpoints and logs.

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> x = np.random.default_rng(0).random((256, 8), dtype=np.float32)
    >>> data = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).repeat().batch(32)
    >>> import tempfile
    >>> summary = fit(lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)]),
    ...               keras.losses.MeanSquaredError(), data, quiet=True,
    ...               overrides=["train.steps=30", "train.global_batch=32", "train.lr=0.05",
    ...                          "train.eval_every=0", f"run.dir={tempfile.mkdtemp()}"])
    >>> summary.steps
    30
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from phalanx.config import Config, load_config


@dataclass
class UserData:
    """Datasets given by the user: ``train`` yields global batches ``(x, y)`` forever."""

    train: Any
    val: Any = None


def fit(model_fn: Callable[[], Any], loss: Callable, train_data, config: Config | None = None, *,
        val_data=None, overrides: Sequence[str] = (), quiet: bool = False):
    """Train the model built by ``model_fn`` on ``train_data`` (global batches of ``(x, y)``).

    ``model_fn`` is called inside the engine's distribution scope so that the
    variables land on the right devices; ``loss`` is a Keras loss (or any
    ``f(y_true, y_pred) -> scalar``). ``config`` (or ``overrides`` of the defaults)
    sets the layout and the optimisation; ``train.global_batch`` must equal the
    dataset's batch size. Returns the trainer's :class:`~phalanx.train.trainer.Summary`.
    """
    from phalanx.mesh import build_mesh
    from phalanx.train.task import KerasTask
    from phalanx.train.trainer import Trainer

    if config is None:
        config = load_config(None, overrides)
    elif overrides:
        from phalanx.config import parse_override
        changes: dict[str, dict] = {}
        for item in overrides:
            key, value = parse_override(item)
            section, _, name = key.partition(".")
            changes.setdefault(section, {})[name] = value
        config = config.replace(**changes)
    build_mesh(config)  # logical devices first, before the data touches TensorFlow
    if config.train.eval_every and val_data is None:
        config = config.replace(train={"eval_every": 0})
    task = KerasTask(model_fn, loss)
    return Trainer(config, task=task, datasets=UserData(train_data, val_data), quiet=quiet).fit()
