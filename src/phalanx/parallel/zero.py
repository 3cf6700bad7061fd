"""AdamW over sharded parameters, with ZeRO stages 0, 1 and 2 over the ``data`` axis.

Rajbhandari et al. 2020 ("ZeRO"): stage 1 partitions the optimizer states over the
data-parallel replicas, stage 2 also the gradients. Here, for every parameter shard
(a tensor-parallel slice of one logical weight, flattened):

* ``zero=0``: gradients are summed over replicas once (all-reduce) and every replica
  keeps whole ``m``/``v`` and applies the same AdamW update to its own copy;
* ``zero=1``: the flat shard is cut into ``dp`` equal pieces (zero-padded); replica
  ``d`` keeps ``m``/``v`` of piece ``d`` only, updates piece ``d`` of the parameter
  from the all-reduced gradient, and the pieces are all-gathered into every copy;
* ``zero=2``: as 1, but the gradient is reduce-scattered: replica ``d`` sums only
  piece ``d`` of every replica's gradient, on its own device.

The step order, clipping and skip-on-non-finite match
:class:`phalanx.train.engine.StrategyEngine` exactly.

Example:
    >>> import numpy as np
    >>> from phalanx.config import TrainConfig
    >>> from phalanx.parallel.params import ShardedParams
    >>> from phalanx.parallel.tensor import Split
    >>> p = ShardedParams({"w": np.zeros([4], np.float32)}, {"w": Split("replicated")}, tp=1, dp=2,
    ...                   place=lambda n, t, d: ["/device:CPU:0"])
    >>> opt = ShardedAdamW(p, TrainConfig(), zero=1, decays=lambda n: False)
    >>> opt.state_bytes_per_device()
    {'/job:localhost/replica:0/task:0/device:CPU:0': 64}
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from phalanx.config import TrainConfig
from phalanx.parallel.params import ShardedParams, ShardKey
from phalanx.train import optim


class ShardedAdamW:
    """Optimizer state and the update for a :class:`ShardedParams`."""

    def __init__(self, params: ShardedParams, cfg: TrainConfig, zero: int, decays: Callable[[str], bool]):
        if zero not in (0, 1, 2):
            raise ValueError(f"parallel.zero={zero} is not valid; choose 0, 1 or 2")
        self.params, self.cfg, self.zero, self.decays = params, cfg, zero, decays
        self.dp = params.dp
        with tf.device(next(iter(params.shards.values())).device(0)):
            self.step = tf.Variable(0, trainable=False, dtype=tf.int64, name="optimizer_step")
        self.m: dict[ShardKey, list[tf.Variable]] = {}
        self.v: dict[ShardKey, list[tf.Variable]] = {}
        for key, shard in params.shards.items():
            shape = shard.shape if zero == 0 else (self.piece_size(shard.size),)
            ms, vs = [], []
            for d in range(self.dp):
                with tf.device(shard.device(d)):
                    ms.append(tf.Variable(tf.zeros(shape), trainable=False, name="m"))
                    vs.append(tf.Variable(tf.zeros(shape), trainable=False, name="v"))
            self.m[key], self.v[key] = ms, vs

    def piece_size(self, size: int) -> int:
        return -(-size // self.dp)

    # -- the update -------------------------------------------------------------

    def apply(self, grads: dict[ShardKey, list[tf.Tensor]], scale: tf.Tensor):
        """``grads[key][d]``: replica d's (loss-scaled) float32 gradient of shard ``key``.

        Returns ``(grad_norm, finite, lr)`` like StrategyEngine; updates every copy.
        """
        reduced = {key: self._reduce(key, g) for key, g in grads.items()}
        squares = []
        for key, parts in reduced.items():
            for d, g in enumerate(parts):
                with tf.device(self.params.shards[key].device(d)):
                    squares.append(tf.reduce_sum(tf.square(g)))
        norm = tf.sqrt(tf.add_n(squares)) / scale
        finite = tf.math.is_finite(norm)
        factor = optim.clip_factor(norm, self.cfg.clip_norm) / scale
        lr = optim.learning_rate(self.step, self.cfg)
        t = self.step + 1
        for key, parts in reduced.items():
            self._update(key, parts, factor, t, lr, finite)
        self.step.assign_add(tf.cast(finite, tf.int64))
        return norm, finite, lr

    def _reduce(self, key: ShardKey, per_replica: list[tf.Tensor]) -> list[tf.Tensor]:
        """zero 0/1: ``[sum]`` (the all-reduced gradient, counted once in the norm);
        zero 2: ``[piece_0, ..., piece_{dp-1}]`` each summed on its replica's device."""
        shard = self.params.shards[key]
        if self.zero < 2 or self.dp == 1:
            if self.dp == 1:
                total = per_replica[0]
            else:
                with tf.device(shard.device(0)):
                    total = tf.add_n(per_replica)
            return [total] if self.zero == 0 else self._pieces(total, shard.size, [shard.device(0)] * self.dp)
        pieces_by_replica = [self._pieces(g, shard.size, [shard.device(d)] * self.dp)
                             for d, g in enumerate(per_replica)]
        out = []
        for d in range(self.dp):
            with tf.device(shard.device(d)):
                out.append(tf.add_n([pieces_by_replica[r][d] for r in range(self.dp)]))
        return out

    def _pieces(self, g: tf.Tensor, size: int, devices: list[str]) -> list[tf.Tensor]:
        n = self.piece_size(size)
        with tf.device(devices[0]):
            flat = tf.pad(tf.reshape(g, [-1]), [[0, n * self.dp - size]])
        return [flat[d * n:(d + 1) * n] for d in range(self.dp)]

    def _update(self, key, parts, factor, t, lr, finite):
        shard = self.params.shards[key]
        decay = self.decays(shard.name)
        if self.zero == 0:
            for d in range(self.dp):
                with tf.device(shard.device(d)):
                    var = shard.copies[d][0]
                    new_p = self._adam(var.read_value(), parts[0], self.m[key][d], self.v[key][d],
                                       factor, t, lr, finite, decay)
                    for copy in shard.copies[d]:
                        copy.assign(new_p)
            return
        n, size = self.piece_size(shard.size), shard.size
        new_pieces = []
        for d in range(self.dp):
            with tf.device(shard.device(d)):
                flat = tf.pad(tf.reshape(shard.copies[d][0].read_value(), [-1]), [[0, n * self.dp - size]])
                new_pieces.append(self._adam(flat[d * n:(d + 1) * n], parts[d], self.m[key][d],
                                             self.v[key][d], factor, t, lr, finite, decay))
        for d in range(self.dp):  # all-gather the updated pieces into every copy
            with tf.device(shard.device(d)):
                full = tf.reshape(tf.concat(new_pieces, 0)[:size], shard.shape)
                for copy in shard.copies[d]:
                    copy.assign(full)

    def _adam(self, p, g, m, v, factor, t, lr, finite, decay):
        new_p, new_m, new_v = optim.adamw_update(p, g * factor, m, v, t, lr, self.cfg, decay)
        m.assign(tf.where(finite, new_m, m))
        v.assign(tf.where(finite, new_v, v))
        return tf.where(finite, new_p, p)

    # -- state -------------------------------------------------------------------

    def logical_state(self, name: str, which: str) -> np.ndarray:
        """Whole logical ``m`` or ``v`` of weight ``name``."""
        slots = self.m if which == "m" else self.v
        pieces = []
        for key in self.params.keys_of(name):
            shard = self.params.shards[key]
            if self.zero == 0:
                pieces.append(slots[key][0].numpy())
            else:
                flat = np.concatenate([s.numpy() for s in slots[key]])[: shard.size]
                pieces.append(flat.reshape(shard.shape))
        return self.params.splits[name].join(pieces)

    def assign_logical_state(self, name: str, which: str, value: np.ndarray) -> None:
        slots = self.m if which == "m" else self.v
        value = np.asarray(value, np.float32)
        if value.shape != self.params.full_shapes[name]:
            raise ValueError(f"optimizer/{which}/{name} has shape {value.shape}, the model expects "
                             f"{self.params.full_shapes[name]}")
        pieces = self.params.splits[name].shard(value, self.params.tp)
        for key, piece in zip(self.params.keys_of(name), pieces):
            if self.zero == 0:
                for var in slots[key]:
                    var.assign(piece)
            else:
                n = self.piece_size(piece.size)
                flat = np.pad(piece.reshape(-1), (0, n * self.dp - piece.size))
                for d, var in enumerate(slots[key]):
                    var.assign(flat[d * n:(d + 1) * n])

    def state_bytes_per_device(self) -> dict[str, int]:
        """Bytes of ``m`` and ``v`` held by each device."""
        out: dict[str, int] = {}
        for slots in (self.m, self.v):
            for variables in slots.values():
                for var in variables:
                    out[var.device] = out.get(var.device, 0) + int(np.prod(var.shape)) * var.dtype.size
        return out
