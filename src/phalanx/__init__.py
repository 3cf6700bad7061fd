"""phalanx: data, tensor and pipeline parallel training on TensorFlow 2 and Keras 3.

The Python API in a few lines (any Keras 3 model and loss, through the same trainer
as ``phalanx train``):

    >>> import keras, numpy as np, tensorflow as tf, phalanx           # doctest: +SKIP
    >>> x = np.random.rand(256, 8).astype("float32"); y = x.sum(1, keepdims=True)
    >>> data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
    >>> summary = phalanx.fit(lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)]),
    ...                       keras.losses.MeanSquaredError(), data,
    ...                       overrides=["train.steps=50", "train.global_batch=32", "run.dir=/tmp/fit"])

Names are imported lazily so that ``import phalanx`` does not start TensorFlow.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Config": ("phalanx.config", "Config"),
    "ConfigError": ("phalanx.config", "ConfigError"),
    "load_config": ("phalanx.config", "load_config"),
    "Mesh": ("phalanx.mesh", "Mesh"),
    "build_mesh": ("phalanx.mesh", "build_mesh"),
    "Trainer": ("phalanx.train.trainer", "Trainer"),
    "fit": ("phalanx.api", "fit"),
    "parallelize": ("phalanx.parallel.apply", "parallelize"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
