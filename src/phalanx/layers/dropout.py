"""Dropout masks that are a function of where an element sits in the logical tensor.

A stateful generator (``keras.layers.Dropout``, a ``SeedGenerator`` per call) draws a mask
for the tensor it is handed: a micro-batch, one replica's rows or one sequence chunk each
get their own draw, so the masks, and the training run, depend on how the batch and the
sequence were cut. Here the mask is a pure function of a key and of each element's
*global* coordinates ``(row, position, feature)`` in the logical ``[B, T, D]`` tensor::

    keep[row, pos, f] = fmix32(h(key, row, pos) + g(f)) >= round(rate * 2**32)

(``fmix32``: MurmurHash3's 32-bit finaliser, a bijection with full avalanche;
``h(key, row, pos) = fmix32(fmix32(key ^ fmix32(row)) ^ fmix32(pos ^ C))``, ``g(f) =
fmix32(f * 0x9E3779B9)``). A shard that holds rows ``[r0, r0 + b)`` and positions ``[p0,
p0 + t)`` computes exactly its own elements: one device, a micro-batch of a pipeline, a data
replica, a sequence-parallel chunk — all draw the masks of the whole run's tensor, at the
cost of their own elements only (no whole tensor is drawn anywhere). Re-running a forward
(activation recomputation) draws the same mask by construction.

The key folds the run's seed, the optimizer step, the layer and the site within it
(:func:`fold`), so every step and every dropout site draws a new mask.

Example:
    >>> import numpy as np, tensorflow as tf
    >>> key = fold(0, 5, 1)                      # seed 0, step 5, site 1
    >>> x = tf.ones([4, 6, 8])
    >>> whole = dropout(x, 0.5, key).numpy()
    >>> part = dropout(x[2:, 3:], 0.5, key, row_offset=2, position_offset=3).numpy()
    >>> bool((whole[2:, 3:] == part).all()), 0.3 < float((whole == 0).mean()) < 0.7
    (True, True)
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["fold", "keep_mask", "dropout", "fmix32"]

_M1, _M2, _GOLDEN, _POS = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9, 0x7F4A7C15


def _u32(value) -> tf.Tensor:
    """``value`` (Python int or integer tensor, any sign or width) modulo 2**32, as uint32."""
    if isinstance(value, int):
        return tf.constant(value & 0xFFFFFFFF, tf.uint32)
    value = tf.convert_to_tensor(value)
    if value.dtype == tf.uint32:
        return value
    return tf.cast(tf.bitwise.bitwise_and(tf.cast(value, tf.int64), 0xFFFFFFFF), tf.uint32)


def _arange(n) -> tf.Tensor:
    return tf.cast(tf.range(n), tf.uint32)  # (no uint32 Range kernel on CPU)


def fmix32(h: tf.Tensor) -> tf.Tensor:
    """MurmurHash3's finaliser on uint32 (wrapping arithmetic): a bijection of 32-bit words
    in which every input bit flips each output bit with probability ~1/2."""
    xor, shift = tf.bitwise.bitwise_xor, tf.bitwise.right_shift
    h = xor(h, shift(h, tf.constant(16, tf.uint32))) * tf.constant(_M1, tf.uint32)
    h = xor(h, shift(h, tf.constant(13, tf.uint32))) * tf.constant(_M2, tf.uint32)
    return xor(h, shift(h, tf.constant(16, tf.uint32)))


def fold(*words) -> tf.Tensor:
    """One uint32 key from ``words`` (ints or integer tensors: the seed, the step, the layer,
    the site, ...), order-sensitive: ``fold(a, b) != fold(b, a)``."""
    h = tf.constant(_GOLDEN, tf.uint32)
    for w in words:
        h = fmix32(tf.bitwise.bitwise_xor(h, fmix32(_u32(w) + tf.constant(_GOLDEN, tf.uint32))) +
                   tf.constant(_POS, tf.uint32))
    return h


def keep_mask(key, shape, rate: float, row_offset=0, position_offset=0) -> tf.Tensor:
    """Boolean ``shape`` ``[b, t, d]``: which elements of rows ``[row_offset, row_offset + b)``
    and positions ``[position_offset, position_offset + t)`` of the logical tensor survive
    dropout at ``rate`` under ``key`` (see the module docstring)."""
    if len(shape) != 3:
        raise ValueError(f"keep_mask: shape must be [batch, positions, features], got {list(shape)}")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"keep_mask: rate {rate!r} is not in [0, 1)")
    b, t, d = shape
    key = _u32(key)
    rows = _u32(row_offset) + _arange(b)
    positions = _u32(position_offset) + _arange(t)
    h_row = fmix32(tf.bitwise.bitwise_xor(key, fmix32(rows)))                       # [b]
    h_pos = fmix32(tf.bitwise.bitwise_xor(positions, tf.constant(_POS, tf.uint32)))  # [t]
    h = fmix32(tf.bitwise.bitwise_xor(h_row[:, None], h_pos[None, :]))              # [b, t]
    g = fmix32(_arange(d) * tf.constant(_GOLDEN, tf.uint32))     # [d]
    bits = fmix32(h[:, :, None] + g[None, None, :])
    threshold = min(int(round(rate * 2.0 ** 32)), 0xFFFFFFFF)
    return bits >= tf.constant(threshold, tf.uint32)


def dropout(x, rate: float, key, row_offset=0, position_offset=0):
    """``x [b, t, d]`` with the elements :func:`keep_mask` drops set to 0 and the rest scaled by
    ``1 / (1 - rate)``; ``x`` itself when ``rate`` is 0. The scaling is done in float32 and
    rounded once to ``x``'s dtype (``1/0.9`` rounded to bfloat16 first would be 0.2% off)."""
    x = tf.convert_to_tensor(x)
    if not rate:
        return x
    with tf.name_scope("dropout"):
        shape = [x.shape[i] if x.shape[i] is not None else tf.shape(x)[i] for i in range(3)]
        keep = keep_mask(key, shape, rate, row_offset, position_offset)
        scale = tf.cast(keep, tf.float32) * (1.0 / (1.0 - rate))
        if x.dtype == tf.float32:
            return x * scale
        return tf.cast(tf.cast(x, tf.float32) * scale, x.dtype)
