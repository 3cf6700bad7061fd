"""Logical weights stored as tensor-parallel shards, replicated over ``data``.

A logical weight (e.g. ``block_0/mlp/fc/kernel``) is cut by its
:class:`~phalanx.parallel.tensor.Split` into shards; shard ``t`` of replica ``d``
has one or more *copies* (``tf.Variable``), the first being the primary. A second
copy exists when two pipeline stages use the same weight (the tied embedding is read
by the first stage and by the head on the last stage); the gradients of all copies
are summed and every copy receives the same update.

:meth:`ShardedParams.logical` and :meth:`ShardedParams.assign_logical` convert
between whole logical tensors and shards, which is what makes checkpoints
layout-independent.

Example:
    >>> import numpy as np
    >>> from phalanx.parallel.tensor import Split
    >>> p = ShardedParams({"w": np.ones([2, 4], np.float32)}, {"w": Split("axis", 1)}, tp=2, dp=1,
    ...                   place=lambda name, t, d: ["/device:CPU:0"])
    >>> [tuple(s.copies[0][0].shape) for s in p.shards.values()]
    [(2, 2), (2, 2)]
    >>> p.logical("w").shape
    (2, 4)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import tensorflow as tf

from phalanx.parallel.tensor import Split

ShardKey = tuple[str, int]


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

    ``place(name, t, d)`` returns the device of every copy of shard ``t`` in replica
    ``d`` (primary first).
    """

    def __init__(self, initial: Mapping[str, np.ndarray], splits: Mapping[str, Split], tp: int, dp: int,
                 place: Callable[[str, int, int], list[str]]):
        self.names = list(initial)
        self.splits, self.tp, self.dp = dict(splits), tp, dp
        self.full_shapes = {n: tuple(np.shape(v)) for n, v in initial.items()}
        self.shards: dict[ShardKey, ParamShard] = {}
        for name in self.names:
            pieces = self.splits[name].shard(initial[name], tp)
            for t, piece in enumerate(pieces):
                copies = []
                for d in range(dp):
                    replica = []
                    for c, dev in enumerate(place(name, t, d)):
                        with tf.device(dev):
                            replica.append(tf.Variable(piece.astype(np.float32), trainable=True,
                                                       name=f"{name}/tp{t}/dp{d}/copy{c}".replace("/", "_")))
                    copies.append(replica)
                self.shards[(name, t)] = ParamShard(name, t, copies)

    def keys_of(self, name: str) -> list[ShardKey]:
        return [(name, t) for t in range(self.splits[name].num_shards(self.tp))]

    def logical(self, name: str) -> np.ndarray:
        """The whole logical tensor (from replica 0's primary copies)."""
        return self.splits[name].join([self.shards[k].copies[0][0].numpy() for k in self.keys_of(name)])

    def assign_logical(self, name: str, value: np.ndarray) -> None:
        value = np.asarray(value, np.float32)
        if value.shape != self.full_shapes[name]:
            raise ValueError(f"tensor {name!r} has shape {value.shape}, the model expects {self.full_shapes[name]}")
        for key, piece in zip(self.keys_of(name), self.splits[name].shard(value, self.tp)):
            for replica in self.shards[key].copies:
                for var in replica:
                    var.assign(piece)

    def num_params(self) -> int:
        return int(sum(np.prod(s) for s in self.full_shapes.values()))
