"""Join the gradients of micro-batches, replicas and workers into the one a single device gives.

A dense gradient is a sum. A sparse one (``tf.IndexedSlices``: the gradient of a ``gather``,
i.e. an embedding lookup) is a list of rows, and Keras's optimizers treat a row that appears
twice differently from one row holding the sum (Adam squares each row, then adds them). So a
sparse gradient is joined as one device's tape over the whole batch would have produced it:

* **Rows whose indices depend on the batch** (token ids): one device gathers every
  occurrence of every token, so its gradient holds one row per occurrence. The micro-batches'
  rows are **concatenated**.
* **Rows whose indices are the same in every micro-batch** (a position table read as
  ``pos_emb(range(maxlen))``: one device looks each position up once per batch, and the
  backward of the broadcast sums the batch's rows into that one row). The micro-batches'
  values are **summed**, row by row, under one copy of the indices.

The rule, decided from the traced graph (:func:`indices_vary`): a piece's index tensor is the
same in every micro-batch when none of the ops it is computed from reads the batch or any
state — no ``Placeholder`` (the step function's inputs, captured variables), no stateful op
(variable reads, random ops) — walking data inputs up from the index tensor and stopping at
shape ops (``Shape``, ``Size``, ``Rank``), which read only shapes, equal for every micro-batch
(the layout splits a batch into equal micro-batches). Everything else keeps its rows: that is
the conservative choice, exact for ids from the batch. Indices computed from the batch size
itself (``range(batch)``) match neither: one device's batch is larger than a micro-batch.

A weight looked up both ways (one table read with token ids and with positions) gets one
gradient from ``tf.gradients``, the concatenation of the lookups' pieces
(``AggregateIndexedSlicesGradients``); :func:`split_pieces` splits it back along that
concatenation and each piece follows its own rule. Outside a traced graph (eager) every
piece keeps its rows.

A sparse gradient being joined is a :class:`SparseGradient`: the summed pieces under a key
(``origin``, piece number) — the same lookup in the same stage of every micro-batch, replica
and worker — and the kept rows. :func:`finish` turns it into the ``IndexedSlices`` the
optimizer receives. A dense gradient joined with a sparse one is their dense sum, as
``tf.gradients`` aggregates them on one device.

Example:
    >>> import tensorflow as tf
    >>> table = tf.ones([5, 2])
    >>> @tf.function
    ... def grads(ids):
    ...     out = []
    ...     for part in tf.split(ids, 2):              # two micro-batches
    ...         with tf.GradientTape() as tape:
    ...             tape.watch(table)
    ...             loss = tf.reduce_sum(tf.gather(table, part)) + tf.reduce_sum(tf.gather(table, tf.range(2)))
    ...         out.append(tape.gradient(loss, table))
    ...     g = join_gradients(join_gradients(None, out[0], origin=0), out[1], origin=0)
    ...     return finish(g).indices
    >>> sorted(grads(tf.constant([3, 4, 3, 1])).numpy().tolist())  # ids kept, positions 0 and 1 once
    [0, 1, 1, 3, 3, 4]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

# Ops that read only the shape of their input: equal for every micro-batch of a step.
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "VariableShape"})
# Ops whose output is not a function of their data inputs alone.
SOURCE_OPS = frozenset({"Placeholder", "PlaceholderWithDefault", "VarHandleOp", "ReadVariableOp"})


def indices_vary(indices: tf.Tensor) -> bool:
    """Whether ``indices`` may differ between the micro-batches of a step (see the module
    docstring): True when any op it is computed from reads the batch or state, or when it
    is not a graph tensor (eager: nothing to read the rule from)."""
    if not hasattr(indices, "op") or tf.executing_eagerly():
        return True
    seen, stack = set(), [indices.op]
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in SHAPE_OPS:
            continue
        if op.type in SOURCE_OPS or op._is_stateful:
            return True
        stack.extend(t.op for t in op.inputs)
    return False


def _concat_parts(indices: tf.Tensor) -> list[tf.Tensor]:
    """The pieces of an index vector that ``tf.gradients`` concatenated (recursively)."""
    op = getattr(indices, "op", None)
    if op is None or op.type != "ConcatV2" or len(op.inputs) < 3:
        return [indices]
    axis = tf.get_static_value(op.inputs[-1])
    parts = list(op.inputs[:-1])
    if axis is None or int(axis) != 0 or any(p.shape.rank != 1 for p in parts):
        return [indices]
    return [piece for p in parts for piece in _concat_parts(p)]


def split_pieces(grad: tf.IndexedSlices) -> list[tf.IndexedSlices]:
    """``grad`` as the lookups' gradients it was concatenated from (one piece if it was not)."""
    parts = _concat_parts(grad.indices)
    if len(parts) == 1:
        return [grad]
    sizes = [p.shape[0] if p.shape[0] is not None else tf.shape(p)[0] for p in parts]
    if any(not isinstance(s, int) for s in sizes):
        sizes = tf.stack([tf.cast(s, tf.int32) for s in sizes])
    values = tf.split(grad.values, sizes, num=len(parts), axis=0)
    return [tf.IndexedSlices(v, i, grad.dense_shape) for v, i in zip(values, parts)]


@dataclass
class SparseGradient:
    """A sparse gradient while it is joined: ``shared`` lookups (same indices in every
    micro-batch; values summed) by key, and the ``rows`` kept of the others."""

    dense_shape: Any
    shared: dict = field(default_factory=dict)  # key -> IndexedSlices
    rows: list = field(default_factory=list)  # IndexedSlices, concatenated by finish()

    def tensors(self) -> list[tf.Tensor]:
        """Every tensor it holds (to wait for them)."""
        return [t for s in list(self.shared.values()) + self.rows for t in (s.values, s.indices)]

    def slices(self) -> tf.IndexedSlices:
        parts = list(self.shared.values()) + self.rows
        if len(parts) == 1:
            return parts[0]
        return tf.IndexedSlices(tf.concat([p.values for p in parts], 0), tf.concat([p.indices for p in parts], 0),
                                self.dense_shape)


def as_sparse(grad: tf.IndexedSlices, origin: Any) -> SparseGradient:
    """One tape's sparse gradient, its pieces sorted by :func:`indices_vary`. ``origin`` names
    the code that produced it (e.g. the pipeline stage): the k-th piece of the same origin is
    the same lookup in every micro-batch."""
    grad = tf.IndexedSlices(tf.cast(grad.values, tf.float32), grad.indices, grad.dense_shape)
    out = SparseGradient(grad.dense_shape)
    for k, piece in enumerate(split_pieces(grad)):
        if indices_vary(piece.indices):
            out.rows.append(piece)
        else:
            out.shared[(origin, k)] = piece
    return out


def _merge(total: SparseGradient, grad: SparseGradient) -> SparseGradient:
    shared = dict(total.shared)
    for key, piece in grad.shared.items():
        if key not in shared:
            shared[key] = piece
            continue
        mine = shared[key]
        if not mine.values.shape.is_compatible_with(piece.values.shape):
            raise ValueError(f"sparse gradient {key}: a lookup with the same indices in every micro-batch gave "
                             f"values of shape {mine.values.shape} and {piece.values.shape}")
        shared[key] = tf.IndexedSlices(mine.values + piece.values, mine.indices, mine.dense_shape)
    return SparseGradient(total.dense_shape, shared, total.rows + grad.rows)


def densify(grad) -> tf.Tensor:
    """A joined gradient as one dense float32 tensor."""
    if isinstance(grad, SparseGradient):
        grad = grad.slices()
    return tf.cast(tf.convert_to_tensor(grad), tf.float32)


def join_gradients(total, grad, origin: Any = None):
    """``total`` joined with ``grad`` (either may be None, a dense tensor, an ``IndexedSlices``
    straight from a tape, or a :class:`SparseGradient`), in float32: sparse with sparse as one
    device would (module docstring), anything with a dense gradient as the dense sum.
    ``origin``: see :func:`as_sparse`."""
    if grad is None:
        return total
    if isinstance(grad, tf.IndexedSlices):
        grad = as_sparse(grad, origin)
    if isinstance(total, tf.IndexedSlices):
        total = as_sparse(total, origin)
    if total is None:
        return grad if isinstance(grad, SparseGradient) else densify(grad)
    if isinstance(total, SparseGradient) and isinstance(grad, SparseGradient):
        return _merge(total, grad)
    return densify(total) + densify(grad)


def finish(grad, dtype=None):
    """The gradient the optimizer receives: an ``IndexedSlices`` for a sparse one, cast to
    ``dtype`` (the variable's) if given."""
    if isinstance(grad, SparseGradient):
        grad = grad.slices()
    if grad is None or dtype is None:
        return grad
    return tf.cast(grad, dtype)
