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

**In a Keras model** (:class:`PositionalDropout`, and the dropout of
:class:`~phalanx.layers.transformer.TransformerBlock`) a dropping layer holds two
non-trainable variables that say where its call sits, an engine's per-call context
(:func:`call_context`):

* a seed state (a Keras ``SeedGenerator``'s ``[seed, calls]``): the key is
  ``fold(seed, calls)``, and a training call advances ``calls`` by one, so Keras's own
  ``fit`` draws new masks every step (:func:`is_step_seed`);
* the row offset: the index of the call's first row in the whole batch, 0 in a plain call
  (its rows are ``0..B-1``: the definition) (:func:`is_row_offset`).

An engine that runs a step as several calls (data replicas, micro-batches, pipeline stages)
gives every call the step's starting seed state and the global index of its first row:
every layout then draws the one-device masks, and the state ends the step one call ahead,
as on one device.

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

import keras
import tensorflow as tf

__all__ = ["fold", "keep_mask", "dropout", "fmix32", "PositionalDropout", "DropoutContext", "is_row_offset",
           "is_step_seed", "call_context", "set_calls"]

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


# -- in a Keras model: the context of a call --------------------------------------------------

_ROWS = "_phalanx_dropout_rows"  # set on a layer's row-offset variable
_SEED = "_phalanx_dropout_seed"  # set on a layer's seed-state variable


def is_row_offset(variable) -> bool:
    """Whether ``variable`` is a dropping layer's row offset (the call's first row in the batch)."""
    return getattr(variable, _ROWS, False)


def is_step_seed(variable) -> bool:
    """Whether ``variable`` is a dropping layer's seed state ``[seed, calls]`` (one call per step)."""
    return getattr(variable, _SEED, False)


def call_context(variable, row: int, step_start):
    """The value an engine gives ``variable`` (a dropping layer's context) for a call whose first
    row is global row ``row`` of the step's batch: the row offset, or the seed state the step
    started from (``step_start``); None for any other variable (it keeps its threaded value)."""
    if is_row_offset(variable):
        return tf.constant(row, variable.dtype)
    if is_step_seed(variable):
        return step_start
    return None


def set_calls(model, calls: int) -> None:
    """Set every dropping layer of ``model`` to have made ``calls`` training calls (its seed state
    ``[seed, calls]``): a run restored after ``calls`` steps draws the masks of the next one."""
    for v in model.non_trainable_variables:
        if is_step_seed(v):
            v.assign(tf.stack([tf.cast(v.value[0], v.dtype), tf.constant(calls, v.dtype)]))


class DropoutContext:
    """The two context variables of a dropping layer (module docstring), made on ``layer``:
    ``key()`` (in a training call: advances the seed state) and ``row_offset()``."""

    def __init__(self, layer, seed: int | None):
        # (seed None: a random one, as Keras's layers draw)
        self.generator = keras.random.SeedGenerator(None if seed is None else int(seed),
                                                    name=f"{layer.name}_dropout_seed")
        setattr(self.generator.state, _SEED, True)
        layer.dropout_seed_generator = self.generator  # tracked: its state is among the layer's variables
        self.rows = layer.add_weight(shape=(), initializer="zeros", dtype="int32", trainable=False,
                                     name="dropout_row_offset")
        setattr(self.rows, _ROWS, True)

    def key(self) -> tf.Tensor:
        state = self.generator.next()
        return fold(state[0], state[1])

    def row_offset(self) -> tf.Tensor:
        return tf.convert_to_tensor(self.rows)


@keras.saving.register_keras_serializable(package="phalanx")
class PositionalDropout(keras.layers.Layer):
    """Dropout of ``[B, T, D]`` by :func:`dropout`'s positional masks (training only): the mask of
    each element is a function of ``seed``, the training calls so far, and the element's global
    row, position and feature, so that every layout an engine runs draws the one-device masks
    (module docstring). Keras's ``Dropout`` draws a new mask per call instead.

    Example:
        >>> import numpy as np
        >>> layer = PositionalDropout(0.5, seed=1)
        >>> x = np.ones((2, 4, 8), "float32")
        >>> bool((layer(x) == x).numpy().all()), 0.2 < float((layer(x, training=True) == 0).numpy().mean()) < 0.8
        (True, True)
    """

    def __init__(self, rate: float, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"layer {self.name!r}: rate {rate!r} is not in [0, 1)")
        self.rate, self.seed = float(rate), int(seed)
        self.context = DropoutContext(self, self.seed)

    def call(self, inputs, training=None):
        if not (training and self.rate):
            return inputs
        return dropout(inputs, self.rate, self.context.key(), self.context.row_offset())

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "rate": self.rate, "seed": self.seed}
