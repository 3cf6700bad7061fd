"""The built-in GPT's weights: their logical names, shapes and seeded initial values.

The GPT itself (pre-LayerNorm blocks, causal self-attention, a GELU MLP or a mixture of
experts, by default tied input/output embeddings) is written once, from the parallel
layers: :func:`phalanx.models.transformer.gpt`. Its weights have fixed logical names
(:func:`weight_shapes`, the one table of them: docs/DESIGN.md; checkpoints, the mesh
engine's shards and the export use them) and a seeded initialisation,
:func:`initial_weights`, that every engine starts from, so any parallel layout can be
compared step by step with the single-device run.

Example:
    >>> from phalanx.config import ModelConfig
    >>> cfg = ModelConfig(layers=2, d_model=32, heads=4, ffn=64, vocab=64, seq_len=16)
    >>> list(weight_shapes(cfg))[:3], num_params(cfg)
    (['embed/tokens', 'embed/positions', 'block_0/ln1/gamma'], 19712)
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import tensorflow as tf

from phalanx.config import ModelConfig
from phalanx.models import gpt_ops
from phalanx.models import init as init_ops

INIT_STD = 0.02

#: the first part of a block weight's name, ``block_{i}/`` (:func:`block_prefix`, :func:`block_index`)
_BLOCK = "block_"


def block_prefix(i: int) -> str:
    """The prefix of every weight name of block ``i`` in :func:`weight_shapes` (``block_{i}/``)."""
    return f"{_BLOCK}{i}/"


def block_index(name: str) -> int | None:
    """The block whose weight ``name`` is (a :func:`weight_shapes` name), None for the
    embeddings, the final LayerNorm and the head.

    >>> block_index("block_12/mlp/fc/kernel"), block_index("final_ln/gamma")
    (12, None)
    """
    head, sep, _ = name.partition("/")
    if not (sep and head.startswith(_BLOCK) and head[len(_BLOCK):].isdigit()):
        return None
    return int(head[len(_BLOCK):])


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical weight name -> shape, in a stable order (embeddings, blocks, final LN, head)."""
    d, f, v, t = cfg.d_model, cfg.ffn_dim, cfg.vocab, cfg.seq_len
    shapes: dict[str, tuple[int, ...]] = {"embed/tokens": (v, d), "embed/positions": (t, d)}
    for i in range(cfg.layers):
        p = block_prefix(i)
        shapes.update({
            p + "ln1/gamma": (d,), p + "ln1/beta": (d,),
            p + "attn/qkv/kernel": (d, 3 * d), p + "attn/qkv/bias": (3 * d,),
            p + "attn/out/kernel": (d, d), p + "attn/out/bias": (d,),
            p + "ln2/gamma": (d,), p + "ln2/beta": (d,),
        })
        if cfg.is_moe_block(i):
            e = cfg.experts
            shapes.update({p + "moe/router": (d, e), p + "moe/w_in": (e, d, f), p + "moe/b_in": (e, f),
                           p + "moe/w_out": (e, f, d), p + "moe/b_out": (e, d)})
        else:
            shapes.update({p + "mlp/fc/kernel": (d, f), p + "mlp/fc/bias": (f,),
                           p + "mlp/proj/kernel": (f, d), p + "mlp/proj/bias": (d,)})
    shapes["final_ln/gamma"] = (d,)
    shapes["final_ln/beta"] = (d,)
    if not cfg.tie_embeddings:
        shapes["head/kernel"] = (d, v)
    return shapes


def num_params(cfg: ModelConfig) -> int:
    return sum(int(np.prod(s)) for s in weight_shapes(cfg).values())


def initializer(cfg: ModelConfig, seed: int) -> Callable[..., np.ndarray]:
    """``init(name, box=None)``: the initial float32 values of ``box`` (``((start, stop), ...)``,
    default the whole tensor) of weight ``name``, made alone (:mod:`phalanx.models.init`:
    fixed tiles, each seeded by ``(seed, name, tile)``), equal to that part of
    :func:`initial_weights`. Engines that shard the weights make only their shards."""
    shapes = weight_shapes(cfg)
    residual_std = INIT_STD / math.sqrt(2 * cfg.layers)

    def init(name: str, box=None) -> np.ndarray:
        shape = shapes[name]
        box = tuple((0, n) for n in shape) if box is None else box
        dims = tuple(b - a for a, b in box)
        if name.endswith("/gamma"):
            return np.ones(dims, np.float32)
        if name.endswith(("/beta", "/bias", "moe/b_in", "moe/b_out")):
            return np.zeros(dims, np.float32)
        std = residual_std if name.endswith(("attn/out/kernel", "mlp/proj/kernel", "moe/w_out")) else INIT_STD
        return init_ops.normal(seed, name, shape, box, std)

    return init


def initial_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 initial weights by logical name (GPT-2 scheme).

    Kernels and embeddings ~ N(0, 0.02); the two residual projections per block
    (attn/out, mlp/proj) are scaled by 1/sqrt(2 * layers) so the residual stream's
    variance does not grow with depth (Radford et al. 2019); biases 0, LN gamma 1.
    Each tensor is drawn in fixed tiles seeded by ``(seed, name, tile)``
    (:func:`initializer`), so a shard of it can be made alone with the same values.
    """
    init = initializer(cfg, seed)
    return {name: init(name) for name in weight_shapes(cfg)}


def decays(name: str) -> bool:
    """Whether AdamW weight decay applies: kernels (experts' and router's included) and
    token embeddings only."""
    return name.endswith(("/kernel", "moe/router", "moe/w_in", "moe/w_out")) or name == "embed/tokens"


def lm_loss(logits: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
    """Mean token cross-entropy, float32."""
    return tf.reduce_mean(gpt_ops.token_cross_entropy(logits, targets))
