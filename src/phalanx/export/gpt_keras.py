"""The built-in GPT rebuilt from stock Keras layers, for export.

:func:`phalanx.models.transformer.gpt` is made of phalanx's parallel layers (weights cut
for tensor parallelism, fused kernels); Keras's ``model.quantize`` only acts on ``Dense`` /
``EinsumDense`` / ``Embedding`` layers, and LiteRT and other runtimes want plain ops.
:func:`build` makes a Functional model that computes the same logits from the same logical
weights (:func:`phalanx.models.gpt.weight_shapes` names; tested to ~1e-5) out of

- ``keras.layers.ReversibleEmbedding`` for the tied token embedding and output head,
- ``keras.layers.Dense`` for the QKV, attention-out, MLP-in and MLP-out projections,
- ``keras.layers.LayerNormalization`` (epsilon 1e-5),

plus small registered layers with no quantizable weights: phalanx's
:class:`~phalanx.layers.transformer.PositionEmbedding`, :class:`CausalSelfAttention` (the
attention core between the Dense projections) and :class:`TanhGelu`. A saved ``.keras``
file loads with ``import phalanx`` then ``keras.saving.load_model`` (``phalanx`` registers
them when Keras first looks one up).

Inputs are int32 tokens ``[batch, seq_len]`` (a fixed length: the position table has
``seq_len`` rows, and :func:`phalanx.models.generate.generate` pads to it); outputs are
float32 logits ``[batch, seq_len, vocab]``.

Example:
    >>> import numpy as np
    >>> from phalanx.config import ModelConfig
    >>> from phalanx.models import gpt
    >>> cfg = ModelConfig(layers=1, d_model=16, heads=2, ffn=32, vocab=64, seq_len=8)
    >>> w = gpt.initial_weights(cfg, 0)
    >>> model = build(cfg, w)
    >>> tuple(model(np.zeros([2, 8], np.int32)).shape)
    (2, 8, 64)
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

from phalanx.config import ConfigError, ModelConfig
from phalanx.layers.transformer import PositionEmbedding
from phalanx.models.gpt import weight_shapes

PACKAGE = "phalanx"
LN_EPS = 1e-5
#: The masked-score fill of full-integer int8 exports. Float exports use -1e9 (exactly
#: the training model's mask); but int8 quantizes the score tensor with one scale per
#: tensor, and a -1e9 fill stretches it so far that every real score rounds to the same
#: value (attention turns uniform: held-out perplexity of the demo GPT +62%, measured).
#: Filling with -64 keeps the range to the scores' own; masked weights stay below
#: exp(-64 - row max) of the row's, and the float model's loss with this fill equals the
#: -1e9 one's to 1e-9 on the demo run (measured with fills of 30, 60 and 120).
INT8_MASK_VALUE = 64.0


@keras.saving.register_keras_serializable(package=PACKAGE)
class CausalSelfAttention(keras.layers.Layer):
    """Fused-QKV activations ``[b, t, 3d]`` (columns ``[q|k|v]``, head-major) -> ``[b, t, d]``:
    the attention core of :func:`phalanx.models.gpt_ops.attention_core`, softmax in float32."""

    def __init__(self, heads: int, mask_value: float = 1e9, **kwargs):
        super().__init__(**kwargs)
        self.heads = int(heads)
        self.mask_value = float(mask_value)

    def call(self, qkv):
        t = ops.shape(qkv)[1]
        d = qkv.shape[-1] // 3
        hd = d // self.heads

        def split(x):
            return ops.transpose(ops.reshape(x, (-1, t, self.heads, hd)), (0, 2, 1, 3))

        q, k, v = (split(qkv[..., i * d:(i + 1) * d]) for i in range(3))
        q = q * ops.cast(1.0 / math.sqrt(hd), q.dtype)
        scores = ops.cast(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))), "float32")
        causal = ops.tril(ops.ones((t, t))) > 0
        scores = ops.where(causal, scores, ops.cast(-self.mask_value, scores.dtype))
        probs = ops.cast(ops.softmax(scores, axis=-1), v.dtype)
        out = ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3))
        return ops.reshape(out, (-1, t, d))

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], input_shape[-1] // 3)

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "mask_value": self.mask_value}


@keras.saving.register_keras_serializable(package=PACKAGE)
class TanhGelu(keras.layers.Layer):
    """GELU, tanh approximation (GPT-2's; Keras's ``"gelu"`` activation is the exact one)."""

    def call(self, x):
        return keras.activations.gelu(x, approximate=True)


def build(cfg: ModelConfig, weights: dict[str, np.ndarray] | None = None, dtype: str = "float32",
          batch_size: int | None = None, mask_value: float = 1e9) -> keras.Model:
    """The Functional Keras GPT for ``cfg``, with ``weights`` (logical names) assigned.

    ``dtype`` is a Keras dtype policy for every layer (``float32``; ``float16`` stores and
    computes in half precision). ``batch_size`` fixes the batch dimension (LiteRT wants
    static shapes); None leaves it free. ``mask_value``: the score given to masked (future)
    positions before the softmax, ``-mask_value`` (see :data:`INT8_MASK_VALUE`).
    """
    if not hasattr(keras.layers, "ReversibleEmbedding"):
        raise ConfigError("keras", f"Keras {keras.__version__} has no keras.layers.ReversibleEmbedding, which the "
                                   f"export of the built-in GPT uses; upgrade Keras (tested with 3.15)")
    d, heads = cfg.d_model, cfg.heads
    tokens = keras.Input((cfg.seq_len,), batch_size=batch_size, dtype="int32", name="tokens")
    embed = keras.layers.ReversibleEmbedding(cfg.vocab, d, tie_weights=cfg.tie_embeddings,
                                             name="embed", dtype=dtype)
    x = embed(tokens)
    x = PositionEmbedding(cfg.seq_len, initializer="zeros", name="positions", dtype=dtype)(x)
    for i in range(cfg.layers):
        p = f"block_{i}_"
        h = keras.layers.LayerNormalization(epsilon=LN_EPS, name=p + "ln1", dtype=dtype)(x)
        h = keras.layers.Dense(3 * d, name=p + "qkv", dtype=dtype)(h)
        h = CausalSelfAttention(heads, mask_value, name=p + "attn", dtype=dtype)(h)
        h = keras.layers.Dense(d, name=p + "out", dtype=dtype)(h)
        x = keras.layers.Add(name=p + "attn_res", dtype=dtype)([x, h])
        h = keras.layers.LayerNormalization(epsilon=LN_EPS, name=p + "ln2", dtype=dtype)(x)
        h = keras.layers.Dense(cfg.ffn_dim, name=p + "fc", dtype=dtype)(h)
        h = TanhGelu(name=p + "gelu", dtype=dtype)(h)
        h = keras.layers.Dense(d, name=p + "proj", dtype=dtype)(h)
        x = keras.layers.Add(name=p + "mlp_res", dtype=dtype)([x, h])
    x = keras.layers.LayerNormalization(epsilon=LN_EPS, name="final_ln", dtype=dtype)(x)
    logits = embed(x, reverse=True)
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(logits)
    model = keras.Model(tokens, logits, name="phalanx_gpt")
    if weights is not None:
        assign(model, cfg, weights)
    return model


def layer_weights(cfg: ModelConfig) -> list[tuple[str, list[str]]]:
    """(Keras layer name, [logical weight names in the layer's weight order]), from
    :func:`phalanx.models.gpt.weight_shapes`: a block's ``block_i/<...>/<sub>/<weight>`` is layer
    ``block_i_<sub>`` (kernel before bias, gamma before beta, as Dense and LayerNormalization
    hold them); the token table and an untied head are the ReversibleEmbedding ``embed``'s two.

    Example:
        >>> layer_weights(ModelConfig(layers=1, d_model=8, heads=2, ffn=16, vocab=16, seq_len=4))[2:4]
        [('block_0_ln1', ['block_0/ln1/gamma', 'block_0/ln1/beta']), ('block_0_qkv', ['block_0/attn/qkv/kernel', \
'block_0/attn/qkv/bias'])]
    """
    out: dict[str, list[str]] = {}
    for name in weight_shapes(cfg):
        if name in ("embed/tokens", "head/kernel"):
            layer = "embed"
        elif name == "embed/positions":
            layer = "positions"
        else:
            block, _, sub = name.rsplit("/", 1)[0].partition("/")
            layer = f"{block}_{sub.rsplit('/', 1)[-1]}" if sub else block
        out.setdefault(layer, []).append(name)
    return list(out.items())


def assign(model: keras.Model, cfg: ModelConfig, weights: dict[str, np.ndarray]) -> None:
    """Copy logical weights into the (float, not yet quantized) export model."""
    missing = [n for _, names in layer_weights(cfg) for n in names if n not in weights]
    if missing:
        raise KeyError(f"weights lack {missing[:5]}")
    for layer_name, names in layer_weights(cfg):
        # (an untied head/kernel [d, V] is ReversibleEmbedding's reverse_embeddings [d, V] as is)
        model.get_layer(layer_name).set_weights([np.asarray(weights[n]) for n in names])
