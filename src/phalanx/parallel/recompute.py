"""Activation recomputation (``parallel.recompute``) with ``tf.recompute_grad``.

* ``none``: keep every activation for the backward;
* ``full``: keep only each block's input; the whole block is recomputed in the
  backward (Chen et al. 2016, "Training deep nets with sublinear memory cost");
* ``selective``: recompute only the attention core (scores, softmax, weighted sum),
  whose ``[batch, heads, seq, seq]`` tensors dominate activation memory at long
  sequence lengths for little compute (Korthikanti et al. 2022).

Example:
    >>> import tensorflow as tf
    >>> f = wrap_block(lambda x, w: x * w, "full")
    >>> float(f(tf.constant(2.0), tf.constant(3.0)))
    6.0
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from phalanx.config import RECOMPUTE
from phalanx.models import gpt_ops


def check_mode(mode: str) -> None:
    if mode not in RECOMPUTE:
        raise ValueError(f"parallel.recompute={mode!r} is not valid; choose one of: {', '.join(RECOMPUTE)}")


def wrap_block(fn: Callable, mode: str) -> Callable:
    """``fn(x, *weights)`` recomputed in the backward when ``mode == "full"``.

    The weights are passed as tensors (not captured variables) so their gradients
    flow through the recomputed function's inputs.
    """
    check_mode(mode)
    return tf.recompute_grad(fn) if mode == "full" else fn


def attention_fn(mode: str) -> Callable[[tf.Tensor, int], tf.Tensor]:
    """``attention_core(qkv, heads)``, recomputed in the backward when ``mode == "selective"``."""
    check_mode(mode)
    if mode != "selective":
        return gpt_ops.attention_core

    def attend(qkv: tf.Tensor, heads: int) -> tf.Tensor:
        return tf.recompute_grad(lambda q: gpt_ops.attention_core(q, heads))(qkv)

    return attend
