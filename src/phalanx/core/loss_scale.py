"""Dynamic loss scaling for ``precision.policy=mixed_float16`` (a fixed 1.0 otherwise).

Every engine keeps one :class:`LossScale`: the step multiplies the loss by ``scale``,
divides the gradients by it, and calls :meth:`LossScale.update` with whether the
gradients were finite. Its state is checkpointed under ``loss_scale/scale``,
``loss_scale/good_steps`` and ``loss_scale/skipped`` (docs/DESIGN.md).

Example:
    >>> import tensorflow as tf
    >>> from phalanx.config import Config
    >>> ls = LossScale(Config().replace(precision={"policy": "mixed_float16", "loss_scale_init": 8.0}))
    >>> ls.update(tf.constant(False)); float(ls.scale.numpy()), int(ls.skipped.numpy())
    (4.0, 1)
"""

from __future__ import annotations

import tensorflow as tf

from phalanx.config import Config


class LossScale:
    """Dynamic loss scaling state for float16 (a fixed 1.0 otherwise).

    The variables are created in the caller's scope (a strategy scope, or the device of
    mesh position (0, 0, 0)), so every replica reads the same scale.
    """

    def __init__(self, cfg: Config):
        p = cfg.precision
        self.dynamic = p.policy == "mixed_float16"
        self.growth_interval = p.loss_scale_growth_interval
        self.scale = tf.Variable(p.loss_scale_init if self.dynamic else 1.0, trainable=False,
                                 dtype=tf.float32, name="loss_scale")
        self.good_steps = tf.Variable(0, trainable=False, dtype=tf.int64, name="good_steps")
        self.skipped = tf.Variable(0, trainable=False, dtype=tf.int64, name="skipped_steps")

    def update(self, finite: tf.Tensor) -> None:
        """Halve on overflow (and count the skip); double after ``growth_interval`` good steps."""
        if not self.dynamic:
            return
        good = tf.where(finite, self.good_steps + 1, tf.zeros_like(self.good_steps))
        grow = good >= self.growth_interval
        new_scale = tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale),
                             tf.maximum(self.scale / 2.0, 1.0))
        self.scale.assign(new_scale)
        self.good_steps.assign(tf.where(grow, tf.zeros_like(good), good))
        self.skipped.assign_add(tf.cast(tf.logical_not(finite), tf.int64))

    def state(self) -> dict[str, tf.Variable]:
        return {"loss_scale/scale": self.scale, "loss_scale/good_steps": self.good_steps,
                "loss_scale/skipped": self.skipped}
