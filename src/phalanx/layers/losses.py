"""Token cross-entropy that reads the logits in their own dtype: fused kernels and a Keras loss.

Keras's ``SparseCategoricalCrossentropy`` converts ``y_pred`` to its own dtype (float32) before
anything else, so under ``mixed_bfloat16`` a language model's loss head first writes a float32
copy of the whole ``[tokens, vocab]`` logits, and its gradient passes through a float32
``[tokens, vocab]`` tensor and a cast back. :func:`token_cross_entropy` reads the logits as they
are (bfloat16 or float32) in one XLA kernel that computes the log-sum-exp and the target logit
in float32, and its gradient ``softmax - onehot`` is one kernel too, written in the logits'
dtype: two passes over the logits instead of six. :class:`TokenCrossEntropy` is the same as a
Keras loss (what phalanx's GPT is compiled with), a ``SparseCategoricalCrossentropy(from_logits=True)``
in everything but where the float32 conversion happens.

Example:
    >>> import numpy as np
    >>> z = np.array([[[2.0, 0.0, -1.0]]], "float32")
    >>> round(float(token_cross_entropy(z, np.array([[0]]))[0, 0]), 4)
    0.1698
    >>> round(float(TokenCrossEntropy()(np.array([[0]]), tf.cast(z, tf.bfloat16))), 4)
    0.1698
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.backend import get_keras_mask  # as Loss.__call__ reads y_pred's mask; no public API
from keras.src.losses.loss import reduce_weighted_values  # Keras's own reduction

from phalanx.core.xla import fused

_F32 = tf.float32


@fused
def _cross_entropy_fwd(logits, targets):
    z = tf.cast(logits, _F32)
    top = tf.reduce_max(z, axis=-1)
    lse = tf.math.log(tf.reduce_sum(tf.exp(z - top[:, None]), axis=-1)) + top
    target = tf.reduce_sum(tf.where(tf.range(tf.shape(z)[-1])[None, :] == targets[:, None], z, 0.0), axis=-1)
    return lse - target, lse


@fused
def _cross_entropy_bwd(dloss, logits, targets, lse):
    z = tf.cast(logits, _F32)
    hit = tf.cast(tf.range(tf.shape(z)[-1])[None, :] == targets[:, None], _F32)
    return tf.cast((tf.exp(z - lse[:, None]) - hit) * dloss[:, None], logits.dtype)


@tf.custom_gradient
def _cross_entropy(logits, targets):
    loss, lse = _cross_entropy_fwd(logits, targets)

    def grad(dloss):
        return _cross_entropy_bwd(dloss, logits, targets, lse), None

    return loss, grad


def token_cross_entropy(logits, targets) -> tf.Tensor:
    """Per-token cross-entropy ``logsumexp(z) - z[target]`` in float32, shape of ``targets``.

    The logits ``[..., V]`` stay in their dtype (no float32 copy of ``[tokens, V]``); the
    log-sum-exp and the gradient are computed in float32 inside the fused kernels, the gradient
    rounded once to the logits' dtype. Targets must lie in ``[0, V)`` (the caller checks).
    """
    with tf.name_scope("cross_entropy"):
        logits = tf.convert_to_tensor(logits)
        targets = tf.cast(targets, tf.int32)
        rows = tf.reshape(logits, [-1, logits.shape[-1]])
        loss = _cross_entropy(rows, tf.reshape(targets, [-1]))
        return tf.reshape(loss, tf.shape(targets))


@keras.saving.register_keras_serializable(package="phalanx")
class TokenCrossEntropy(keras.losses.SparseCategoricalCrossentropy):
    """``SparseCategoricalCrossentropy(from_logits=True)`` that reads ``y_pred`` in its own dtype
    (:func:`token_cross_entropy`): the same loss, reductions and sample weights, without the
    float32 copy of the logits Keras's makes under a mixed policy. Still a
    ``SparseCategoricalCrossentropy`` (with ``from_logits=True``, last axis), so a
    vocabulary-parallel head's shard logits are read as Keras's would be.

    Example:
        >>> import numpy as np
        >>> z = np.random.default_rng(0).normal(size=(2, 3, 5)).astype("float32")
        >>> y = np.array([[1, 4, 0], [2, 2, 3]])
        >>> ref = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, z)
        >>> bool(abs(float(TokenCrossEntropy()(y, z)) - float(ref)) < 1e-6)
        True
    """

    def __init__(self, reduction="sum_over_batch_size", name="token_cross_entropy", dtype=None):
        super().__init__(from_logits=True, reduction=reduction, name=name, dtype=dtype)

    def __call__(self, y_true, y_pred, sample_weight=None):
        # Loss.__call__ would convert y_pred to self.dtype (float32): the copy this loss avoids.
        in_mask = get_keras_mask(y_pred)
        with tf.name_scope(self.name):
            y_pred = tf.convert_to_tensor(y_pred)
            if not y_pred.dtype.is_floating:
                raise ValueError(f"TokenCrossEntropy: y_pred must be floating-point logits, got {y_pred.dtype.name}")
            labels = tf.convert_to_tensor(y_true)
            if labels.shape.rank == y_pred.shape.rank and labels.shape[-1] == 1:
                labels = tf.squeeze(labels, axis=-1)
            labels = tf.cast(labels, tf.int32)
            vocab = int(y_pred.shape[-1])
            # tf.nn.sparse_softmax_cross_entropy_with_logits refuses such labels on a CPU; the
            # kernel would silently give them the log-sum-exp alone.
            checks = [tf.debugging.assert_non_negative(labels, message=f"y: labels must be in [0, {vocab})"),
                      tf.debugging.assert_less(labels, vocab, message=f"y: labels must be in [0, {vocab})")]
            with tf.control_dependencies(checks):
                losses = token_cross_entropy(y_pred, labels)
            return reduce_weighted_values(losses, sample_weight=sample_weight, mask=in_mask, reduction=self.reduction,
                                          dtype=self.dtype)

    def call(self, y_true, y_pred):
        return token_cross_entropy(y_pred, y_true)

    def get_config(self):
        return {"reduction": self.reduction, "name": self.name, "dtype": self.dtype}
