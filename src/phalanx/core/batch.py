"""Cutting a batch (any nest of tensors sharing a leading axis) into rows and micro-batches.

Example:
    >>> import numpy as np
    >>> micro = split_batch((np.arange(8).reshape(4, 2), np.arange(4)), 2)
    >>> [t.shape.as_list() for t in micro], take(micro, 1)[1].numpy().tolist()
    ([[2, 2, 2], [2, 2]], [2, 3])
    >>> rows(np.arange(6), 2, 3).tolist()
    [2, 3, 4]
"""

from __future__ import annotations

import tensorflow as tf


def split_batch(batch, parts: int):
    """Split every tensor of a (nested) batch into ``parts`` equal pieces along axis 0,
    returning a nest whose tensors have a new leading axis of size ``parts``."""
    def split(t):
        shape = tf.shape(t)
        return tf.reshape(t, tf.concat([[parts, shape[0] // parts], shape[1:]], 0))
    return tf.nest.map_structure(split, batch)


def take(batch, index):
    """Piece ``index`` of a :func:`split_batch` nest."""
    return tf.nest.map_structure(lambda t: t[index], batch)


def rows(batch, start, size):
    """Rows ``[start, start + size)`` of every tensor of the nest."""
    return tf.nest.map_structure(lambda t: t[start:start + size], batch)
