"""Tensor-parallel Keras layers (Megatron-LM, Shoeybi et al. 2019): Dense cut by columns or
rows, an embedding cut by vocabulary with its cross-entropy, and an MLP block.

Each layer holds ``tp`` shard variables per cut weight (:class:`~phalanx.layers.sharding.ShardedLayer`)
and runs shard ``r``'s ops under :func:`~phalanx.layers.sharding.on_device_of` shard ``r``'s
value, so the ops follow the weights wherever the engine put them. Ops that combine shards
(the row-parallel sum, the column concat) run on shard 0's device. No layer names a device:
outside an engine a tp=2 layer runs where Keras puts it and gives the numbers of a tp=1
layer, which is a plain Keras layer.

What flows between layers is an ordinary tensor. Inside a block the activation stays cut:
:class:`ParallelMLP` keeps its hidden layer in shards, and a :class:`RowParallelDense` fed
(in a graph) straight by a :class:`ColumnParallelDense` of the same ``tp`` takes the
column shards from the concat's inputs instead of slicing the concat, so the full
activation is never formed (the unused concat is pruned by Grappler; see
:func:`input_slices` for the one case where that needs care).

Logical weights (what ``.keras`` files, :meth:`~ShardedLayer.logical_weights` and
:meth:`~ShardedLayer.set_logical_weights` see, whatever ``tp`` is):

================================  =====================================================
``ColumnParallelDense``           ``kernel`` [in, units] (cut dim 1), ``bias`` [units] (cut)
``RowParallelDense``              ``kernel`` [in, units] (cut dim 0), ``bias`` [units] (whole)
``VocabParallelEmbedding``        ``embeddings`` [vocab, dim] (cut dim 0)
``ParallelMLP``                   ``up`` [D, F], ``up_bias`` [F], (``gate`` [D, F], ``gate_bias``
                                  [F] when gated), ``down`` [F, D], ``down_bias`` [D] (whole);
                                  F cut everywhere
================================  =====================================================

The Dense layers' names and order are :class:`keras.layers.Dense`'s, the embedding's is
:class:`keras.layers.Embedding`'s, so their weights load both ways.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras.src.backend.common.variables import AutocastScope  # no public way to read a variable un-cast

from phalanx.layers import kernels as kernels_lib
from phalanx.layers.sharding import ShardedLayer, on_device_of, shard_values

# Activations that are not element-wise must see the whole output, so a column layer
# applies them after the concat.
_NOT_ELEMENTWISE = ("softmax", "log_softmax")


def dims(x) -> list:
    """The shape of ``x``: static where known, dynamic scalars elsewhere (for reshapes that keep
    the static shape)."""
    dynamic = None
    out = []
    for i, d in enumerate(x.shape):
        if d is None:
            dynamic = tf.shape(x) if dynamic is None else dynamic
            d = dynamic[i]
        out.append(d)
    return out


def matmul(x, w, transpose_b: bool = False, bias=None):
    """``x [..., k] @ w [k, n] (+ bias)`` as one 2-D MatMul in ``x``'s dtype (``w`` and
    ``bias`` are cast to it): the gradient of a batched einsum was ~100x slower on CPU
    (ARCHITECTURE.md). The bias is added to the 2-D product with ``bias_add``, before the
    reshape back, so Grappler fuses MatMul + BiasAdd into one oneDNN kernel."""
    n = w.shape[0] if transpose_b else w.shape[-1]
    w = tf.cast(w, x.dtype)
    y = tf.matmul(x if x.shape.rank == 2 else tf.reshape(x, [-1, x.shape[-1]]), w, transpose_b=transpose_b)
    if bias is not None:
        y = tf.nn.bias_add(y, tf.cast(bias, x.dtype))
    return y if x.shape.rank == 2 else tf.reshape(y, dims(x)[:-1] + [n])


def add_shards(parts, device_of):
    """The sum of per-shard partial results, on shard 0's device (the device of ``device_of``)."""
    if len(parts) == 1:
        return parts[0]
    with on_device_of(device_of):
        return tf.add_n(parts)


_COLUMN_MARK = "_phalanx_column_shards"  # set on a ColumnParallelDense's concat op: its tp


def input_slices(x, n: int) -> list:
    """``x`` cut into ``n`` equal slices of its last axis.

    When ``x`` is (in a graph) the concat made by a :class:`ColumnParallelDense` with the
    same ``tp``, the concat's inputs are used as they are: the whole activation is never
    formed and each piece stays where it was made. The price: nothing downstream reads the
    concat, so a gradient taken with respect to the concat itself (rather than the weights)
    is None. A pipeline stage boundary between the two layers must therefore hand the
    activation on through ``tf.identity``, which turns this off.
    """
    if n == 1:
        return [x]
    pieces = concat_pieces(x, _COLUMN_MARK, n, -1)
    if pieces is not None:
        return pieces
    # Slice where x is, so only the slice travels to its shard's device.
    width = x.shape[-1] // n
    with on_device_of(x):
        return [x[..., r * width:(r + 1) * width] for r in range(n)]


def concat_pieces(x, mark: str, n: int, axis: int):
    """The ``n`` inputs of the ConcatV2 op that made ``x`` (in a graph), when a layer tagged
    that op with ``mark`` = ``n`` and it joins ``n`` equal pieces along ``axis``; else None."""
    try:
        op = x.op  # eager tensors and KerasTensors have none
    except AttributeError:
        return None
    if getattr(op, mark, None) != n or op.type != "ConcatV2" or len(op.inputs) != n + 1:
        return None
    joined, rank = tf.get_static_value(op.inputs[-1]), x.shape.rank
    pieces = list(op.inputs[:-1])
    if joined is None or rank is None or int(joined) % rank != axis % rank or x.shape[axis] is None:
        return None
    return pieces if all(p.shape[axis] == x.shape[axis] // n for p in pieces) else None


def _check_divisible(layer, what: str, size: int, tp: int) -> None:
    if size % tp:
        raise ValueError(f"layer {layer.name!r}: {what} {size} is not divisible by tp={tp}")


def _serialize(obj):
    return keras.initializers.serialize(obj)


class _DenseBase(ShardedLayer):
    def __init__(self, units: int, tp: int = 1, activation=None, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", **kwargs):
        super().__init__(tp=tp, **kwargs)
        self.units, self.use_bias = int(units), use_bias
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    SPLIT_AXES: dict = {}  # the subclass's: the dimension each logical weight is cut along

    def build(self, input_shape):
        self.kernel = self.add_logical_weight("kernel", (input_shape[-1], self.units), self.SPLIT_AXES["kernel"],
                                              initializer=self.kernel_initializer)
        self.bias = (self.add_logical_weight("bias", (self.units,), self.SPLIT_AXES["bias"],
                                             initializer=self.bias_initializer)
                     if self.use_bias else None)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "use_bias": self.use_bias,
                "activation": keras.activations.serialize(self.activation),
                "kernel_initializer": _serialize(self.kernel_initializer),
                "bias_initializer": _serialize(self.bias_initializer)}


@keras.saving.register_keras_serializable(package="phalanx")
class ColumnParallelDense(_DenseBase):
    """A Dense layer whose kernel ``[in, units]`` is cut into ``tp`` shards along ``units``.

    Shard ``r`` computes its ``units/tp`` outputs on its own device (bias and an
    element-wise activation included); the result is their concat, an ordinary tensor.
    Weights: ``kernel``, ``bias``, as :class:`keras.layers.Dense`.

    Example:
        >>> import numpy as np
        >>> x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
        >>> dense = keras.layers.Dense(6)
        >>> _ = dense(x)
        >>> col = ColumnParallelDense(6, tp=2)
        >>> col.build((None, 3, 4))
        >>> col.set_logical_weights(dict(zip(["kernel", "bias"], dense.get_weights())))
        >>> [tuple(v.shape) for v in col.weights]
        [(4, 3), (4, 3), (3,), (3,)]
        >>> bool(np.allclose(col(x), dense(x), atol=1e-6))
        True
    """

    #: the dimension each logical weight is cut along (None: whole)
    SPLIT_AXES = {"kernel": 1, "bias": 0}

    def __init__(self, units: int, tp: int = 1, **kwargs):
        super().__init__(units, tp=tp, **kwargs)
        _check_divisible(self, "units", self.units, tp)

    def call(self, inputs):
        kernels = shard_values(self, self.kernel)
        biases = shard_values(self, self.bias) if self.use_bias else [None] * self.tp
        late = getattr(self.activation, "__name__", "") in _NOT_ELEMENTWISE
        x = tf.cast(inputs, self.compute_dtype)
        outs = []
        for kernel, bias in zip(kernels, biases):
            with on_device_of(kernel):
                y = matmul(x, kernel)
                y = y if bias is None else y + bias
                outs.append(y if late else self.activation(y))
        if len(outs) > 1:
            with on_device_of(kernels[0]):
                y = tf.concat(outs, axis=-1)
            if not late and not tf.executing_eagerly():
                setattr(y.op, _COLUMN_MARK, self.tp)  # a RowParallelDense may read the shards instead
        else:
            y = outs[0]
        return self.activation(y) if late else y


@keras.saving.register_keras_serializable(package="phalanx")
class RowParallelDense(_DenseBase):
    """A Dense layer whose kernel ``[in, units]`` is cut into ``tp`` shards along ``in``.

    Shard ``r`` multiplies its slice of the input by its kernel rows on its own device; the
    partial products are summed on shard 0's device, where the whole bias is added once
    (then the activation). Fed by a :class:`ColumnParallelDense` of the same ``tp``, it takes
    that layer's shard outputs directly (see :func:`input_slices`). Weights: ``kernel``,
    ``bias``, as :class:`keras.layers.Dense`.

    Example:
        >>> import numpy as np
        >>> x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
        >>> dense = keras.layers.Dense(3)
        >>> _ = dense(x)
        >>> row = RowParallelDense(3, tp=2)
        >>> row.build((None, 4))
        >>> row.set_logical_weights({"kernel": dense.kernel.numpy(), "bias": dense.bias.numpy()})
        >>> [tuple(v.shape) for v in row.weights]
        [(2, 3), (2, 3), (3,)]
        >>> bool(np.allclose(row(x), dense(x), atol=1e-6))
        True
    """

    SPLIT_AXES = {"kernel": 0, "bias": None}

    def call(self, inputs):
        kernels = shard_values(self, self.kernel)
        parts = []
        for piece, kernel in zip(input_slices(inputs, self.tp), kernels):
            with on_device_of(kernel):
                parts.append(matmul(tf.cast(piece, self.compute_dtype), kernel))
        y = add_shards(parts, kernels[0])
        with on_device_of(kernels[0]):
            if self.use_bias:
                y = y + shard_values(self, self.bias)[0]
            return self.activation(y)


@keras.saving.register_keras_serializable(package="phalanx")
class VocabParallelEmbedding(ShardedLayer):
    """An embedding whose table ``[vocab, dim]`` is cut into ``tp`` shards of rows.

    ``call(ids)``: shard ``r`` looks up the ids in its range ``[r*vocab/tp, (r+1)*vocab/tp)``
    on its device (zeros for the others); the lookups are summed on shard 0's device. Ids
    outside ``[0, vocab)`` give zeros at tp>1 (an error at tp=1, as
    :class:`keras.layers.Embedding`). ``call(x, reverse=True)`` is the tied output head:
    logits ``x @ table^T``, the concat of the shard logits (:func:`join_vocab_logits`; for a
    loss that never forms the full logits, use :func:`vocab_parallel_cross_entropy`, or
    :func:`shard_logits_cross_entropy` on :func:`vocab_logit_shards` of the output, as
    ``phalanx.fit`` does). Weight: ``embeddings``, as
    :class:`keras.layers.Embedding`.

    Example:
        >>> import numpy as np
        >>> emb = VocabParallelEmbedding(8, 4, tp=2)
        >>> ids = np.array([[0, 5, 7]])
        >>> tuple(emb(ids).shape), tuple(emb(emb(ids), reverse=True).shape)
        ((1, 3, 4), (1, 3, 8))
        >>> bool(np.allclose(emb(ids)[0, 1], emb.logical_weights()["embeddings"][5]))
        True
    """

    def __init__(self, vocab: int, dim: int, tp: int = 1, embeddings_initializer="uniform", **kwargs):
        super().__init__(tp=tp, **kwargs)
        self.vocab, self.dim = int(vocab), int(dim)
        _check_divisible(self, "vocab", self.vocab, tp)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)

    SPLIT_AXES = {"embeddings": 0}

    def build(self, input_shape=None):
        self.embeddings = self.add_logical_weight("embeddings", (self.vocab, self.dim), self.SPLIT_AXES["embeddings"],
                                                  initializer=self.embeddings_initializer)

    def call(self, inputs, reverse: bool = False):
        tables = shard_values(self, self.embeddings)
        if reverse:
            x = tf.cast(inputs, self.compute_dtype)
            logits = []
            for table in tables:
                with on_device_of(table):
                    logits.append(matmul(x, table, transpose_b=True))
            return join_vocab_logits(logits, tables[0])
        return embedding_lookup(inputs, tables)

    def compute_output_spec(self, inputs, reverse: bool = False):
        # (A spec, not a shape: Keras's compute_output_shape takes only *_shape arguments.)
        shape = tuple(inputs.shape[:-1]) + (self.vocab,) if reverse else tuple(inputs.shape) + (self.dim,)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "dim": self.dim,
                "embeddings_initializer": _serialize(self.embeddings_initializer)}


def embedding_lookup(ids, tables):
    """Rows ``ids`` of the table cut into ``tables`` (shards of rows, rank order), in the
    tables' dtype: shard ``r`` looks up the ids in its range on its table's device (zeros for
    the others) and the lookups are summed on shard 0's device (:class:`VocabParallelEmbedding`)."""
    ids = tf.cast(ids, "int32")
    if len(tables) == 1:
        with on_device_of(tables[0]):
            return tf.gather(tables[0], ids)
    rows = tables[0].shape[0]
    parts = []
    for r, table in enumerate(tables):
        with on_device_of(table):
            local = ids - r * rows
            mine = (local >= 0) & (local < rows)
            found = tf.gather(table, tf.where(mine, local, 0))
            parts.append(found * tf.cast(mine, found.dtype)[..., None])
    return add_shards(parts, tables[0])


_VOCAB_MARK = "_phalanx_vocab_shards"  # set on a vocab-parallel head's concat op: its tp


def join_vocab_logits(logits: list, anchor):
    """The logits of a vocabulary-parallel output head: the concat of the shard logits
    ``[..., vocab/tp]`` (rank order) on the device of ``anchor`` (shard 0's value). In a
    graph the concat op is tagged, so that a loss can take the shard logits instead
    (:func:`vocab_logit_shards`) and the concat, then unused, is pruned."""
    if len(logits) == 1:
        return logits[0]
    with on_device_of(anchor):
        y = tf.concat(logits, axis=-1)
    if not tf.executing_eagerly():
        setattr(y.op, _VOCAB_MARK, len(logits))
    return y


def vocab_logit_shards(y, tp: int):
    """The ``tp`` shard logits ``y`` was joined from, when (in a graph) ``y`` is the output of a
    vocabulary-parallel head cut ``tp`` ways: the reverse call of a
    :class:`VocabParallelEmbedding` (tied head, :func:`join_vocab_logits`) or a
    :class:`ColumnParallelDense` (untied head; without a softmax-like activation). Else None.

    Example:
        >>> emb = VocabParallelEmbedding(8, 4, tp=2)
        >>> emb.build()
        >>> @tf.function
        ... def widths(h):
        ...     return tf.constant([z.shape[-1] for z in vocab_logit_shards(emb(h, reverse=True), 2)])
        >>> widths(tf.ones([2, 4])).numpy().tolist()
        [4, 4]
        >>> vocab_logit_shards(tf.ones([2, 8]), 2) is None  # an eager tensor was joined from nothing
        True
    """
    if tp < 2 or not isinstance(y, tf.Tensor):
        return None
    for mark in (_VOCAB_MARK, _COLUMN_MARK):
        pieces = concat_pieces(y, mark, tp, -1)
        if pieces is not None:
            return pieces
    return None


def joined_shards(y):
    """``(mark, pieces)`` when ``y`` is a vocabulary-parallel head's or a column-parallel
    layer's tagged join of its shards (:func:`vocab_logit_shards`), else None. A stage call
    returns the pieces (a function's output carries no op of its body) and
    :func:`rejoin_shards` joins them again outside, where the loss can read them.

    >>> @tf.function
    ... def widths(h):
    ...     mark, pieces = joined_shards(join_vocab_logits([h, h], h))
    ...     y = rejoin_shards(mark, pieces, [p.device for p in pieces])
    ...     return tf.constant([int(z.shape[-1]) for z in vocab_logit_shards(y, 2)])
    >>> widths(tf.ones([2, 4])).numpy().tolist()
    [4, 4]
    """
    for mark in (_VOCAB_MARK, _COLUMN_MARK):
        n = getattr(getattr(y, "op", None), mark, None)
        pieces = concat_pieces(y, mark, n, -1) if n else None
        if pieces is not None:
            return mark, pieces
    return None


def rejoin_shards(mark: str, pieces: list, devices: list):
    """The tagged join of ``pieces`` (``mark`` from :func:`joined_shards`) in a graph, each
    piece through an identity on ``devices[r]`` (where it was made: a reader of the shards,
    such as :func:`shard_logits_cross_entropy`, then runs each shard's ops there)."""
    placed = []
    for piece, device in zip(pieces, devices):
        with tf.device(device or None):
            placed.append(tf.identity(piece))
    y = tf.concat(placed, axis=-1)
    setattr(y.op, mark, len(placed))
    return y


def shard_logits_cross_entropy(logits: list, labels, anchors=None):
    """Per-token cross-entropy ``-log softmax(z)[label]`` of the logits ``z`` cut by
    vocabulary into ``logits`` (shard ``r``'s ``[..., vocab/tp]``, rank order), without
    joining them: each shard reduces its logits to a max, then (after the global max, on
    shard 0's device) a sum of exps and the target logit when the label is in its range;
    shard 0 combines ``max + log(sum of sums) - target``. Only those per-token scalars
    cross devices. The logits are read in float32; the result ``[...]`` (float32) is on
    shard 0's device. Shard ``r``'s ops run on the device of ``anchors[r]``. Equal to ``keras.losses.sparse_categorical_crossentropy(labels,
    concat(logits), from_logits=True)``.

    Args:
        logits: the shard logits.
        labels: ``[...]`` integer targets in ``[0, vocab)``.
        anchors: a value of each shard, whose device the shard's ops run on (default: the
            shard logits themselves).

    Example:
        >>> import numpy as np
        >>> z = np.random.default_rng(0).normal(size=(2, 3, 8)).astype("float32")
        >>> labels = np.array([[1, 7, 4], [0, 2, 6]])
        >>> got = shard_logits_cross_entropy([z[..., :4], z[..., 4:]], labels)
        >>> ref = keras.losses.sparse_categorical_crossentropy(labels, z, from_logits=True)
        >>> bool(np.allclose(got, ref, rtol=1e-6))
        True
    """
    anchors = logits if anchors is None else anchors
    labels = tf.cast(labels, "int32")
    logits = [tf.convert_to_tensor(z) for z in logits]
    rows = logits[0].shape[-1]
    floats, maxes = [], []
    for r, z in enumerate(logits):
        with on_device_of(anchors[r]):
            z = tf.cast(z, "float32")
            floats.append(z)
            maxes.append(tf.reduce_max(z, axis=-1))
    with on_device_of(anchors[0]):
        # A shift for a stable log-sum-exp; its gradient cancels exactly, so none flows.
        top = tf.stop_gradient(tf.reduce_max(tf.stack(maxes), axis=0))
    sums, targets = [], []
    for r, z in enumerate(floats):
        with on_device_of(anchors[r]):
            sums.append(tf.reduce_sum(tf.exp(z - top[..., None]), axis=-1))
            local = labels - r * rows
            mine = (local >= 0) & (local < rows)
            picked = tf.gather(z, tf.where(mine, local, 0)[..., None], batch_dims=labels.shape.rank)[..., 0]
            targets.append(picked * tf.cast(mine, z.dtype))
    with on_device_of(anchors[0]):
        return top + tf.math.log(add_shards(sums, anchors[0])) - add_shards(targets, anchors[0])


_REDUCTIONS = ("sum_over_batch_size", "mean_with_sample_weight", "sum", "none")


def vocab_parallel_cross_entropy(hidden, table, labels, sample_weight=None, reduction: str = "sum_over_batch_size",
                                 transposed: bool = False, kernels=None):
    """Token cross-entropy of the tied-head logits ``hidden @ table^T`` against ``labels``,
    computed shard by shard so the full logits are never on one device.

    Shard ``r`` forms its logits ``[..., vocab/tp]`` (float32) on its shard's device and reduces them
    to a max, then (after the global max is known, on shard 0's device) a sum of exps and the
    target logit when the label is in its range; shard 0 combines
    ``loss = max + log(sum of sums) - target``. Equal to
    ``keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)``.

    Args:
        hidden: ``[..., dim]`` final hidden states.
        table: a :class:`VocabParallelEmbedding`, or its table shards (tensors or variables,
            rank order, each ``[vocab/tp, dim]``), or with ``transposed=True`` the shards of an
            untied head kernel (each ``[dim, vocab/tp]``).
        labels: ``[...]`` integer targets in ``[0, vocab)``.
        sample_weight: optional ``[...]`` per-token weights (e.g. a padding mask).
        reduction: as a Keras loss: ``"sum_over_batch_size"`` (sum of weighted losses / number
            of tokens), ``"mean_with_sample_weight"`` (/ sum of weights), ``"sum"`` or ``"none"``.
            Unlike a Keras loss object it does not rescale under a distribution strategy.
        kernels: the :class:`~phalanx.layers.kernels.Kernels` of the one-shard loss (the
            whole logits on one device, in the compute dtype of ``hidden``).

    Example:
        >>> import numpy as np
        >>> emb = VocabParallelEmbedding(8, 4, tp=2)
        >>> h = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
        >>> labels = np.array([[1, 7, 4], [0, 2, 6]])
        >>> loss = vocab_parallel_cross_entropy(h, emb, labels)
        >>> ref = keras.losses.sparse_categorical_crossentropy(labels, emb(h, reverse=True), from_logits=True)
        >>> bool(np.allclose(loss, np.mean(ref), rtol=1e-6))
        True
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r} is not one of {_REDUCTIONS}")
    if isinstance(table, VocabParallelEmbedding):
        if not table.built:
            table.build()
        shards = shard_values(table, table.embeddings)
    else:
        with AutocastScope(None):
            shards = [tf.convert_to_tensor(t) for t in table]
    labels = tf.cast(labels, "int32")
    # A layer's shards are in its compute dtype; raw shards (an engine's float32 variables)
    # are cast to the hidden states' dtype, so the matmul runs in the compute dtype.
    hidden = tf.convert_to_tensor(hidden)
    raw = not isinstance(table, VocabParallelEmbedding) and hidden.dtype.is_floating
    dtype = hidden.dtype if raw else shards[0].dtype
    if len(shards) == 1:
        with on_device_of(shards[0]):
            z = matmul(tf.cast(hidden, dtype), shards[0], transpose_b=not transposed)
            losses = kernels_lib.get(kernels).cross_entropy(z, labels)
    else:
        logits = []
        for r, table_r in enumerate(shards):
            with on_device_of(table_r):
                logits.append(tf.cast(matmul(tf.cast(hidden, dtype), table_r, transpose_b=not transposed), "float32"))
        losses = shard_logits_cross_entropy(logits, labels, anchors=shards)
    with on_device_of(shards[0]):
        if reduction == "none":
            return losses if sample_weight is None else losses * tf.cast(sample_weight, losses.dtype)
        weight = tf.ones_like(losses) if sample_weight is None else tf.cast(sample_weight, losses.dtype)
        total = tf.reduce_sum(losses * weight)
        if reduction == "sum":
            return total
        if reduction == "mean_with_sample_weight":
            count = tf.reduce_sum(weight)
        else:
            count = tf.cast(tf.size(losses), total.dtype)
        return tf.math.divide_no_nan(total, count)


@keras.saving.register_keras_serializable(package="phalanx")
class ParallelMLP(ShardedLayer):
    """A transformer MLP block, ``down(activation(up(x)))``, or with ``gated=True``
    ``down(activation(gate(x)) * up(x))`` (SwiGLU when ``activation="silu"``, Shazeer 2020).

    ``up`` (and ``gate``) are column-parallel and ``down`` row-parallel: each shard computes
    its ``hidden_dim/tp`` hidden units and its partial output on its own device, and only the
    output is summed (on shard 0's device, then the whole ``down_bias`` is added). The hidden
    activation is never whole. The input and output width is the input's last dimension.
    Weights, in order: ``up``, ``up_bias``, ``gate``, ``gate_bias``, ``down``, ``down_bias``
    (no gate without ``gated``, no biases without ``use_bias``).

    Example:
        >>> import numpy as np
        >>> mlp = ParallelMLP(8, tp=2, activation="silu", gated=True, use_bias=False)
        >>> tuple(mlp(np.ones((2, 3, 4), "float32")).shape)
        (2, 3, 4)
        >>> list(mlp.logical_weights())
        ['up', 'gate', 'down']
    """

    def __init__(self, hidden_dim: int, tp: int = 1, activation="gelu", gated: bool = False, use_bias: bool = True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", kernels=None, **kwargs):
        super().__init__(tp=tp, **kwargs)
        self.hidden_dim, self.gated, self.use_bias = int(hidden_dim), gated, use_bias
        self.kernels = kernels_lib.get(kernels)
        _check_divisible(self, "hidden_dim", self.hidden_dim, tp)
        self.activation = keras.activations.get(activation)
        if getattr(self.activation, "__name__", "") in _NOT_ELEMENTWISE:
            raise ValueError(f"layer {self.name!r}: activation {activation!r} is not element-wise, so it cannot "
                             f"run on a hidden layer cut into shards")
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    #: the dimension each logical weight is cut along (None: whole): up/gate by columns, down by rows
    SPLIT_AXES = {"up": 1, "up_bias": 0, "gate": 1, "gate_bias": 0, "down": 0, "down_bias": None}

    def build(self, input_shape):
        d, f = input_shape[-1], self.hidden_dim
        self.up, self.up_bias = self._column("up", d, f)
        self.gate, self.gate_bias = self._column("gate", d, f) if self.gated else (None, None)
        self.down = self.add_logical_weight("down", (f, d), self.SPLIT_AXES["down"],
                                            initializer=self.kernel_initializer)
        self.down_bias = (self.add_logical_weight("down_bias", (d,), self.SPLIT_AXES["down_bias"],
                                                  initializer=self.bias_initializer) if self.use_bias else None)

    def _column(self, name, d, f):
        kernel = self.add_logical_weight(name, (d, f), self.SPLIT_AXES[name], initializer=self.kernel_initializer)
        bias = (self.add_logical_weight(f"{name}_bias", (f,), self.SPLIT_AXES[f"{name}_bias"],
                                        initializer=self.bias_initializer) if self.use_bias else None)
        return kernel, bias

    def shard_weights(self) -> list[dict]:
        """Shard ``r``'s weights as tensors on their devices, ``{"up", "up_bias", "gate",
        "gate_bias", "down"}`` (those that exist): the ``weights`` of :meth:`partials`."""
        out = [{} for _ in range(self.tp)]
        for name in ("up", "up_bias", "gate", "gate_bias", "down"):
            variables = getattr(self, name)
            if variables is not None:
                for r, value in enumerate(shard_values(self, variables)):
                    out[r][name] = value
        return out

    def partials(self, xs: list, weights: list) -> list:
        """The per-shard partial outputs (before their sum and ``down_bias``) when shard
        ``r`` reads input ``xs[r]`` with ``weights[r]`` (as :meth:`shard_weights` gives them),
        on the device of its ``down`` value. The one definition of the MLP's per-shard math:
        :meth:`call` and the sequence-parallel
        :class:`~phalanx.layers.transformer.TransformerBlock` run it.
        """
        kernels = self.kernels
        parts = []
        for r, w in enumerate(weights):
            with on_device_of(w["down"]):
                x = tf.cast(xs[r], self.compute_dtype)
                h = matmul(x, w["up"])
                if self.gated:
                    up = h if w.get("up_bias") is None else h + tf.cast(w["up_bias"], h.dtype)
                    h = kernels.bias_activation(matmul(x, w["gate"]), w.get("gate_bias"), self.activation) * up
                else:
                    h = kernels.bias_activation(h, w.get("up_bias"), self.activation)
                parts.append(matmul(h, w["down"]))
        return parts

    def call(self, inputs):
        x = tf.cast(inputs, self.compute_dtype)
        weights = self.shard_weights()
        y = add_shards(self.partials([x] * self.tp, weights), weights[0]["down"])
        if self.use_bias:
            with on_device_of(weights[0]["down"]):
                y = y + shard_values(self, self.down_bias)[0]
        return y

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        return {**super().get_config(), "hidden_dim": self.hidden_dim, "gated": self.gated,
                "use_bias": self.use_bias, "activation": keras.activations.serialize(self.activation),
                "kernel_initializer": _serialize(self.kernel_initializer),
                "bias_initializer": _serialize(self.bias_initializer), "kernels": kernels_lib.serialize(self.kernels)}
