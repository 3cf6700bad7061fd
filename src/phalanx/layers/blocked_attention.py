"""Causal attention computed by query blocks, without a full-size score or probability matrix.

FlashAttention's algorithm (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient
Exact Attention with IO-Awareness") as TensorFlow ops: the sequence is cut into blocks of
``block_size`` positions; query block ``i`` attends to the keys of blocks ``0..i`` only (the
blocks above the diagonal are never computed), so its scores are one matmul against the
key prefix, and the causal mask is applied inside the fused softmax kernel, where it touches
only the diagonal block's columns (no ``SelectV2`` over a ``[T, T]`` matrix). The softmax
statistics are float32 whatever the compute dtype; the forward keeps only ``q, k, v``, the
output and each row's float32 log-sum-exp. The backward (``tf.custom_gradient``) recomputes
each block's scores from ``q, k`` and the saved log-sum-exp (``p = exp(s - lse)``) instead of
storing the probabilities: ``dp = do v^T``, ``ds = p (dp - rowsum(do * o))``, ``dq = ds k``,
``dk = ds^T q``, ``dv = p^T do``.

Because a query block sees all its visible keys in one matmul, the forward's softmax is the
ordinary (not the running, rescaled) one: the numbers equal the plain attention's up to the
order of float32 sums. Matmuls run in the compute dtype (bfloat16 under ``mixed_bfloat16``,
through oneDNN); the element-wise work between them is one XLA kernel per block
(:func:`phalanx.core.xla.fused`).

Grouped-query attention: ``q`` has ``H`` heads and ``k``, ``v`` ``KV``; query head ``h`` reads
key/value head ``h // (H / KV)``. A group's query rows are folded into the block's rows, so
keys and values are never repeated.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(1, 2, 5, 4)).astype("float32") for _ in range(3))
    >>> o = causal_attention(q, k, v, block_size=2)
    >>> s = np.einsum("bhqd,bhkd->bhqk", q / 2.0, k) + np.triu(np.full((5, 5), -np.inf), 1)
    >>> p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    >>> bool(np.allclose(o, p @ v, atol=1e-5))
    True
"""

from __future__ import annotations

import math

import tensorflow as tf

from phalanx.core.xla import fused

#: positions per block (query and key blocks alike): the reference GPT's seq_len 512 is four blocks
BLOCK_SIZE = 128
_F32 = tf.float32


def _visible(rows: int, cols: int, block: int, start: int):
    """[rows, cols] bool: row ``r`` (query position ``start + r % block``; a group's query
    heads are stacked as consecutive runs of ``block`` rows) sees key ``c <= start + r % block``."""
    pos = start + tf.range(rows) % block
    return tf.range(cols)[None, :] <= pos[:, None]


@fused
def _softmax_fwd(s, block: int, start: int):
    """Probabilities (``s``'s dtype) and float32 log-sum-exp ``[..., rows, 1]`` of the causal
    softmax over a key prefix ``s [..., rows, start + block_len]``."""
    rows, cols = s.shape[-2], s.shape[-1]
    z = tf.where(_visible(rows, cols, block, start), tf.cast(s, _F32), -math.inf)
    top = tf.reduce_max(z, axis=-1, keepdims=True)  # finite: every row sees key 0
    e = tf.exp(z - top)
    total = tf.reduce_sum(e, axis=-1, keepdims=True)
    return tf.cast(e / total, s.dtype), top + tf.math.log(total)


@fused
def _softmax_bwd(s, lse, dp, delta, block: int, start: int):
    """``p = exp(s - lse)`` (masked) and ``ds = p (dp - delta)``, both in ``s``'s dtype."""
    rows, cols = s.shape[-2], s.shape[-1]
    p = tf.where(_visible(rows, cols, block, start), tf.exp(tf.cast(s, _F32) - lse), 0.0)
    ds = p * (tf.cast(dp, _F32) - delta)
    return tf.cast(p, s.dtype), tf.cast(ds, s.dtype)


@fused
def _row_dot(do, o):
    """``rowsum(do * o)`` in float32, ``[..., rows, 1]``."""
    return tf.reduce_sum(tf.cast(do, _F32) * tf.cast(o, _F32), axis=-1, keepdims=True)


def _bounds(t: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(s + block, t)) for s in range(0, t, block)]


def _rows(x, groups: int, s: int, e: int):
    """Query rows ``[s, e)`` of ``x [B, KV, G, T, hd]`` as ``[B, KV, G*(e-s), hd]``."""
    b, kv, hd = tf.shape(x)[0], x.shape[1], x.shape[-1]
    return tf.reshape(x[:, :, :, s:e], [b, kv, groups * (e - s), hd])


def _unrows(x, groups: int):
    """``[B, KV, G*n, hd]`` -> ``[B, KV, G, n, hd]``."""
    b, kv, hd = tf.shape(x)[0], x.shape[1], x.shape[-1]
    return tf.reshape(x, [b, kv, groups, x.shape[2] // groups, hd])


def _pad_to(x, t: int):
    """``x [B, KV, n, hd]`` zero-padded to ``t`` positions along axis 2."""
    return x if x.shape[2] == t else tf.pad(x, [[0, 0], [0, 0], [0, t - x.shape[2]], [0, 0]])


def _attention(q, k, v, block: int):
    """q ``[B, KV, G, T, hd]`` (scaled), k, v ``[B, KV, T, hd]`` -> o like q; see the module."""
    groups, t = q.shape[2], q.shape[3]
    spans = _bounds(t, block)

    @tf.custom_gradient
    def run(q, k, v):
        outs, lses = [], []
        for s, e in spans:
            qi = _rows(q, groups, s, e)
            scores = tf.matmul(qi, k[:, :, :e], transpose_b=True)       # [B, KV, G*n, e]
            p, lse = _softmax_fwd(scores, e - s, s)
            outs.append(_unrows(tf.matmul(p, v[:, :, :e]), groups))
            lses.append(lse)
        o = tf.concat(outs, axis=3) if len(outs) > 1 else outs[0]

        def grad(do):
            with tf.name_scope("blocked_attention_grad"):
                return _grad(tf.cast(do, q.dtype))

        def _grad(do):
            dq, dks, dvs = [], [], []
            for (s, e), lse in zip(spans, lses):
                qi, doi = _rows(q, groups, s, e), _rows(do, groups, s, e)
                ki, vi = k[:, :, :e], v[:, :, :e]
                scores = tf.matmul(qi, ki, transpose_b=True)
                dp = tf.matmul(doi, vi, transpose_b=True)
                p, ds = _softmax_bwd(scores, lse, dp, _row_dot(doi, _rows(o, groups, s, e)), e - s, s)
                dq.append(_unrows(tf.matmul(ds, ki), groups))
                dks.append(_pad_to(tf.matmul(ds, qi, transpose_a=True), t))
                dvs.append(_pad_to(tf.matmul(p, doi, transpose_a=True), t))
            dq = tf.concat(dq, axis=3) if len(dq) > 1 else dq[0]
            return dq, tf.add_n(dks), tf.add_n(dvs)

        return o, grad

    return run(q, k, v)


def causal_attention(q, k, v, block_size: int | None = None, scale: float | None = None):
    """Causal scaled dot-product attention by query blocks (see the module docstring).

    ``q [B, H, T, hd]``, ``k``, ``v`` ``[B, KV, T, hd]`` (``KV`` divides ``H``; query head ``h``
    reads key/value head ``h // (H/KV)``), all in the compute dtype; ``T`` (and ``H``, ``KV``,
    ``hd``) must be known when traced. ``block_size``: positions per block (default
    :data:`BLOCK_SIZE`). ``q`` is multiplied by ``scale`` (default
    ``1/sqrt(hd)``) in its dtype first, as the plain attention does. Returns ``[B, H, T, hd]``
    in ``q``'s dtype; differentiable in ``q``, ``k`` and ``v``.
    """
    q, k, v = (tf.convert_to_tensor(x) for x in (q, k, v))
    k, v = tf.cast(k, q.dtype), tf.cast(v, q.dtype)
    if None in q.shape[1:] or None in k.shape[1:] or q.shape.rank != 4:
        raise ValueError(f"causal_attention: q, k, v must be [B, heads, T, head_dim] with static heads, T and "
                         f"head_dim; got q {q.shape}, k {k.shape}")
    heads, t, hd = q.shape[1], q.shape[2], q.shape[3]
    kv = k.shape[1]
    if heads % kv or k.shape[2:] != (t, hd) or v.shape[1:] != k.shape[1:]:
        raise ValueError(f"causal_attention: q {q.shape} does not match k {k.shape} / v {v.shape} "
                         f"(k and v [B, KV, T, hd] with KV dividing q's heads)")
    block_size = BLOCK_SIZE if block_size is None else block_size
    if int(block_size) < 1:
        raise ValueError(f"causal_attention: block_size must be >= 1, got {block_size}")
    scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
    with tf.name_scope("blocked_attention"):
        q = q * tf.cast(scale, q.dtype)
        b = tf.shape(q)[0]
        q5 = tf.reshape(q, [b, kv, heads // kv, t, hd])
        o = _attention(q5, k, v, int(block_size))
        return tf.reshape(o, [b, heads, t, hd])
