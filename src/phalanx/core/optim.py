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
from phalanx.core.xla import fused


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


class AdamWScalars(NamedTuple):
    """The scalars of one AdamW update, the same for every variable: :func:`adamw_scalars`."""

    step_size: tf.Tensor  # lr sqrt(c2) / c1 (0 on a step that changes nothing)
    epsilon: tf.Tensor  # eps sqrt(c2)
    beta1: tf.Tensor  # cfg.beta1 (1 on a step that changes nothing)
    beta2: tf.Tensor  # cfg.beta2 (1 on a step that changes nothing)
    factor: tf.Tensor  # the gradients' multiplier (0 on a step that changes nothing)
    lr: tf.Tensor  # the weight decay's learning rate (0 on a step that changes nothing)


def adamw_scalars(step, lr, factor, finite, cfg: TrainConfig) -> AdamWScalars:
    """The scalars :func:`apply_adamw` hands the fused kernel, computed once for every variable
    of a step (see there). When ``finite`` is false they make the update change nothing:
    learning rate 0, betas 1 (``m += (g - m)(1 - beta1)`` keeps ``m``) and gradient factor 0
    (``multiply_no_nan``: 0 even for an infinite or NaN gradient).

    Example:
        >>> s = adamw_scalars(tf.constant(1), 1e-3, 0.5, tf.constant(True), TrainConfig(beta1=0.9, beta2=0.95))
        >>> round(float(s.step_size), 6), float(s.factor)
        (0.002236, 0.5)
        >>> float(adamw_scalars(tf.constant(1), 1e-3, 0.5, tf.constant(False), TrainConfig()).beta1)
        1.0
    """
    with tf.name_scope("adamw_scalars"):
        b1, b2 = cfg.beta1, cfg.beta2
        t = tf.cast(step, tf.float32)
        c1 = -tf.math.expm1(t * tf.math.log1p(tf.constant(b1, tf.float32) - 1.0))
        c2 = -tf.math.expm1(t * tf.math.log1p(tf.constant(b2, tf.float32) - 1.0))
        finite = tf.convert_to_tensor(finite, tf.bool)
        lr = tf.where(finite, tf.cast(lr, tf.float32), 0.0)
        root_c2 = tf.sqrt(c2)
        one = tf.constant(1.0, tf.float32)
        return AdamWScalars(step_size=lr * root_c2 / c1, epsilon=cfg.eps * root_c2,
                            beta1=tf.where(finite, tf.constant(b1, tf.float32), one),
                            beta2=tf.where(finite, tf.constant(b2, tf.float32), one),
                            factor=tf.where(finite, tf.cast(factor, tf.float32), 0.0), lr=lr)


def apply_adamw(var, m, v, grad, *, cfg: TrainConfig, decay: bool, mask=None, step=None, lr=None, factor=None,
                finite=None, scalars: AdamWScalars | None = None):
    """One AdamW step, in place on the float32 variables ``var``, ``m`` and ``v``.

    The AdamW of Loshchilov & Hutter 2019 (decoupled weight decay), with the learning
    rate ``lr`` multiplying both terms (as PyTorch's ``AdamW``)::

        g = grad * factor
        m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
        var = var - lr (m / (1 - beta1^step) / (sqrt(v / (1 - beta2^step)) + eps) + wd var)

    ``step`` is the 1-based update count (bias correction), ``factor`` the clip factor
    over the loss scale, ``wd`` is ``cfg.weight_decay`` when ``decay`` else 0. When
    ``finite`` is false nothing changes (a float16 overflow step). ``mask`` (pruning):
    masked entries of ``var``, ``m`` and ``v`` are zeroed after the update. ``scalars``
    (:func:`adamw_scalars` of ``step``, ``lr``, ``factor``, ``finite``) in their place: one
    set for every variable of a step.

    The one AdamW apply of phalanx: every engine that uses phalanx's AdamW calls it.
    The update is one XLA kernel per variable (:func:`phalanx.core.xla.fused`): it reads
    ``var``, ``m``, ``v`` and the gradient once and writes the three back, the decay, the
    gradient factor and the mask inside (16 against 34 ms in a profiled bfloat16 step of the
    2-layer reference GPT, where TensorFlow's ``ResourceApplyAdam`` followed a separate decay
    multiply and gradient scaling: benchmarks/results/fused_step_2026-11-28.md; one grouped
    update over all variables measured slower than per-variable kernels). Its arithmetic is
    ``ResourceApplyAdam``'s::

        m += (g - m)(1 - beta1);   v += (g^2 - v)(1 - beta2);   var -= lr' m / (sqrt(v) + eps')

    with ``var`` first multiplied by ``1 - lr wd``, ``lr' = lr sqrt(c2) / c1`` and ``eps' = eps
    sqrt(c2)``, which is the formula above; ``c = 1 - beta^step`` is taken as
    ``-expm1(step log1p(beta - 1))``, exact to float32 rounding even where ``1 - beta2^step`` is
    small (beta2 = 0.999, early steps), where float32 ``1 - pow(beta2, step)`` loses half its
    digits. A step that changes nothing runs the same kernel with scalars that keep every value
    (no ``tf.cond``: a branch per variable was most of a large model's optimizer graph and its
    build time). Runs the update (in a traced step, ordered by the automatic control
    dependencies on the variables).
    """
    with tf.name_scope("adamw"):
        if scalars is None:
            scalars = adamw_scalars(step, lr, factor, finite, cfg)
        wd = cfg.weight_decay if decay else 0.0
        keep = 1.0 - scalars.lr * wd  # the decay's multiplier (1 without decay)
        grad = tf.cast(grad, tf.float32)
        # the variables' handles, not the variables: one trace for every variable (XLA compiles
        # once per shape), and nothing of a variable is kept in the trace
        handles = [x.handle for x in (var, m, v)]
        hyper = (keep, scalars.step_size, scalars.epsilon, scalars.beta1, scalars.beta2, scalars.factor)
        if mask is None:
            return _adamw_kernel(*handles, grad, *hyper)
        mask = mask.read_value() if isinstance(mask, tf.Variable) else tf.convert_to_tensor(mask, tf.float32)
        return _masked_adamw_kernel(*handles, grad, *hyper, mask)


def _adamw_values(handles, grad, keep, step_size, epsilon, beta1, beta2, factor):
    """The new ``(var, m, v)`` of one AdamW step (:func:`apply_adamw`) from the float32 variables
    behind ``handles``."""
    var, m, v = (tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32) for h in handles)
    g = tf.math.multiply_no_nan(grad, factor)  # 0 for any gradient when factor is 0 (a skipped step)
    m = m + (g - m) * (1.0 - beta1)
    v = v + (g * g - v) * (1.0 - beta2)
    return var * keep - step_size * m / (tf.sqrt(v) + epsilon), m, v


@fused
def _adamw_kernel(var, m, v, grad, keep, step_size, epsilon, beta1, beta2, factor):
    handles = (var, m, v)
    for h, value in zip(handles, _adamw_values(handles, grad, keep, step_size, epsilon, beta1, beta2, factor)):
        tf.raw_ops.AssignVariableOp(resource=h, value=value)


@fused
def _masked_adamw_kernel(var, m, v, grad, keep, step_size, epsilon, beta1, beta2, factor, mask):
    # pruned: masked weights (and their moments) stay exactly zero
    handles = (var, m, v)
    for h, value in zip(handles, _adamw_values(handles, grad, keep, step_size, epsilon, beta1, beta2, factor)):
        tf.raw_ops.AssignVariableOp(resource=h, value=value * mask)


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
