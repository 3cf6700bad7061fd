"""AdamW update math and the learning-rate schedule, as plain tensor functions.

Kept apart from any Keras optimizer so that every engine (tf.distribute, mesh with
sharded optimizer states) applies the same update to whole or sharded tensors, and
checkpoints hold optimizer state under the weights' logical names.

Example:
    >>> import tensorflow as tf
    >>> from phalanx.config import TrainConfig
    >>> float(learning_rate(tf.constant(0), TrainConfig(lr=1e-3, warmup=10, steps=100)))
    0.0001
"""

from __future__ import annotations

import math

import tensorflow as tf

from phalanx.config import TrainConfig


def learning_rate(step: tf.Tensor, cfg: TrainConfig) -> tf.Tensor:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine to ``lr * min_lr_ratio``.

    ``step`` counts optimizer updates already applied (0 for the first update).
    """
    step = tf.cast(step, tf.float32)
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warm = peak * (step + 1.0) / float(max(cfg.warmup, 1))
    decay_steps = float(max(cfg.steps - cfg.warmup, 1))
    progress = tf.clip_by_value((step - cfg.warmup) / decay_steps, 0.0, 1.0)
    cosine = floor + 0.5 * (peak - floor) * (1.0 + tf.cos(math.pi * progress))
    return tf.where(step < cfg.warmup, warm, cosine)


def adamw_update(param, grad, m, v, step, lr, cfg: TrainConfig, decay: bool):
    """One AdamW step (Loshchilov & Hutter 2019, decoupled weight decay) on tensors.

    ``step`` is the 1-based update count for bias correction. Returns the new
    ``(param, m, v)``; all float32.
    """
    b1, b2 = cfg.beta1, cfg.beta2
    m = b1 * m + (1.0 - b1) * grad
    v = b2 * v + (1.0 - b2) * tf.square(grad)
    step = tf.cast(step, tf.float32)
    m_hat = m / (1.0 - tf.pow(b1, step))
    v_hat = v / (1.0 - tf.pow(b2, step))
    update = m_hat / (tf.sqrt(v_hat) + cfg.eps)
    if decay and cfg.weight_decay > 0:
        update = update + cfg.weight_decay * param
    return param - lr * update, m, v


def global_norm(grads: list[tf.Tensor]) -> tf.Tensor:
    """sqrt of the sum of squares of all gradients, float32."""
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads]))


def clip_factor(norm: tf.Tensor, clip_norm: float) -> tf.Tensor:
    """Multiplier that brings the global norm down to ``clip_norm`` (1 when below or disabled)."""
    if clip_norm <= 0:
        return tf.constant(1.0, tf.float32)
    return tf.minimum(1.0, clip_norm / tf.maximum(norm, 1e-12))
