"""Element-wise work as one XLA kernel: the one switch and decorator every fused kernel uses.

A chain of element-wise TensorFlow ops is one pass over memory per op; compiled by XLA it is
one pass. phalanx compiles the element-wise pieces between matmuls (LayerNorm, bias + GELU,
the loss head, the attention softmax's backward: :mod:`phalanx.layers.kernels`) and the AdamW
update (:func:`phalanx.core.optim.apply_adamw`) this way; the matmuls stay out of XLA
(oneDNN's are faster on CPU).

Example:
    >>> import tensorflow as tf
    >>> double_plus_one = fused(lambda x: 2.0 * x + 1.0)
    >>> float(double_plus_one(tf.constant(3.0)))
    7.0
"""

from __future__ import annotations

import os

import tensorflow as tf

# PHALANX_XLA_KERNELS=0 runs the fused kernels as ordinary TensorFlow ops (same math and
# gradients, unfused): for a platform without XLA, or to measure what the fusion buys.
XLA_KERNELS = os.environ.get("PHALANX_XLA_KERNELS", "1").strip().lower() not in ("0", "false", "no")


def fused(fn):
    """``fn`` as one XLA kernel (compiled once per input shape, dtype and Python argument):
    the element-wise work in one pass over memory."""
    return tf.function(fn, jit_compile=XLA_KERNELS, autograph=False)
