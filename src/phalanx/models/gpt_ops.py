"""The GPT math as plain functions on tensors.

The Keras layers in :mod:`phalanx.models.gpt` and the tensor/pipeline-parallel engine
both call these, so the single-device model and every parallel layout compute the
same thing from the same code.

Example:
    >>> import tensorflow as tf
    >>> x = tf.random.normal([2, 5, 8])
    >>> y = layer_norm(x, tf.ones([8]), tf.zeros([8]))
    >>> tuple(y.shape)
    (2, 5, 8)
"""

from __future__ import annotations

import math

import tensorflow as tf

LAYER_NORM_EPS = 1e-5


def layer_norm(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor) -> tf.Tensor:
    """LayerNorm over the last dim, statistics in float32 (stable under bfloat16/float16)."""
    x32 = tf.cast(x, tf.float32)
    mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
    y = (x32 - mean) * tf.math.rsqrt(var + LAYER_NORM_EPS)
    y = y * tf.cast(gamma, tf.float32) + tf.cast(beta, tf.float32)
    return tf.cast(y, x.dtype)


def gelu(x: tf.Tensor) -> tf.Tensor:
    """GELU, tanh approximation (as in GPT-2)."""
    return tf.nn.gelu(x, approximate=True)


def dense(x: tf.Tensor, kernel: tf.Tensor, bias: tf.Tensor | None = None) -> tf.Tensor:
    """``x @ kernel + bias`` in the dtype of ``x`` (variables are float32 masters).

    Leading dims are flattened into one 2-D matmul: the gradient of an ellipsis
    ``einsum`` was ~100x slower on TF 2.21 CPU (measured).
    """
    kernel = tf.cast(kernel, x.dtype)
    if x.shape.rank == 2:
        y = tf.matmul(x, kernel)
    else:
        lead = tf.shape(x)[:-1]
        y = tf.matmul(tf.reshape(x, [-1, x.shape[-1]]), kernel)
        y = tf.reshape(y, tf.concat([lead, [kernel.shape[-1]]], 0))
    if bias is not None:
        # bias_add, not `+`: the same sum, but Grappler fuses MatMul + BiasAdd into one
        # kernel (oneDNN) and its gradient is a plain column sum.
        y = tf.nn.bias_add(y, tf.cast(bias, x.dtype))
    return y


def causal_attention(q: tf.Tensor, k: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
    """Scaled dot-product attention with a causal mask.

    q, k, v: ``[batch, heads, seq, head_dim]``; softmax in float32.
    """
    head_dim = q.shape[-1]
    seq = tf.shape(q)[2]
    # Scale q ([b, h, t, hd]) rather than the scores ([b, h, t, t]): t/hd times fewer
    # multiplies forward and backward (exact in any dtype when hd is a power of 4).
    q = q * tf.cast(1.0 / math.sqrt(head_dim), q.dtype)
    scores = tf.cast(tf.matmul(q, k, transpose_b=True), tf.float32)
    # An additive mask instead of tf.where: the same softmax (exp(-1e9) is 0 either
    # way), and its gradient passes straight through instead of another select.
    causal = tf.linalg.band_part(tf.ones([seq, seq], tf.float32), -1, 0)
    scores = scores + (causal - 1.0) * 1e9
    probs = tf.cast(tf.nn.softmax(scores, axis=-1), v.dtype)
    return tf.matmul(probs, v)


def split_heads(x: tf.Tensor, heads: int) -> tf.Tensor:
    """``[b, t, heads*hd]`` -> ``[b, heads, t, hd]``."""
    b, t = tf.shape(x)[0], tf.shape(x)[1]
    hd = x.shape[-1] // heads
    return tf.transpose(tf.reshape(x, [b, t, heads, hd]), [0, 2, 1, 3])


def merge_heads(x: tf.Tensor) -> tf.Tensor:
    """``[b, heads, t, hd]`` -> ``[b, t, heads*hd]``."""
    b, h, t, hd = tf.shape(x)[0], x.shape[1], tf.shape(x)[2], x.shape[3]
    return tf.reshape(tf.transpose(x, [0, 2, 1, 3]), [b, t, h * hd])


def attention_core(qkv: tf.Tensor, heads: int) -> tf.Tensor:
    """Fused-QKV activations ``[b, t, 3*heads*hd]`` (columns ``[q|k|v]``) -> ``[b, t, heads*hd]``.

    With tensor parallelism each device passes its own column slice (its heads of q,
    k and v, in that order) and its local head count.
    """
    q, k, v = tf.split(qkv, 3, axis=-1)
    out = causal_attention(split_heads(q, heads), split_heads(k, heads), split_heads(v, heads))
    return merge_heads(out)


def token_cross_entropy(logits: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
    """Per-token cross-entropy in float32, shape of ``targets``."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=targets, logits=tf.cast(logits, tf.float32))
