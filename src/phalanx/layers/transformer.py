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
(the same sums in the same order, up to the order gradients are accumulated in), except
**dropout**: under sequence parallelism each chunk draws its own mask from the block's
seed generator, so the masks differ from those of the same block without it (same
distribution, different draws). A mixture-of-experts block gathers the normalised chunks
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

import math

import keras
import tensorflow as tf
from keras.src.backend.common.variables import AutocastScope  # read float32 LN weights un-cast

from phalanx.layers.attention import ParallelSelfAttention, rotary
from phalanx.layers.moe import MoE
from phalanx.layers.sharding import ShardedLayer, on_device_of, shard_values
from phalanx.layers.tensor_parallel import ParallelMLP, dims, matmul

_MASKED = -1e9  # as phalanx.layers.attention
_CHUNK_MARK = "_phalanx_sequence_chunks"  # set on a sequence-parallel block's output concat op: its tp


@keras.saving.register_keras_serializable(package="phalanx")
def gelu_approximate(x):
    """GELU, tanh approximation (GPT-2's; Keras's ``"gelu"`` is the exact erf form)."""
    return tf.nn.gelu(x, approximate=True)


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

    def __init__(self, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)

    def build(self, input_shape):
        d = input_shape[-1]
        self.gamma = self.add_logical_weight("gamma", (d,), None, initializer="ones")[0]
        self.beta = self.add_logical_weight("beta", (d,), None, initializer="zeros")[0]

    def normalize(self, x):
        with tf.name_scope("layer_norm"):
            x32 = tf.cast(x, tf.float32)
            mean, var = tf.nn.moments(x32, axes=[-1], keepdims=True)
            y = (x32 - mean) * tf.math.rsqrt(var + self.epsilon)
            y = y * tf.cast(_read(self.gamma), tf.float32) + tf.cast(_read(self.beta), tf.float32)
            return tf.cast(y, self.compute_dtype)

    def call(self, inputs):
        return self.normalize(inputs)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon}


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
        x = tf.cast(inputs, self.compute_dtype)
        table = tf.cast(_read(self.embeddings), self.compute_dtype)
        return x + table[:tf.shape(x)[1]]

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
    size = x.shape[1] // n
    try:
        op = x.op  # eager tensors and KerasTensors have none
    except AttributeError:
        op = None
    if getattr(op, _CHUNK_MARK, None) == n and op.type == "ConcatV2" and len(op.inputs) == n + 1:
        axis, rank = tf.get_static_value(op.inputs[-1]), x.shape.rank
        pieces = list(op.inputs[:-1])
        if axis is not None and rank is not None and int(axis) % rank == 1 and \
                all(p.shape[1] == size for p in pieces):
            return pieces
    with on_device_of(x), tf.name_scope("sequence_chunks"):
        return tf.split(x, n, axis=1)


def _shard_variables(layer: ShardedLayer, name: str) -> list:
    return layer._logical[name][0]


def _reduce_scatter(parts: list, anchors: list, bias=None) -> list:
    """Chunk ``c`` of ``sum(parts)`` (+ ``bias``) on the device of ``anchors[c]``: each part
    is cut on its own device and only chunks travel."""
    n = len(parts)
    pieces = []
    for part, anchor in zip(parts, anchors):
        with on_device_of(anchor), tf.name_scope("reduce_scatter"):
            pieces.append(tf.split(part, n, axis=1))
    out = []
    for c, anchor in enumerate(anchors):
        with on_device_of(anchor), tf.name_scope("reduce_scatter"):
            y = tf.add_n([pieces[r][c] for r in range(n)])
            out.append(y if bias is None else y + bias)
    return out


def attention_partials(attn: ParallelSelfAttention, xs: list, attention_mask=None, padding_mask=None,
                       training=None) -> list:
    """The per-shard partial outputs (before their sum and the output bias) of ``attn`` when
    shard ``r`` reads input ``xs[r]`` (the whole sequence, on its device). The same per-shard
    computation as :meth:`ParallelSelfAttention.call`, dropout seeds included."""
    w = {name: shard_values(attn, entry[0]) for name, entry in attn._logical.items()}
    b, t, d = dims(xs[0])
    hd, groups = attn.head_dim, attn.num_heads // attn.num_kv_heads
    kv = attn.num_kv_heads // attn.tp
    dropping = bool(training) and attn.dropout > 0
    seeds = [attn.seed_generator.next() for _ in range(attn.tp)] if dropping else None
    parts = []
    for r in range(attn.tp):
        with on_device_of(w["output"][r]):
            x = tf.cast(xs[r], attn.compute_dtype)

            def project(name, heads):
                y = matmul(x, tf.reshape(w[name][r], [d, heads * hd]))
                if attn.use_bias:
                    y = y + tf.reshape(w[f"{name}_bias"][r], [heads * hd])
                return tf.reshape(y, [b, t, heads, hd])

            q, k, v = project("query", kv * groups), project("key", kv), project("value", kv)
            if attn.rope_max_wavelength is not None:
                q = rotary(q, attn.rope_max_wavelength, attn.rope_scaling_factor)
                k = rotary(k, attn.rope_max_wavelength, attn.rope_scaling_factor)
            q = q * tf.cast(1.0 / math.sqrt(hd), q.dtype)
            q = tf.reshape(tf.transpose(tf.reshape(q, [b, t, kv, groups, hd]), [0, 2, 3, 1, 4]),
                           [b, kv, groups * t, hd])
            k, v = tf.transpose(k, [0, 2, 1, 3]), tf.transpose(v, [0, 2, 1, 3])
            scores = tf.cast(tf.reshape(tf.matmul(q, k, transpose_b=True), [b, kv, groups, t, t]), "float32")
            mask = attn._mask(x, attention_mask, padding_mask)
            if mask is not None:
                scores += (1.0 - tf.cast(mask, "float32"))[:, None, None] * _MASKED
            probs = tf.nn.softmax(scores, axis=-1)
            if dropping:
                probs = tf.nn.experimental.stateless_dropout(probs, rate=attn.dropout, seed=seeds[r])
            probs = tf.reshape(tf.cast(probs, attn.compute_dtype), [b, kv, groups * t, t])
            o = tf.reshape(tf.matmul(probs, v), [b, kv, groups, t, hd])
            o = tf.reshape(tf.transpose(o, [0, 3, 1, 2, 4]), [b, t, kv * groups * hd])
            parts.append(matmul(o, tf.reshape(w["output"][r], [kv * groups * hd, d])))
    return parts


def mlp_partials(mlp: ParallelMLP, xs: list) -> list:
    """The per-shard partial outputs (before their sum and ``down_bias``) of ``mlp`` when
    shard ``r`` reads input ``xs[r]``: the per-shard computation of :meth:`ParallelMLP.call`."""
    def values(variables):
        return shard_values(mlp, variables) if variables is not None else [None] * mlp.tp

    up, up_b, gate, gate_b = (values(v) for v in (mlp.up, mlp.up_bias, mlp.gate, mlp.gate_bias))
    down = shard_values(mlp, mlp.down)
    parts = []
    for r in range(mlp.tp):
        with on_device_of(down[r]):
            x = tf.cast(xs[r], mlp.compute_dtype)
            h = matmul(x, up[r])
            h = h if up_b[r] is None else h + up_b[r]
            if mlp.gated:
                g = matmul(x, gate[r])
                h = mlp.activation(g if gate_b[r] is None else g + gate_b[r]) * h
            else:
                h = mlp.activation(h)
            parts.append(matmul(h, down[r]))
    return parts


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
        moe: a :class:`~phalanx.layers.moe.MoE` layer, or a dict of its arguments
            (``num_experts`` required; ``hidden_dim``, ``activation``, ``gated`` and
            ``kernel_initializer`` default to the block's), replacing the MLP.
        sequence_parallel: run LayerNorm, dropout and the residual on sequence chunks
            (``tp > 1``).
        layer_norm_epsilon, use_bias, causal, rope_max_wavelength, kernel_initializer,
        bias_initializer, seed: as named (``seed`` seeds the dropout generators).

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
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", seed: int | None = None, **kwargs):
        super().__init__(tp=tp, **kwargs)
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
        self.ln1 = LayerNorm(layer_norm_epsilon, name="ln1", dtype=policy)
        self.attention = ParallelSelfAttention(
            self.num_heads, self.head_dim, num_kv_heads=self.num_kv_heads, tp=tp, use_bias=use_bias, causal=causal,
            rope_max_wavelength=rope_max_wavelength, dropout=self.attention_dropout,
            kernel_initializer=self.kernel_initializer, bias_initializer=self.bias_initializer, seed=seed,
            name="attention", dtype=policy)
        self.ln2 = LayerNorm(layer_norm_epsilon, name="ln2", dtype=policy)
        self._moe_config = None
        if moe is None:
            self.mlp = ParallelMLP(self.ffn_dim, tp=tp, activation=self.activation, gated=self.gated,
                                   use_bias=use_bias, kernel_initializer=self.kernel_initializer,
                                   bias_initializer=self.bias_initializer, name="mlp", dtype=policy)
            self.moe = None
        else:
            self.mlp = None
            self.moe = self._make_moe(moe, policy)
        self.seed_generator = keras.random.SeedGenerator(seed) if self.dropout else None

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

    def _drop(self, x, seed):
        return x if seed is None else tf.nn.experimental.stateless_dropout(x, rate=self.dropout, seed=seed)

    def _seeds(self, training, n: int) -> list:
        if not (training and self.dropout):
            return [None] * n
        return [self.seed_generator.next() for _ in range(n)]

    def _ffn(self, h, training):
        return self.mlp(h) if self.moe is None else self.moe(h, training=training)

    def call(self, inputs, padding_mask=None, attention_mask=None, training=None):
        x = tf.cast(inputs, self.compute_dtype)
        t = x.shape[1]
        if self.sequence_parallel and self.tp > 1 and t is not None and t % self.tp == 0:
            return self._call_sequence_parallel(x, padding_mask, attention_mask, training)
        seeds = self._seeds(training, 2)
        h = self.attention(self.ln1.normalize(x), attention_mask=attention_mask, padding_mask=padding_mask,
                           training=training)
        x = x + self._drop(h, seeds[0])
        return x + self._drop(self._ffn(self.ln2.normalize(x), training), seeds[1])

    def _call_sequence_parallel(self, x, padding_mask, attention_mask, training):
        n = self.tp
        # Shard r's value carries the device of tensor rank r: chunk r runs there.
        anchors = shard_values(self.attention, _shard_variables(self.attention, "output"))
        chunks = sequence_chunks(x, n)
        attn_seeds, ffn_seeds = self._seeds(training, n), self._seeds(training, n)

        def on_chunks(fn, *lists):
            out = []
            for r, anchor in enumerate(anchors):
                with on_device_of(anchor), tf.name_scope(f"sp_chunk{r}"):
                    out.append(fn(r, *(values[r] for values in lists)))
            return out

        def all_gather(pieces):
            return on_chunks(lambda r: tf.concat(pieces, axis=1))

        def bias(layer, name):
            return shard_values(layer, [layer.whole_variable(name)])[0] if layer.use_bias else None

        h = on_chunks(lambda r, c: self.ln1.normalize(c), chunks)
        parts = attention_partials(self.attention, all_gather(h), attention_mask, padding_mask, training)
        a = _reduce_scatter(parts, anchors, bias(self.attention, "output_bias"))
        x = on_chunks(lambda r, c, y: c + self._drop(y, attn_seeds[r]), chunks, a)
        h = on_chunks(lambda r, c: self.ln2.normalize(c), x)
        if self.moe is None:
            m = _reduce_scatter(mlp_partials(self.mlp, all_gather(h)), anchors, bias(self.mlp, "down_bias"))
        else:  # routing capacity and the balancing loss are defined over the whole call
            with on_device_of(anchors[0]):
                whole = tf.concat(h, axis=1)
            y = self.moe(whole, training=training)
            with on_device_of(y):
                m = tf.split(y, n, axis=1)
        x = on_chunks(lambda r, c, y: c + self._drop(y, ffn_seeds[r]), x, m)
        with on_device_of(anchors[0]):
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
                "bias_initializer": keras.initializers.serialize(self.bias_initializer), "seed": self.seed}
