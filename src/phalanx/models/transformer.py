"""phalanx's GPT written once from the parallel layers, as a Keras Functional model.

The architecture is :mod:`phalanx.models.gpt`'s (docs/DESIGN.md): token ids ``[B, T]`` ->
a vocabulary-parallel token embedding plus learned positions -> (dropout) -> ``layers``
pre-LN :class:`~phalanx.layers.transformer.TransformerBlock` s (GELU, tanh form; every
``moe_every``-th block a mixture of experts) -> a final LayerNorm -> logits ``[B, T, vocab]``
from the tied embedding (``reverse=True``) or an untied column-parallel head. The same
definition runs at ``tp=1`` (plain Keras layers, Keras's own ``fit``) and, through
:func:`phalanx.fit`, on any ``dp x tp x pp`` layout (``ep`` for the experts), with
``sequence_parallel`` for the blocks.

Weights convert both ways to the built-in GPT's logical names
(:func:`phalanx.models.gpt.weight_shapes`) with :func:`load_gpt_weights` /
:func:`gpt_weights`:

==================================  ===========================================================
built-in GPT                        this model (layer / logical weight)
==================================  ===========================================================
``embed/tokens`` [v, d]             ``embed`` / ``embeddings``
``embed/positions`` [t, d]          ``positions`` / ``embeddings``
``block_i/ln1/{gamma,beta}``        ``block_i`` / ``ln1/{gamma,beta}`` (and ``ln2``)
``block_i/attn/qkv/kernel`` [d,3d]  ``block_i`` / ``attention/{query,key,value}`` [d, H, hd]:
                                    columns ``[0,d)``, ``[d,2d)``, ``[2d,3d)`` reshaped
``block_i/attn/qkv/bias`` [3d]      ``attention/{query,key,value}_bias`` [H, hd], the same cut
``block_i/attn/out/kernel`` [d, d]  ``attention/output`` [H, hd, d]
``block_i/attn/out/bias`` [d]       ``attention/output_bias``
``block_i/mlp/fc/{kernel,bias}``    ``mlp/up``, ``mlp/up_bias``
``block_i/mlp/proj/{kernel,bias}``  ``mlp/down``, ``mlp/down_bias``
``block_i/moe/{router,w_in,...}``   ``moe/{router,w_in,b_in,w_out,b_out}``
``final_ln/{gamma,beta}``           ``final_ln`` / ``gamma``, ``beta``
``head/kernel`` [d, v] (untied)     ``head`` / ``kernel``
==================================  ===========================================================

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

from typing import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from phalanx.config import ModelConfig
from phalanx.layers.attention import ParallelSelfAttention
from phalanx.layers.kernels import Kernels
from phalanx.layers.sharding import Split
from phalanx.layers.tensor_parallel import (ColumnParallelDense, ParallelMLP, VocabParallelEmbedding,
                                            embedding_lookup, vocab_parallel_cross_entropy)
from phalanx.layers.transformer import LayerNorm, PositionEmbedding, TransformerBlock, gelu_approximate
from phalanx.models import gpt_ops
from phalanx.models.gpt import INIT_STD, initial_weights, weight_shapes
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
        dtype_policy: str | None = None, name: str = "gpt") -> keras.Model:
    """phalanx's GPT for ``cfg`` as a Keras Functional model on token ids ``[B, T]`` (``T <=
    cfg.seq_len``) returning logits ``[B, T, vocab]``, its weights cut for ``tp`` tensor shards
    and ``ep`` expert shards.

    ``seed``: start from :func:`phalanx.models.gpt.initial_weights` ``(cfg, seed)`` — the
    weights every phalanx engine starts from — or, with ``None``, from the layers' Keras
    initialisers (the same distributions). ``dtype_policy``: a Keras policy name for every layer.
    """
    d, policy = cfg.d_model, dtype_policy
    normal = keras.initializers.RandomNormal(stddev=INIT_STD)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embed = VocabParallelEmbedding(cfg.vocab, d, tp=tp, embeddings_initializer=normal, name="embed", dtype=policy)
    x = PositionEmbedding(cfg.seq_len, initializer=normal, name="positions", dtype=policy)(embed(tokens))
    if cfg.dropout:
        x = keras.layers.Dropout(cfg.dropout, name="embed_dropout", dtype=policy)(x)
    for i in range(cfg.layers):
        x = _block(cfg, i, tp, ep, sequence_parallel, policy)(x)
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


def _block(cfg: ModelConfig, i: int, tp: int, ep: int = 1, sequence_parallel: bool = False,
           dtype_policy: str | None = None) -> TransformerBlock:
    """Block ``i`` of the GPT (unbuilt)."""
    moe = None
    if cfg.is_moe_block(i):
        moe = {"num_experts": cfg.experts, "top_k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
               "aux_loss_coef": cfg.aux_loss_coef, "ep": ep}
    return TransformerBlock(cfg.heads, cfg.head_dim, cfg.ffn_dim, tp=tp, activation=gelu_approximate,
                            dropout=cfg.dropout, moe=moe, sequence_parallel=sequence_parallel,
                            layer_norm_epsilon=LAYER_NORM_EPS,
                            kernel_initializer=keras.initializers.RandomNormal(stddev=INIT_STD), kernels=FUSED,
                            name=f"block_{i}", dtype=dtype_policy)


def _blocks(model) -> list[TransformerBlock]:
    blocks = sorted((layer for layer in model.layers if isinstance(layer, TransformerBlock)),
                    key=lambda layer: int(layer.name.rsplit("_", 1)[-1]))
    if [b.name for b in blocks] != [f"block_{i}" for i in range(len(blocks))]:
        raise ValueError(f"model {model.name!r} is not a phalanx.models.transformer.gpt model: its blocks are "
                         f"{[b.name for b in blocks]}")
    return blocks


def _head(model):
    try:
        return model.get_layer("head")
    except ValueError:
        return None


def gpt_weights(model) -> dict[str, np.ndarray]:
    """The model's weights under the built-in GPT's logical names
    (:func:`phalanx.models.gpt.weight_shapes` order), whole whatever ``tp`` and ``ep`` are."""
    out = {"embed/tokens": model.get_layer("embed").logical_weights()["embeddings"],
           "embed/positions": model.get_layer("positions").logical_weights()["embeddings"]}
    for i, block in enumerate(_blocks(model)):
        w, p = block.logical_weights(), f"block_{i}/"
        d = w["ln1/gamma"].shape[0]
        out[p + "ln1/gamma"], out[p + "ln1/beta"] = w["ln1/gamma"], w["ln1/beta"]
        out[p + "attn/qkv/kernel"] = np.concatenate([w[f"attention/{n}"].reshape(d, -1)
                                                     for n in ("query", "key", "value")], axis=1)
        out[p + "attn/qkv/bias"] = np.concatenate([w[f"attention/{n}_bias"].reshape(-1)
                                                   for n in ("query", "key", "value")])
        out[p + "attn/out/kernel"] = w["attention/output"].reshape(-1, d)
        out[p + "attn/out/bias"] = w["attention/output_bias"]
        out[p + "ln2/gamma"], out[p + "ln2/beta"] = w["ln2/gamma"], w["ln2/beta"]
        if block.moe is not None:
            for short in ("router", "w_in", "b_in", "w_out", "b_out"):
                out[p + "moe/" + short] = w["moe/" + short]
        else:
            out[p + "mlp/fc/kernel"], out[p + "mlp/fc/bias"] = w["mlp/up"], w["mlp/up_bias"]
            out[p + "mlp/proj/kernel"], out[p + "mlp/proj/bias"] = w["mlp/down"], w["mlp/down_bias"]
    final = model.get_layer("final_ln").logical_weights()
    out["final_ln/gamma"], out["final_ln/beta"] = final["gamma"], final["beta"]
    head = _head(model)
    if head is not None:
        out["head/kernel"] = head.logical_weights()["kernel"]
    return out


def load_gpt_weights(model, weights: dict) -> None:
    """Assign weights named as the built-in GPT's (``gpt_weights`` of another layout,
    :func:`~phalanx.models.gpt.initial_weights`, or ``GPT.named_variables()`` values) to
    ``model``, cut into its shards. Missing or extra names, and wrong shapes, are errors."""
    expected = gpt_weights(model)
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(f"load_gpt_weights: model {model.name!r} needs the weights {missing[:4]} (missing) and "
                         f"not {extra[:4]} (unexpected)")
    for key, value in weights.items():
        if tuple(np.shape(value)) != tuple(expected[key].shape):
            raise ValueError(f"load_gpt_weights: {key!r} has shape {tuple(np.shape(value))}, the model's is "
                             f"{tuple(expected[key].shape)}")
    model.get_layer("embed").set_logical_weights({"embeddings": weights["embed/tokens"]})
    model.get_layer("positions").set_logical_weights({"embeddings": weights["embed/positions"]})
    for i, block in enumerate(_blocks(model)):
        p, attn = f"block_{i}/", block.attention
        d, h, hd = weights[p + "ln1/gamma"].shape[0], attn.num_heads, attn.head_dim
        kv = attn.num_kv_heads
        qkv, qkv_b = np.asarray(weights[p + "attn/qkv/kernel"]), np.asarray(weights[p + "attn/qkv/bias"])
        cuts = np.cumsum([h * hd, kv * hd])
        new = {"ln1/gamma": weights[p + "ln1/gamma"], "ln1/beta": weights[p + "ln1/beta"],
               "ln2/gamma": weights[p + "ln2/gamma"], "ln2/beta": weights[p + "ln2/beta"],
               "attention/output": np.asarray(weights[p + "attn/out/kernel"]).reshape(h, hd, d),
               "attention/output_bias": weights[p + "attn/out/bias"]}
        for name, heads, kernel, bias in zip(("query", "key", "value"), (h, kv, kv), np.split(qkv, cuts, axis=1),
                                             np.split(qkv_b, cuts)):
            new[f"attention/{name}"] = kernel.reshape(d, heads, hd)
            new[f"attention/{name}_bias"] = bias.reshape(heads, hd)
        if block.moe is not None:
            new.update({"moe/" + s: weights[p + "moe/" + s] for s in ("router", "w_in", "b_in", "w_out", "b_out")})
        else:
            new.update({"mlp/up": weights[p + "mlp/fc/kernel"], "mlp/up_bias": weights[p + "mlp/fc/bias"],
                        "mlp/down": weights[p + "mlp/proj/kernel"], "mlp/down_bias": weights[p + "mlp/proj/bias"]})
        block.set_logical_weights(new)
    model.get_layer("final_ln").set_logical_weights({"gamma": weights["final_ln/gamma"],
                                                     "beta": weights["final_ln/beta"]})
    head = _head(model)
    if head is not None:
        head.set_logical_weights({"kernel": weights["head/kernel"]})


# -- the GPT on weights held outside Keras (the mesh engine's shard variables) ---------------

#: A built-in GPT block weight (its name after ``block_i/``) -> where
#: :meth:`TransformerBlock.forward` takes it: (its ``weights`` entry, the key in a shard's dict
#: or the index in the LayerNorm pair). The attention's projection is the fused ``qkv``.
_BLOCK_SLOTS = {
    "ln1/gamma": ("ln1", 0), "ln1/beta": ("ln1", 1), "ln2/gamma": ("ln2", 0), "ln2/beta": ("ln2", 1),
    "attn/qkv/kernel": ("attention", "qkv"), "attn/qkv/bias": ("attention", "qkv_bias"),
    "attn/out/kernel": ("attention", "output"), "attn/out/bias": ("attention_bias", None),
    "mlp/fc/kernel": ("mlp", "up"), "mlp/fc/bias": ("mlp", "up_bias"),
    "mlp/proj/kernel": ("mlp", "down"), "mlp/proj/bias": ("mlp_bias", None),
}


def _split_of(name: str) -> Split:
    """The :class:`Split` of built-in weight ``name``, from the split its layer declares."""
    if name == "embed/tokens":
        return Split.of_axis(VocabParallelEmbedding.SPLIT_AXES["embeddings"])
    if name == "head/kernel":
        return Split.of_axis(ColumnParallelDense.SPLIT_AXES["kernel"])
    entry, key = _BLOCK_SLOTS.get(name.split("/", 1)[-1] if name.startswith("block_") else "", (None, None))
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
        >>> from phalanx.models.gpt import GPT, lm_loss
        >>> one = GPT(cfg)
        >>> one.assign_weights(weights)
        >>> abs(loss - float(lm_loss(one(tokens[:, :-1]), tokens[:, 1:]))) < 1e-5
        True
    """

    def __init__(self, cfg: ModelConfig, tp: int = 1, dtype_policy: str = "float32"):
        if cfg.experts:
            raise ValueError("ShardedGPT: a mixture-of-experts GPT runs as a Keras model (phalanx.fit)")
        check_tp(cfg, tp)
        self.cfg, self.tp = cfg, tp
        self.template = _block(cfg, 0, tp, dtype_policy=dtype_policy)
        self.positions = PositionEmbedding(cfg.seq_len, name="positions", dtype=dtype_policy)
        self.final_ln = LayerNorm(LAYER_NORM_EPS, kernels=FUSED, name="final_ln", dtype=dtype_policy)

    def _shards(self, w: Weights, name: str) -> list:
        return [w(name, t) for t in range(self.tp)]

    def embed(self, tokens, w: Weights, devices: Sequence[str]):
        """Token (vocabulary-parallel) + position embeddings of ``tokens [B, T]``, on ``devices[0]``."""
        x = embedding_lookup(tokens, self._shards(w, "embed/tokens"), devices)
        with tf.device(devices[0]):
            return self.positions.add_positions(x, w("embed/positions", 0))

    def block_weights(self, w: Weights, i: int) -> dict:
        """Block ``i``'s weights in the form :meth:`TransformerBlock.forward` takes."""
        out = {"attention": [{} for _ in range(self.tp)], "mlp": [{} for _ in range(self.tp)],
               "ln1": [None, None], "ln2": [None, None]}
        for short, (entry, key) in _BLOCK_SLOTS.items():
            name = f"block_{i}/{short}"
            if entry in ("attention", "mlp"):
                for t in range(self.tp):
                    out[entry][t][key] = w(name, t)
            elif key is None:
                out[entry] = w(name, 0)
            else:
                out[entry][key] = w(name, 0)
        return out

    def block(self, x, w: Weights, i: int, devices: Sequence[str], wrap_core=None):
        """Block ``i`` on the residual stream ``x`` (on ``devices[0]``)."""
        return self.template.forward(x, self.block_weights(w, i), devices=devices, kernels=FUSED,
                                     wrap_core=wrap_core)

    def loss(self, x, targets, w: Weights, devices: Sequence[str]):
        """Final LayerNorm, vocabulary-parallel logits and the mean token cross-entropy (float32);
        the full ``[tokens, vocab]`` logits exist on no device when ``tp > 1``."""
        with tf.device(devices[0]):
            h = self.final_ln.normalize(x, w("final_ln/gamma", 0), w("final_ln/beta", 0))
        tied = self.cfg.tie_embeddings
        shards = self._shards(w, "embed/tokens" if tied else "head/kernel")
        return vocab_parallel_cross_entropy(h, shards, targets, transposed=not tied, devices=devices, kernels=FUSED)


__all__ = ["gpt", "gpt_weights", "load_gpt_weights", "gpt_splits", "check_tp", "ShardedGPT", "FusedKernels",
           "FUSED"]
