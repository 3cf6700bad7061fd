"""The GPT math as plain functions on tensors.

The Keras layers in :mod:`phalanx.models.gpt` and the tensor/pipeline-parallel engine
both call these, so the single-device model and every parallel layout compute the
same thing from the same code.

Matmuls run in the compute dtype (bfloat16 under ``mixed_bfloat16``) through oneDNN.
The element-wise pieces around them — LayerNorm, bias + GELU, the attention softmax's
backward and the loss head's softmax-cross-entropy — are fused kernels: one
XLA-compiled function for the forward and one for the backward (``tf.custom_gradient``),
reading and writing the compute dtype and computing in float32 inside (the attention
softmax's forward is oneDNN's, in the compute dtype). As chains of separate TensorFlow
ops these pieces were a third of a bfloat16 step of the reference GPT on CPU (every op a
pass over memory, plus the casts to and from float32 around each of them); see
benchmarks/results/profile_gpt.md. The matmuls stay out of XLA: oneDNN's are faster on CPU.

Precision: LayerNorm statistics, the softmaxes and GELU are computed in float32 and
rounded once to the compute dtype; the attention softmax's backward reads the
probabilities as stored for the ``probs @ v`` matmul (compute dtype); the loss is
float32 from bfloat16 logits.

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

from phalanx.core.xla import fused as _fused
from phalanx.layers import losses as _losses

LAYER_NORM_EPS = 1e-5
_F32 = tf.float32
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def _rows(x: tf.Tensor) -> tf.Tensor:
    """``x`` as a matrix ``[-1, last dim]`` (a reshape: no copy)."""
    return x if x.shape.rank == 2 else tf.reshape(x, [-1, x.shape[-1]])


# -- LayerNorm -------------------------------------------------------------------------


@_fused
def _layer_norm_fwd(x, gamma, beta):
    x32 = tf.cast(x, _F32)
    mean = tf.reduce_mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(centred), axis=-1, keepdims=True) + LAYER_NORM_EPS)
    return tf.cast(centred * rstd * gamma + beta, x.dtype), mean, rstd


def _ln_bwd_f32(dy32, s32, mean, rstd, gamma):
    """LayerNorm's backward in float32: ``(ds, dgamma, dbeta)`` of ``y = (s - mean) rstd gamma + beta``."""
    xhat = (s32 - mean) * rstd
    g = dy32 * gamma
    ds = rstd * (g - tf.reduce_mean(g, axis=-1, keepdims=True) - xhat * tf.reduce_mean(g * xhat, axis=-1, keepdims=True))
    return ds, tf.reduce_sum(dy32 * xhat, axis=0), tf.reduce_sum(dy32, axis=0)


@_fused
def _layer_norm_bwd(dy, x, mean, rstd, gamma):
    dx, dgamma, dbeta = _ln_bwd_f32(tf.cast(dy, _F32), tf.cast(x, _F32), mean, rstd, gamma)
    return tf.cast(dx, x.dtype), dgamma, dbeta


@tf.custom_gradient
def _layer_norm(x, gamma, beta):
    y, mean, rstd = _layer_norm_fwd(x, gamma, beta)

    def grad(dy):
        return _layer_norm_bwd(dy, x, mean, rstd, gamma)

    return y, grad


def layer_norm(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor) -> tf.Tensor:
    """LayerNorm over the last dim, statistics in float32 (stable under bfloat16/float16);
    the result in the dtype of ``x``."""
    with tf.name_scope("layer_norm"):
        gamma, beta = tf.cast(tf.convert_to_tensor(gamma), _F32), tf.cast(tf.convert_to_tensor(beta), _F32)
        return tf.reshape(_layer_norm(_rows(x), gamma, beta), tf.shape(x))


@_fused
def _add_layer_norm_fwd(x, y, bias, gamma, beta):
    s = tf.cast(tf.cast(x, _F32) + tf.cast(y, _F32) + bias, x.dtype)  # the residual stream, rounded once
    s32 = tf.cast(s, _F32)
    mean = tf.reduce_mean(s32, axis=-1, keepdims=True)
    centred = s32 - mean
    rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(centred), axis=-1, keepdims=True) + LAYER_NORM_EPS)
    return s, tf.cast(centred * rstd * gamma + beta, x.dtype), mean, rstd


@_fused
def _add_layer_norm_bwd(ds, dy, s, mean, rstd, gamma):
    dnorm, dgamma, dbeta = _ln_bwd_f32(tf.cast(dy, _F32), tf.cast(s, _F32), mean, rstd, gamma)
    total = tf.cast(ds, _F32) + dnorm  # s feeds the residual stream and the LayerNorm
    return tf.cast(total, s.dtype), tf.reduce_sum(total, axis=0), dgamma, dbeta


@tf.custom_gradient
def _add_layer_norm(x, y, bias, gamma, beta):
    s, out, mean, rstd = _add_layer_norm_fwd(x, y, bias, gamma, beta)

    def grad(ds, dy):
        ds = tf.zeros_like(s) if ds is None else ds
        dy = tf.zeros_like(out) if dy is None else dy
        dsum, dbias, dgamma, dbeta = _add_layer_norm_bwd(ds, dy, s, mean, rstd, gamma)
        return dsum, tf.cast(dsum, y.dtype), dbias, dgamma, dbeta

    return (s, out), grad


def add_layer_norm(x: tf.Tensor, y: tf.Tensor, bias: tf.Tensor | None, gamma: tf.Tensor,
                   beta: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(s, layer_norm(s))`` for ``s = x + y + bias`` (a residual add and the next LayerNorm):
    one kernel forward, one backward. The sum is taken in float32 and rounded once to ``x``'s
    dtype (the residual stream); the LayerNorm reads that rounded ``s``, statistics in float32;
    the backward adds the residual's and the LayerNorm's gradients in float32 and rounds once."""
    with tf.name_scope("add_layer_norm"):
        x = tf.convert_to_tensor(x)
        d = x.shape[-1]
        b = tf.zeros([d], _F32) if bias is None else tf.cast(tf.convert_to_tensor(bias), _F32)
        gamma, beta = tf.cast(tf.convert_to_tensor(gamma), _F32), tf.cast(tf.convert_to_tensor(beta), _F32)
        s, out = _add_layer_norm(_rows(x), _rows(tf.convert_to_tensor(y)), b, gamma, beta)
        shape = tf.shape(x)
        return tf.reshape(s, shape), tf.reshape(out, shape)


# -- bias + GELU -----------------------------------------------------------------------


def _gelu_terms(u):
    u2 = u * u
    return u2, tf.tanh(u * (_GELU_C + _GELU_C * _GELU_A * u2))


@_fused
def _gelu_fwd(h, bias):
    u = tf.cast(h, _F32) + bias
    _, t = _gelu_terms(u)
    return tf.cast(0.5 * u * (1.0 + t), h.dtype)


@_fused
def _gelu_bwd(dy, h, bias):
    u = tf.cast(h, _F32) + bias
    u2, t = _gelu_terms(u)
    slope = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * (_GELU_C + 3.0 * _GELU_C * _GELU_A * u2)
    du = tf.cast(dy, _F32) * slope
    return tf.cast(du, h.dtype), tf.reduce_sum(du, axis=0)


@tf.custom_gradient
def _bias_gelu(h, bias):
    def grad(dy):
        return _gelu_bwd(dy, h, bias)

    return _gelu_fwd(h, bias), grad


def gelu(x: tf.Tensor, bias: tf.Tensor | None = None) -> tf.Tensor:
    """GELU (tanh approximation, as in GPT-2) of ``x + bias``, in the dtype of ``x``.

    The bias add (float32) is part of the fused kernel, and so is its gradient (a
    float32 column sum): pass a matmul's bias here rather than to :func:`dense`.
    """
    with tf.name_scope("gelu"):
        rows = _rows(x)
        b = tf.zeros([x.shape[-1]], _F32) if bias is None else tf.cast(tf.convert_to_tensor(bias), _F32)
        return tf.reshape(_bias_gelu(rows, b), tf.shape(x))


# -- dense -----------------------------------------------------------------------------


def dense(x: tf.Tensor, kernel: tf.Tensor, bias: tf.Tensor | None = None) -> tf.Tensor:
    """``x @ kernel + bias`` in the dtype of ``x`` (variables are float32 masters).

    Leading dims are flattened into one 2-D matmul: the gradient of an ellipsis
    ``einsum`` was ~100x slower on TF 2.21 CPU (measured). The bias is added to the
    2-D matmul result, before the reshape back, so that Grappler fuses MatMul + BiasAdd
    into one oneDNN kernel (a reshape between them prevents it).
    """
    kernel = tf.cast(kernel, x.dtype)
    y = tf.matmul(_rows(x), kernel)
    if bias is not None:
        # bias_add, not `+`: the same sum, but fusable, and its gradient is a plain column sum.
        y = tf.nn.bias_add(y, tf.cast(bias, x.dtype))
    if x.shape.rank == 2:
        return y
    return tf.reshape(y, tf.concat([tf.shape(x)[:-1], [kernel.shape[-1]]], 0))


# -- attention -------------------------------------------------------------------------


@_fused
def _softmax_bwd(dprobs, probs):
    p, dp = tf.cast(probs, _F32), tf.cast(dprobs, _F32)
    return tf.cast(p * (dp - tf.reduce_sum(dp * p, axis=-1, keepdims=True)), probs.dtype)


@tf.custom_gradient
def _causal_softmax(scores):
    tq, tk = tf.shape(scores)[-2], tf.shape(scores)[-1]
    # query i (of the last tq positions) sees keys j <= i + tk - tq; the others get the
    # dtype's lowest value, whose exp is exactly 0 (an additive -1e9 would be -inf, and
    # 0 * inf NaN, in float16)
    visible = tf.cast(tf.linalg.band_part(tf.ones(tf.stack([tq, tk]), tf.int8), -1, tk - tq), tf.bool)
    probs = tf.nn.softmax(tf.where(visible, scores, scores.dtype.min), axis=-1)

    def grad(dprobs):
        return _softmax_bwd(dprobs, probs)

    return probs, grad


def causal_softmax(scores: tf.Tensor) -> tf.Tensor:
    """``softmax(scores)`` over the last axis with a causal mask (query ``i`` sees keys
    ``<= i``), in the dtype of ``scores``.

    Forward: the mask is applied in the compute dtype (exact: a visible score is kept as
    it is) and oneDNN's softmax, which accumulates in float32 and rounds once, runs on it
    (measured faster than an XLA softmax and than a float32 round trip). Backward: one
    fused kernel, ``p (dp - sum(dp p))`` in float32.
    """
    with tf.name_scope("softmax"):
        return _causal_softmax(scores)


def causal_attention(q: tf.Tensor, k: tf.Tensor, v: tf.Tensor) -> tf.Tensor:
    """Scaled dot-product attention with a causal mask.

    q, k, v: ``[batch, heads, seq, head_dim]``; softmax as :func:`causal_softmax`.
    """
    # Scale q ([b, h, t, hd]) rather than the scores ([b, h, t, t]): t/hd times fewer
    # multiplies forward and backward (exact in any dtype when hd is a power of 4).
    q = q * tf.cast(1.0 / math.sqrt(q.shape[-1]), q.dtype)
    return tf.matmul(causal_softmax(tf.matmul(q, k, transpose_b=True)), v)


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


# -- loss head -------------------------------------------------------------------------

#: per-token cross-entropy from logits in their own dtype (fused kernels; :mod:`phalanx.layers.losses`)
token_cross_entropy = _losses.token_cross_entropy
