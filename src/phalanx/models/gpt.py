"""A GPT decoder as Keras 3 layers, written for one device.

Pre-LayerNorm blocks, causal self-attention with a fused QKV projection, a GELU MLP
and (by default) tied input/output embeddings. Parallelism is applied from outside
(:mod:`phalanx.parallel`); this file knows nothing about devices.

Weights have fixed logical names (docs/DESIGN.md) and a seeded initialisation,
:func:`initial_weights`, that every engine starts from, so any parallel layout can be
compared step by step with the single-device run.

Example:
    >>> import numpy as np
    >>> from phalanx.config import ModelConfig
    >>> cfg = ModelConfig(layers=2, d_model=32, heads=4, ffn=64, vocab=64, seq_len=16)
    >>> model = GPT(cfg)
    >>> logits = model(np.zeros([2, 16], np.int32))
    >>> tuple(logits.shape)
    (2, 16, 64)
"""

from __future__ import annotations

import math
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from phalanx.config import ModelConfig
from phalanx.layers.moe import MoE
from phalanx.models import gpt_ops
from phalanx.models import init as init_ops

INIT_STD = 0.02


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical weight name -> shape, in a stable order (embeddings, blocks, final LN, head)."""
    d, f, v, t = cfg.d_model, cfg.ffn_dim, cfg.vocab, cfg.seq_len
    shapes: dict[str, tuple[int, ...]] = {"embed/tokens": (v, d), "embed/positions": (t, d)}
    for i in range(cfg.layers):
        p = f"block_{i}/"
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


class _Named(keras.layers.Layer):
    """A layer whose weights are created by logical name, zero-initialised (see :func:`initial_weights`)."""

    def _weight(self, logical_name: str, shape: tuple[int, ...]):
        w = self.add_weight(name=logical_name.rsplit("/", 1)[-1], shape=shape, initializer="zeros",
                            dtype="float32", autocast=False)
        self.named[logical_name] = w
        return w


class Block(_Named):
    """One pre-LN transformer block: x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, cfg: ModelConfig, index: int, **kwargs):
        super().__init__(name=f"block_{index}", **kwargs)
        self.cfg, self.named = cfg, {}
        d, f, p = cfg.d_model, cfg.ffn_dim, f"block_{index}/"
        self.ln1_g, self.ln1_b = self._weight(p + "ln1/gamma", (d,)), self._weight(p + "ln1/beta", (d,))
        self.qkv_k, self.qkv_b = self._weight(p + "attn/qkv/kernel", (d, 3 * d)), self._weight(p + "attn/qkv/bias", (3 * d,))
        self.out_k, self.out_b = self._weight(p + "attn/out/kernel", (d, d)), self._weight(p + "attn/out/bias", (d,))
        self.ln2_g, self.ln2_b = self._weight(p + "ln2/gamma", (d,)), self._weight(p + "ln2/beta", (d,))
        self.moe = None
        if cfg.is_moe_block(index):
            # The experts' MLPs use the dense MLP's GELU; the router and the losses are MoE's.
            self.moe = MoE(cfg.experts, f, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                           aux_loss_coef=cfg.aux_loss_coef, activation=gpt_ops.gelu, name="moe",
                           kernel_initializer="zeros", dtype=kwargs.get("dtype"))
            self.moe.build((None, None, d))
            for short in ("router", "w_in", "b_in", "w_out", "b_out"):
                self.named[p + "moe/" + short] = self.moe.whole_variable(short)
        else:
            self.fc_k, self.fc_b = self._weight(p + "mlp/fc/kernel", (d, f)), self._weight(p + "mlp/fc/bias", (f,))
            self.proj_k, self.proj_b = (self._weight(p + "mlp/proj/kernel", (f, d)),
                                        self._weight(p + "mlp/proj/bias", (d,)))
        self.drop = keras.layers.Dropout(cfg.dropout) if cfg.dropout > 0 else None

    def _dropout(self, x, training):
        return self.drop(x, training=training) if self.drop is not None else x

    def attention(self, x):
        h = gpt_ops.layer_norm(x, self.ln1_g, self.ln1_b)
        h = gpt_ops.attention_core(gpt_ops.dense(h, self.qkv_k, self.qkv_b), self.cfg.heads)
        return gpt_ops.dense(h, self.out_k, self.out_b)

    def mlp(self, x, training=False):
        h = gpt_ops.layer_norm(x, self.ln2_g, self.ln2_b)
        if self.moe is not None:
            return self.moe(h, training=training)
        h = gpt_ops.gelu(gpt_ops.dense(h, self.fc_k), self.fc_b)  # the bias inside the fused GELU
        return gpt_ops.dense(h, self.proj_k, self.proj_b)

    def call(self, x, training=False):
        x = x + self._dropout(self.attention(x), training)
        return x + self._dropout(self.mlp(x, training), training)


class GPT(keras.Model):
    """GPT decoder: tokens ``[b, t]`` int32 -> logits ``[b, t, vocab]`` (compute dtype).

    ``dtype_policy`` is a Keras policy name (``float32``, ``mixed_bfloat16``,
    ``mixed_float16``): variables stay float32, matmuls run in the compute dtype.
    Variables are read as float32 (``autocast=False``) and cast where the math wants
    the compute dtype (``gpt_ops``): the token embedding is gathered from float32 rows
    and summed with the positions in float32 before one cast (Keras's autocast would
    cast the whole ``[vocab, d]`` table first), and LayerNorm's gamma and beta stay
    float32 instead of a round trip through bfloat16.
    """

    def __init__(self, cfg: ModelConfig, dtype_policy: str = "float32", **kwargs):
        super().__init__(name="gpt", dtype=dtype_policy, **kwargs)
        self.cfg = cfg
        self.named: dict = {}
        d = cfg.d_model
        self.tokens_w = self.add_weight(name="tokens", shape=(cfg.vocab, d), initializer="zeros", dtype="float32",
                                        autocast=False)
        self.positions_w = self.add_weight(name="positions", shape=(cfg.seq_len, d), initializer="zeros",
                                           dtype="float32", autocast=False)
        self.named.update({"embed/tokens": self.tokens_w, "embed/positions": self.positions_w})
        self.blocks = [Block(cfg, i, dtype=dtype_policy) for i in range(cfg.layers)]
        for block in self.blocks:
            self.named.update(block.named)
        self.final_g = self.add_weight(name="final_ln_gamma", shape=(d,), initializer="zeros", dtype="float32",
                                        autocast=False)
        self.final_b = self.add_weight(name="final_ln_beta", shape=(d,), initializer="zeros", dtype="float32",
                                        autocast=False)
        self.named.update({"final_ln/gamma": self.final_g, "final_ln/beta": self.final_b})
        self.head_w = None
        if not cfg.tie_embeddings:
            self.head_w = self.add_weight(name="head_kernel", shape=(d, cfg.vocab), initializer="zeros",
                                          dtype="float32", autocast=False)
            self.named["head/kernel"] = self.head_w
        self.embed_drop = keras.layers.Dropout(cfg.dropout) if cfg.dropout > 0 else None
        # Put the weights in logical order so that `trainable_variables` lines up with
        # weight_shapes(); engines rely on names, not on this order.
        self.ordered_names = list(weight_shapes(cfg))
        assert set(self.ordered_names) == set(self.named), "weight names out of sync with weight_shapes()"

    def named_variables(self) -> dict[str, tf.Variable]:
        """Logical name -> the backing ``tf.Variable``, in :func:`weight_shapes` order."""
        return {n: _tf_variable(self.named[n]) for n in self.ordered_names}

    def assign_weights(self, weights: dict[str, np.ndarray]) -> None:
        for name, var in self.named_variables().items():
            var.assign(weights[name])

    def embed(self, tokens, training=False):
        with tf.name_scope("embed"):
            x = tf.gather(self.tokens_w, tokens) + self.positions_w[: tf.shape(tokens)[1]]
            x = tf.cast(x, self.compute_dtype)
        if self.embed_drop is not None:
            x = self.embed_drop(x, training=training)
        return x

    def logits(self, x):
        x = gpt_ops.layer_norm(x, self.final_g, self.final_b)
        with tf.name_scope("head"):
            if self.head_w is None:
                return tf.matmul(tf.reshape(x, [-1, self.cfg.d_model]), tf.cast(self.tokens_w, x.dtype),
                                 transpose_b=True)
            return tf.reshape(x, [-1, self.cfg.d_model]) @ tf.cast(self.head_w, x.dtype)

    def call(self, tokens, training=False):
        x = self.embed(tokens, training)
        for block in self.blocks:
            x = block(x, training=training)
        b, t = tf.shape(tokens)[0], tf.shape(tokens)[1]
        return tf.reshape(self.logits(x), [b, t, self.cfg.vocab])


def _tf_variable(v) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras 3 variable (Keras wraps it in ``.value``)."""
    return v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v


def lm_loss(logits: tf.Tensor, targets: tf.Tensor) -> tf.Tensor:
    """Mean token cross-entropy, float32."""
    return tf.reduce_mean(gpt_ops.token_cross_entropy(logits, targets))
