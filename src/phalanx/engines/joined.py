"""A logical tensor held by several variables (:class:`JoinedVariable`).

The built-in GPT keeps some logical tensors in parts (e.g. ``attn/qkv/kernel`` as the query,
key and value side by side); checkpoints, the optimizer-slot views and pruning read and
write them by their logical name through this view.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from phalanx.checkpoint import boxes


class JoinedVariable:
    """A logical tensor held by several variables, each holding a box of it
    (:mod:`phalanx.checkpoint.boxes`) in its own shape of that size: e.g. the built-in GPT's
    ``attn/qkv/kernel`` ``[d, 3d]`` is the attention's query, key and value ``[d, heads,
    head_dim]`` side by side (:func:`phalanx.models.transformer.weight_parts`). What the state,
    the checkpoints and pruning use of a variable: ``shape``, ``dtype``, ``read_value()``
    (joined on the device), ``numpy()`` and ``assign(array)`` (cut into the variables).

    Example:
        >>> q, k = tf.Variable(tf.ones([2, 1, 2])), tf.Variable(tf.zeros([2, 2]))
        >>> qk = JoinedVariable([(q, ((0, 2), (0, 2))), (k, ((0, 2), (2, 4)))])
        >>> qk.numpy().tolist()
        [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
        >>> qk.assign(np.arange(8, dtype="float32").reshape(2, 4)); q.numpy()[:, 0].tolist()
        [[0.0, 1.0], [4.0, 5.0]]
    """

    def __init__(self, parts: list):
        self.parts = [(v, tuple(tuple(int(i) for i in ab) for ab in box)) for v, box in parts]
        shape = tuple(max(box[a][1] for _, box in self.parts) for a in range(len(self.parts[0][1])))
        cut = [a for a in range(len(shape)) if any(box[a] != (0, shape[a]) for _, box in self.parts)]
        if len(cut) > 1:
            raise ValueError(f"the parts {[box for _, box in self.parts]} of a {shape} tensor are side by side along "
                             f"more than one axis")
        self.axis = cut[0] if cut else None
        # the parts in box order along that axis (what read_value concatenates)
        self._order = sorted(range(len(self.parts)), key=lambda i: self.parts[i][1][self.axis or 0][0])
        self.shape, self.dtype = tf.TensorShape(shape), self.parts[0][0].dtype

    def read_value(self):
        pieces = [tf.reshape(self.parts[i][0].read_value(), boxes.shape_of(self.parts[i][1])) for i in self._order]
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=self.axis)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.read_value().numpy())

    def join(self, values: list) -> np.ndarray:
        """The logical array from arrays shaped as the variables (one per part, in order)."""
        whole = np.empty(tuple(self.shape), np.asarray(values[0]).dtype)
        for (_, box), value in zip(self.parts, values):
            whole[boxes.index(box)] = np.reshape(value, boxes.shape_of(box))
        return whole

    def assign(self, value) -> None:
        value = np.asarray(value)
        for v, box in self.parts:
            v.assign(np.reshape(value[boxes.index(box)], tuple(v.shape)))
