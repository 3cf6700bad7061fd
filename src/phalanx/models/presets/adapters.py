"""Conversions between plain Keras / keras-hub layers and phalanx's tensor-parallel layers.

Each rule kind of :func:`phalanx.models.parallelize.parallelize` has conversions, one per
source layer type it fits:

=============  =====================================================================
``column``     ``keras.layers.Dense`` (or a Dense-like ``EinsumDense``) -> ``ColumnParallelDense``
``row``        the same -> ``RowParallelDense``
``vocab``      ``keras.layers.Embedding`` -> ``VocabParallelEmbedding``;
               ``keras.layers.ReversibleEmbedding`` (keras-hub's token embedding, also the
               tied or untied LM head with ``reverse=True``) -> :class:`ParallelReversibleEmbedding`
``attention``  ``keras.layers.MultiHeadAttention`` (keras-hub's ``CachedMultiHeadAttention``,
               GPT-2) -> :class:`ParallelMultiHeadAttention`; keras-hub ``LlamaAttention`` ->
               :class:`ParallelLlamaAttention`; keras-hub ``CachedMistralAttention`` ->
               :class:`ParallelMistralAttention`
``mlp``        a keras-hub gated decoder block (``LlamaTransformerDecoder``,
               ``MistralTransformerDecoder``): its three FFN Dense layers -> one ``ParallelMLP``
=============  =====================================================================

A converted layer is built, holds the source layer's current weights (as logical values)
and remembers how to make the source layer again (:class:`Origin`: the class, its config
and the logical -> source weight map), never the source layer itself: :func:`to_plain`
rebuilds a fresh plain layer from that config and the current (trained) weights.

The adapters subclass :class:`~phalanx.layers.ParallelSelfAttention` and
:class:`~phalanx.layers.VocabParallelEmbedding` and only change the call signature (the
one the keras-hub block uses) and the weight mapping: the numbers are those layers'.
Generation with a key/value cache is not supported on the sharded layers: a cache
argument raises ``NotImplementedError`` (generate with the plain model after
:func:`~phalanx.models.parallelize.unparallelize`).

keras-hub is never imported here: its classes are recognised by name and module, so
phalanx works without it.
"""

from __future__ import annotations

import inspect
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from phalanx.layers.attention import ParallelSelfAttention
from phalanx.layers.sharding import ShardedLayer, on_device_of
from phalanx.layers.tensor_parallel import (
    ColumnParallelDense,
    ParallelMLP,
    RowParallelDense,
    VocabParallelEmbedding,
    join_vocab_logits,
    matmul,
    shard_values,
)

_NO_CACHE = ("layer {name!r} is tensor-parallel and does not take a key/value cache: generate with the plain "
             "model (phalanx.unparallelize(model) first)")


def _np(v) -> np.ndarray:
    return np.asarray(v.numpy() if hasattr(v, "numpy") else keras.ops.convert_to_numpy(v))


def is_keras_hub(layer, *names: str) -> bool:
    """Whether ``layer`` is (a subclass of) one of keras-hub's classes called ``names``."""
    return any(c.__name__ in names and c.__module__.startswith("keras_hub") for c in type(layer).__mro__)


# ---------------------------------------------------------------------------------------------
# Origin: how to make the plain layer again
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Origin:
    """What :func:`to_plain` needs to rebuild the source layer of a converted one: its class,
    the keyword arguments of its constructor, the shape(s) to build it with, and where each
    logical weight goes (``{logical name: sub-layer attribute path + "." + variable name}``,
    e.g. ``{"query": "_query_dense.kernel"}``)."""

    cls: type
    kwargs: dict
    build_args: tuple
    weight_map: dict = field(default_factory=dict)
    build_kwargs: dict = field(default_factory=dict)


def build_at(layer, parent_path, *args, **kwargs) -> None:
    """Build ``layer`` as if its parent were building it: its variables get the paths (e.g.
    ``transformer_layer_0/self_attention/query/kernel``) of the layer it stands for."""
    layer._parent_path = parent_path
    layer.build(*args, **kwargs)


def _set_origin(layer, origin: Origin) -> None:
    object.__setattr__(layer, "_phalanx_origin", origin)


def origin_of(layer) -> Origin | None:
    return getattr(layer, "_phalanx_origin", None)


def _resolve(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def to_plain(layer):
    """A fresh plain layer made from ``layer``'s :class:`Origin`, built, holding ``layer``'s
    current weights. A layer with no origin (loaded from a file, or built directly) is made
    from its own config when it has a plain twin (column/row Dense -> ``Dense``, vocab
    embeddings -> ``Embedding`` / ``ReversibleEmbedding``, the MultiHeadAttention adapter ->
    ``MultiHeadAttention``)."""
    origin = origin_of(layer) or _fallback_origin(layer)
    if origin is None:
        raise ValueError(f"layer {layer.name!r} ({type(layer).__name__}) has no plain Keras twin to make")
    plain = origin.cls(**origin.kwargs)
    build_at(plain, getattr(layer, "_parent_path", None), *origin.build_args, **origin.build_kwargs)
    values = layer.logical_weights()
    for name, target in origin.weight_map.items():
        variable = _resolve(plain, target)
        variable.assign(values[name].astype(variable.dtype))
    return plain


def _fallback_origin(layer) -> Origin | None:
    """The plain layer a tensor-parallel layer with no :class:`Origin` (one loaded from a file,
    or built directly) stands for, from its own config; None when it has no plain twin
    (``ParallelSelfAttention`` with rotary embeddings, ``ParallelMLP``, ...)."""
    common = {"name": layer.name, "dtype": layer.dtype_policy}
    if type(layer) in (ColumnParallelDense, RowParallelDense):
        n_in = int(layer.kernel[0].shape[0]) * (layer.tp if isinstance(layer, RowParallelDense) else 1)
        kwargs = {"units": layer.units, "activation": layer.activation, "use_bias": layer.use_bias,
                  "kernel_initializer": layer.kernel_initializer, "bias_initializer": layer.bias_initializer, **common}
        wmap = {"kernel": "kernel", **({"bias": "bias"} if layer.use_bias else {})}
        return Origin(keras.layers.Dense, kwargs, ((None, n_in),), wmap)
    if type(layer) is VocabParallelEmbedding:
        kwargs = {"input_dim": layer.vocab, "output_dim": layer.dim,
                  "embeddings_initializer": layer.embeddings_initializer, **common}
        return Origin(keras.layers.Embedding, kwargs, (None,), {"embeddings": "embeddings"})
    if isinstance(layer, ParallelReversibleEmbedding):
        kwargs = {"input_dim": layer.vocab, "output_dim": layer.dim, "tie_weights": layer.tie_weights,
                  "logit_soft_cap": layer.logit_soft_cap, "reverse_dtype": layer.reverse_dtype,
                  "embeddings_initializer": layer.embeddings_initializer, **common}
        wmap = {"embeddings": "embeddings"}
        if not layer.tie_weights:
            wmap["reverse_embeddings"] = "reverse_embeddings"
        return Origin(keras.layers.ReversibleEmbedding, kwargs, (None,), wmap)
    if type(layer) is ParallelMultiHeadAttention:
        d = int(layer._shard_vars["query"][0].shape[0])
        kwargs = {"num_heads": layer.num_heads, "key_dim": layer.head_dim, "use_bias": layer.use_bias,
                  "dropout": layer.dropout, "seed": layer.seed, "kernel_initializer": layer.kernel_initializer,
                  "bias_initializer": layer.bias_initializer, **common}
        return Origin(keras.layers.MultiHeadAttention, kwargs, (), {**_QKVO, **(_QKVO_BIAS if layer.use_bias else {})},
                      build_kwargs={"query_shape": (None, None, d), "value_shape": (None, None, d)})
    return None


def can_make_plain(layer) -> bool:
    """Whether :func:`to_plain` knows the plain layer ``layer`` stands for."""
    return isinstance(layer, ShardedLayer) and (origin_of(layer) is not None or _fallback_origin(layer) is not None)


# ---------------------------------------------------------------------------------------------
# Saving in the plain layout
# ---------------------------------------------------------------------------------------------

class WeightView(keras.layers.Layer):
    """Stands in a ``.keras`` / ``.weights.h5`` file where a plain sub-layer was (e.g. the
    ``_query_dense`` of keras-hub's attention): it saves the given logical weights of the
    tensor-parallel layer that now holds them, whole, in that sub-layer's order, and loads
    them back into it. So a converted keras-hub model saves the file its plain model saves
    (keras-hub alone reloads it) and loads a plain model's weights. It holds no variable and
    is not tracked as a layer (so it is not in ``model.layers`` or ``model.weights``)."""

    def __init__(self, owner, names, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "_phalanx_owner", weakref.ref(owner))
        object.__setattr__(self, "_phalanx_names", tuple(names))

    def save_own_variables(self, store):
        values = self._phalanx_owner().logical_weights()
        for i, name in enumerate(self._phalanx_names):
            store[f"{i}"] = values[name]

    def load_own_variables(self, store):
        names = self._phalanx_names
        if len(store.keys()) != len(names):
            raise ValueError(f"layer {self.name!r} expects {len(names)} saved weights ({list(names)}), the file "
                             f"holds {len(store.keys())}")
        self._phalanx_owner().set_logical_weights({name: store[f"{i}"] for i, name in enumerate(names)})


def attach_views(holder, owner, views: dict) -> None:
    """Put a :class:`WeightView` of ``owner`` at each ``holder.<attribute>`` of ``views``
    (``{attribute or (attribute, alias, ...): (sub-layer name, [logical weight names])}``;
    one view under every name), untracked, and let ``owner`` save nothing itself (its
    weights are saved through the views). Keras's files name a sub-layer by the first of
    its attribute names in ``dir`` order, public names first (``MultiHeadAttention`` has
    ``query_dense`` for ``_query_dense``), so a view stands under all of them."""
    for attrs, (name, names) in views.items():
        view = WeightView(owner, names, name=name)
        for attr in (attrs,) if isinstance(attrs, str) else attrs:
            object.__setattr__(holder, attr, view)
    object.__setattr__(owner, "_phalanx_viewed", True)


class _SavedThroughViews:
    """Mixin: a layer whose weights are saved by :class:`WeightView` s saves nothing itself."""

    def save_own_variables(self, store):
        if not getattr(self, "_phalanx_viewed", False):
            super().save_own_variables(store)

    def load_own_variables(self, store):
        if not getattr(self, "_phalanx_viewed", False):
            super().load_own_variables(store)


# ---------------------------------------------------------------------------------------------
# Dense -> column / row
# ---------------------------------------------------------------------------------------------

def dense_dims(layer) -> tuple[int, int] | None:
    """``(input width, units)`` of a ``Dense`` or of an ``EinsumDense`` that is one (a 2-D kernel
    contracting the last axis, bias on the output axis or none); None for anything else."""
    if isinstance(layer, keras.layers.Dense):
        if layer.kernel is None:
            return None
        return int(layer.kernel.shape[0]), int(layer.kernel.shape[1])
    if isinstance(layer, keras.layers.EinsumDense):
        m = re.fullmatch(r"\s*(\.\.\.)?([a-z]*)\s*,\s*([a-z]{2})\s*->\s*(\.\.\.)?([a-z]*)\s*", layer.equation)
        if not m or layer.kernel is None or len(layer.kernel.shape) != 2:
            return None
        lhs, kernel, out = m.group(2), m.group(3), m.group(5)
        if bool(m.group(1)) != bool(m.group(4)) or not lhs or lhs[-1] != kernel[0] or out != lhs[:-1] + kernel[1]:
            return None
        if layer.bias_axes not in (None, "", kernel[1]):
            return None
        return int(layer.kernel.shape[0]), int(layer.kernel.shape[1])
    return None


def _dense_unsupported(layer) -> str | None:
    for attr in ("kernel_regularizer", "bias_regularizer", "kernel_constraint", "bias_constraint",
                 "activity_regularizer"):
        if getattr(layer, attr, None) is not None:
            return f"has a {attr.replace('_', ' ')}, which the tensor-parallel Dense does not carry"
    if getattr(layer, "lora_enabled", False):
        return "has LoRA enabled"
    if getattr(layer, "quantization_mode", None):
        return f"is quantized ({layer.quantization_mode})"
    return None


def _dense_origin(layer) -> Origin:
    n_in, _ = dense_dims(layer)
    built_with = getattr(layer, "_build_shapes_dict", None)
    if built_with and len(built_with) == 1:  # the shape Keras built it with (its input spec)
        shape = tuple(next(iter(built_with.values())))
    elif isinstance(layer, keras.layers.EinsumDense):
        lhs = layer.equation.split(",")[0].strip()
        batch_dims = len(lhs.replace("...", "")) - 1 + (1 if "..." in lhs else 0)
        shape = (None,) * batch_dims + (n_in,)
    else:
        shape = (None, n_in)
    wmap = {"kernel": "kernel"}
    if getattr(layer, "bias", None) is not None:
        wmap["bias"] = "bias"
    return Origin(type(layer), layer.get_config(), (shape,), wmap)


def _dense_to(cls, layer, tp: int):
    n_in, units = dense_dims(layer)
    use_bias = getattr(layer, "bias", None) is not None
    new = cls(units, tp=tp, activation=layer.activation, use_bias=use_bias,
              kernel_initializer=layer.kernel_initializer,
              bias_initializer=getattr(layer, "bias_initializer", "zeros"),
              dtype=layer.dtype_policy, name=layer.name)
    build_at(new, layer._parent_path, (None, n_in))
    values = {"kernel": _np(layer.kernel)}
    if use_bias:
        values["bias"] = _np(layer.bias)
    new.set_logical_weights(values)
    _set_origin(new, _dense_origin(layer))
    return new


def _dense_problems(layer, tp, split_axis: int, what: str):
    """Why ``layer`` cannot be cut over ``tp`` along its kernel's ``split_axis`` (None if it
    can); ``what`` names the split dimension in the message, ``{}`` standing for its size."""
    dims = dense_dims(layer)
    if dims is None:
        return "is not a Dense layer (or an EinsumDense equal to one)"
    if _dense_unsupported(layer):
        return _dense_unsupported(layer)
    if dims[split_axis] % tp:
        return f"has {what.format(dims[split_axis])}, which tp={tp} does not divide"
    return None


def column_problems(layer, tp):
    return _dense_problems(layer, tp, 1, "{} output units")


def row_problems(layer, tp):
    return _dense_problems(layer, tp, 0, "input width {}")


def to_column(layer, tp):
    return _dense_to(ColumnParallelDense, layer, tp)


def to_row(layer, tp):
    return _dense_to(RowParallelDense, layer, tp)


# ---------------------------------------------------------------------------------------------
# Embedding -> vocab
# ---------------------------------------------------------------------------------------------

@keras.saving.register_keras_serializable(package="phalanx")
class ParallelReversibleEmbedding(VocabParallelEmbedding):
    """:class:`~phalanx.layers.VocabParallelEmbedding` with the options of
    ``keras.layers.ReversibleEmbedding`` (keras-hub's token embedding): ``tie_weights=False``
    adds a separate output head ``reverse_embeddings [dim, vocab]`` cut along the vocabulary
    (shard ``r`` computes its slice of the logits on its device), ``logit_soft_cap`` caps the
    reverse logits with ``tanh(logits / cap) * cap`` (shard by shard), ``reverse_dtype`` runs
    the reverse matmul in that dtype. Logical weights: ``embeddings`` and, untied,
    ``reverse_embeddings``, as the Keras layer.

    Example:
        >>> import numpy as np
        >>> emb = ParallelReversibleEmbedding(8, 4, tp=2, tie_weights=False)
        >>> tuple(emb(np.array([[1, 7]]), reverse=False).shape), list(emb.logical_weights())
        ((1, 2, 4), ['embeddings', 'reverse_embeddings'])
    """

    def __init__(self, vocab: int, dim: int, tp: int = 1, tie_weights: bool = True, logit_soft_cap=None,
                 reverse_dtype=None, **kwargs):
        super().__init__(vocab, dim, tp=tp, **kwargs)
        self.tie_weights, self.logit_soft_cap, self.reverse_dtype = bool(tie_weights), logit_soft_cap, reverse_dtype

    def build(self, input_shape=None):
        super().build(input_shape)
        self.reverse_embeddings = (None if self.tie_weights else
                                   self.add_logical_weight("reverse_embeddings", (self.dim, self.vocab), split_axis=1,
                                                           initializer=self.embeddings_initializer))

    def call(self, inputs, reverse: bool = False):
        if not reverse:
            return super().call(inputs)
        if self.tie_weights:
            tables, transpose = shard_values(self, self.embeddings), True
        else:
            tables, transpose = shard_values(self, self.reverse_embeddings), False
        x = tf.cast(inputs, self.compute_dtype)
        logits = []
        for table in tables:
            with on_device_of(table):
                xr, tr = x, table
                if self.reverse_dtype is not None:
                    xr, tr = tf.cast(xr, self.reverse_dtype), tf.cast(tr, self.reverse_dtype)
                z = matmul(xr, tr, transpose_b=transpose)
                if self.logit_soft_cap is not None:
                    cap = tf.cast(self.logit_soft_cap, z.dtype)
                    z = tf.tanh(z / cap) * cap
                logits.append(z)
        return join_vocab_logits(logits, tables[0])

    def compute_output_spec(self, inputs, reverse: bool = False):
        shape = list(inputs.shape)
        shape = shape[:-1] + [self.vocab] if reverse else shape + [self.dim]
        dtype = self.reverse_dtype if (reverse and self.reverse_dtype) else self.compute_dtype
        return keras.KerasTensor(shape, dtype=dtype)

    def get_config(self):
        return {**super().get_config(), "tie_weights": self.tie_weights, "logit_soft_cap": self.logit_soft_cap,
                "reverse_dtype": self.reverse_dtype}


@keras.saving.register_keras_serializable(package="phalanx")
class ReversibleEmbedding(ParallelReversibleEmbedding):
    """:class:`ParallelReversibleEmbedding` under the name of the Keras layer it replaces.
    Keras's files name the layers of a Functional model by class (``reversible_embedding``),
    and keras-hub's token embedding is one of them: under this name a converted keras-hub
    model saves the file its plain model saves (keras-hub alone reloads it), and loads a
    plain model's weights."""


def vocab_problems(layer, tp):
    if not isinstance(layer, keras.layers.Embedding):
        return "is not an Embedding"
    if layer.mask_zero:
        return "has mask_zero=True, which the vocab-parallel embedding does not implement"
    for attr in ("embeddings_regularizer", "embeddings_constraint", "activity_regularizer"):
        if getattr(layer, attr, None) is not None:
            return f"has an {attr.replace('_', ' ')}, which the vocab-parallel embedding does not carry"
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "is quantized or has LoRA enabled"
    if layer.input_dim % tp:
        return f"has a vocabulary of {layer.input_dim}, which tp={tp} does not divide"
    return None


def to_vocab(layer, tp):
    reversible = isinstance(layer, keras.layers.ReversibleEmbedding)
    common = {"embeddings_initializer": layer.embeddings_initializer, "dtype": layer.dtype_policy, "name": layer.name}
    if reversible:
        new = ReversibleEmbedding(layer.input_dim, layer.output_dim, tp=tp, tie_weights=layer.tie_weights,
                                  logit_soft_cap=layer.logit_soft_cap, reverse_dtype=layer.reverse_dtype, **common)
    else:
        new = VocabParallelEmbedding(layer.input_dim, layer.output_dim, tp=tp, **common)
    build_at(new, layer._parent_path)
    values = {"embeddings": _np(layer.embeddings)}
    wmap = {"embeddings": "embeddings"}
    if reversible and not layer.tie_weights:
        values["reverse_embeddings"] = _np(layer.reverse_embeddings)
        wmap["reverse_embeddings"] = "reverse_embeddings"
    new.set_logical_weights(values)
    _set_origin(new, Origin(type(layer), layer.get_config(), (None,), wmap))
    return new


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

def _unattended_to(y, mask, fill=None):
    """``y [B, T, D]`` with the rows whose mask ``[B, T, S]`` attends to nothing set to ``fill``
    (zeros when None). ``keras.layers.Softmax`` gives such rows all-zero probabilities
    (keras-hub's Llama and Mistral, and Keras's MultiHeadAttention with dropout), so the
    attention output there is the output bias; ParallelSelfAttention's softmax spreads
    them evenly instead. Only padded query positions have such rows."""
    if mask is None:
        return y
    mask = tf.convert_to_tensor(mask)
    if mask.shape.rank != 3:
        return y
    with on_device_of(y):
        seen = tf.reduce_any(tf.cast(mask, "bool"), axis=-1)[..., None]
        fill = tf.zeros_like(y) if fill is None else tf.broadcast_to(tf.cast(fill, y.dtype), tf.shape(y))
        return tf.where(seen, y, fill)


def _causal(t):
    i = tf.range(t)
    return (i[:, None] >= i[None, :])[None]


@keras.saving.register_keras_serializable(package="phalanx")
class ParallelMultiHeadAttention(_SavedThroughViews, ParallelSelfAttention):
    """``keras.layers.MultiHeadAttention``'s call signature (and keras-hub's
    ``CachedMultiHeadAttention``'s, GPT-2) over :class:`~phalanx.layers.ParallelSelfAttention`:
    ``call(query, value, key=None, attention_mask=None, training=None, use_causal_mask=False,
    cache=None, cache_update_index=None)``, self-attention only (``value`` and ``key`` are
    ``query`` or None). ``attention_mask [B, T, T]`` (1 = attend) combines with the causal
    mask when ``use_causal_mask``. Scores scale by ``1/sqrt(head_dim)``, as Keras's.
    Cross-attention, ``return_attention_scores``, the query/key/value masks and a cache
    raise ``NotImplementedError``."""

    def __init__(self, num_heads: int, head_dim: int, tp: int = 1, zero_unattended: bool = False, **kwargs):
        kwargs.setdefault("causal", False)
        super().__init__(num_heads, head_dim, tp=tp, **kwargs)
        # Keras's MultiHeadAttention with dropout > 0 takes its Softmax path, which gives a
        # query that may attend to nothing zero probabilities (without dropout, its fused
        # path spreads them evenly, as ParallelSelfAttention does).
        self.zero_unattended = bool(zero_unattended)
        # Keep the caller's tensors as they are, so `value is query` tells self-attention
        # (ParallelSelfAttention casts to the compute dtype itself).
        self._convert_input_args = False

    def call(self, query, value=None, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, return_attention_scores=False, training=None, use_causal_mask=False,
             cache=None, cache_update_index=None):
        if cache is not None or cache_update_index is not None:
            raise NotImplementedError(_NO_CACHE.format(name=self.name))
        if return_attention_scores:
            raise NotImplementedError(f"layer {self.name!r}: return_attention_scores is not supported")
        if any(m is not None for m in (query_mask, value_mask, key_mask)):
            raise NotImplementedError(f"layer {self.name!r}: query/value/key masks are not supported; pass "
                                      f"attention_mask")
        if (value is not None and value is not query) or (key is not None and key is not query):
            raise NotImplementedError(f"layer {self.name!r} is tensor-parallel self-attention: value and key must "
                                      f"be the query tensor itself (cross-attention is not supported)")
        mask = attention_mask
        if use_causal_mask:
            causal = _causal(tf.shape(query)[1])
            mask = causal if mask is None else tf.logical_and(tf.cast(mask, "bool"), causal)
        y = super().call(query, attention_mask=mask, training=training)
        if self.zero_unattended and mask is not None:
            mask = tf.broadcast_to(tf.cast(mask, "bool"), tf.concat([tf.shape(query)[:2], tf.shape(query)[1:2]], 0))
            bias = shard_values(self, self._shard_vars["output_bias"])[0] if self.use_bias else None
            y = _unattended_to(y, mask, bias)
        return y

    def build(self, input_shape):
        super().build(input_shape)
        bias = ["_bias"] if self.use_bias else []
        attach_views(self, self, {(f"_{part}_dense", f"{part}_dense"): (name, [f"{logical}{b}" for b in [""] + bias])
                                  for part, name, logical in (("query", "query", "query"), ("key", "key", "key"),
                                                              ("value", "value", "value"),
                                                              ("output", "attention_output", "output"))})

    def get_config(self):
        return {**super().get_config(), "zero_unattended": self.zero_unattended}

    def compute_output_shape(self, query_shape, value_shape=None, key_shape=None, **kwargs):
        return tuple(query_shape)

    def compute_output_spec(self, query, *args, **kwargs):
        return keras.KerasTensor(query.shape, dtype=self.compute_dtype)


@keras.saving.register_keras_serializable(package="phalanx")
class ParallelLlamaAttention(_SavedThroughViews, ParallelSelfAttention):
    """keras-hub ``LlamaAttention``'s call signature, ``call(hidden_states,
    attention_mask=None, cache=None, cache_update_index=None, training=None)``, over
    :class:`~phalanx.layers.ParallelSelfAttention` with grouped-query heads and rotary
    embeddings. The mask is the block's own (causal and padding, 1 = attend); no mask means
    none, as keras-hub's. ``cache`` raises ``NotImplementedError``."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads=None, tp: int = 1, **kwargs):
        kwargs.setdefault("causal", False)
        kwargs.setdefault("use_bias", False)
        super().__init__(num_heads, head_dim, num_kv_heads=num_kv_heads, tp=tp, **kwargs)

    def build(self, input_shape):
        super().build(input_shape)
        attach_views(self, self, {f"_{part}_dense": (name, [part]) for part, name in
                                  (("query", "query"), ("key", "key"), ("value", "value"),
                                   ("output", "attention_output"))})

    def call(self, hidden_states, attention_mask=None, cache=None, cache_update_index=None, training=None):
        if cache is not None or cache_update_index is not None:
            raise NotImplementedError(_NO_CACHE.format(name=self.name))
        y = super().call(hidden_states, attention_mask=attention_mask, training=training)
        # keras-hub's softmax (keras.layers.Softmax) zeroes a row that attends to nothing
        # (a padded query in a sliding window); no output bias, so the output there is 0.
        return _unattended_to(y, attention_mask)

    def compute_output_shape(self, hidden_states_shape, *args, **kwargs):
        return tuple(hidden_states_shape)

    def compute_output_spec(self, hidden_states, *args, **kwargs):
        return keras.KerasTensor(hidden_states.shape, dtype=self.compute_dtype)


@keras.saving.register_keras_serializable(package="phalanx")
class ParallelMistralAttention(ParallelLlamaAttention):
    """keras-hub ``CachedMistralAttention`` (same call as Llama's; the sliding window is in
    the block's mask, so the attention itself is Llama's with the plain rotary embedding)."""


def _mha_problems(layer, tp):
    if getattr(layer, "_output_shape", None) is not None:
        return "has a custom output_shape"
    if layer._value_dim != layer._key_dim:
        return f"has value_dim {layer._value_dim} != key_dim {layer._key_dim}"
    if tuple(layer._attention_axes or ()) not in ((), (1,)):
        return f"attends over axes {layer._attention_axes} (only the sequence axis is supported)"
    if getattr(layer, "_query_dense", None) is None or not layer._query_dense.built:
        return "is not built (call the model once first)"
    dims = [int(d._kernel.shape[0] if hasattr(d, "_kernel") else d.kernel.shape[0])
            for d in (layer._query_dense, layer._key_dense, layer._value_dense)]
    if len(set(dims)) != 1:
        return f"has query/key/value input widths {dims} (self-attention needs one width)"
    for attr in ("_kernel_regularizer", "_bias_regularizer", "_kernel_constraint", "_bias_constraint"):
        if getattr(layer, attr, None) is not None:
            return f"has a {attr.strip('_').replace('_', ' ')}, which the tensor-parallel attention does not carry"
    if layer._num_heads % tp:
        return f"has {layer._num_heads} heads, which tp={tp} does not divide"
    return None


def _llama_problems(layer, tp):
    if not layer.built:
        return "is not built (call the model once first)"
    kv = layer.num_key_value_heads
    if getattr(layer, "rope_frequency_adjustment_factor", None) is not None:
        return ("uses Llama 3.1 rotary frequency adjustment, which ParallelSelfAttention's rotary embedding does "
                "not implement")
    if kv % tp:
        return f"has {kv} key/value heads, which tp={tp} does not divide (each shard needs whole key/value heads)"
    return None


def _mistral_problems(layer, tp):
    if not layer.built:
        return "is not built (call the model once first)"
    kv = layer._num_key_value_heads
    if kv % tp:
        return f"has {kv} key/value heads, which tp={tp} does not divide (each shard needs whole key/value heads)"
    return None


def attention_problems(layer, tp):
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return _mha_problems(layer, tp)
    if is_keras_hub(layer, "LlamaAttention"):
        return _llama_problems(layer, tp)
    if is_keras_hub(layer, "CachedMistralAttention"):
        return _mistral_problems(layer, tp)
    return ("is not a self-attention layer phalanx can split (keras MultiHeadAttention, keras-hub "
            "CachedMultiHeadAttention, LlamaAttention or CachedMistralAttention)")


_QKVO = {"query": "_query_dense.kernel", "key": "_key_dense.kernel", "value": "_value_dense.kernel",
         "output": "_output_dense.kernel"}
_QKVO_BIAS = {"query_bias": "_query_dense.bias", "key_bias": "_key_dense.bias", "value_bias": "_value_dense.bias",
              "output_bias": "_output_dense.bias"}


def _copy_attention(new, layer, wmap):
    new.set_logical_weights({name: _np(_resolve(layer, target)) for name, target in wmap.items()})


def _warn_dropout(layer, rate):
    if rate:
        warnings.warn(f"layer {layer.name!r}: keras-hub drops the attention output (before the output projection); "
                      f"the tensor-parallel attention drops the attention probabilities instead (rate {rate})",
                      stacklevel=3)


def to_attention(layer, tp):
    if isinstance(layer, keras.layers.MultiHeadAttention):
        d = int(layer._query_dense.kernel.shape[0])
        use_bias = bool(layer._use_bias)
        new = ParallelMultiHeadAttention(layer._num_heads, layer._key_dim, tp=tp, use_bias=use_bias,
                                         dropout=layer._dropout, zero_unattended=layer._dropout > 0, seed=layer.seed,
                                         kernel_initializer=layer._kernel_initializer,
                                         bias_initializer=layer._bias_initializer,
                                         dtype=layer.dtype_policy, name=layer.name)
        wmap = {**_QKVO, **(_QKVO_BIAS if use_bias else {})}
        origin = Origin(type(layer), layer.get_config(), (), wmap,
                        build_kwargs={"query_shape": (None, None, d), "value_shape": (None, None, d)})
    elif is_keras_hub(layer, "LlamaAttention"):
        d = int(layer._query_dense.kernel.shape[0])
        hd = int(layer._query_dense.kernel.shape[-1])
        _warn_dropout(layer, layer.dropout)
        # keras-hub's LlamaRotaryEmbedding overrides the inverse frequencies without the
        # position scaling factor, so Llama's rope_position_scaling_factor has no effect there:
        # the same here.
        new = ParallelLlamaAttention(layer.num_query_heads, hd, num_kv_heads=layer.num_key_value_heads, tp=tp,
                                     rope_max_wavelength=layer.rope_max_wavelength, rope_scaling_factor=1.0,
                                     dropout=layer.dropout, kernel_initializer=layer.kernel_initializer,
                                     dtype=layer.dtype_policy, name=layer.name)
        kwargs = {"num_query_heads": layer.num_query_heads, "num_key_value_heads": layer.num_key_value_heads,
                  "rope_max_wavelength": layer.rope_max_wavelength,
                  "rope_position_scaling_factor": layer.rope_position_scaling_factor,
                  "rope_frequency_adjustment_factor": layer.rope_frequency_adjustment_factor,
                  "rope_low_freq_factor": layer.rope_low_freq_factor,
                  "rope_high_freq_factor": layer.rope_high_freq_factor,
                  "rope_pretraining_sequence_length": layer.rope_pretraining_sequence_length,
                  "kernel_initializer": keras.initializers.serialize(layer.kernel_initializer),
                  "dropout": layer.dropout, "dtype": layer.dtype_policy, "name": layer.name}
        origin = Origin(type(layer), kwargs, ((None, None, d),), dict(_QKVO))
        wmap = _QKVO
    else:  # keras-hub CachedMistralAttention
        d = int(layer._query_dense.kernel.shape[0])
        _warn_dropout(layer, layer._dropout)
        new = ParallelMistralAttention(layer._num_query_heads, layer._head_dim,
                                       num_kv_heads=layer._num_key_value_heads, tp=tp,
                                       rope_max_wavelength=layer._rope_max_wavelength,
                                       rope_scaling_factor=layer._rope_scaling_factor, dropout=layer._dropout,
                                       kernel_initializer=layer._kernel_initializer, dtype=layer.dtype_policy,
                                       name=layer.name)
        origin = Origin(type(layer), layer.get_config(), ((None, None, d),), dict(_QKVO))
        wmap = _QKVO
    build_at(new, layer._parent_path, (None, None, d))
    _copy_attention(new, layer, wmap)
    _set_origin(new, origin)
    return new


# ---------------------------------------------------------------------------------------------
# A gated decoder block's FFN -> ParallelMLP
# ---------------------------------------------------------------------------------------------

_GATED_BLOCKS = ("LlamaTransformerDecoder", "MistralTransformerDecoder")
_GATED_CALL = ("self", "decoder_sequence", "decoder_padding_mask", "decoder_attention_mask", "self_attention_cache",
               "self_attention_cache_update_index", "training")
_FFN = ("_feedforward_intermediate_dense", "_feedforward_gate_dense", "_feedforward_output_dense")


def _gated_block_call(self, decoder_sequence, decoder_padding_mask=None, decoder_attention_mask=None,
                      self_attention_cache=None, self_attention_cache_update_index=None, training=None):
    """keras-hub's Llama / Mistral decoder block (``call`` of ``LlamaTransformerDecoder`` and
    ``MistralTransformerDecoder``, identical in keras-hub 0.32) with its three FFN Dense layers
    replaced by one :class:`~phalanx.layers.ParallelMLP` (``self._phalanx_mlp``)."""
    if self_attention_cache is not None or self_attention_cache_update_index is not None:
        raise NotImplementedError(_NO_CACHE.format(name=self.name))
    mask = self._compute_self_attention_mask(
        decoder_sequence=decoder_sequence, decoder_padding_mask=decoder_padding_mask,
        decoder_attention_mask=decoder_attention_mask, self_attention_cache=None,
        self_attention_cache_update_index=None)
    residual = decoder_sequence
    x = self._self_attention_layernorm(decoder_sequence)
    x = self._self_attention_layer(hidden_states=x, attention_mask=mask, cache=None, cache_update_index=None)
    x = self._self_attention_dropout(x, training=training)
    x = x + residual
    residual = x
    x = self._feedforward_layernorm(x)
    x = self._phalanx_mlp(x)
    return x + residual


@dataclass(frozen=True)
class BlockOrigin:
    """The three FFN Dense layers' configs and build shapes (rebuilt by :func:`mlp_to_plain`)."""

    dense: tuple  # ((attribute, class, config, build shape), ...) in the block's tracking order


def mlp_problems(block, tp):
    if not is_keras_hub(block, *_GATED_BLOCKS):
        return ("is not a gated keras-hub decoder block (LlamaTransformerDecoder, MistralTransformerDecoder); "
                "for other blocks use column / row rules on the FFN Dense layers")
    if getattr(block, "_phalanx_mlp", None) is not None:
        return "already has a tensor-parallel MLP"
    params = tuple(inspect.signature(type(block).call).parameters)
    if params != _GATED_CALL:
        return (f"has a call signature {params} this phalanx does not know (written for keras-hub 0.32's "
                f"{_GATED_CALL}): its block call cannot be reproduced")
    for attr in _FFN:
        dense = getattr(block, attr, None)
        if dense is None or dense_dims(dense) is None:
            return f"has no Dense {attr}"
        if _dense_unsupported(dense):
            return f"{attr} {_dense_unsupported(dense)}"
    f = dense_dims(block._feedforward_intermediate_dense)[1]
    if f % tp:
        return f"has an FFN of width {f}, which tp={tp} does not divide"
    return None


@keras.saving.register_keras_serializable(package="phalanx")
class ParallelBlockMLP(_SavedThroughViews, ParallelMLP):
    """The :class:`~phalanx.layers.ParallelMLP` that holds a keras-hub block's FFN: saved
    through views standing where the block's three Dense layers were."""


def _activation(fn):
    name = getattr(fn, "__name__", "")
    return name if name in ("silu", "gelu", "relu", "swish") and getattr(keras.activations, name, None) else fn


def mlp_dense_layers(block) -> list:
    """The FFN Dense layers of a gated keras-hub block (those it has)."""
    return [d for d in (getattr(block, attr, None) for attr in _FFN) if isinstance(d, keras.layers.Layer)
            and not isinstance(d, WeightView)]


def to_mlp(block, tp, replace) -> ParallelMLP:
    """Replace ``block``'s FFN Dense layers by one ParallelMLP, in place. ``replace(old, new)``
    is the caller's tracker-aware swap (of ``old`` by ``new``, or removal when ``new`` is None)."""
    up, gate, down = (getattr(block, attr) for attr in _FFN)
    d, f = dense_dims(up)
    mlp = ParallelBlockMLP(f, tp=tp, activation=_activation(block.activation), gated=True, use_bias=False,
                      kernel_initializer=up.kernel_initializer, dtype=up.dtype_policy, name="feedforward_mlp")
    build_at(mlp, up._parent_path, (None, None, d))
    mlp.set_logical_weights({"up": _np(up.kernel), "gate": _np(gate.kernel), "down": _np(down.kernel)})
    records = []
    for attr, dense in zip(_FFN, (up, gate, down)):
        n_in = dense_dims(dense)[0]
        records.append((attr, type(dense), dense.get_config(), (None, None, n_in)))
    object.__setattr__(block, "_phalanx_block_origin", BlockOrigin(tuple(records)))
    replace(up, mlp)
    replace(gate, None)
    replace(down, None)
    for attr in _FFN:
        delattr(block, attr)
    block._phalanx_mlp = mlp
    attach_views(block, mlp, {attr: (dense.name, [key]) for attr, dense, key in
                              zip(_FFN, (up, gate, down), ("up", "gate", "down"))})
    object.__setattr__(block, "call", _gated_block_call.__get__(block))
    return mlp


def mlp_to_plain(block, replace) -> None:
    """Undo :func:`to_mlp`: fresh Dense layers from their configs, holding the MLP's current
    weights, in their original places; the block's own ``call`` again."""
    mlp = block._phalanx_mlp
    values = mlp.logical_weights()
    origin = block._phalanx_block_origin
    made = {}
    for (attr, cls, config, shape), key in zip(origin.dense, ("up", "gate", "down")):
        dense = cls.from_config(config)
        build_at(dense, mlp._parent_path, shape)
        dense.kernel.assign(values[key].astype(dense.kernel.dtype))
        made[attr] = dense
    # The MLP's place in the tracker goes to the first Dense; the others follow it.
    replace(mlp, made[_FFN[0]], after=[made[_FFN[1]], made[_FFN[2]]])
    delattr(block, "_phalanx_mlp")
    for attr in _FFN:
        object.__delattr__(block, attr)  # the weight view
        setattr(block, attr, made[attr])
    object.__delattr__(block, "call")
    object.__delattr__(block, "_phalanx_block_origin")


# ---------------------------------------------------------------------------------------------
# The table the machinery reads
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversion:
    """How rule kind ``kind`` converts a layer: ``problems(layer, tp)`` is None when it fits
    (else the reason, completing "layer 'x' ..."); ``convert(layer, tp)`` returns the new layer."""

    kind: str
    problems: Callable
    convert: Callable | None


CONVERSIONS = {
    "column": Conversion("column", column_problems, to_column),
    "row": Conversion("row", row_problems, to_row),
    "vocab": Conversion("vocab", vocab_problems, to_vocab),
    "attention": Conversion("attention", attention_problems, to_attention),
    "mlp": Conversion("mlp", mlp_problems, None),  # a block edit, applied by the machinery (to_mlp)
}


def is_converted(layer) -> bool:
    return isinstance(layer, ShardedLayer) or getattr(layer, "_phalanx_mlp", None) is not None


__all__ = ["ParallelMultiHeadAttention", "ParallelLlamaAttention", "ParallelMistralAttention",
           "ParallelReversibleEmbedding", "ReversibleEmbedding", "ParallelBlockMLP", "WeightView", "CONVERSIONS",
           "to_plain", "can_make_plain", "to_mlp", "mlp_to_plain", "dense_dims", "is_keras_hub"]
