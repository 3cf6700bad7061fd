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

from phalanx.config import ATTENTION
from phalanx.layers import blocked_attention
from phalanx.layers import kernels as kernels_lib
from phalanx.layers.sharding import ShardedLayer, on_device_of
from phalanx.layers.tensor_parallel import add_shards, dims, matmul, shard_values

_MASKED = -1e9  # added to masked scores, as keras.layers.Softmax does (float32 here)



def check_attention(value: str, owner: str = "attention_core") -> str:
    """``value`` if it names an attention core (:data:`phalanx.config.ATTENTION`: ``plain`` forms
    the [B, H, T, T] scores and probabilities, ``blocked`` is
    :func:`phalanx.layers.blocked_attention.causal_attention`), else a ValueError naming ``owner``."""
    if value not in ATTENTION:
        raise ValueError(f"{owner}={value!r} is not valid; choose one of: {', '.join(ATTENTION)}")
    return value


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
    ``attention_core``: ``"plain"`` (the scores as one ``[B, H, T, T]`` matrix) or
    ``"blocked"`` (:func:`phalanx.layers.blocked_attention.causal_attention`: by query blocks,
    no full-size score matrix kept, the same numbers within round-off): causal, without
    ``attention_mask`` / ``padding_mask``, on a sequence length known when traced, and no
    ``dropout``; anything else is refused with a ValueError naming the layer.

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
                 bias_initializer="zeros", seed: int | None = None, kernels=None, attention_core: str = "plain",
                 **kwargs):
        super().__init__(tp=tp, **kwargs)
        self.kernels = kernels_lib.get(kernels)
        self.attention_core = check_attention(attention_core, f"layer {self.name!r}: attention_core")
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
        if dropout and self.attention_core == "blocked":
            raise ValueError(f"layer {self.name!r}: attention_core='blocked' does not drop attention probabilities "
                             f"(dropout={dropout!r}); use attention_core='plain' or dropout=0")
        if not causal and self.attention_core == "blocked":
            raise ValueError(f"layer {self.name!r}: attention_core='blocked' computes causal attention only; use "
                             f"attention_core='plain' with causal=False")
        self.use_bias, self.causal, self.dropout, self.seed = use_bias, causal, float(dropout), seed
        self.rope_max_wavelength, self.rope_scaling_factor = rope_max_wavelength, float(rope_scaling_factor)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout else None

    #: what wraps the attention core ``(q, k, v) -> o`` (scores, softmax, weighted sum), e.g.
    #: ``tf.recompute_grad``: set while a training step is traced with
    #: ``parallel.recompute=selective`` (:func:`phalanx.parallel.recompute.attention_cores`);
    #: None: the core runs as it is
    core_wrapper = None

    #: the dimension each logical weight is cut along (the head axis; None: whole)
    SPLIT_AXES = {"query": 1, "query_bias": 0, "key": 1, "key_bias": 0, "value": 1, "value_bias": 0,
                  "output": 0, "output_bias": None}

    def build(self, input_shape):
        d, h, kv, hd = input_shape[-1], self.num_heads, self.num_kv_heads, self.head_dim
        self._shard_vars = {}

        def add(name, shape, bias=False):
            init = self.bias_initializer if bias else self.kernel_initializer
            self._shard_vars[name] = self.add_logical_weight(name, shape, self.SPLIT_AXES[name], initializer=init)

        for name, heads in (("query", h), ("key", kv), ("value", kv)):
            add(name, (d, heads, hd))
            if self.use_bias:
                add(f"{name}_bias", (heads, hd), bias=True)
        add("output", (h, hd, d))
        if self.use_bias:
            add("output_bias", (d,), bias=True)

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

    def shard_weights(self) -> list[dict]:
        """Shard ``r``'s weights as tensors on their devices: ``query``, ``key``, ``value``,
        ``output`` and (with ``use_bias``) ``query_bias``, ``key_bias``, ``value_bias`` — the
        ``weights`` of :meth:`partials` (``output_bias`` is whole: added after the sum)."""
        out = [{} for _ in range(self.tp)]
        for name, (variables, split_axis, _) in self._logical.items():
            if split_axis is not None:
                for r, value in enumerate(shard_values(self, variables)):
                    out[r][name] = value
        return out

    def partials(self, xs: list, weights: list, attention_mask=None, padding_mask=None, training=None) -> list:
        """The per-shard partial outputs (before their sum and ``output_bias``) when shard
        ``r`` reads input ``xs[r]`` ``[B, T, D]`` with ``weights[r]`` (as :meth:`shard_weights`
        gives them), on the device of its ``output`` value. The one definition of the
        attention's per-shard math: :meth:`call` and the sequence-parallel
        :class:`~phalanx.layers.transformer.TransformerBlock` run it.

        With no ``attention_mask`` / ``padding_mask`` a causal layer's softmax is the layer's
        ``kernels.causal_softmax``; masks go through the float32 additive-mask softmax. The
        attention core is wrapped by :attr:`core_wrapper` when one is set.
        """
        dropping = bool(training) and self.dropout > 0
        # Seeds drawn once, outside the shards' device scopes: the generator's state is one
        # whole variable, and each shard must drop with its own seed.
        seeds = [self.seed_generator.next() for _ in weights] if dropping else [None] * len(weights)
        parts = []
        for r, w in enumerate(weights):
            with on_device_of(w["output"]):
                parts.append(self._shard(tf.cast(xs[r], self.compute_dtype), w, attention_mask, padding_mask,
                                         seeds[r]))
        return parts

    def _shard(self, x, w, attention_mask, padding_mask, seed):
        b, t, d = dims(x)
        hd, groups = self.head_dim, self.num_heads // self.num_kv_heads
        kv = self.num_kv_heads // self.tp                 # key/value heads per shard
        kernels, wrap_core = self.kernels, self.core_wrapper

        def project(name, heads):
            bias = w.get(f"{name}_bias")
            y = matmul(x, tf.reshape(w[name], [d, heads * hd]),
                       bias=None if bias is None else tf.reshape(bias, [heads * hd]))
            return tf.reshape(y, [b, t, heads, hd])

        q, k, v = project("query", kv * groups), project("key", kv), project("value", kv)
        if self.rope_max_wavelength is not None:
            q = rotary(q, self.rope_max_wavelength, self.rope_scaling_factor)
            k = rotary(k, self.rope_max_wavelength, self.rope_scaling_factor)

        def blocked(q, k, v):
            o = blocked_attention.causal_attention(swap_heads(q, 2), swap_heads(k, 2), swap_heads(v, 2))
            return tf.reshape(swap_heads(o, 1), [b, t, kv * groups * hd])

        def core(q, k, v):
            q = q * tf.cast(1.0 / math.sqrt(hd), q.dtype)
            # A group's query heads share one key/value head: fold them into the query
            # length, [B, kv, groups*T, hd], so K and V are never repeated.
            q = tf.reshape(swap_heads(q, 2), [b, kv, groups * t, hd])
            k, v = swap_heads(k, 2), swap_heads(v, 2)
            # [B, H, T, T] (a reshape: a group's query rows are consecutive)
            scores = tf.reshape(tf.matmul(q, k, transpose_b=True), [b, kv * groups, t, t])
            if self.causal and attention_mask is None and padding_mask is None:
                probs = kernels.causal_softmax(scores)
            else:
                scores = tf.cast(scores, "float32")
                mask = self._mask(x, attention_mask, padding_mask)
                if mask is not None:
                    scores += (1.0 - tf.cast(mask, "float32"))[:, None] * _MASKED
                probs = tf.nn.softmax(scores, axis=-1)
            if seed is not None:
                probs = tf.nn.experimental.stateless_dropout(probs, rate=self.dropout, seed=seed)
            probs = tf.reshape(tf.cast(probs, self.compute_dtype), [b, kv, groups * t, t])
            o = swap_heads(tf.reshape(tf.matmul(probs, v), [b, kv * groups, t, hd]), 1)
            return tf.reshape(o, [b, t, kv * groups * hd])

        if self.attention_core == "blocked":  # honoured or refused, never silently the plain core
            if attention_mask is not None or padding_mask is not None or x.shape[1] is None:
                raise ValueError(f"layer {self.name!r}: attention_core='blocked' takes no attention_mask or "
                                 f"padding_mask and needs the sequence length when traced (got "
                                 f"attention_mask={'set' if attention_mask is not None else None}, padding_mask="
                                 f"{'set' if padding_mask is not None else None}, length {x.shape[1]}); use "
                                 f"attention_core='plain'")
            core = blocked
        o = (core if wrap_core is None else wrap_core(core))(q, k, v)
        return matmul(o, tf.reshape(w["output"], [kv * groups * hd, d]))

    def call(self, inputs, attention_mask=None, padding_mask=None, training=None):
        x = tf.cast(inputs, self.compute_dtype)
        weights = self.shard_weights()
        y = add_shards(self.partials([x] * self.tp, weights, attention_mask, padding_mask, training),
                       weights[0]["output"])
        if self.use_bias:
            with on_device_of(weights[0]["output"]):
                y = y + shard_values(self, [self.whole_variable("output_bias")])[0]
        return y

    def compute_output_spec(self, inputs, attention_mask=None, padding_mask=None, training=None):
        return keras.KerasTensor(tuple(inputs.shape), dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "head_dim": self.head_dim,
                "num_kv_heads": self.num_kv_heads, "use_bias": self.use_bias, "causal": self.causal,
                "rope_max_wavelength": self.rope_max_wavelength, "rope_scaling_factor": self.rope_scaling_factor,
                "dropout": self.dropout, "seed": self.seed, "kernels": kernels_lib.serialize(self.kernels),
                "attention_core": self.attention_core,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer)}
