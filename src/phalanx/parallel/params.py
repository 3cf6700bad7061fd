"""Logical weights stored as tensor-parallel shards, replicated over ``data``.

A logical weight (e.g. ``block_0/mlp/fc/kernel``) is cut by its
:class:`~phalanx.layers.sharding.Split` into shards; shard ``t`` of replica ``d``
has one or more *copies* (``tf.Variable``), the first being the primary. A second
copy exists when two pipeline stages use the same weight (the tied embedding is read
by the first stage and by the head on the last stage); the gradients of all copies
are summed and every copy receives the same update.

:func:`split_regions` says which boxes of the logical tensor each shard holds (one box,
or three for the fused ``[q|k|v]`` split). Everything that moves weights between
processes and files goes through it, one shard at a time, never through a whole
tensor: initial values (``init(name, box)`` makes only the boxes of each shard) and
checkpoints (:meth:`ShardedParams.checkpoint_slots`: every shard is a
:class:`~phalanx.checkpoint.Slot` written and restored box by box).
:meth:`ShardedParams.logical` and :meth:`ShardedParams.assign_logical` convert whole
logical tensors (for tests, pruning and export).

Example:
    >>> import numpy as np
    >>> from phalanx.layers.sharding import Split
    >>> p = ShardedParams({"w": np.ones([2, 4], np.float32)}, {"w": Split("axis", 1)}, tp=2, dp=1,
    ...                   place=lambda name, t, d: ["/device:CPU:0"])
    >>> [tuple(s.copies[0][0].shape) for s in p.shards.values()]
    [(2, 2), (2, 2)]
    >>> p.logical("w").shape
    (2, 4)
    >>> split_regions(Split("qkv"), (2, 12), 1, 2)   # shard 1 of [q|k|v]: 3 boxes of the logical tensor
    [(((0, 2), (0, 2)), ((0, 2), (2, 4))), (((0, 2), (2, 4)), ((0, 2), (6, 8))), (((0, 2), (4, 6)), ((0, 2), (10, 12)))]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import tensorflow as tf

from phalanx.checkpoint import boxes
from phalanx.checkpoint.boxes import Box
from phalanx.checkpoint.sharded import Slot
from phalanx.layers.sharding import Split

ShardKey = tuple[str, int]
#: ``init(name, box)``: the initial values of ``box`` of logical weight ``name``
Init = Callable[[str, Box], np.ndarray]


def shard_shape(split: Split, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """The shape of every shard of a logical tensor of ``shape``."""
    shape = tuple(shape)
    if split.kind == "replicated" or tp == 1:
        return shape
    axis = split.axis if split.kind == "axis" else len(shape) - 1
    if shape[axis] % (tp if split.kind == "axis" else 3 * tp):
        raise ValueError(f"dim {axis} of shape {shape} is not divisible by tp={tp}"
                         + (" x 3 (q, k, v)" if split.kind == "qkv" else ""))
    return shape[:axis] + (shape[axis] // tp,) + shape[axis + 1:]


def split_regions(split: Split, shape: tuple[int, ...], t: int, tp: int) -> list[tuple[Box, Box]]:
    """``(box of shard t, box of the logical tensor)`` pairs: where shard ``t`` of ``tp``
    keeps each part of the logical tensor (the inverse of ``Split.shard`` / ``join``)."""
    shape = tuple(shape)
    local = boxes.full(shard_shape(split, shape, tp))
    if split.kind == "replicated" or tp == 1:
        return [(local, local)]
    if split.kind == "axis":
        a, n = split.axis, shape[split.axis] // tp
        logical = local[:a] + ((t * n, (t + 1) * n),) + local[a + 1:]
        return [(local, logical)]
    whole, width = shape[-1] // 3, shape[-1] // (3 * tp)  # [q|k|v], each third cut by heads
    out = []
    for j in range(3):
        out.append((local[:-1] + ((j * width, (j + 1) * width),),
                    local[:-1] + ((j * whole + t * width, j * whole + (t + 1) * width),)))
    return out


def restrict(regions: list[tuple[Box, Box]], box: Box) -> list[tuple[Box, Box]]:
    """``regions`` of a shard cut to a sub-box ``box`` of the shard, with the local boxes
    made relative to ``box`` (for a slot that holds only ``box`` of the shard)."""
    out = []
    for local, logical in regions:
        common = boxes.intersect(local, box)
        if common is None:
            continue
        offset = [g0 - l0 for (l0, _), (g0, _) in zip(local, logical)]
        out.append((boxes.relative(common, box), boxes.translate(common, offset)))
    return out


@dataclass
class ParamShard:
    """Shard ``index`` of logical weight ``name``: ``copies[d]`` are replica d's variables."""

    name: str
    index: int
    copies: list[list[tf.Variable]]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.copies[0][0].shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    def device(self, replica: int) -> str:
        return self.copies[replica][0].device


class ShardedParams:
    """All shards and copies of a set of logical weights.

    ``initial`` maps each name to its whole initial value, or (with ``init``) to its
    shape: then shard ``t`` is made from ``init(name, box)`` for each box it holds, and no
    whole tensor exists on the host. ``place(name, t, d)`` returns the device of every
    copy of shard ``t`` in replica ``d`` (primary first).
    """

    def __init__(self, initial: Mapping[str, np.ndarray] | Mapping[str, tuple], splits: Mapping[str, Split],
                 tp: int, dp: int, place: Callable[[str, int, int], list[str]], init: Init | None = None):
        self.names = list(initial)
        self.splits, self.tp, self.dp = dict(splits), tp, dp
        if init is None:
            values = dict(initial)
            self.full_shapes = {n: tuple(np.shape(v)) for n, v in values.items()}
            init = lambda name, box: np.asarray(values[name])[boxes.index(box)]  # noqa: E731
        else:
            self.full_shapes = {n: tuple(int(x) for x in s) for n, s in initial.items()}
        self.shards: dict[ShardKey, ParamShard] = {}
        for name in self.names:
            for t in range(self.splits[name].num_shards(tp)):
                piece = self._make_shard(name, t, init)
                copies = []
                for d in range(dp):
                    replica = []
                    for c, dev in enumerate(place(name, t, d)):
                        with tf.device(dev):
                            replica.append(tf.Variable(piece, trainable=True,
                                                       name=f"{name}/tp{t}/dp{d}/copy{c}".replace("/", "_")))
                    copies.append(replica)
                self.shards[(name, t)] = ParamShard(name, t, copies)
                del piece

    def _make_shard(self, name: str, t: int, init: Init) -> np.ndarray:
        shape = self.full_shapes[name]
        piece = np.empty(shard_shape(self.splits[name], shape, self.tp), np.float32)
        for local, logical in self.regions(name, t):
            piece[boxes.index(local)] = init(name, logical)
        return piece

    def keys_of(self, name: str) -> list[ShardKey]:
        return [(name, t) for t in range(self.splits[name].num_shards(self.tp))]

    def regions(self, name: str, t: int) -> list[tuple[Box, Box]]:
        """(box of shard ``t``, box of logical ``name``) pairs (:func:`split_regions`)."""
        return split_regions(self.splits[name], self.full_shapes[name], t, self.tp)

    def owner(self, key: ShardKey) -> int:
        """The replica that writes shard ``key`` to a checkpoint: replicas take turns, so
        data-parallel replicas share the writing."""
        return self._order()[key] % self.dp

    def _order(self) -> dict[ShardKey, int]:
        if not hasattr(self, "_order_cache"):
            self._order_cache = {k: i for i, k in enumerate(self.shards)}
        return self._order_cache

    def logical(self, name: str) -> np.ndarray:
        """The whole logical tensor (from replica 0's primary copies)."""
        return self.splits[name].join([self.shards[k].copies[0][0].numpy() for k in self.keys_of(name)])

    def assign_logical(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value, np.float32)
        if value.shape != self.full_shapes[name]:
            raise ValueError(f"tensor {name!r} has shape {value.shape}, the model expects {self.full_shapes[name]}")
        for key, piece in zip(self.keys_of(name), self.splits[name].shard(value, self.tp)):
            self.assign_shard(key, piece)

    def assign_shard(self, key: ShardKey, value: np.ndarray) -> None:
        """Load ``value`` into every copy of shard ``key`` in every replica."""
        for replica in self.shards[key].copies:
            for var in replica:
                var.assign(value)

    def checkpoint_slots(self) -> list[tuple[str, Slot]]:
        """``(device, slot)`` for every shard: written from the primary copy of its
        :meth:`owner` replica, restored into every copy of every replica."""
        out = []
        for key, shard in self.shards.items():
            name, t = key
            var = shard.copies[self.owner(key)][0]
            out.append((var.device, Slot(name, self.full_shapes[name], np.float32, shard.shape, self.regions(name, t),
                                         fetch=var.read_value, assign=lambda x, k=key: self.assign_shard(k, x))))
        return out

    def num_params(self) -> int:
        return int(sum(np.prod(s) for s in self.full_shapes.values()))
