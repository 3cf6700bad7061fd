"""Sharded weights: how a layer's variables are cut over a mesh axis, and where its ops run.

A sharded layer (the tensor-parallel layers, an expert-parallel MoE) holds one
``keras.Variable`` per shard and tags each with a :class:`Placement`: the mesh axis it is
cut over (``"tensor"`` or ``"expert"``), its rank on that axis and the number of shards.
The layer never names a device. The engine reads the tags and puts each shard on the
device of its rank (:class:`phalanx.engines.keras_model.KerasModelEngine`); at every step
it hands the layer its shard values as tensors produced on those devices. The layer runs
each shard's ops under :func:`on_device_of` that value, so the ops follow the weights, and
replica ``d``'s copy of the layer runs on replica ``d``'s devices. Outside an engine (one
device, Keras's own ``fit``) the values carry no device and everything runs where Keras
puts it: the layer is then a plain layer.

Example:
    >>> import keras
    >>> v = keras.Variable([1.0, 2.0])
    >>> tag(v, "tensor", rank=1, shards=2)
    >>> placement_of(v)
    Placement(axis='tensor', rank=1, shards=2)
    >>> placement_of(keras.Variable([0.0])) is None
    True
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import keras
import tensorflow as tf

AXES = ("tensor", "expert")


@dataclass(frozen=True)
class Split:
    """How a weight held outside a layer (an engine's shard variables) is cut over the
    ``tensor`` axis: ``replicated`` (one whole copy), ``axis`` (equal slices along ``axis``,
    as :meth:`ShardedLayer.add_logical_weight` cuts along ``split_axis``) or ``qkv`` (a fused
    ``[q|k|v]`` last dim, each third cut by heads: shard ``t`` holds ``[q_t | k_t | v_t]``,
    the ``qkv`` weights of :meth:`phalanx.layers.ParallelSelfAttention.partials`).

    Example:
        >>> import numpy as np
        >>> s = Split("qkv")
        >>> w = np.arange(12.0).reshape(1, 12)          # d=4: q|k|v of 4 columns each
        >>> [p.tolist() for p in s.shard(w, 2)]
        [[[0.0, 1.0, 4.0, 5.0, 8.0, 9.0]], [[2.0, 3.0, 6.0, 7.0, 10.0, 11.0]]]
        >>> bool((s.join(s.shard(w, 2)) == w).all())
        True
    """

    kind: str
    axis: int = 0

    def __post_init__(self):
        if self.kind not in ("replicated", "axis", "qkv"):
            raise ValueError(f"Split.kind must be replicated, axis or qkv, got {self.kind!r}")

    @classmethod
    def of_axis(cls, split_axis: int | None) -> "Split":
        """The split of a layer's logical weight declared with ``split_axis`` (None: whole)."""
        return cls("replicated") if split_axis is None else cls("axis", split_axis)

    def num_shards(self, tp: int) -> int:
        return 1 if self.kind == "replicated" else tp

    def shard(self, value, tp: int) -> list:
        """The ``num_shards(tp)`` pieces of a whole logical tensor."""
        import numpy as np

        value = np.asarray(value)
        if self.kind == "replicated":
            return [value]
        if self.kind == "axis":
            return split_value(value, self.axis, tp)
        q, k, v = np.split(value, 3, axis=-1)
        parts = [split_value(x, -1, tp) for x in (q, k, v)]
        return [np.concatenate([parts[0][t], parts[1][t], parts[2][t]], axis=-1) for t in range(tp)]

    def join(self, pieces):
        """Inverse of :meth:`shard`."""
        import numpy as np

        pieces = [np.asarray(p) for p in pieces]
        if self.kind == "replicated":
            return pieces[0]
        if self.kind == "axis":
            return np.concatenate(pieces, axis=self.axis)
        thirds = [np.split(p, 3, axis=-1) for p in pieces]
        return np.concatenate([np.concatenate([t[i] for t in thirds], axis=-1) for i in range(3)], axis=-1)
_ATTR = "_phalanx_placement"


@dataclass(frozen=True)
class Placement:
    """Shard ``rank`` of ``shards`` of a weight cut over mesh axis ``axis``."""

    axis: str
    rank: int
    shards: int

    def __post_init__(self):
        if self.axis not in AXES:
            raise ValueError(f"Placement.axis must be one of {AXES}, got {self.axis!r}")
        if not 0 <= self.rank < self.shards:
            raise ValueError(f"Placement.rank {self.rank} is outside [0, {self.shards})")


def tag(variable, axis: str, rank: int, shards: int) -> None:
    """Mark ``variable`` as shard ``rank`` of ``shards`` over mesh axis ``axis``."""
    setattr(variable, _ATTR, Placement(axis, rank, shards))


def placement_of(variable) -> Placement | None:
    """The :class:`Placement` of a tagged variable; None for a whole (replicated) one."""
    return getattr(variable, _ATTR, None)


def on_device_of(value):
    """A ``tf.device`` scope on the device ``value`` was produced on, or no scope when it
    names none (eager tensors name theirs; graph tensors only when built under a scope)."""
    device = getattr(value, "device", "") or ""
    return tf.device(device) if device else contextlib.nullcontext()


def shard_values(layer, variables) -> list:
    """Each variable's value in ``layer``'s compute dtype, made on the device of the value
    the engine handed in (so ``on_device_of`` the result finds that device).

    Read with ``tf.convert_to_tensor`` and outside Keras's autocast: ``keras.ops`` may hand
    back the variable itself, which names no device, and an autocast adds a Cast outside
    any device scope."""
    from keras.src.backend.common.variables import AutocastScope  # no public un-cast read

    out = []
    for v in variables:
        with AutocastScope(None):
            raw = tf.convert_to_tensor(v)
        with on_device_of(raw):
            out.append(tf.cast(raw, layer.compute_dtype))
    return out


def split_value(value, axis: int, shards: int) -> list:
    """``value`` (NumPy or tensor) cut into ``shards`` equal slices along ``axis``."""
    import numpy as np

    value = np.asarray(value)
    if value.shape[axis] % shards:
        raise ValueError(f"dimension {axis} of shape {tuple(value.shape)} is not divisible into {shards} shards")
    return np.split(value, shards, axis=axis)


class ShardedLayer(keras.layers.Layer):
    """Base of the layers whose weights may be cut into shards.

    A subclass declares each *logical* weight once with :meth:`add_logical_weight`, which
    creates ``tp`` tagged shard variables (cut along ``split_axis``) or, for
    ``split_axis=None``, one whole variable. Whatever ``tp`` is, the layer saves, loads
    and reports its weights as the logical tensors, in declaration order — the same list a
    one-device layer would save — so ``.keras`` files and :meth:`logical_weights` do not
    depend on the layout.

    Example:
        >>> class Scale(ShardedLayer):
        ...     def build(self, shape):
        ...         self.w = self.add_logical_weight("w", (shape[-1],), split_axis=0, initializer="ones")
        ...     def call(self, x):
        ...         return x * keras.ops.concatenate([keras.ops.convert_to_tensor(s) for s in self.w])
        >>> layer = Scale(tp=2)
        >>> layer.build((None, 4))
        >>> [tuple(v.shape) for v in layer.weights], layer.logical_weights()["w"].tolist()
        ([(2,), (2,)], [1.0, 1.0, 1.0, 1.0])
    """

    def __init__(self, tp: int = 1, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp: {tp!r} is not a positive integer")
        self.tp = tp
        self._logical: dict[str, tuple[list, int | None, str]] = {}

    def add_logical_weight(self, name: str, shape, split_axis: int | None, initializer="glorot_uniform",
                           trainable: bool = True, axis: str = "tensor", shards: int | None = None,
                           regularizer=None, constraint=None, **whole_kwargs) -> list:
        """Create logical weight ``name`` of ``shape``: ``shards`` (default ``tp``) variables
        cut along ``split_axis`` (tagged with their rank on mesh axis ``axis``), or one whole
        variable when ``split_axis`` is None. Returns the list of variables.

        The initializer runs on the whole logical shape, so the values do not depend on
        the number of shards (every layout starts from the same weights). ``whole_kwargs``
        (``dtype``, ``autocast``, ``aggregation``) go to ``add_weight`` of a whole weight."""
        import numpy as np

        shape = tuple(int(d) for d in shape)
        n = 1 if split_axis is None else (self.tp if shards is None else shards)
        if split_axis is not None and shape[split_axis] % n:
            raise ValueError(f"layer {self.name!r}: weight {name!r} of shape {shape} cannot be cut into {n} "
                             f"{axis} shards along dimension {split_axis} ({shape[split_axis]} is not divisible "
                             f"by {n})")
        init = keras.initializers.get(initializer)
        if whole_kwargs and n > 1:
            raise ValueError(f"layer {self.name!r}: {sorted(whole_kwargs)} apply to whole weights only, not to "
                             f"{name!r} cut into {n} shards")
        if n == 1:
            variables = [self.add_weight(shape=shape, initializer=init, name=name, trainable=trainable,
                                         regularizer=regularizer, constraint=constraint, **whole_kwargs)]
        else:
            with tf.init_scope():  # eager even when the layer is first built inside a tf.function
                whole = np.asarray(keras.ops.convert_to_numpy(init(shape, dtype=self.variable_dtype)))
            variables = []
            for rank, piece in enumerate(split_value(whole, split_axis, n)):
                v = self.add_weight(shape=piece.shape, initializer=keras.initializers.Constant(0.0),
                                    name=f"{name}_shard{rank}", trainable=trainable,
                                    regularizer=regularizer, constraint=constraint)
                v.assign(piece)
                tag(v, axis, rank, n)
                variables.append(v)
        self._logical[name] = (variables, split_axis, axis)
        return variables

    def whole_variable(self, name: str):
        """The one variable of logical weight ``name`` when it is not cut into shards."""
        variables = self._logical[name][0]
        if len(variables) != 1:
            raise ValueError(f"layer {self.name!r}: weight {name!r} is cut into {len(variables)} shards")
        return variables[0]

    def logical_weights(self) -> dict:
        """``{name: whole NumPy value}`` of every logical weight, in declaration order."""
        import numpy as np

        out = {}
        for name, (variables, split_axis, _) in self._logical.items():
            values = [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]
            out[name] = values[0] if split_axis is None else np.concatenate(values, axis=split_axis)
        return out

    def set_logical_weights(self, values: dict) -> None:
        """Assign whole logical values (``{name: array}``), cutting them into the shards.
        A name this layer does not have, or a shape that differs, is an error naming it."""
        import numpy as np

        unknown = sorted(set(values) - set(self._logical))
        if unknown:
            raise ValueError(f"layer {self.name!r} has no logical weight {unknown[0]!r}; it has "
                             f"{sorted(self._logical)}")
        for name, value in values.items():
            variables, split_axis, _ = self._logical[name]
            value = np.asarray(value)
            expected = list(variables[0].shape)
            if split_axis is not None:
                expected[split_axis] *= len(variables)
            if tuple(value.shape) != tuple(expected):
                raise ValueError(f"layer {self.name!r}: weight {name!r} has shape {tuple(expected)}, "
                                 f"got {tuple(value.shape)}")
            pieces = [value] if split_axis is None else split_value(value, split_axis, len(variables))
            for v, piece in zip(variables, pieces):
                v.assign(piece)

    def save_own_variables(self, store):
        for i, value in enumerate(self.logical_weights().values()):
            store[f"{i}"] = value

    def load_own_variables(self, store):
        names = list(self._logical)
        if len(store.keys()) != len(names):
            raise ValueError(f"layer {self.name!r} expects {len(names)} saved weights ({names}), "
                             f"the file holds {len(store.keys())}")
        self.set_logical_weights({name: store[f"{i}"] for i, name in enumerate(names)})

    def get_config(self):
        return {**super().get_config(), "tp": self.tp}
