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

import keras
import numpy as np

from phalanx.config import ModelConfig
from phalanx.layers.tensor_parallel import ColumnParallelDense, VocabParallelEmbedding
from phalanx.layers.transformer import LayerNorm, PositionEmbedding, TransformerBlock, gelu_approximate
from phalanx.models.gpt import INIT_STD, initial_weights
from phalanx.models.gpt_ops import LAYER_NORM_EPS


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
        moe = None
        if cfg.is_moe_block(i):
            moe = {"num_experts": cfg.experts, "top_k": cfg.top_k, "capacity_factor": cfg.capacity_factor,
                   "aux_loss_coef": cfg.aux_loss_coef, "ep": ep}
        x = TransformerBlock(cfg.heads, cfg.head_dim, cfg.ffn_dim, tp=tp, activation=gelu_approximate,
                             dropout=cfg.dropout, moe=moe, sequence_parallel=sequence_parallel,
                             layer_norm_epsilon=LAYER_NORM_EPS, kernel_initializer=normal,
                             name=f"block_{i}", dtype=policy)(x)
    x = LayerNorm(LAYER_NORM_EPS, name="final_ln", dtype=policy)(x)
    if cfg.tie_embeddings:
        logits = embed(x, reverse=True)
    else:
        logits = ColumnParallelDense(cfg.vocab, tp=tp, use_bias=False, kernel_initializer=normal, name="head",
                                     dtype=policy)(x)
    model = keras.Model(tokens, logits, name=name)
    if seed is not None:
        load_gpt_weights(model, initial_weights(cfg, seed))
    return model


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


__all__ = ["gpt", "gpt_weights", "load_gpt_weights"]
