"""The element-wise pieces of a transformer's math, as one swappable set of functions.

The parallel layers (:mod:`~phalanx.layers.attention`, :mod:`~phalanx.layers.tensor_parallel`,
:mod:`~phalanx.layers.transformer`) compute their matmuls themselves and take the pieces
between them — LayerNorm, bias + activation, the causal softmax and the token
cross-entropy — from a :class:`Kernels`. :data:`PLAIN` is TensorFlow's ordinary ops, with the
numerics of the Keras / keras-hub layers these layers replace (float32 softmax with an
additive mask, ``tf.nn.moments`` LayerNorm). phalanx's GPT runs the fused XLA kernels of
:mod:`phalanx.models.gpt_ops` instead (:class:`phalanx.models.transformer.FusedKernels`):
the same functions of the same inputs, measured 15-25% faster in bfloat16. A layer takes its
kernels as a constructor argument (saved in its config when not :data:`PLAIN`).

Example:
    >>> import numpy as np
    >>> y = PLAIN.layer_norm(np.array([[1.0, 2.0, 3.0]], "float32"), np.ones(3, "float32"),
    ...                      np.zeros(3, "float32"), 1e-5)
    >>> [round(float(v), 4) for v in y[0]]
    [-1.2247, 0.0, 1.2247]
"""

from __future__ import annotations

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="phalanx")
def gelu_approximate(x):
    """GELU, tanh approximation (GPT-2's; Keras's ``"gelu"`` is the exact erf form)."""
    return tf.nn.gelu(x, approximate=True)


@keras.saving.register_keras_serializable(package="phalanx")
class Kernels:
    """TensorFlow's ordinary ops for the element-wise pieces (see the module docstring).

    A subclass overrides any of the methods with faster kernels of the same math; it must
    be registered with ``keras.saving.register_keras_serializable`` and take no arguments,
    so a layer holding it saves and loads.
    """

    def layer_norm(self, x, gamma, beta, epsilon: float):
        """LayerNorm over the last axis, statistics in float32; the result in ``x``'s dtype."""
        x = tf.convert_to_tensor(x)
        x32 = tf.cast(x, tf.float32)
        mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
        y = (x32 - mean) * tf.math.rsqrt(var + epsilon)
        return tf.cast(y * tf.cast(gamma, tf.float32) + tf.cast(beta, tf.float32), x.dtype)

    def add_layer_norm(self, x, y, bias, gamma, beta, epsilon: float):
        """``(s, layer_norm(s))`` for the residual sum ``s = x + (y + bias)`` (``bias`` may be
        None), both in ``x``'s dtype: a pre-LN block's residual add and the next LayerNorm."""
        x = tf.convert_to_tensor(x)
        y = tf.cast(y, x.dtype)
        s = x + (y if bias is None else y + tf.cast(bias, x.dtype))
        return s, self.layer_norm(s, gamma, beta, epsilon)

    def bias_activation(self, h, bias, activation):
        """``activation(h + bias)`` (``bias`` may be None), in ``h``'s dtype."""
        return activation(h if bias is None else h + tf.cast(bias, h.dtype))

    def causal_softmax(self, scores):
        """Softmax over the last axis of ``scores [..., T, T]`` with the causal mask (query
        ``i`` sees keys ``<= i``), computed in float32, returned in ``scores``' dtype."""
        t = tf.shape(scores)[-1]
        i = tf.range(t)
        visible = i[:, None] >= i[None, :]
        probs = tf.nn.softmax(tf.where(visible, tf.cast(scores, tf.float32), -1e9), axis=-1)
        return tf.cast(probs, scores.dtype)

    def cross_entropy(self, logits, targets):
        """Per-token cross-entropy (float32) of ``logits [..., V]`` against ``targets [...]``."""
        return tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(targets, tf.int32),
                                                              tf.cast(logits, tf.float32))

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))

    def __repr__(self):
        return f"{type(self).__name__}()"


PLAIN = Kernels()


def get(kernels) -> Kernels:
    """``kernels`` as a :class:`Kernels`: None is :data:`PLAIN`, a dict a serialised one."""
    if kernels is None:
        return PLAIN
    if isinstance(kernels, dict):
        kernels = keras.saving.deserialize_keras_object(kernels)
    if not isinstance(kernels, Kernels):
        raise ValueError(f"kernels: expected a phalanx.layers.kernels.Kernels, got {type(kernels).__name__}")
    return kernels


def serialize(kernels: Kernels):
    """A layer's config entry for ``kernels``: None for :data:`PLAIN`."""
    return None if kernels == PLAIN else keras.saving.serialize_keras_object(kernels)
