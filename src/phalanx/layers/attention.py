"""Self-attention split by heads (Megatron-LM), grouped-query attention included.

Shard ``r`` of a :class:`ParallelSelfAttention` holds ``H/tp`` query heads and the
``KV/tp`` key/value heads they read, and computes their attention on its own device; the
output projection is row-parallel, so only the ``[B, T, D]`` partial outputs are summed (on
shard 0's device). Query head ``h`` reads key/value head ``h // (H/KV)`` (keras-hub Llama's
``ops.repeat`` convention), so cutting both head axes into ``tp`` contiguous blocks keeps
every group on one shard.

Logical weights, in order (those of :class:`keras.layers.MultiHeadAttention`, so its
``get_weights()`` load positionally when ``num_kv_heads == num_heads``)::

    query [D, H, hd]   query_bias [H, hd]    key [D, KV, hd]      key_bias [KV, hd]
    value [D, KV, hd]  value_bias [KV, hd]   output [H, hd, D]    output_bias [D]

The head axis (1 of the kernels, 0 of ``output`` and the biases) is cut; ``output_bias`` is
whole. Biases exist only with ``use_bias``.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from phalanx.layers.sharding import ShardedLayer, on_device_of
from phalanx.layers.tensor_parallel import add_shards, dims, matmul, shard_values

_MASKED = -1e9  # added to masked scores, as keras.layers.Softmax does (float32 here)


# Below this many elements, swap_heads moves the head axis with Unpack + Pack (plain copies)
# rather than a Transpose: with oneDNN on (TF_ENABLE_ONEDNN_OPTS=1, the phalanx default),
# Transpose runs as a oneDNN reorder whose fixed cost (~0.1-0.2 ms, measured on the AMD
# EPYC development machine) dominates small tensors: forward + backward of a [2, 128, 2, 64]
# swap took 0.26 ms as a Transpose and 0.04 ms as Unpack + Pack, [8, 128, 2, 64] 0.36 vs
# 0.26 ms; from [8, 128, 4, 64] on the reorder is faster (0.59 vs 0.70 ms).
_SMALL_SWAP = 1 << 17


def swap_heads(x, heads_axis: int):
    """Swap axes 1 and 2 of a rank-4 ``x`` whose head axis is ``heads_axis`` (1 or 2):
    ``[B, T, H, hd]`` <-> ``[B, H, T, hd]``. A small tensor of known shape (see
    ``_SMALL_SWAP``) is unstacked along its (static) head axis and stacked on the other;
    anything else goes through a Transpose."""
    if x.shape.is_fully_defined() and x.shape.num_elements() <= _SMALL_SWAP:
        return tf.stack(tf.unstack(x, axis=heads_axis), axis=3 - heads_axis)
    return tf.transpose(x, [0, 2, 1, 3])


def rotary(x, max_wavelength: float, scaling_factor: float = 1.0):
    """Rotary position embedding of ``x [B, T, heads, hd]`` at positions ``0..T-1``, in
    keras-hub's ``RotaryEmbedding`` convention: inverse frequencies
    ``max_wavelength**(-2i/hd) / scaling_factor``, angles repeated as ``[f, f]`` over the
    feature axis and the rotation ``x*cos + concat(-x2, x1)*sin`` with ``x1, x2`` the halves."""
    hd = x.shape[-1]
    inverse = tf.pow(tf.constant(float(max_wavelength)), -tf.range(0, hd, 2, dtype="float32") / hd) / scaling_factor
    angles = tf.range(tf.shape(x)[1], dtype="float32")[:, None] * inverse[None, :]   # [T, hd/2]
    angles = tf.concat([angles, angles], axis=-1)[None, :, None, :]
    cos, sin = tf.cast(tf.cos(angles), x.dtype), tf.cast(tf.sin(angles), x.dtype)
    x1, x2 = tf.split(x, 2, axis=-1)
    return x * cos + tf.concat([-x2, x1], axis=-1) * sin


@keras.saving.register_keras_serializable(package="phalanx")
class ParallelSelfAttention(ShardedLayer):
    """Multi-head self-attention with ``num_heads`` query heads of width ``head_dim`` and
    ``num_kv_heads`` key/value heads (default ``num_heads``; fewer is grouped-query
    attention), split by heads into ``tp`` shards (see the module docstring).

    ``call(x, attention_mask=None, padding_mask=None, training=None)``: ``x [B, T, D]`` gives
    ``[B, T, D]``. ``attention_mask`` is ``[B, T, T]`` (query, key; True/1 = attend) or, of
    rank 2, a ``[B, T]`` padding mask (1 = real token) as is ``padding_mask``; both combine
    with the causal mask (``causal=True``). Scores are scaled by ``1/sqrt(head_dim)`` and the
    softmax runs in float32 whatever the compute dtype. With ``rope_max_wavelength`` set,
    queries and keys get rotary embeddings (:func:`rotary`, positions from 0: no cache).
    ``dropout`` drops attention probabilities in training, each shard with its own seed.

    Example:
        >>> import numpy as np
        >>> attn = ParallelSelfAttention(num_heads=4, head_dim=2, num_kv_heads=2, tp=2, rope_max_wavelength=10000)
        >>> x = np.random.default_rng(0).normal(size=(2, 5, 8)).astype("float32")
        >>> tuple(attn(x, padding_mask=np.array([[1, 1, 1, 0, 0], [1] * 5])).shape)
        (2, 5, 8)
        >>> {k: v.shape for k, v in attn.logical_weights().items() if not k.endswith("bias")}
        {'query': (8, 4, 2), 'key': (8, 2, 2), 'value': (8, 2, 2), 'output': (4, 2, 8)}
        >>> ParallelSelfAttention(num_heads=4, head_dim=2, num_kv_heads=2, tp=4, name="attn")
        Traceback (most recent call last):
        ...
        ValueError: layer 'attn': tp=4 does not divide num_kv_heads=2 (each shard needs whole key/value heads)
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int | None = None, tp: int = 1,
                 use_bias: bool = True, causal: bool = True, rope_max_wavelength: float | None = None,
                 rope_scaling_factor: float = 1.0, dropout: float = 0.0, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", seed: int | None = None, **kwargs):
        super().__init__(tp=tp, **kwargs)
        self.num_heads, self.head_dim = int(num_heads), int(head_dim)
        self.num_kv_heads = self.num_heads if num_kv_heads is None else int(num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"layer {self.name!r}: num_kv_heads={self.num_kv_heads} does not divide "
                             f"num_heads={self.num_heads}")
        if self.num_kv_heads % tp:
            raise ValueError(f"layer {self.name!r}: tp={tp} does not divide num_kv_heads={self.num_kv_heads} "
                             f"(each shard needs whole key/value heads)")
        if rope_max_wavelength is not None and self.head_dim % 2:
            raise ValueError(f"layer {self.name!r}: rotary embeddings need an even head_dim, got {self.head_dim}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"layer {self.name!r}: dropout {dropout!r} is not in [0, 1)")
        self.use_bias, self.causal, self.dropout, self.seed = use_bias, causal, float(dropout), seed
        self.rope_max_wavelength, self.rope_scaling_factor = rope_max_wavelength, float(rope_scaling_factor)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout else None

    def build(self, input_shape):
        d, h, kv, hd = input_shape[-1], self.num_heads, self.num_kv_heads, self.head_dim
        self._shard_vars = {}

        def add(name, shape, split_axis, bias=False):
            init = self.bias_initializer if bias else self.kernel_initializer
            self._shard_vars[name] = self.add_logical_weight(name, shape, split_axis, initializer=init)

        for name, heads in (("query", h), ("key", kv), ("value", kv)):
            add(name, (d, heads, hd), 1)
            if self.use_bias:
                add(f"{name}_bias", (heads, hd), 0, bias=True)
        add("output", (h, hd, d), 0)
        if self.use_bias:
            add("output_bias", (d,), None, bias=True)

    def _mask(self, x, attention_mask, padding_mask):
        """The combined [B or 1, T, T] boolean mask (True = attend), or None; made on the
        current device so only the small inputs travel."""
        t = tf.shape(x)[1]
        mask = None
        if self.causal:
            i = tf.range(t)
            mask = (i[:, None] >= i[None, :])[None]
        for m in (attention_mask, padding_mask):
            if m is None:
                continue
            m = tf.cast(m, "bool")
            m = m[:, None, :] if m.shape.rank == 2 else m  # a padding mask masks keys
            mask = m if mask is None else mask & m
        return mask

    def call(self, inputs, attention_mask=None, padding_mask=None, training=None):
        x = tf.cast(inputs, self.compute_dtype)
        w = {name: shard_values(self, v) for name, v in self._shard_vars.items()}
        b, t, d = dims(x)
        hd, groups = self.head_dim, self.num_heads // self.num_kv_heads
        kv = self.num_kv_heads // self.tp                 # key/value heads per shard
        dropping = bool(training) and self.dropout > 0
        # Seeds drawn once, outside the shards' device scopes: the generator's state is one
        # whole variable, and each shard must drop with its own seed.
        seeds = [self.seed_generator.next() for _ in range(self.tp)] if dropping else None
        parts = []
        for r in range(self.tp):
            with on_device_of(w["output"][r]):
                def project(name, heads):
                    y = matmul(x, tf.reshape(w[name][r], [d, heads * hd]))
                    if self.use_bias:
                        y = y + tf.reshape(w[f"{name}_bias"][r], [heads * hd])
                    return tf.reshape(y, [b, t, heads, hd])

                q, k, v = project("query", kv * groups), project("key", kv), project("value", kv)
                if self.rope_max_wavelength is not None:
                    q = rotary(q, self.rope_max_wavelength, self.rope_scaling_factor)
                    k = rotary(k, self.rope_max_wavelength, self.rope_scaling_factor)
                q = q * tf.cast(1.0 / math.sqrt(hd), q.dtype)
                # A group's query heads share one key/value head: fold them into the query
                # length, [B, kv, groups*T, hd], so K and V are never repeated.
                q = tf.reshape(swap_heads(q, 2), [b, kv, groups * t, hd])
                k, v = swap_heads(k, 2), swap_heads(v, 2)
                scores = tf.reshape(tf.matmul(q, k, transpose_b=True), [b, kv, groups, t, t])
                scores = tf.cast(scores, "float32")
                mask = self._mask(x, attention_mask, padding_mask)
                if mask is not None:
                    scores += (1.0 - tf.cast(mask, "float32"))[:, None, None] * _MASKED
                probs = tf.nn.softmax(scores, axis=-1)
                if dropping:
                    probs = tf.nn.experimental.stateless_dropout(probs, rate=self.dropout, seed=seeds[r])
                probs = tf.reshape(tf.cast(probs, self.compute_dtype), [b, kv, groups * t, t])
                o = swap_heads(tf.reshape(tf.matmul(probs, v), [b, kv * groups, t, hd]), 1)
                o = tf.reshape(o, [b, t, kv * groups * hd])
                parts.append(matmul(o, tf.reshape(w["output"][r], [kv * groups * hd, d])))
        y = add_shards(parts, w["output"][0])
        if self.use_bias:
            with on_device_of(w["output"][0]):
                y = y + w["output_bias"][0]
        return y

    def compute_output_spec(self, inputs, attention_mask=None, padding_mask=None, training=None):
        return keras.KerasTensor(tuple(inputs.shape), dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "head_dim": self.head_dim,
                "num_kv_heads": self.num_kv_heads, "use_bias": self.use_bias, "causal": self.causal,
                "rope_max_wavelength": self.rope_max_wavelength, "rope_scaling_factor": self.rope_scaling_factor,
                "dropout": self.dropout, "seed": self.seed,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}
