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


def core_wrapper(mode: str) -> Callable[[Callable], Callable] | None:
    """What wraps the attention core ``(q, k, v) -> o`` (the ``wrap_core`` of
    :meth:`phalanx.layers.ParallelSelfAttention.partials`): ``tf.recompute_grad`` when
    ``mode == "selective"``, else None."""
    check_mode(mode)
    return tf.recompute_grad if mode == "selective" else None
