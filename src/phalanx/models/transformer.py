"""phalanx's GPT written once from the parallel layers, as a Keras Functional model.

The architecture is :mod:`phalanx.models.gpt`'s (docs/DESIGN.md): token ids ``[B, T]`` ->
a vocabulary-parallel token embedding plus learned positions -> (dropout) -> ``layers``
pre-LN :class:`~phalanx.layers.transformer.TransformerBlock` s (GELU, tanh form; every
``moe_every``-th block a mixture of experts) -> a final LayerNorm -> logits ``[B, T, vocab]``
from the tied embedding (``reverse=True``) or an untied column-parallel head. The same
definition runs at ``tp=1`` (plain Keras layers, Keras's own ``fit``) and, through
:func:`phalanx.fit`, on any ``dp x tp x pp`` layout (``ep`` for the experts), with
``sequence_parallel`` for the blocks.

It is the built-in GPT of every engine: at ``tp=1`` the tf.distribute engines train it
(:class:`phalanx.engines.task.GPTTask`), the mesh engine computes the same blocks on its own
shard variables (:class:`ShardedGPT`), and the Keras engines run it as it is.

Its weights are also known by the built-in GPT's logical names
(:func:`phalanx.models.gpt.weight_shapes`, which checkpoints, the mesh engine and the export
use): :func:`weight_parts` says which variables hold each name, :func:`gpt_weights` /
:func:`load_gpt_weights` convert. A name is the layer's own (``block_i/ln1/gamma``,
``block_i/moe/w_in``, ``final_ln/beta``, ``head/kernel``) but for ``embed/tokens`` /
``embed/positions`` (the ``embed`` and ``positions`` layers' ``embeddings``) and a block's
``attn/qkv``, ``attn/out``, ``mlp/fc`` and ``mlp/proj`` kernels ``[in, out]`` and biases: the
attention's query, key and value ``[d, heads, head_dim]`` side by side, its output
``[heads, head_dim, d]``, and the MLP's ``up`` and ``down`` (:data:`_FUSED`).

Example:
    >>> import numpy as np
    >>> from phalanx.config import ModelConfig
    >>> from phalanx.models.gpt import weight_shapes
    >>> cfg = ModelConfig(layers=2, d_model=16, heads=2, ffn=32, vocab=32, seq_len=8)
    >>> model = gpt(cfg, tp=2, sequence_parallel=True)
    >>> tuple(model(np.zeros((2, 8), "int32")).shape)
    (2, 8, 32)
    >>> sorted(gpt_weights(model)) == sorted(weight_shapes(cfg))
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from phalanx.checkpoint import boxes
from phalanx.config import ModelConfig
from phalanx.layers import dropout as dropout_lib
from phalanx.layers.dropout import PositionalDropout
from phalanx.layers.attention import ParallelSelfAttention
from phalanx.layers.kernels import Kernels
from phalanx.layers.sharding import Split
from phalanx.layers.tensor_parallel import (ColumnParallelDense, ParallelMLP, VocabParallelEmbedding,
                                            embedding_lookup, vocab_parallel_cross_entropy)
from phalanx.layers.transformer import LayerNorm, PositionEmbedding, TransformerBlock, gelu_approximate
from phalanx.models import gpt_ops
from phalanx.models.gpt import INIT_STD, block_index, block_prefix, initial_weights, weight_shapes
from phalanx.models.gpt_ops import LAYER_NORM_EPS


@keras.saving.register_keras_serializable(package="phalanx")
class FusedKernels(Kernels):
    """The GPT's element-wise pieces as the fused XLA kernels of :mod:`phalanx.models.gpt_ops`
    (the same math as :class:`~phalanx.layers.kernels.Kernels`, measured 15-25% faster in
    bfloat16): LayerNorm (at the GPT's epsilon), bias + GELU (tanh form), the causal softmax
    (in the compute dtype) and the token cross-entropy. Anything else (another epsilon or
    activation) falls back to the plain ops."""

    def layer_norm(self, x, gamma, beta, epsilon: float):
        if epsilon != LAYER_NORM_EPS:
            return super().layer_norm(x, gamma, beta, epsilon)
        return gpt_ops.layer_norm(x, gamma, beta)

    def bias_activation(self, h, bias, activation):
        if activation is not gelu_approximate:
            return super().bias_activation(h, bias, activation)
        return gpt_ops.gelu(h, bias)

    def causal_softmax(self, scores):
        return gpt_ops.causal_softmax(scores)

    def cross_entropy(self, logits, targets):
        return gpt_ops.token_cross_entropy(logits, targets)


FUSED = FusedKernels()


def gpt(cfg: ModelConfig, tp: int = 1, ep: int = 1, sequence_parallel: bool = False, seed: int | None = 0,
        dtype_policy: str | None = None, name: str = "gpt", dropout_seed: int = 0) -> keras.Model:
    """phalanx's GPT for ``cfg`` as a Keras Functional model on token ids ``[B, T]`` (``T <=
    cfg.seq_len``) returning logits ``[B, T, vocab]``, its weights cut for ``tp`` tensor shards
    and ``ep`` expert shards.

    ``seed``: start from :func:`phalanx.models.gpt.initial_weights` ``(cfg, seed)`` — the
    weights every phalanx engine starts from — or, with ``None``, from the layers' Keras
    initialisers (the same distributions). ``dtype_policy``: a Keras policy name for every layer.
    ``dropout_seed`` (``cfg.dropout > 0``): the seed of the positional dropout masks
    (:mod:`phalanx.layers.dropout`; each dropping layer's own from it: :func:`dropout_seeds`).
    """
    d, policy = cfg.d_model, dtype_policy
    normal = keras.initializers.RandomNormal(stddev=INIT_STD)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embed = VocabParallelEmbedding(cfg.vocab, d, tp=tp, embeddings_initializer=normal, name="embed", dtype=policy)
    x = PositionEmbedding(cfg.seq_len, initializer=normal, name="positions", dtype=policy)(embed(tokens))
    seeds = dropout_seeds(dropout_seed, cfg.layers)
    if cfg.dropout:
        x = PositionalDropout(cfg.dropout, seed=seeds[-1], name="embed_dropout", dtype=policy)(x)
    for i in range(cfg.layers):
        x = _block(cfg, i, tp, ep, sequence_parallel, policy, seed=seeds[i])(x)
    x = LayerNorm(LAYER_NORM_EPS, kernels=FUSED, name="final_ln", dtype=policy)(x)
    if cfg.tie_embeddings:
        logits = embed(x, reverse=True)
    else:
        logits = ColumnParallelDense(cfg.vocab, tp=tp, use_bias=False, kernel_initializer=normal, name="head",
                                     dtype=policy)(x)
    model = keras.Model(tokens, logits, name=name)
    if seed is not None:
        load_gpt_weights(model, initial_weights(cfg, seed))
    return model


def dropout_seeds(seed: int, layers: int) -> dict[int, int]:
    """The dropout seed of each dropping layer of the GPT: block ``i``'s at ``i``, the embedding's at
    -1, distinct for every (run seed, layer).

    >>> dropout_seeds(0, 2)
    {-1: 0, 0: 1, 1: 2}
    """
    return {i: (int(seed) * 1_000_003 + i + 1) & 0x7FFFFFFF for i in range(-1, layers)}


def _block(cfg: ModelConfig, i: int, tp: int, ep: int = 1, sequence_parallel: bool = False,
           dtype_policy: str | None = None, seed: int | None = None) -> TransformerBlock:
    """Block ``i`` of the GPT (unbuilt); ``seed``: its dropout masks' seed."""
    moe = None
    if cfg.is_moe_block(i):
        moe = {"num_experts": cfg.experts, "top_k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
               "aux_loss_coef": cfg.aux_loss_coef, "ep": ep}
    return TransformerBlock(cfg.heads, cfg.head_dim, cfg.ffn_dim, tp=tp, activation=gelu_approximate,
                            dropout=cfg.dropout, moe=moe, sequence_parallel=sequence_parallel,
                            layer_norm_epsilon=LAYER_NORM_EPS,
                            kernel_initializer=keras.initializers.RandomNormal(stddev=INIT_STD), kernels=FUSED,
                            attention_core=cfg.attention, seed=seed, name=f"block_{i}", dtype=dtype_policy)


def blocks(model) -> list[TransformerBlock]:
    """The blocks ``block_0``, ``block_1``, ... of a :func:`gpt` model, in order."""
    found = sorted((layer for layer in model.layers if isinstance(layer, TransformerBlock)),
                   key=lambda layer: int(layer.name.rsplit("_", 1)[-1]))
    if [b.name for b in found] != [f"block_{i}" for i in range(len(found))]:
        raise ValueError(f"model {model.name!r} is not a phalanx.models.transformer.gpt model: its blocks are "
                         f"{[b.name for b in found]}")
    return found


def _head(model):
    try:
        return model.get_layer("head")
    except ValueError:
        return None


# -- the built-in GPT's weight names on this model's variables ----------------------------------

#: The built-in names (:func:`~phalanx.models.gpt.weight_shapes`) that differ from the layers'
#: own (``layer/logical weight``): whole names, and in a block the weights that the built-in GPT
#: keeps as one ``[in, out]`` kernel (and bias) made of sub-layer weights side by side along
#: the last axis, each with how many leading axes of that weight are the kernel's ``in`` side
#: (the attention's ``[D, heads, head_dim]`` / ``[heads, head_dim, D]`` as ParallelSelfAttention
#: multiplies them). Every other name is the layer's own.
_RENAMED = {"embed/tokens": "embed/embeddings", "embed/positions": "positions/embeddings"}
_FUSED = {"attn/qkv": (("attention/query", "attention/key", "attention/value"), 1),
          "attn/out": (("attention/output",), 2), "mlp/fc": (("mlp/up",), 1), "mlp/proj": (("mlp/down",), 1)}
_FUSED_OF = {source: (short, i, in_axes) for short, (sources, in_axes) in _FUSED.items()
             for i, source in enumerate(sources)}
_NAME_OF = {layer_path: name for name, layer_path in _RENAMED.items()}


@dataclass(frozen=True)
class Part:
    """One variable behind a built-in GPT weight: ``variable`` (a layer's whole weight or one
    of its shards; a Keras variable) holds box ``box`` (:mod:`phalanx.checkpoint.boxes`) of the
    built-in tensor, in another shape of the same size (``shape``, a reshape away)."""

    variable: Any
    box: tuple

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)


def _builtin_name(layer: str, weight: str) -> tuple[str, int, int | None]:
    """The built-in name of ``layer``'s logical weight ``weight``, the weight's place among the
    parts side by side, and (a fused kernel's) its ``in`` axes (bias: 0; unfused: None)."""
    path = f"{layer}/{weight}"
    if path in _NAME_OF:
        return _NAME_OF[path], 0, None
    base = weight[:-len("_bias")] if weight.endswith("_bias") else weight
    if layer.startswith("block_") and base in _FUSED_OF:
        short, i, in_axes = _FUSED_OF[base]
        return (f"{layer}/{short}/bias", i, 0) if base != weight else (f"{layer}/{short}/kernel", i, in_axes)
    return path, 0, None


def _gpt_layers(model) -> list:
    head = _head(model)
    return [model.get_layer("embed"), model.get_layer("positions"), *blocks(model), model.get_layer("final_ln")] + \
        ([head] if head is not None else [])


def _logical_entries(layer):
    """``(weight, variables, split_axis)`` of ``layer``'s trainable logical weights, in order
    (a block's named ``sublayer/weight``)."""
    children = layer._children() if isinstance(layer, TransformerBlock) else {"": layer}
    for prefix, child in children.items():
        for weight, (variables, split_axis, _) in child._logical.items():
            if variables[0].trainable:
                yield (f"{prefix}/{weight}" if prefix else weight), variables, split_axis


def _merged(shape: tuple, in_axes: int | None) -> list[list[int]]:
    """The axes of ``shape`` that each axis of the built-in shape merges: all of them for a bias
    (``in_axes`` 0), ``[in | out]`` for a kernel, one each for an unfused weight (None)."""
    axes = list(range(len(shape)))
    if in_axes is None:
        return [[a] for a in axes]
    return [axes] if in_axes == 0 else [axes[:in_axes], axes[in_axes:]]


def weight_parts(model) -> dict[str, list[Part]]:
    """The built-in GPT's weights (:func:`~phalanx.models.gpt.weight_shapes` names and order)
    on ``model``'s variables (a :func:`gpt` model, any ``tp`` / ``ep``): for each name the
    :class:`Part` s that hold it. The one mapping between the two namings:
    :func:`gpt_weights`, :func:`load_gpt_weights` and the tf.distribute engines' logical
    state (:class:`phalanx.engines.task.GPTTask`) read it.

    Example:
        >>> cfg = ModelConfig(layers=1, d_model=8, heads=2, ffn=16, vocab=16, seq_len=4)
        >>> parts = weight_parts(gpt(cfg, seed=None))
        >>> for p in parts["block_0/attn/qkv/kernel"]:
        ...     print(p.variable.path, tuple(p.variable.shape), p.box)
        block_0/attention/query (8, 2, 4) ((0, 8), (0, 8))
        block_0/attention/key (8, 2, 4) ((0, 8), (8, 16))
        block_0/attention/value (8, 2, 4) ((0, 8), (16, 24))
    """
    found: dict[str, list] = {}
    for layer in _gpt_layers(model):
        for weight, variables, split_axis in _logical_entries(layer):
            name, place, in_axes = _builtin_name(layer.name, weight)
            found.setdefault(name, []).append((place, variables, split_axis, in_axes))
    out: dict[str, list[Part]] = {}
    for name, sources in found.items():
        parts, offset = [], 0
        for _, variables, split_axis, in_axes in sorted(sources, key=lambda s: s[0]):
            whole = [int(n) for n in variables[0].shape]
            if split_axis is not None:
                whole[split_axis] *= len(variables)
            groups = _merged(tuple(whole), in_axes)
            merged = [math.prod(whole[a] for a in g) for g in groups]
            for r, var in enumerate(variables):
                box = []
                for g, size in zip(groups, merged):
                    if split_axis in g:
                        lead = g[:g.index(split_axis)]
                        if math.prod(whole[a] for a in lead) != 1:  # never for the head/expert cuts
                            raise ValueError(f"{name}: shard {r} of {var.path} is not one box of the built-in shape")
                        stride = math.prod(whole[a] for a in g[g.index(split_axis) + 1:])
                        n = whole[split_axis] // len(variables)
                        box.append((r * n * stride, (r + 1) * n * stride))
                    else:
                        box.append((0, size))
                box[-1] = (box[-1][0] + offset, box[-1][1] + offset)  # side by side along the last axis
                parts.append(Part(var, tuple(box)))
            offset += merged[-1]
        out[name] = parts
    return out


def built_in_shape(parts: list[Part]) -> tuple[int, ...]:
    """The whole shape of a built-in weight held by ``parts``."""
    return tuple(max(p.box[a][1] for p in parts) for a in range(len(parts[0].box)))


def gpt_weights(model) -> dict[str, np.ndarray]:
    """The model's weights under the built-in GPT's logical names
    (:func:`phalanx.models.gpt.weight_shapes` order), whole whatever ``tp`` and ``ep`` are."""
    out = {}
    for name, parts in weight_parts(model).items():
        whole = np.empty(built_in_shape(parts), np.float32)
        for p in parts:
            whole[boxes.index(p.box)] = np.asarray(keras.ops.convert_to_numpy(p.variable.value)).reshape(p.shape)
        out[name] = whole
    return out


def load_gpt_weights(model, weights: dict) -> None:
    """Assign weights named as the built-in GPT's (``gpt_weights`` of another layout, or
    :func:`~phalanx.models.gpt.initial_weights`) to ``model``, cut into its shards. Missing or
    extra names, and wrong shapes, are errors."""
    expected = weight_parts(model)
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(f"load_gpt_weights: model {model.name!r} needs the weights {missing[:4]} (missing) and "
                         f"not {extra[:4]} (unexpected)")
    for key, value in weights.items():
        if tuple(np.shape(value)) != built_in_shape(expected[key]):
            raise ValueError(f"load_gpt_weights: {key!r} has shape {tuple(np.shape(value))}, the model's is "
                             f"{built_in_shape(expected[key])}")
    for key, parts in expected.items():
        value = np.asarray(weights[key])
        for p in parts:
            p.variable.assign(value[boxes.index(p.box)].reshape(p.variable.shape))


# -- the GPT on weights held outside Keras (the mesh engine's shard variables) ---------------

#: a LayerNorm's two weights, in the order :meth:`LayerNorm.normalize` takes them
_LN_PAIR = ("gamma", "beta")


def _block_slot(short: str) -> tuple[str, Any] | None:
    """Where :meth:`TransformerBlock.forward` takes the built-in block weight ``short`` (its name
    after ``block_i/``): (its ``weights`` entry, the key in a shard's dict or the index in the
    LayerNorm pair); None for a weight it does not take (the experts'). Derived from
    :data:`_FUSED` (the one mapping of the block's names to the sub-layers') and the sub-layers'
    declared splits: a projection's bias cut with its shards goes with them (the attention's
    fused ``qkv_bias``, ``up_bias``), an uncut one is whole, added after the sum
    (``attention_bias`` / ``mlp_bias``, as :meth:`TransformerBlock.own_weights` names them)."""
    group, _, leaf = short.rpartition("/")
    if group in _FUSED:
        sources, _ = _FUSED[group]
        entry, weight = sources[0].split("/")
        key = "qkv" if len(sources) > 1 else weight  # ParallelSelfAttention.partials' fused projection
        if leaf == "kernel":
            return entry, key
        split_axes = ParallelSelfAttention.SPLIT_AXES if entry == "attention" else ParallelMLP.SPLIT_AXES
        return (f"{entry}_bias", None) if split_axes[f"{weight}_bias"] is None else (entry, f"{key}_bias")
    if leaf in _LN_PAIR:
        return group, _LN_PAIR.index(leaf)
    return None


def _split_of(name: str) -> Split:
    """The :class:`Split` of built-in weight ``name``, from the split its layer declares."""
    if name == "embed/tokens":
        return Split.of_axis(VocabParallelEmbedding.SPLIT_AXES["embeddings"])
    if name == "head/kernel":
        return Split.of_axis(ColumnParallelDense.SPLIT_AXES["kernel"])
    slot = _block_slot(name.split("/", 1)[-1]) if block_index(name) is not None else None
    entry, key = slot if slot is not None else (None, None)
    if entry == "attention":
        # q, k and v side by side, each cut by heads (ParallelSelfAttention's query/key/value axis)
        return Split("qkv") if key.startswith("qkv") else Split.of_axis(ParallelSelfAttention.SPLIT_AXES[key])
    if entry == "mlp":
        return Split.of_axis(ParallelMLP.SPLIT_AXES[key])
    return Split("replicated")


def gpt_splits(cfg: ModelConfig) -> dict[str, Split]:
    """The :class:`~phalanx.layers.sharding.Split` over the ``tensor`` axis of every built-in
    GPT weight (:func:`~phalanx.models.gpt.weight_shapes` names), as the parallel layers cut them.

    Example:
        >>> cfg = ModelConfig(layers=1, d_model=16, heads=2, ffn=32, vocab=32, seq_len=8)
        >>> splits = gpt_splits(cfg)
        >>> splits["block_0/attn/qkv/kernel"], splits["block_0/mlp/fc/kernel"], splits["final_ln/beta"]
        (Split(kind='qkv', axis=0), Split(kind='axis', axis=1), Split(kind='replicated', axis=0))
    """
    return {name: _split_of(name) for name in weight_shapes(cfg)}


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the model dim that ``tp`` does not divide."""
    for key, value in (("model.heads", cfg.heads), ("model.ffn", cfg.ffn_dim), ("model.vocab", cfg.vocab)):
        if value % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {key}={value}")


#: ``w(name, t)``: shard ``t`` of built-in weight ``name`` (``t`` is 0 for a whole weight)
Weights = Callable[[str, int], object]


class ShardedGPT:
    """phalanx's GPT computed on weights held outside Keras, by the parallel layers' own
    per-shard code: :func:`~phalanx.layers.tensor_parallel.embedding_lookup`,
    :meth:`TransformerBlock.forward` and
    :func:`~phalanx.layers.tensor_parallel.vocab_parallel_cross_entropy`, with the fused
    kernels (:data:`FUSED`). The mesh engine keeps the weights (shard variables keyed by the
    built-in names and :func:`gpt_splits`) and hands them in as ``w(name, t)``; ``devices[t]``
    is the device of tensor rank ``t``. The layers here are templates: never built, they
    hold only the configuration.

    Example:
        >>> cfg = ModelConfig(layers=1, d_model=16, heads=2, ffn=32, vocab=32, seq_len=8)
        >>> weights = initial_weights(cfg, 0)
        >>> net = ShardedGPT(cfg, tp=2)
        >>> shards = {(n, t): p for n, s in gpt_splits(cfg).items() for t, p in enumerate(s.shard(weights[n], 2))}
        >>> w, devices = (lambda n, t: tf.constant(shards[(n, t)])), ["/device:CPU:0"] * 2
        >>> tokens = tf.zeros([2, 9], tf.int32)
        >>> x = net.block(net.embed(tokens[:, :-1], w, devices), w, 0, devices)
        >>> loss = float(net.loss(x, tokens[:, 1:], w, devices))
        >>> from phalanx.models.gpt import lm_loss
        >>> one = gpt(cfg, seed=None)
        >>> load_gpt_weights(one, weights)
        >>> abs(loss - float(lm_loss(one(tokens[:, :-1]), tokens[:, 1:]))) < 1e-5
        True
    """

    #: the layer word of the embedding's dropout key (the blocks use their index)
    EMBED_LAYER = -1

    def __init__(self, cfg: ModelConfig, tp: int = 1, dtype_policy: str = "float32",
                 sequence_parallel: bool = False):
        if cfg.experts:
            raise ValueError("ShardedGPT: a mixture-of-experts GPT runs as a Keras model (phalanx.fit)")
        check_tp(cfg, tp)
        if sequence_parallel and (tp < 2 or cfg.seq_len % tp):
            raise ValueError(f"sequence parallelism needs tp > 1 dividing model.seq_len={cfg.seq_len}, got tp={tp}")
        self.cfg, self.tp, self.sequence_parallel = cfg, tp, bool(sequence_parallel)
        self.template = _block(cfg, 0, tp, sequence_parallel=self.sequence_parallel, dtype_policy=dtype_policy)
        self.positions = PositionEmbedding(cfg.seq_len, name="positions", dtype=dtype_policy)
        self.final_ln = LayerNorm(LAYER_NORM_EPS, kernels=FUSED, name="final_ln", dtype=dtype_policy)
        # each block's weights (weight_shapes names and order) and where forward takes them
        self._block_slots: dict[int, list] = {}
        for name in weight_shapes(cfg):
            i = block_index(name)
            if i is not None:
                self._block_slots.setdefault(i, []).append((name, _block_slot(name[len(block_prefix(i)):])))

    def _shards(self, w: Weights, name: str) -> list:
        return [w(name, t) for t in range(self.tp)]

    def embed(self, tokens, w: Weights, devices: Sequence[str], dropout=None):
        """Token (vocabulary-parallel) + position embeddings of ``tokens [B, T]``, on ``devices[0]``.

        ``dropout``: ``(key, row_offset)`` to train with ``cfg.dropout``: ``key`` (uint32, e.g.
        :func:`phalanx.layers.dropout.fold` of the seed and the step) is folded with the layer
        (:attr:`EMBED_LAYER`, a block's index), ``row_offset`` is the first row of ``tokens`` in
        the whole batch, so every layout draws the same masks; None: no dropout."""
        x = embedding_lookup(tokens, self._shards(w, "embed/tokens"), devices)
        with tf.device(devices[0]):
            x = self.positions.add_positions(x, w("embed/positions", 0))
            if dropout is not None and self.cfg.dropout:
                key, rows = dropout
                x = dropout_lib.dropout(x, self.cfg.dropout, dropout_lib.fold(key, self.EMBED_LAYER), rows)
            return x

    def block_weights(self, w: Weights, i: int) -> dict:
        """Block ``i``'s weights in the form :meth:`TransformerBlock.forward` takes."""
        out = {"attention": [{} for _ in range(self.tp)], "mlp": [{} for _ in range(self.tp)],
               "ln1": [None, None], "ln2": [None, None]}
        for name, (entry, key) in self._block_slots[i]:
            if entry in ("attention", "mlp"):
                for t in range(self.tp):
                    out[entry][t][key] = w(name, t)
            elif key is None:
                out[entry] = w(name, 0)
            else:
                out[entry][key] = w(name, 0)
        return out

    def block(self, x, w: Weights, i: int, devices: Sequence[str], wrap_core=None, dropout=None):
        """Block ``i`` on the residual stream ``x`` (on ``devices[0]``; with sequence parallelism
        the chunks of ``x`` on the tensor ranks' devices); ``dropout`` as for :meth:`embed`."""
        key, rows = (None, 0) if dropout is None else dropout
        with tf.name_scope(f"block_{i}"):
            return self.template.forward(x, self.block_weights(w, i), training=dropout is not None, devices=devices,
                                         kernels=FUSED, wrap_core=wrap_core,
                                         dropout_key=None if key is None else dropout_lib.fold(key, i),
                                         row_offset=rows)

    def loss(self, x, targets, w: Weights, devices: Sequence[str]):
        """Final LayerNorm, vocabulary-parallel logits and the mean token cross-entropy (float32);
        the full ``[tokens, vocab]`` logits exist on no device when ``tp > 1``."""
        with tf.device(devices[0]):
            h = self.final_ln.normalize(x, w("final_ln/gamma", 0), w("final_ln/beta", 0))
        shards = self._shards(w, self.head_weight)
        return vocab_parallel_cross_entropy(h, shards, targets, transposed=not self.cfg.tie_embeddings,
                                            devices=devices, kernels=FUSED)

    @property
    def head_weight(self) -> str:
        """The weight :meth:`loss` multiplies by: the token table when the head is tied."""
        return "embed/tokens" if self.cfg.tie_embeddings else "head/kernel"


__all__ = ["gpt", "blocks", "weight_parts", "Part", "gpt_weights", "load_gpt_weights", "gpt_splits", "check_tp",
           "ShardedGPT", "FusedKernels", "FUSED"]
