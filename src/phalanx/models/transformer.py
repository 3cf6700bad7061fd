"""phalanx's GPT written once from the parallel layers, as a Keras Functional model.

The architecture is :mod:`phalanx.models.gpt`'s (docs/DESIGN.md): token ids ``[B, T]`` ->
a vocabulary-parallel token embedding plus learned positions -> (dropout) -> ``layers``
pre-LN :class:`~phalanx.layers.transformer.TransformerBlock` s (GELU, tanh form; every
``moe_every``-th block a mixture of experts) -> a final LayerNorm -> logits ``[B, T, vocab]``
from the tied embedding (``reverse=True``) or an untied column-parallel head. The same
definition runs at ``tp=1`` (plain Keras layers, Keras's own ``fit``) and, through
:func:`phalanx.fit`, on any ``dp x tp x pp`` layout (``ep`` for the experts), with
``sequence_parallel`` for the blocks.

It is the built-in GPT of every engine: the Keras engines run it as it is, and at ``tp=1`` the
parameter-server engine trains it (:class:`phalanx.engines.task.GPTTask`).

Its weights are also known by the built-in GPT's logical names
(:func:`phalanx.models.gpt.weight_shapes`, which checkpoints and the export use): :func:`weight_parts` says which variables hold each name, :func:`gpt_weights` /
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
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from phalanx.checkpoint import boxes
from phalanx.config import ModelConfig
from phalanx.layers.dropout import PositionalDropout
from phalanx.layers.kernels import Kernels
from phalanx.layers.tensor_parallel import ColumnParallelDense, VocabParallelEmbedding
from phalanx.layers.transformer import LayerNorm, PositionEmbedding, TransformerBlock, gelu_approximate
from phalanx.models import gpt_ops
from phalanx.models.gpt import INIT_STD, initializer, weight_shapes
from phalanx.models.gpt_ops import LAYER_NORM_EPS


@keras.saving.register_keras_serializable(package="phalanx")
class FusedKernels(Kernels):
    """The GPT's element-wise pieces as the fused XLA kernels of :mod:`phalanx.models.gpt_ops`
    (the same math as :class:`~phalanx.layers.kernels.Kernels`, measured 15-25% faster in
    bfloat16): LayerNorm (at the GPT's epsilon; also with the residual add before it), bias + GELU (tanh form), the causal softmax
    (in the compute dtype) and the token cross-entropy. Anything else (another epsilon or
    activation) falls back to the plain ops."""

    def layer_norm(self, x, gamma, beta, epsilon: float):
        if epsilon != LAYER_NORM_EPS:
            return super().layer_norm(x, gamma, beta, epsilon)
        return gpt_ops.layer_norm(x, gamma, beta)

    def add_layer_norm(self, x, y, bias, gamma, beta, epsilon: float):
        if epsilon != LAYER_NORM_EPS:
            return super().add_layer_norm(x, y, bias, gamma, beta, epsilon)
        return gpt_ops.add_layer_norm(x, y, bias, gamma, beta)

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
        initialize(model, cfg, seed)
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
    :func:`gpt_weights`, :func:`load_gpt_weights`, :func:`initialize` and the engines' logical
    state read it.

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


def initialize(model, cfg: ModelConfig, seed: int) -> None:
    """Assign the built-in GPT's initial weights to ``model`` (a :func:`gpt` model of ``cfg``, any
    ``tp`` / ``ep``): the values of :func:`phalanx.models.gpt.initial_weights` ``(cfg, seed)``,
    the weights every phalanx engine starts from, each variable's part made alone
    (:func:`phalanx.models.gpt.initializer`), so the host never holds a whole initial tensor of a
    sharded weight.

    Example:
        >>> from phalanx.models.gpt import initial_weights
        >>> cfg = ModelConfig(layers=1, d_model=8, heads=2, ffn=16, vocab=16, seq_len=4)
        >>> model = gpt(cfg, tp=2, seed=None)
        >>> initialize(model, cfg, seed=3)
        >>> want = initial_weights(cfg, 3)
        >>> all(np.array_equal(got, want[name]) for name, got in gpt_weights(model).items())
        True
    """
    parts, shapes = weight_parts(model), weight_shapes(cfg)
    got = {name: built_in_shape(held) for name, held in parts.items()}
    if got != shapes:
        raise ValueError(f"initialize: model {model.name!r} does not hold the weights of model config {cfg}: "
                         f"{sorted(set(got.items()) ^ set(shapes.items()))[:4]} differ")
    init = initializer(cfg, seed)
    for name, held in parts.items():
        for p in held:
            p.variable.assign(np.reshape(init(name, p.box), tuple(p.variable.shape)))


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ``ValueError`` naming the model dim that ``tp`` does not divide."""
    for key, value in (("model.heads", cfg.heads), ("model.ffn", cfg.ffn_dim), ("model.vocab", cfg.vocab)):
        if value % tp:
            raise ValueError(f"parallel.tp={tp} does not divide {key}={value}")


__all__ = ["gpt", "blocks", "weight_parts", "Part", "gpt_weights", "load_gpt_weights", "initialize", "check_tp",
           "FusedKernels", "FUSED"]
