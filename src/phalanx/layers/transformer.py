"""A pre-LayerNorm transformer block built from the tensor-parallel layers, with Megatron
sequence parallelism (Korthikanti et al. 2022).

:class:`TransformerBlock` is GPT-2's block::

    x = x + dropout(attention(ln1(x)))
    x = x + dropout(mlp(ln2(x)))          # or a mixture of experts in place of the MLP

with :class:`~phalanx.layers.attention.ParallelSelfAttention` (split by heads) and
:class:`~phalanx.layers.tensor_parallel.ParallelMLP` (hidden layer split), or a
:class:`~phalanx.layers.moe.MoE`. At ``tp=1`` it is a plain Keras layer.

**Sequence parallelism** (``sequence_parallel=True``, ``tp > 1``). Without it, the regions
between the tensor-parallel matmuls (LayerNorm, dropout, the residual adds) run on the
whole ``[B, T, D]`` activation on one device after an all-reduce of the partial outputs.
With it they run on ``tp`` chunks of the sequence, chunk ``r`` (``T/tp`` positions) on the
device of tensor rank ``r`` (the device of the block's shard ``r``):

* **all-gather** before the column-parallel matmuls (the attention's Q/K/V, the MLP's
  ``up``/``gate``): each device concatenates the ``tp`` normalised chunks and computes
  its heads / its hidden units on the whole sequence;
* **reduce-scatter** in place of the all-reduce after the row-parallel matmuls (the
  attention's output projection, the MLP's ``down``): each device cuts its partial output
  into chunks and device ``r`` sums the ``tp`` partials of chunk ``r`` (then adds the bias);
* LayerNorm, dropout and the residual add run on chunk ``r`` on device ``r``.

The communicated bytes equal the all-reduce's (an all-reduce *is* a reduce-scatter plus an
all-gather), but the activations of the LayerNorm / dropout / residual regions, and the
residual stream between blocks, are ``1/tp`` per device instead of whole on one, and their
compute is spread over the ``tp`` devices. What leaves the block is an ordinary tensor,
the concat of the chunks; a following block fed (in a graph) directly by that concat takes
the chunks from the concat's inputs (:func:`sequence_chunks`), so nothing is gathered
between blocks and the unused concat is pruned. The numbers equal ``sequence_parallel=False``
(the same sums in the same order, up to the order gradients are accumulated in), dropout
included: the masks are a function of each element's place in the whole tensor
(:mod:`phalanx.layers.dropout`), so chunk ``r`` draws exactly its positions of the mask the
block draws without sequence parallelism. A mixture-of-experts block gathers the normalised chunks
once (its routing capacity and balancing loss are defined over the whole call) and cuts
its output again. Sequence parallelism needs the sequence length known when the graph is
traced and divisible by ``tp``; otherwise the block runs without it (same numbers).

Logical weights (:meth:`TransformerBlock.logical_weights`), in order, whatever the layout::

    ln1/gamma ln1/beta
    attention/query attention/query_bias attention/key attention/key_bias
    attention/value attention/value_bias attention/output attention/output_bias
    ln2/gamma ln2/beta
    mlp/up mlp/up_bias [mlp/gate mlp/gate_bias] mlp/down mlp/down_bias
      or moe/router moe/w_in moe/b_in [moe/w_gate] moe/w_out moe/b_out (+ MoE statistics)

(the sub-layers' own names, :mod:`~phalanx.layers.attention`,
:mod:`~phalanx.layers.tensor_parallel`, :mod:`~phalanx.layers.moe`, prefixed).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.backend.common.variables import AutocastScope  # read float32 LN weights un-cast

from phalanx.layers import dropout as dropout_lib
from phalanx.layers import kernels as kernels_lib
from phalanx.layers.attention import ParallelSelfAttention
from phalanx.layers.kernels import gelu_approximate
from phalanx.layers.moe import MoE
from phalanx.layers.sharding import ShardedLayer, on_device_of, shard_values
from phalanx.layers.tensor_parallel import ParallelMLP, concat_pieces

__all__ = ["LayerNorm", "PositionEmbedding", "TransformerBlock", "sequence_chunks",
           "gelu_approximate"]  # (the GPT's activation, defined with the kernels)

_CHUNK_MARK = "_phalanx_sequence_chunks"  # set on a sequence-parallel block's output concat op: its tp


def _read(variable):
    """A variable's value (the engine's value inside a stateless call), not autocast."""
    with AutocastScope(None):
        return tf.convert_to_tensor(variable)


@keras.saving.register_keras_serializable(package="phalanx")
class LayerNorm(ShardedLayer):
    """LayerNorm over the last axis with statistics in float32 whatever the compute dtype
    (``(x - mean) * rsqrt(var + epsilon) * gamma + beta``, as the built-in GPT's). Weights:
    ``gamma`` ``[D]`` (ones), ``beta`` ``[D]`` (zeros), whole at any ``tp``.

    :meth:`normalize` applies it to any tensor, e.g. one sequence chunk under a device scope.

    Example:
        >>> import numpy as np
        >>> y = LayerNorm()(np.array([[1.0, 2.0, 3.0]], "float32"))
        >>> [round(float(v), 4) for v in y[0]]
        [-1.2247, 0.0, 1.2247]
    """

    def __init__(self, epsilon: float = 1e-5, kernels=None, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)
        self.kernels = kernels_lib.get(kernels)

    def build(self, input_shape):
        d = input_shape[-1]
        self.gamma = self.add_logical_weight("gamma", (d,), None, initializer="ones")[0]
        self.beta = self.add_logical_weight("beta", (d,), None, initializer="zeros")[0]

    def normalize(self, x, gamma=None, beta=None):
        """``x`` normalised with this layer's ``gamma``/``beta`` (or the given tensors: the values
        read once for a call), by the layer's kernels, in the compute dtype."""
        gamma = _read(self.gamma) if gamma is None else gamma
        beta = _read(self.beta) if beta is None else beta
        with tf.name_scope("layer_norm"):
            return self.kernels.layer_norm(tf.cast(x, self.compute_dtype), gamma, beta, self.epsilon)

    def add_normalize(self, x, y, bias=None, gamma=None, beta=None):
        """``(s, normalize(s))`` of the residual sum ``s = x + y + bias`` (``bias`` may be None),
        in the compute dtype: one fused kernel where the layer's kernels have one."""
        gamma = _read(self.gamma) if gamma is None else gamma
        beta = _read(self.beta) if beta is None else beta
        with tf.name_scope("layer_norm"):
            return self.kernels.add_layer_norm(tf.cast(x, self.compute_dtype), y, bias, gamma, beta, self.epsilon)

    def call(self, inputs):
        return self.normalize(inputs)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon, "kernels": kernels_lib.serialize(self.kernels)}


# Its own registered name: export/gpt_keras.py registers another "phalanx>PositionEmbedding".
@keras.saving.register_keras_serializable(package="phalanx", name="TransformerPositionEmbedding")
class PositionEmbedding(ShardedLayer):
    """Adds learned position embeddings: ``x [B, T, D] + embeddings[:T]``. Weight:
    ``embeddings`` ``[sequence_length, D]`` (whole at any ``tp``).

    Example:
        >>> import numpy as np
        >>> layer = PositionEmbedding(8)
        >>> tuple(layer(np.zeros((2, 5, 4), "float32")).shape)
        (2, 5, 4)
    """

    def __init__(self, sequence_length: int, initializer="uniform", **kwargs):
        super().__init__(**kwargs)
        self.sequence_length = int(sequence_length)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        self.embeddings = self.add_logical_weight("embeddings", (self.sequence_length, input_shape[-1]), None,
                                                  initializer=self.initializer)[0]

    def call(self, inputs):
        return self.add_positions(inputs, _read(self.embeddings))

    def add_positions(self, x, table):
        """``x + table[:T]`` in float32, the sum cast once to the compute dtype (so the
        ``[T, D]`` table is not rounded on its own first)."""
        x = tf.convert_to_tensor(x)
        return tf.cast(tf.cast(x, tf.float32) + tf.cast(table, tf.float32)[:tf.shape(x)[1]], self.compute_dtype)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "sequence_length": self.sequence_length,
                "initializer": keras.initializers.serialize(self.initializer)}


def sequence_chunks(x, n: int) -> list:
    """``x [B, T, ...]`` cut into ``n`` chunks of ``T/n`` positions.

    When ``x`` is (in a graph) the output concat of a sequence-parallel
    :class:`TransformerBlock` with the same ``tp``, its pieces are used as they are: each
    stays on the device it was made on and the whole tensor is never formed. Otherwise ``x``
    is split where it is. As with :func:`~phalanx.layers.tensor_parallel.input_slices`, a
    gradient taken with respect to the concat itself is then None: a pipeline stage boundary
    hands the activation on through ``tf.identity`` (the engine does), which turns this off."""
    pieces = concat_pieces(x, _CHUNK_MARK, n, 1)
    if pieces is not None:
        return pieces
    with on_device_of(x), tf.name_scope("sequence_chunks"):
        return tf.split(x, n, axis=1)


def _reduce_scatter(parts: list, scope, bias=None) -> list:
    """Chunk ``c`` of ``sum(parts)`` (+ ``bias``) under ``scope(c)`` (the device of tensor rank
    ``c``): each part is cut on its own device and only chunks travel."""
    n = len(parts)
    pieces = []
    for r, part in enumerate(parts):
        with scope(r), tf.name_scope("reduce_scatter"):
            pieces.append(tf.split(part, n, axis=1))
    out = []
    for c in range(n):
        with scope(c), tf.name_scope("reduce_scatter"):
            y = tf.add_n([pieces[r][c] for r in range(n)])
            out.append(y if bias is None else y + tf.cast(bias, y.dtype))
    return out


def _sum(parts: list, bias):
    y = parts[0] if len(parts) == 1 else tf.add_n(parts)
    return y if bias is None else y + tf.cast(bias, y.dtype)


_MOE_KEYS = ("num_experts", "hidden_dim", "top_k", "capacity_factor", "aux_loss_coef", "z_loss_coef", "gated",
             "activation", "kernel_initializer", "ep")


@keras.saving.register_keras_serializable(package="phalanx")
class TransformerBlock(ShardedLayer):
    """A pre-LN transformer block (GPT-2): ``x + dropout(attn(ln1(x)))`` then
    ``x + dropout(mlp(ln2(x)))``; see the module docstring for sequence parallelism and the
    logical weight names.

    Args:
        num_heads, head_dim, num_kv_heads: the attention's query heads, their width and the
            key/value heads (default ``num_heads``; fewer is grouped-query attention).
        ffn_dim: the MLP's hidden width (and each expert's, by default).
        tp: tensor-parallel shards of the attention heads and the MLP's hidden layer.
        gated, activation: a gated MLP (SwiGLU with ``"silu"``) and its activation: a Keras
            activation (``"gelu"`` is exact; GPT-2's tanh form is :func:`gelu_approximate`).
        dropout: on the attention and MLP outputs before each residual add (training only).
        attention_dropout: on the attention probabilities.
        attention_core: ``"plain"`` or ``"blocked"``, the attention's core
            (:class:`~phalanx.layers.attention.ParallelSelfAttention`).
        moe: a :class:`~phalanx.layers.moe.MoE` layer, or a dict of its arguments
            (``num_experts`` required; ``hidden_dim``, ``activation``, ``gated`` and
            ``kernel_initializer`` default to the block's), replacing the MLP.
        sequence_parallel: run LayerNorm, dropout and the residual on sequence chunks
            (``tp > 1``).
        layer_norm_epsilon, use_bias, causal, rope_max_wavelength, kernel_initializer,
        bias_initializer, seed: as named (``seed`` seeds the dropout masks: the block's positional
            masks, :mod:`phalanx.layers.dropout`, and the attention's).

    ``call(x, padding_mask=None, attention_mask=None, training=None)``: ``[B, T, D] -> [B, T, D]``.

    Example:
        >>> import numpy as np
        >>> block = TransformerBlock(num_heads=4, head_dim=4, ffn_dim=32, tp=2, sequence_parallel=True)
        >>> tuple(block(np.ones((2, 6, 16), "float32")).shape)
        (2, 6, 16)
        >>> list(block.logical_weights())[:3]
        ['ln1/gamma', 'ln1/beta', 'attention/query']
    """

    def __init__(self, num_heads: int, head_dim: int, ffn_dim: int, tp: int = 1, num_kv_heads: int | None = None,
                 gated: bool = False, activation="gelu", dropout: float = 0.0, attention_dropout: float = 0.0,
                 moe=None, sequence_parallel: bool = False, layer_norm_epsilon: float = 1e-5,
                 use_bias: bool = True, causal: bool = True, rope_max_wavelength: float | None = None,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", seed: int | None = None,
                 kernels=None, attention_core: str = "plain", **kwargs):
        super().__init__(tp=tp, **kwargs)
        self.kernels = kernels_lib.get(kernels)
        self.attention_core = attention_core
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"layer {self.name!r}: dropout {dropout!r} is not in [0, 1)")
        self.num_heads, self.head_dim, self.ffn_dim = int(num_heads), int(head_dim), int(ffn_dim)
        self.num_kv_heads = None if num_kv_heads is None else int(num_kv_heads)
        self.gated, self.dropout, self.attention_dropout = bool(gated), float(dropout), float(attention_dropout)
        self.sequence_parallel, self.layer_norm_epsilon = bool(sequence_parallel), float(layer_norm_epsilon)
        self.use_bias, self.causal, self.rope_max_wavelength, self.seed = use_bias, causal, rope_max_wavelength, seed
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        policy = self.dtype_policy
        self.ln1 = LayerNorm(layer_norm_epsilon, kernels=self.kernels, name="ln1", dtype=policy)
        self.attention = ParallelSelfAttention(
            self.num_heads, self.head_dim, num_kv_heads=self.num_kv_heads, tp=tp, use_bias=use_bias, causal=causal,
            rope_max_wavelength=rope_max_wavelength, dropout=self.attention_dropout,
            kernel_initializer=self.kernel_initializer, bias_initializer=self.bias_initializer, seed=seed,
            kernels=self.kernels, attention_core=attention_core, name="attention", dtype=policy)
        self.ln2 = LayerNorm(layer_norm_epsilon, kernels=self.kernels, name="ln2", dtype=policy)
        self._moe_config = None
        if moe is None:
            self.mlp = ParallelMLP(self.ffn_dim, tp=tp, activation=self.activation, gated=self.gated,
                                   use_bias=use_bias, kernel_initializer=self.kernel_initializer,
                                   bias_initializer=self.bias_initializer, kernels=self.kernels, name="mlp",
                                   dtype=policy)
            self.moe = None
        else:
            self.mlp = None
            self.moe = self._make_moe(moe, policy)
        # the dropout masks' seed state and row offset (layers/dropout.py: an engine's per-call context)
        self.dropout_context = dropout_lib.DropoutContext(self, seed) if self.dropout else None

    def _make_moe(self, moe, policy):
        if isinstance(moe, MoE):
            self._moe_config = keras.saving.serialize_keras_object(moe)
            return moe
        if not isinstance(moe, dict):
            raise ValueError(f"layer {self.name!r}: moe must be a phalanx.layers.MoE or a dict of its arguments, "
                             f"got {type(moe).__name__}")
        if "class_name" in moe:  # a serialised MoE layer (from get_config)
            self._moe_config = moe
            return keras.saving.deserialize_keras_object(moe)
        unknown = sorted(set(moe) - set(_MOE_KEYS))
        if unknown or "num_experts" not in moe:
            raise ValueError(f"layer {self.name!r}: moe {moe!r}: needs num_experts and takes only {list(_MOE_KEYS)}")
        self._moe_config = dict(moe)
        args = {"hidden_dim": self.ffn_dim, "activation": self.activation, "gated": self.gated,
                "kernel_initializer": self.kernel_initializer, **moe}
        return MoE(name="moe", dtype=policy, **args)

    # -- weights ----------------------------------------------------------------------------

    def build(self, input_shape):
        for layer in self._children().values():
            layer.build(input_shape)

    def _children(self) -> dict:
        ffn = {"mlp": self.mlp} if self.moe is None else {"moe": self.moe}
        return {"ln1": self.ln1, "attention": self.attention, "ln2": self.ln2, **ffn}

    def logical_weights(self) -> dict:
        """``{"sublayer/name": whole NumPy value}`` (see the module docstring), in order."""
        return {f"{prefix}/{name}": value for prefix, layer in self._children().items()
                for name, value in layer.logical_weights().items()}

    def set_logical_weights(self, values: dict) -> None:
        """Assign whole logical values named as :meth:`logical_weights` names them."""
        layers = self._children()
        names = [f"{prefix}/{name}" for prefix, layer in layers.items() for name in layer._logical]
        unknown = [key for key in values if key not in names]
        if unknown:
            raise ValueError(f"layer {self.name!r} has no logical weight {unknown[0]!r}; it has {names}")
        groups: dict[str, dict] = {}
        for key, value in values.items():
            prefix, _, name = key.partition("/")
            groups.setdefault(prefix, {})[name] = value
        for prefix, group in groups.items():
            layers[prefix].set_logical_weights(group)

    # The sub-layers save their own weights; the block has none of its own.
    def save_own_variables(self, store):
        pass

    def load_own_variables(self, store):
        pass

    # -- the computation ---------------------------------------------------------------------

    def _drop(self, x, key, row_offset=0, position_offset=0):
        """Dropout of ``x`` (rows / positions from the given offsets of the block's input) by
        the positional masks of :mod:`phalanx.layers.dropout`; ``x`` when ``key`` is None."""
        if key is None:
            return x
        return dropout_lib.dropout(x, self.dropout, key, row_offset, position_offset)

    def _site_keys(self, training) -> list:
        """The keys of the block's two dropout sites (attention, MLP) for this call, folded from
        the block's seed state (:class:`~phalanx.layers.dropout.DropoutContext`: one call per
        step); None when nothing is dropped."""
        if not (training and self.dropout):
            return [None, None]
        key = self.dropout_context.key()
        return [dropout_lib.fold(key, site) for site in (0, 1)]

    def own_weights(self) -> dict:
        """The block's weights as tensors on their devices, the ``weights`` of :meth:`forward`:
        ``ln1``/``ln2`` ``(gamma, beta)``, ``attention`` / ``mlp`` the per-shard dicts of the
        sub-layers' ``shard_weights()``, ``attention_bias`` / ``mlp_bias`` the whole output
        biases (None without ``use_bias``); no ``mlp`` entries for a mixture of experts."""
        out = {"ln1": (_read(self.ln1.gamma), _read(self.ln1.beta)), "attention": self.attention.shard_weights(),
               "ln2": (_read(self.ln2.gamma), _read(self.ln2.beta)), "attention_bias": self._bias(self.attention,
                                                                                               "output_bias")}
        if self.moe is None:
            out["mlp"], out["mlp_bias"] = self.mlp.shard_weights(), self._bias(self.mlp, "down_bias")
        return out

    def _bias(self, layer, name):
        return shard_values(layer, [layer.whole_variable(name)])[0] if layer.use_bias else None

    def call(self, inputs, padding_mask=None, attention_mask=None, training=None):
        # the rows of this call in the whole batch (0: a plain call; an engine's micro-batch: its own)
        rows = self.dropout_context.row_offset() if training and self.dropout else 0
        return self.forward(inputs, self.own_weights(), padding_mask, attention_mask, training, row_offset=rows)

    def forward(self, x, weights: dict, padding_mask=None, attention_mask=None, training=None, row_offset=0):
        """The block on ``x [B, T, D]`` with ``weights`` (as :meth:`own_weights` gives them), each
        tensor rank's work on the device of its weights. The residual stream, the LayerNorms and
        the output sums run on rank 0's device, or with sequence parallelism on the ranks'
        sequence chunks. ``row_offset`` (the first row of ``x`` in the whole batch) and the
        block's seed state key the dropout masks (training only)."""
        x = tf.cast(x, self.compute_dtype)
        anchors = [w["output"] for w in weights["attention"]]

        def scope(r):
            return on_device_of(anchors[r])

        t = x.shape[1]
        if self.sequence_parallel and self.tp > 1 and t is not None and t % self.tp == 0:
            return self._forward_sequence_parallel(x, weights, padding_mask, attention_mask, training, scope,
                                                   row_offset)
        keys = self._site_keys(training)
        with scope(0):
            h = self.ln1.normalize(x, *weights["ln1"])
        parts = self.attention.partials([h] * self.tp, weights["attention"], attention_mask, padding_mask, training)
        with scope(0):
            if keys[0] is None:  # no dropout between: the residual add and ln2 as one kernel
                x, h = self.ln2.add_normalize(x, _sum(parts, None), weights["attention_bias"], *weights["ln2"])
            else:
                x = x + self._drop(_sum(parts, weights["attention_bias"]), keys[0], row_offset)
                h = self.ln2.normalize(x, *weights["ln2"])
        if self.moe is None:
            parts = self.mlp.partials([h] * self.tp, weights["mlp"])
            with scope(0):
                m = _sum(parts, weights["mlp_bias"])
        else:
            m = self.moe(h, training=training)
        with scope(0):
            return x + self._drop(m, keys[1], row_offset)

    def _forward_sequence_parallel(self, x, weights, padding_mask, attention_mask, training, scope, row_offset=0):
        n = self.tp
        chunks = sequence_chunks(x, n)
        keys, span = self._site_keys(training), x.shape[1] // n  # chunk r: positions [r*span, ...)

        def on_chunks(fn, *lists):
            out = []
            for r in range(n):
                with scope(r), tf.name_scope(f"sp_chunk{r}"):
                    out.append(fn(r, *(values[r] for values in lists)))
            return out

        def all_gather(pieces):
            return on_chunks(lambda r: tf.concat(pieces, axis=1))

        h = on_chunks(lambda r, c: self.ln1.normalize(c, *weights["ln1"]), chunks)
        parts = self.attention.partials(all_gather(h), weights["attention"], attention_mask, padding_mask, training)
        a = _reduce_scatter(parts, scope, weights["attention_bias"])
        x = on_chunks(lambda r, c, y: c + self._drop(y, keys[0], row_offset, r * span), chunks, a)
        h = on_chunks(lambda r, c: self.ln2.normalize(c, *weights["ln2"]), x)
        if self.moe is None:
            parts = self.mlp.partials(all_gather(h), weights["mlp"])
            m = _reduce_scatter(parts, scope, weights["mlp_bias"])
        else:  # routing capacity and the balancing loss are defined over the whole call
            with scope(0):
                whole = tf.concat(h, axis=1)
            y = self.moe(whole, training=training)
            with on_device_of(y):
                m = tf.split(y, n, axis=1)
        x = on_chunks(lambda r, c, y: c + self._drop(y, keys[1], row_offset, r * span), x, m)
        with scope(0):
            y = tf.concat(x, axis=1)
        if not tf.executing_eagerly():
            setattr(y.op, _CHUNK_MARK, n)  # the next block may take the chunks instead
        return y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def compute_output_spec(self, inputs, padding_mask=None, attention_mask=None, training=None):
        return keras.KerasTensor(tuple(inputs.shape), dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "head_dim": self.head_dim,
                "ffn_dim": self.ffn_dim, "num_kv_heads": self.num_kv_heads, "gated": self.gated,
                "activation": keras.activations.serialize(self.activation), "dropout": self.dropout,
                "attention_dropout": self.attention_dropout, "moe": self._moe_config,
                "sequence_parallel": self.sequence_parallel, "layer_norm_epsilon": self.layer_norm_epsilon,
                "use_bias": self.use_bias, "causal": self.causal, "rope_max_wavelength": self.rope_max_wavelength,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "bias_initializer": keras.initializers.serialize(self.bias_initializer), "seed": self.seed,
                "kernels": kernels_lib.serialize(self.kernels), "attention_core": self.attention_core}
