"""Megatron-style tensor parallelism for the GPT, hand-placed with ``tf.device``.

Each logical weight (docs/DESIGN.md) is either kept whole on the first device of its
tensor group (LayerNorm parameters, row-parallel biases, position embeddings) or split
over the ``tensor`` axis (Shoeybi et al. 2019, "Megatron-LM"):

* ``attn/qkv`` column-parallel: shard ``t`` holds the columns of heads
  ``[t*H/tp, (t+1)*H/tp)`` of q, of k and of v, concatenated ``[q_t | k_t | v_t]``,
  so :func:`phalanx.models.gpt_ops.attention_core` runs unchanged on ``H/tp`` heads;
* ``mlp/fc`` column-parallel, ``attn/out`` and ``mlp/proj`` row-parallel: each device
  multiplies its slice and the partial sums are added (the all-reduce);
* ``embed/tokens`` vocab-parallel (rows), ``head/kernel`` vocab-parallel (columns):
  the embedding lookup masks ids outside the local vocab range and sums, and the
  cross-entropy combines per-shard max, sum of exponentials and target logit, so
  the full ``[tokens, vocab]`` logits never exist on one device.

Example:
    >>> import numpy as np
    >>> s = Split("qkv")
    >>> w = np.arange(12.0).reshape(1, 12)          # d=4: q|k|v of 4 columns each
    >>> [p.tolist() for p in s.shard(w, 2)]
    [[[0.0, 1.0, 4.0, 5.0, 8.0, 9.0]], [[2.0, 3.0, 6.0, 7.0, 10.0, 11.0]]]
    >>> bool((s.join(s.shard(w, 2)) == w).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from phalanx.config import ModelConfig
from phalanx.models import gpt_ops


@dataclass(frozen=True)
class Split:
    """How one logical tensor is cut over the ``tensor`` axis.

    ``kind``: ``replicated`` (one whole copy), ``axis`` (equal slices along ``axis``) or
    ``qkv`` (the fused ``[q|k|v]`` last dim, each third sliced by heads).
    """

    kind: str
    axis: int = 0

    def __post_init__(self):
        if self.kind not in ("replicated", "axis", "qkv"):
            raise ValueError(f"Split.kind must be replicated, axis or qkv, got {self.kind!r}")

    def num_shards(self, tp: int) -> int:
        return 1 if self.kind == "replicated" else tp

    def shard(self, value: np.ndarray, tp: int) -> list[np.ndarray]:
        """The ``num_shards(tp)`` pieces of a whole logical tensor."""
        value = np.asarray(value)
        if self.kind == "replicated":
            return [value]
        if self.kind == "axis":
            if value.shape[self.axis] % tp:
                raise ValueError(f"dim {self.axis} of shape {value.shape} is not divisible by tp={tp}")
            return list(np.split(value, tp, axis=self.axis))
        q, k, v = np.split(value, 3, axis=-1)
        parts = [np.split(x, tp, axis=-1) for x in (q, k, v)]
        return [np.concatenate([parts[0][t], parts[1][t], parts[2][t]], axis=-1) for t in range(tp)]

    def join(self, pieces: Sequence[np.ndarray]) -> np.ndarray:
        """Inverse of :meth:`shard`."""
        pieces = [np.asarray(p) for p in pieces]
        if self.kind == "replicated":
            return pieces[0]
        if self.kind == "axis":
            return np.concatenate(pieces, axis=self.axis)
        thirds = [np.split(p, 3, axis=-1) for p in pieces]
        return np.concatenate([np.concatenate([t[i] for t in thirds], axis=-1) for i in range(3)], axis=-1)


def gpt_splits(cfg: ModelConfig) -> dict[str, Split]:
    """The :class:`Split` of every GPT weight name (docs/DESIGN.md names)."""
    from phalanx.models.gpt import weight_shapes

    out = {}
    for name in weight_shapes(cfg):
        if name == "embed/tokens":
            out[name] = Split("axis", 0)          # vocab rows
        elif name == "head/kernel":
            out[name] = Split("axis", 1)          # vocab columns
        elif name.endswith("attn/qkv/kernel") or name.endswith("attn/qkv/bias"):
            out[name] = Split("qkv")
        elif name.endswith("mlp/fc/kernel"):
            out[name] = Split("axis", 1)
        elif name.endswith("mlp/fc/bias"):
            out[name] = Split("axis", 0)
        elif name.endswith("attn/out/kernel") or name.endswith("mlp/proj/kernel"):
            out[name] = Split("axis", 0)          # row-parallel: input features
        else:
            out[name] = Split("replicated")
    return out


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the model dim that ``tp`` does not divide."""
    for key, value in (("model.heads", cfg.heads), ("model.ffn", cfg.ffn_dim), ("model.vocab", cfg.vocab)):
        if value % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {key}={value}")


# ---------------------------------------------------------------------------
# The tensor-parallel GPT pieces. ``w(name, t)`` returns the tensor of shard ``t`` of
# a weight (``t`` is 0 for replicated weights); ``devices[t]`` is the device of tensor
# rank t; the residual stream lives on ``devices[0]``.

Weights = Callable[[str, int], tf.Tensor]
AttentionFn = Callable[[tf.Tensor, int], tf.Tensor]


def vocab_parallel_embed(tokens: tf.Tensor, w: Weights, devices: Sequence[str], vocab: int,
                         dtype: tf.DType) -> tf.Tensor:
    """Token + position embedding; each device looks up only the ids of its vocab rows."""
    tp = len(devices)
    per = vocab // tp
    parts = []
    for t, dev in enumerate(devices):
        with tf.device(dev):
            local = tokens - t * per
            inside = tf.logical_and(local >= 0, local < per)
            rows = tf.gather(w("embed/tokens", t), tf.where(inside, local, tf.zeros_like(local)))
            parts.append(rows * tf.cast(inside, rows.dtype)[..., None])
    with tf.device(devices[0]):
        x = tf.add_n(parts) if tp > 1 else parts[0]
        x = x + w("embed/positions", 0)[: tf.shape(tokens)[1]]
        return tf.cast(x, dtype)


def block(x: tf.Tensor, w: Weights, prefix: str, devices: Sequence[str], heads: int,
          attention: AttentionFn = gpt_ops.attention_core) -> tf.Tensor:
    """One pre-LN block with column/row-parallel attention and MLP over ``devices``."""
    tp = len(devices)
    with tf.device(devices[0]):
        h = gpt_ops.layer_norm(x, w(prefix + "ln1/gamma", 0), w(prefix + "ln1/beta", 0))
    partial = []
    for t, dev in enumerate(devices):
        with tf.device(dev):
            qkv = gpt_ops.dense(h, w(prefix + "attn/qkv/kernel", t), w(prefix + "attn/qkv/bias", t))
            a = attention(qkv, heads // tp)
            partial.append(gpt_ops.dense(a, w(prefix + "attn/out/kernel", t)))
    with tf.device(devices[0]):
        x = x + _sum(partial) + tf.cast(w(prefix + "attn/out/bias", 0), x.dtype)
        h = gpt_ops.layer_norm(x, w(prefix + "ln2/gamma", 0), w(prefix + "ln2/beta", 0))
    partial = []
    for t, dev in enumerate(devices):
        with tf.device(dev):
            f = gpt_ops.gelu(gpt_ops.dense(h, w(prefix + "mlp/fc/kernel", t), w(prefix + "mlp/fc/bias", t)))
            partial.append(gpt_ops.dense(f, w(prefix + "mlp/proj/kernel", t)))
    with tf.device(devices[0]):
        return x + _sum(partial) + tf.cast(w(prefix + "mlp/proj/bias", 0), x.dtype)


def vocab_parallel_loss(x: tf.Tensor, targets: tf.Tensor, w: Weights, devices: Sequence[str],
                        cfg: ModelConfig) -> tf.Tensor:
    """Final LayerNorm, vocab-parallel logits and mean token cross-entropy (float32).

    Per shard: logits ``[N, V/tp]``; the loss is ``logsumexp - target logit`` with the
    logsumexp assembled from per-shard maxima and sums of exponentials.
    """
    tp = len(devices)
    per = cfg.vocab // tp
    with tf.device(devices[0]):
        h = gpt_ops.layer_norm(x, w("final_ln/gamma", 0), w("final_ln/beta", 0))
        h = tf.reshape(h, [-1, cfg.d_model])
        flat_targets = tf.reshape(targets, [-1])
    logits, maxes = [], []
    for t, dev in enumerate(devices):
        with tf.device(dev):
            if cfg.tie_embeddings:
                z = tf.matmul(h, tf.cast(w("embed/tokens", t), h.dtype), transpose_b=True)
            else:
                z = tf.matmul(h, tf.cast(w("head/kernel", t), h.dtype))
            z = tf.cast(z, tf.float32)
            logits.append(z)
            maxes.append(tf.reduce_max(z, axis=-1))
    with tf.device(devices[0]):
        # The max only shifts the exponent for stability; it carries no gradient.
        top = tf.stop_gradient(tf.reduce_max(tf.stack(maxes), axis=0) if tp > 1 else maxes[0])
    sums, picked = [], []
    for t, dev in enumerate(devices):
        with tf.device(dev):
            z = logits[t]
            sums.append(tf.reduce_sum(tf.exp(z - top[:, None]), axis=-1))
            local = flat_targets - t * per
            inside = tf.logical_and(local >= 0, local < per)
            idx = tf.where(inside, local, tf.zeros_like(local))
            value = tf.gather(z, idx[:, None], batch_dims=1)[:, 0]
            picked.append(tf.where(inside, value, tf.zeros_like(value)))
    with tf.device(devices[0]):
        lse = tf.math.log(_sum(sums)) + top
        return tf.reduce_mean(lse - _sum(picked))


def _sum(parts: list[tf.Tensor]) -> tf.Tensor:
    return tf.add_n(parts) if len(parts) > 1 else parts[0]
