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

Under ZeRO every flat buffer of the update is a piece: each replica's gradient is cut
straight into the ``dp`` pieces (no whole flat copy), replica ``d`` reads only piece ``d``
of its parameters, and the gathered pieces are written into each shard from the parts
that cover it (no whole flat group either), so the optimizer step's temporaries beyond the
gradient are ``1/dp`` of the parameters.

The step order, clipping and skip-on-non-finite match
:class:`phalanx.engines.strategy.StrategyEngine` exactly.

Example:
    >>> import numpy as np
    >>> from phalanx.config import TrainConfig
    >>> from phalanx.parallel.params import ShardedParams
    >>> from phalanx.layers.sharding import Split
    >>> p = ShardedParams({"w": np.zeros([4], np.float32)}, {"w": Split("replicated")}, tp=1, dp=2,
    ...                   place=lambda n, t, d: ["/device:CPU:0"])
    >>> opt = ShardedAdamW(p, TrainConfig(), zero=1, decays=lambda n: False)
    >>> opt.state_bytes_per_device()
    {'/job:localhost/replica:0/task:0/device:CPU:0': 32}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import tensorflow as tf

from phalanx import prune
from phalanx.config import TrainConfig
from phalanx.checkpoint import boxes
from phalanx.checkpoint.sharded import Slot
from phalanx.parallel.params import ShardedParams, ShardKey, restrict
from phalanx.core import optim


@dataclass(frozen=True)
class Group:
    """Shards that share devices (one per replica) and weight decay, flattened together.

    ``keys[i]`` occupies ``[offsets[i], offsets[i] + sizes[i])`` of the flat buffer of
    ``total`` elements (Rajbhandari et al.'s contiguous buffers: one Adam update and one
    gather per group instead of one per tensor).
    """

    devices: tuple[str, ...]
    decay: bool
    keys: tuple[ShardKey, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int


class ShardedAdamW:
    """Optimizer state and the update for a :class:`ShardedParams`."""

    def __init__(self, params: ShardedParams, cfg: TrainConfig, zero: int, decays: Callable[[str], bool]):
        if zero not in (0, 1, 2):
            raise ValueError(f"parallel.zero={zero} is not valid; choose 0, 1 or 2")
        self.params, self.cfg, self.zero, self.decays = params, cfg, zero, decays
        self.dp = params.dp
        with tf.device(next(iter(params.shards.values())).device(0)):
            self.step = tf.Variable(0, trainable=False, dtype=tf.int64, name="optimizer_step")
        members: dict[tuple, list[ShardKey]] = {}
        for key, shard in params.shards.items():
            devices = tuple(shard.device(d) for d in range(self.dp))
            members.setdefault((devices, bool(decays(shard.name))), []).append(key)
        self.groups: list[Group] = []
        self.where: dict[ShardKey, tuple[int, int]] = {}  # key -> (group index, position)
        for (devices, decay), keys in members.items():
            sizes = tuple(params.shards[k].size for k in keys)
            offsets = tuple(int(x) for x in np.cumsum((0,) + sizes[:-1]))
            for i, k in enumerate(keys):
                self.where[k] = (len(self.groups), i)
            self.groups.append(Group(devices, decay, tuple(keys), offsets, sizes, int(sum(sizes))))
        self.m: list[list[tf.Variable]] = []
        self.v: list[list[tf.Variable]] = []
        for g in self.groups:
            n = g.total if zero == 0 else self.piece_size(g.total)
            ms, vs = [], []
            for d in range(self.dp):
                with tf.device(g.devices[d]):
                    ms.append(tf.Variable(tf.zeros([n]), trainable=False, name="m"))
                    vs.append(tf.Variable(tf.zeros([n]), trainable=False, name="v"))
            self.m.append(ms)
            self.v.append(vs)
        # Pruning masks (phalanx.prune), one per group holding a pruned shard and replica, shaped
        # like that replica's m/v (the whole flat group, or its ZeRO piece); all ones until set_masks.
        self.masks: list[list[tf.Variable] | None] = [None] * len(self.groups)
        if cfg.prune.target > 0:
            for i, g in enumerate(self.groups):
                if any(prune.prunable(k[0]) for k in g.keys):
                    self.masks[i] = []
                    for d in range(self.dp):
                        with tf.device(g.devices[d]):
                            self.masks[i].append(tf.Variable(tf.ones_like(self.m[i][d]), trainable=False,
                                                             name="mask"))

        # The flat parameters (whole group, or this replica's ZeRO piece) are updated in place by
        # optim.apply_adamw, which works on variables: one scratch variable per group and replica
        # holds them during the update only (emptied after, so it costs no memory between steps).
        self.scratch: list[list[tf.Variable]] = []
        for g in self.groups:
            row = []
            for d in range(self.dp):
                with tf.device(g.devices[d]):
                    row.append(tf.Variable(tf.zeros([0]), shape=tf.TensorShape([None]), trainable=False,
                                           name="adamw_params"))
            self.scratch.append(row)

    def piece_size(self, size: int) -> int:
        return -(-size // self.dp)

    @property
    def sharded(self) -> bool:
        """Whether the moments (and the update) are cut into ZeRO pieces."""
        return self.zero > 0 and self.dp > 1

    def _piece(self, g: Group, flats: list[tf.Tensor], r: int) -> tf.Tensor:
        """Piece ``r`` (``[r n, (r + 1) n)``, zero-padded past the end) of group ``g``'s flat
        buffer, cut from its shards' flat tensors ``flats``: only that piece is copied."""
        n = self.piece_size(g.total)
        lo, hi = r * n, (r + 1) * n
        parts = []
        for flat, off, size in zip(flats, g.offsets, g.sizes):
            a, b = max(lo, off), min(hi, off + size)
            if a < b:
                parts.append(flat if (a, b) == (off, off + size) else flat[a - off:b - off])
        if hi > g.total:
            parts.append(tf.zeros([hi - max(lo, g.total)], flats[0].dtype))
        return tf.concat(parts, 0) if len(parts) > 1 else tf.identity(parts[0])

    # -- the update -------------------------------------------------------------

    def apply(self, grads: dict[ShardKey, list[tf.Tensor]], scale: tf.Tensor):
        """``grads[key][d]``: replica d's (loss-scaled) float32 gradient of shard ``key``.

        Updates every copy; returns the step's :class:`~phalanx.core.optim.StepScalars` (the
        engine ends the step with :func:`~phalanx.core.optim.finish_step`).
        """
        reduced = []
        for g in self.groups:
            per_replica = []
            for d in range(self.dp):
                with tf.device(g.devices[d]):
                    flats = [tf.reshape(grads[k][d], [-1]) for k in g.keys]
                    if self.sharded:  # replica d's gradient cut into the ZeRO pieces (no whole flat copy)
                        per_replica.append([self._piece(g, flats, r) for r in range(self.dp)])
                    else:
                        per_replica.append(tf.concat(flats, 0))
            reduced.append(self._reduce(g, per_replica))
        squares = []
        for g, parts in zip(self.groups, reduced):
            for d, part in enumerate(parts):
                with tf.device(g.devices[d]):
                    squares.append(tf.nn.l2_loss(part))  # sum(part^2) / 2, one pass
        s = optim.step_scalars(tf.sqrt(2.0 * tf.add_n(squares)), scale, self.step, self.cfg)
        # The updates run one group after another on each device, and only once the norm (so
        # every gradient) exists: ``after[device]`` holds the ops of the group updated last there,
        # which the next group's parameter read waits for. Without that order the read of the
        # flat parameters, which depends on no gradient, ran when the step started (a float32
        # copy of every parameter alive through the forward and backward), and two groups'
        # updates could overlap or not from one run to the next (a third flat buffer, or not).
        after: dict[str, list] = {}
        for i, parts in enumerate(reduced):
            self._update(i, parts, s.factor, s.count, s.lr, s.finite, after)
        return s

    def _reduce(self, g: Group, per_replica: list) -> list[tf.Tensor]:
        """zero 0: ``[sum]`` (all-reduce; counted once in the norm); zero 1: the pieces of
        that sum, summed on replica 0; zero 2: ``[piece_0, ..., piece_{dp-1}]``, piece d summed
        on replica d (reduce-scatter). ``per_replica[r]``: replica r's flat gradient (zero 0)
        or its pieces (zero >= 1); the sums are elementwise, so a piece of the sum is the sum
        of the pieces."""
        if self.dp == 1:
            return [per_replica[0]]
        if self.zero == 0:
            with tf.device(g.devices[0]):
                return [tf.add_n(per_replica)]
        out = []
        for d in range(self.dp):
            with tf.device(g.devices[0 if self.zero == 1 else d]):
                out.append(tf.add_n([per_replica[r][d] for r in range(self.dp)]))
        return out

    def _flat_params(self, g: Group, d: int, after: list) -> tf.Tensor:
        """Replica ``d``'s parameters of group ``g`` as one flat float32 tensor (under ZeRO,
        only replica ``d``'s piece of it: the update's temporaries are ``1/dp`` of the group),
        read once every op in ``after`` has run (the same values: nothing writes them before
        the update)."""
        with tf.control_dependencies(after):
            flats = [tf.reshape(self.params.shards[k].copies[d][0].read_value(), [-1]) for k in g.keys]
            return self._piece(g, flats, d) if self.sharded else tf.concat(flats, 0)

    def _update(self, i, parts, factor, t, lr, finite, after: dict[str, list]):
        """Update group ``i`` on every replica; its reads wait for ``factor`` and for
        ``after[device]``, which is then set to this group's last ops on that device."""
        g = self.groups[i]
        waits = [after.get(g.devices[d], []) + [factor] for d in range(self.dp)]
        if not self.sharded:
            for d in range(self.dp):
                with tf.device(g.devices[d]):
                    new, done = self._adam(i, d, self._flat_params(g, d, waits[d]), parts[0], factor, t, lr, finite)
                    after[g.devices[d]] = done + self._assign(g, d, [new], g.total, done)
            return
        new_pieces, dones = [], []
        for d in range(self.dp):
            with tf.device(g.devices[d]):
                new, done = self._adam(i, d, self._flat_params(g, d, waits[d]), parts[d], factor, t, lr, finite)
                new_pieces.append(new)
                dones.append(done)
        for d in range(self.dp):  # all-gather the updated pieces into every replica's copies
            with tf.device(g.devices[d]):
                after[g.devices[d]] = dones[d] + self._assign(g, d, new_pieces, self.piece_size(g.total), dones[d])

    def _assign(self, g: Group, d: int, pieces: list[tf.Tensor], n: int, after: list) -> list:
        """Write the flat group, held as ``pieces`` of ``n`` elements each, into replica ``d``'s
        copies of group ``g``'s shards once ``after`` ran; each shard is joined from the parts
        of the pieces it spans (no whole flat group is built). Returns the assignments (graph
        mode; nothing when eager)."""
        ops = []
        with tf.control_dependencies(after):
            for k, off, size in zip(g.keys, g.offsets, g.sizes):
                parts = [pieces[r][max(off, r * n) - r * n: min(off + size, (r + 1) * n) - r * n]
                         for r in range(off // n, (off + size - 1) // n + 1)]
                shard = self.params.shards[k]
                value = tf.reshape(tf.concat(parts, 0) if len(parts) > 1 else parts[0], shard.shape)
                for copy in shard.copies[d]:
                    ops.append(copy.assign(value, read_value=False))
        return [op for op in ops if op is not None]

    def _mask(self, i: int, d: int):
        return None if self.masks[i] is None else self.masks[i][d]

    def _adam(self, i, d, p, grad, factor, t, lr, finite):
        """AdamW on replica ``d``'s flat parameters ``p`` of group ``i`` (whole, or its ZeRO
        piece) with that replica's ``m``/``v``; returns the new flat parameters and the op that
        empties the scratch variable (graph mode; ``[]`` when eager).

        The update's ops wait for ``p`` to be in the scratch variable, so its temporaries
        (the clipped gradient) are made only then: one order in every step and run."""
        scratch = self.scratch[i][d]
        loaded = scratch.assign(p, read_value=False)
        with tf.control_dependencies([] if loaded is None else [loaded]):
            optim.apply_adamw(scratch, self.m[i][d], self.v[i][d], grad, step=t, lr=lr, factor=factor,
                              finite=finite, cfg=self.cfg, decay=self.groups[i].decay, mask=self._mask(i, d))
        new = tf.identity(scratch.read_value())
        emptied = scratch.assign(tf.zeros([0]), read_value=False)
        return new, [] if emptied is None else [emptied]

    # -- state -------------------------------------------------------------------

    def checkpoint_slots(self) -> list[tuple[str, Slot]]:
        """``(device, slot)`` for every part of ``m`` and ``v`` (and of the pruning masks of
        pruned weights), by logical name (``optimizer/m/<weight>``, ``prune/mask/<weight>``)
        and box, written by the device that holds it.

        ``zero=0``: every replica holds whole moments; shard ``key``'s range of the flat
        group buffer is written by the shard's owner replica (as its weight is) and
        restored into every replica. ``zero>=1``: replica ``d`` holds piece ``d`` of the
        flat buffer, which spans parts of several shards; each part is cut into boxes of
        its shard (:func:`~phalanx.checkpoint.boxes.flat_boxes`, contiguous in the buffer)
        and then into boxes of the logical tensor, written and restored by replica ``d``
        alone. Padding past the group's end is not saved (it stays zero).
        """
        out = []
        params = self.params
        # Pruning masks (prune/mask/<weight>) are cut and written like the moments: per device.
        for which, slots in (("optimizer/m/", self.m), ("optimizer/v/", self.v), (prune.MASK_PREFIX, self.masks)):
            for i, g in enumerate(self.groups):
                if slots[i] is None:
                    continue
                piece = g.total if self.zero == 0 or self.dp == 1 else self.piece_size(g.total)
                for pos, key in enumerate(g.keys):
                    name, t = key
                    if which == prune.MASK_PREFIX and not prune.prunable(name):
                        continue
                    shape, full = params.shards[key].shape, params.full_shapes[name]
                    regions = params.regions(name, t)
                    off, size = g.offsets[pos], g.sizes[pos]
                    if self.zero == 0 or self.dp == 1:
                        owner = params.owner(key)
                        var = slots[i][owner]
                        out.append((var.device, Slot(
                            f"{which}{name}", full, np.float32, shape, regions,
                            fetch=lambda v=var, a=off, n=size, s=shape: tf.reshape(v[a:a + n], s),
                            assign=lambda x, vs=slots[i], a=off, n=size: [v[a:a + n].assign(x.reshape(-1))
                                                                          for v in vs],
                            optional=which == prune.MASK_PREFIX)))
                        continue
                    for d in range(self.dp):
                        lo, hi = max(d * piece, off), min((d + 1) * piece, off + size)
                        var = slots[i][d]
                        for start, box in boxes.flat_boxes(shape, lo - off, hi - off):
                            a = off + start - d * piece
                            n = boxes.volume(box)
                            out.append((var.device, Slot(
                                f"{which}{name}", full, np.float32, boxes.shape_of(box),
                                restrict(regions, box),
                                fetch=lambda v=var, a=a, n=n, s=boxes.shape_of(box): tf.reshape(v[a:a + n], s),
                                assign=lambda x, v=var, a=a, n=n: v[a:a + n].assign(x.reshape(-1)),
                                optional=which == prune.MASK_PREFIX)))
        return out

    def set_masks(self, masks: dict[str, np.ndarray]) -> None:
        """Install pruning masks (whole logical 0/1 tensors by weight name), cut like the
        weights (tensor-parallel Split, then ZeRO pieces), and zero ``m``/``v`` where masked.
        The caller zeroes the weights themselves."""
        flats = {}
        for name, mask in masks.items():
            mask = np.asarray(mask, np.float32)
            if mask.shape != self.params.full_shapes.get(name):
                raise ValueError(f"mask {name!r} has shape {mask.shape}, the weight "
                                 f"{self.params.full_shapes.get(name)}")
            for key, piece in zip(self.params.keys_of(name), self.params.splits[name].shard(mask, self.params.tp)):
                i, pos = self.where[key]
                if self.masks[i] is None:
                    raise KeyError(f"no pruning mask slot for {name!r}: built without train.prune.target, or "
                                   f"{name!r} is not a pruned weight")
                g = self.groups[i]
                flat = flats.setdefault(i, np.ones(g.total, np.float32))
                flat[g.offsets[pos]: g.offsets[pos] + g.sizes[pos]] = piece.reshape(-1)
        for i, flat in flats.items():
            if self.zero != 0:
                n = self.piece_size(self.groups[i].total)
                flat = np.pad(flat, (0, n * self.dp - self.groups[i].total), constant_values=1.0)
            for d, var in enumerate(self.masks[i]):
                value = flat if self.zero == 0 else flat[d * n:(d + 1) * n]
                var.assign(value)
                for slot in (self.m[i][d], self.v[i][d]):
                    slot.assign(slot.numpy() * value)

    def set_shard_mask(self, key: ShardKey, mask: np.ndarray) -> None:
        """Install the pruning mask of one shard (0/1, the shard's shape) in every replica (its
        ZeRO pieces where they lie) and zero ``m``/``v`` where masked; the other shards' masks
        stay. The caller zeroes the weights (:mod:`phalanx.prune` works shard by shard)."""
        i, pos = self.where[key]
        if self.masks[i] is None:
            raise KeyError(f"no pruning mask slot for {key[0]!r}: built without train.prune.target, or "
                           f"{key[0]!r} is not a pruned weight")
        g = self.groups[i]
        off, size = g.offsets[pos], g.sizes[pos]
        flat = tf.reshape(tf.convert_to_tensor(mask, tf.float32), [-1])  # a NumPy mask is copied once
        if int(flat.shape[0]) != size:
            raise ValueError(f"mask of shard {key} has {int(flat.shape[0])} elements, the shard {size}")
        n = g.total if self.zero == 0 or self.dp == 1 else self.piece_size(g.total)
        for d in range(self.dp):
            start = 0 if self.zero == 0 or self.dp == 1 else d * n  # where replica d's buffer starts
            lo, hi = max(start, off), min(start + n, off + size)
            if lo >= hi:
                continue
            part = flat[lo - off:hi - off]
            a, b = lo - start, hi - start
            self.masks[i][d][a:b].assign(part)
            for slot in (self.m[i][d], self.v[i][d]):
                slot[a:b].assign(slot[a:b] * part)

    def state_bytes_per_device(self) -> dict[str, int]:
        """Bytes of ``m`` and ``v`` held by each device."""
        out: dict[str, int] = {}
        for slots in (self.m, self.v):
            for variables in slots:
                for var in variables:
                    out[var.device] = out.get(var.device, 0) + int(np.prod(var.shape)) * var.dtype.size
        return out
