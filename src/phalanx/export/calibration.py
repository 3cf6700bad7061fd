"""Calibration batches for full-integer int8: the representative dataset of the converter.

For a run directory they come from the run's own input pipeline
(:func:`phalanx.data.pipeline.make_datasets`), from the *training* split so the held-out
split that the report scores stays unseen; for a user's model, from the data the caller
gives. Every batch is run through the float model by the converter to record activation
ranges.

Example:
    >>> import numpy as np
    >>> rep = from_arrays(np.ones([10, 3], "float32"), batches=2, batch_size=4)
    >>> [b[0].shape for b in rep()]
    [(4, 3), (4, 3)]
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from phalanx.config import ConfigError

DEFAULT_BATCHES = 8


def check_batches(n: int, key: str = "--calibration-batches") -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(key, f"must be an integer >= 1, got {n!r}")
    return n


def from_run(datasets, batches: int) -> Callable[[], Iterable[list[np.ndarray]]]:
    """``batches`` training batches of the run's pipeline, inputs only (``[:, :-1]``)."""
    check_batches(batches)
    cached: list[np.ndarray] = []
    for i, batch in enumerate(datasets.train):
        if i >= batches:
            break
        cached.append(np.asarray(batch)[:, :-1].astype(np.int32))

    def representative():
        for tokens in cached:
            yield [tokens]
    return representative


def from_arrays(x, batches: int, batch_size: int = 32) -> Callable[[], Iterable[list[np.ndarray]]]:
    """Up to ``batches`` slices of ``batch_size`` rows of the input array(s) ``x``."""
    check_batches(batches, "calibration_batches")
    inputs = x if isinstance(x, (list, tuple)) else [x]
    inputs = [np.asarray(a) for a in inputs]
    n = len(inputs[0])
    if n == 0:
        raise ConfigError("calibration_data", "is empty; int8 needs at least one batch of inputs")
    chunks = [(s, min(s + batch_size, n)) for s in range(0, n, batch_size)][:batches]

    def representative():
        for s, e in chunks:
            yield [a[s:e] for a in inputs]
    return representative


def from_user(data, batches: int, batch_size: int = 32) -> Callable[[], Iterable[list[np.ndarray]]]:
    """Calibration from what a caller gives: a ``tf.data.Dataset`` (of inputs or of
    ``(x, y)`` pairs), a NumPy array (or list of arrays) of inputs, or an ``(x, y)`` tuple."""
    if data is None:
        raise ConfigError("calibration_data", "quantize='int8' (full-integer) calibrates activation ranges on "
                                              "real inputs: pass calibration_data= (a tf.data.Dataset of "
                                              "batches, or an array of inputs), or use quantize='int8-dynamic', "
                                              "which needs none")
    check_batches(batches, "calibration_batches")
    try:
        import tensorflow as tf
        is_dataset = isinstance(data, tf.data.Dataset)
    except ImportError:  # pragma: no cover
        is_dataset = False
    if is_dataset:
        cached = []
        for item in data.take(batches):
            x = item[0] if isinstance(item, tuple) else item
            cached.append([np.asarray(t) for t in (x if isinstance(x, (list, tuple)) else [x])])
        if not cached:
            raise ConfigError("calibration_data", "the dataset yielded no batch")

        def representative():
            yield from cached
        return representative
    if isinstance(data, tuple) and len(data) == 2 and not isinstance(data[0], (int, float)):
        data = data[0]  # (x, y): calibration needs the inputs only
    return from_arrays(data, batches, batch_size)
