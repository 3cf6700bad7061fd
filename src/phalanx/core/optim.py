"""AdamW (the one apply every engine uses) and the learning-rate schedule.

Kept apart from any Keras optimizer so that every engine (tf.distribute, mesh with
sharded optimizer states) applies the same update to whole or sharded variables, and
checkpoints hold optimizer state under the weights' logical names.

Example:
    >>> import tensorflow as tf
    >>> from phalanx.config import TrainConfig
    >>> round(float(learning_rate(tf.constant(0), TrainConfig(lr=1e-3, warmup=10, steps=100))), 8)
    0.0001
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


def apply_adamw(var, m, v, grad, *, step, lr, factor, finite, cfg: TrainConfig, decay: bool, mask=None):
    """One AdamW step, in place on the float32 variables ``var``, ``m`` and ``v``.

    The AdamW of Loshchilov & Hutter 2019 (decoupled weight decay), with the learning
    rate ``lr`` multiplying both terms (as PyTorch's ``AdamW``)::

        g = grad * factor
        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        var = var - lr (m / (1 - beta1^step) / (sqrt(v / (1 - beta2^step)) + eps) + wd var)

    ``step`` is the 1-based update count (bias correction), ``factor`` the clip factor
    over the loss scale, ``wd`` is ``cfg.weight_decay`` when ``decay`` else 0. When
    ``finite`` is false nothing changes (a float16 overflow step). ``mask`` (pruning):
    masked entries of ``var``, ``m`` and ``v`` are zeroed after the update.

    The one AdamW apply of phalanx: every engine that uses phalanx's AdamW calls it.
    The update is TensorFlow's fused ``ResourceApplyAdam`` kernel (one pass over
    ``var``, ``m``, ``v`` and the gradient, 8x faster on the reference GPT's 92M
    parameters than the same math as separate tensor ops: benchmarks/results/profile_gpt.md)
    after one multiply of ``var`` by ``1 - lr wd``. The bias corrections are computed
    here and handed to the kernel as its step size ``lr sqrt(c2) / c1`` and epsilon
    ``eps sqrt(c2)`` (with zero beta powers), which makes its ``lr' m / (sqrt(v) + eps')``
    the formula above; ``c = 1 - beta^step`` is taken as ``-expm1(step log1p(beta - 1))``,
    exact to float32 rounding even where ``1 - beta2^step`` is small (beta2 = 0.999,
    early steps), where float32 ``1 - pow(beta2, step)`` loses half its digits.
    Returns the op that runs the update (graph mode).
    """
    with tf.name_scope("adamw"):
        b1, b2 = cfg.beta1, cfg.beta2
        t = tf.cast(step, tf.float32)
        c1 = -tf.math.expm1(t * tf.math.log1p(tf.constant(b1, tf.float32) - 1.0))
        c2 = -tf.math.expm1(t * tf.math.log1p(tf.constant(b2, tf.float32) - 1.0))
        lr = tf.cast(lr, tf.float32)
        root_c2 = tf.sqrt(c2)
        step_size, eps = lr * root_c2 / c1, cfg.eps * root_c2
        zero = tf.constant(0.0, tf.float32)
        wd = cfg.weight_decay if decay else 0.0

        def update():
            decayed = [var.assign(var.read_value() * (1.0 - lr * wd), read_value=False)] if wd > 0 else []
            # the scaled gradient once the decay's temporary is gone: never both beside var
            with tf.control_dependencies([op for op in decayed if op is not None]):
                scaled = grad * tf.cast(factor, grad.dtype)
            tf.raw_ops.ResourceApplyAdam(
                var=var.handle, m=m.handle, v=v.handle, beta1_power=zero, beta2_power=zero, lr=step_size,
                beta1=tf.constant(b1, tf.float32), beta2=tf.constant(b2, tf.float32), epsilon=eps,
                grad=scaled, use_locking=False)
            if mask is not None:  # pruned: masked weights (and their moments) stay exactly zero
                for slot in (var, m, v):
                    slot.assign(slot.read_value() * mask)
            return tf.constant(True)

        return tf.cond(finite, update, lambda: tf.constant(False))


def global_norm(grads: list[tf.Tensor]) -> tf.Tensor:
    """sqrt of the sum of squares of all gradients, float32."""
    with tf.name_scope("global_norm"):
        return tf.sqrt(2.0 * tf.add_n([tf.nn.l2_loss(tf.cast(g, tf.float32)) for g in grads]))


def clip_factor(norm: tf.Tensor, clip_norm: float) -> tf.Tensor:
    """Multiplier that brings the global norm down to ``clip_norm`` (1 when below or disabled)."""
    if clip_norm <= 0:
        return tf.constant(1.0, tf.float32)
    return tf.minimum(1.0, clip_norm / tf.maximum(norm, 1e-12))


class StepScalars(NamedTuple):
    """What one optimizer step needs besides the gradients: see :func:`step_scalars`."""

    norm: tf.Tensor  # global gradient norm, unscaled (logged as grad_norm)
    finite: tf.Tensor  # whether it is finite (False: a float16 overflow, the step changes nothing)
    factor: tf.Tensor  # clip factor over the loss scale: multiplies the scaled gradients
    lr: tf.Tensor  # learning rate of this update
    count: tf.Tensor  # 1-based update count (AdamW's bias correction)
    scale: tf.Tensor  # the loss scale the gradients carry


def step_scalars(scaled_norm: tf.Tensor, scale: tf.Tensor, step: tf.Variable, cfg: TrainConfig) -> StepScalars:
    """The step's prologue, the same in every engine: from the global norm of the loss-scaled
    gradients (however an engine sums it over its shards), the unscaled norm, whether it is
    finite, the clip factor, the learning rate and the update count.

    Example:
        >>> from phalanx.config import TrainConfig
        >>> s = step_scalars(tf.constant(8.0), tf.constant(4.0), tf.Variable(0, dtype=tf.int64),
        ...                  TrainConfig(clip_norm=1.0, lr=1e-3, warmup=0, steps=10))
        >>> float(s.norm), float(s.factor), int(s.count)
        (2.0, 0.125, 1)
    """
    norm = scaled_norm / scale
    return StepScalars(norm=norm, finite=tf.math.is_finite(norm), factor=clip_factor(norm, cfg.clip_norm) / scale,
                       lr=learning_rate(step, cfg), count=step + 1, scale=scale)


def finish_step(s: StepScalars, step: tf.Variable, loss_scale) -> dict[str, tf.Tensor]:
    """The step's epilogue, after every update: count the update if it was applied, adjust the
    loss scale (:class:`~phalanx.core.loss_scale.LossScale`), and return the logged figures
    ``grad_norm``, ``skipped``, ``loss_scale`` and ``lr``."""
    step.assign_add(tf.cast(s.finite, tf.int64))
    loss_scale.update(s.finite)
    return {"grad_norm": s.norm, "skipped": 1.0 - tf.cast(s.finite, tf.float32), "loss_scale": s.scale, "lr": s.lr}
