"""Gradual magnitude pruning of any Keras model trained by ``phalanx.fit`` (``train.prune.*``).

Pruned: the kernels of Keras's ``Dense``, ``EinsumDense`` and ``Conv1D/2D/3D`` layers, and
of phalanx's tensor-parallel layers that stand for them (``ColumnParallelDense``,
``RowParallelDense``, ``ParallelMLP``, ``ParallelSelfAttention``: a keras-hub model after
:func:`phalanx.parallelize`). Never biases, embeddings, normalisation or anything else.

The schedule is the built-in GPT's (:mod:`phalanx.prune`): before the step that follows
``t`` completed optimizer steps, at ``t = start, start + every, ...`` up to ``end`` (and at
``end``), the masks are recomputed from the current magnitudes with Zhu & Gupta's cubic
sparsity. ``unstructured``: the ``round(s x size)`` smallest ``|w|`` of each logical kernel
(ties: the lowest flat index); ``N:M``: of every M consecutive weights along the kernel's
input axis (axis -2 of a Dense ``[in, out]`` or Conv ``[..., in, out]`` kernel; for an
EinsumDense kernel the last axis its equation contracts, e.g. ``head_dim`` of attention's
``[heads, head_dim, out]`` output kernel), the smallest ``M - N`` are zeroed.

A tensor-parallel kernel's mask is computed over the whole logical kernel, shard by shard
(:func:`phalanx.prune.shards.shard_masks`: a radix selection over the shards, no kernel
joined), so each shard's mask is its part of the one-device mask. After every optimizer step
the masked weights are multiplied by their masks again, inside the step, before the data
replicas' copies are refreshed from them (the optimizer's update of a pruned weight does not
resurrect it; its moments are left as they are, as a Keras callback that masks the weights
after each batch would leave them). Under ZeRO the masks are applied to the slices the
optimizer updates, each cut like its weight's slices, with no optimizer state gathered
(:meth:`KerasPruning.train_step`). The masks are saved
in ``phalanx.fit``'s per-epoch checkpoints (``prune/mask/<weight>``,
:meth:`KerasPruning.mask_slots`) and installed again on resume.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    >>> [(w.name, w.shape, w.nm_axis) for w in prunable_weights(model)]
    [('kernel', (8, 4), 0), ('kernel', (4, 2), 0)]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import keras
import numpy as np
import tensorflow as tf

from phalanx import checkpoint
from phalanx.checkpoint import boxes
from phalanx.config import Config, ConfigError, parse_prune_pattern
from phalanx.layers.attention import ParallelSelfAttention
from phalanx.layers.sharding import ShardedLayer
from phalanx.layers.tensor_parallel import ColumnParallelDense, ParallelMLP, RowParallelDense
from phalanx.prune import MASK_PREFIX, enabled, is_update_step, nm_mask, scheduled_sparsity
from phalanx.prune.shards import WeightShard, shard_masks

#: phalanx's tensor-parallel layers: logical kernel name -> its input axis (for N:M)
_SHARDED_KERNELS = {ColumnParallelDense: {"kernel": 0}, RowParallelDense: {"kernel": 0},
                    ParallelMLP: {"up": 0, "gate": 0, "down": 0},
                    ParallelSelfAttention: {"query": 0, "key": 0, "value": 0, "output": 1}}


@dataclass
class PrunedWeight:
    """One logical kernel: its variables (tensor shards in order, cut along ``axis``; one
    variable and ``axis`` None when whole), the input axis N:M groups run along, and the
    installed masks (one per variable, on its device; empty before the first update)."""

    name: str
    variables: list
    axis: int | None
    nm_axis: int
    masks: list = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        shape = [int(d) for d in self.variables[0].shape]
        if self.axis is not None:
            shape[self.axis] *= len(self.variables)
        return tuple(shape)

    @property
    def path(self) -> str:
        return self.variables[0].path


def _einsum_input_axis(layer) -> int:
    """The last axis of an EinsumDense kernel that its equation contracts."""
    lhs, out = layer.equation.split("->")
    kernel = lhs.split(",")[1]
    contracted = [i for i, c in enumerate(kernel) if c not in out]
    if not contracted:
        raise ConfigError("train.prune.pattern", f"layer {layer.name!r}: equation {layer.equation!r} contracts no "
                                                 f"kernel axis, so N:M has no input axis; use unstructured")
    return contracted[-1]


def prunable_weights(model) -> list[PrunedWeight]:
    """The kernels :mod:`this module <phalanx.prune.keras>` prunes, in ``model.variables`` order."""
    out, seen = [], set()
    for layer in model._flatten_layers(include_self=False):
        found = []
        if isinstance(layer, ShardedLayer):
            for cls, names in _SHARDED_KERNELS.items():
                if isinstance(layer, cls):
                    for name, nm_axis in names.items():
                        if name in layer._logical:
                            variables, axis, _ = layer._logical[name]
                            found.append(PrunedWeight(name, list(variables), axis if len(variables) > 1 else None,
                                                      nm_axis))
        elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense,
                                keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)):
            kernel = getattr(layer, "_kernel", None)  # the variable (``kernel`` may add a LoRA product)
            kernel = getattr(layer, "kernel", None) if kernel is None else kernel
            if isinstance(kernel, keras.Variable) and kernel.trainable:
                rank = len(kernel.shape)
                nm_axis = _einsum_input_axis(layer) if isinstance(layer, keras.layers.EinsumDense) else rank - 2
                found.append(PrunedWeight("kernel", [kernel], None, nm_axis))
        for w in found:
            if id(w.variables[0]) not in seen:
                seen.add(id(w.variables[0]))
                out.append(w)
    order = {id(v): i for i, v in enumerate(model.variables)}
    return sorted(out, key=lambda w: order.get(id(w.variables[0]), len(order)))


def _shards(weight: PrunedWeight, install, moved: bool) -> list[WeightShard]:
    """``weight`` as :class:`~phalanx.prune.shards.WeightShard` objects, one per variable; with
    ``moved`` the N:M axis is put at -2 (where :func:`shard_masks` groups), and back for install."""
    shape, ndim = weight.shape, len(weight.shape)
    order = list(range(ndim))
    if moved:
        order.remove(weight.nm_axis)
        order.insert(ndim - 2, weight.nm_axis)
    out = []
    for r, v in enumerate(weight.variables):
        local = tuple(int(d) for d in v.shape)
        logical = list(boxes.full(shape))
        if weight.axis is not None:
            size = local[weight.axis]
            logical[weight.axis] = (r * size, (r + 1) * size)

        def fetch(v=v):
            return np.transpose(np.asarray(keras.ops.convert_to_numpy(v.value)), order)

        def put(mask, r=r):
            install(r, np.transpose(mask, np.argsort(order)))

        out.append(WeightShard(weight.path, tuple(shape[a] for a in order),
                               [(boxes.full(tuple(local[a] for a in order)), tuple(logical[a] for a in order))],
                               fetch=fetch, install=put))
    return out


class KerasPruning:
    """The fit loop's pruning hook: :meth:`train_step` runs one engine step with the masks
    updated before it (on the schedule) and applied after it. Without ``train.prune.target``
    it only runs the step.

    ``model``: the compiled model (its tensor-parallel layers already in place); ``workers``:
    the number of workers the fit spans. Bad settings (no prunable kernel, an N:M input axis
    that M does not divide, several workers) are ConfigErrors naming the key, raised here,
    before any step.
    """

    def __init__(self, cfg: Config, model, workers: int = 1):
        self.pc, self.model = cfg.train.prune, model
        self.on = enabled(cfg)
        if self.on and workers > 1:
            # each worker would mask alone, and only the chief restores masks from a checkpoint
            raise ConfigError("train.prune.target", f"{self.pc.target}: pruning a Keras model runs in one process; "
                                                    f"across {workers} workers use train.prune.target=0")
        self.weights = prunable_weights(model) if self.on else []
        self.nm = parse_prune_pattern(self.pc.pattern) if self.on else None
        # under ZeRO: id(slice) -> (it, its piece of the mask); whether they follow the masks (None after
        # a mask changed). The traced multiplications by target set; the (engine, pair count) whose step
        # multiplies by the masks.
        self._pieces, self._placed, self._multiply_fns, self._hooked = {}, None, {}, None
        if self.on and not self.weights:
            raise ConfigError("train.prune.target", f"{self.pc.target}: model {model.name!r} has no kernel phalanx "
                                                    f"prunes (Dense, EinsumDense, Conv1D/2D/3D or their "
                                                    f"tensor-parallel forms); set train.prune.target=0")
        if self.nm is not None:
            m = self.nm[1]
            for w in self.weights:
                if w.shape[w.nm_axis] % m:
                    raise ConfigError("train.prune.pattern",
                                      f"{self.pc.pattern} groups {m} consecutive weights along the input axis, but "
                                      f"{w.path} has {w.shape[w.nm_axis]} there (shape {w.shape}, axis {w.nm_axis}); "
                                      f"use a pattern whose M divides every pruned kernel's input axis, or "
                                      f"unstructured")

    # -- the step -----------------------------------------------------------------------------

    def train_step(self, engine, batch):
        """``engine.train_step(batch)`` with the masks recomputed first when the schedule says
        so and applied to the updated weights inside the step.

        The masks multiply the weights the optimizer updates, where it updates them: inside the
        step, after the optimizer's apply and before the data replicas' whole copies are
        refreshed from them (``engine.set_after_update``), so the copies are masked with no
        pass of their own. Without ZeRO (``engine.slices`` None) those are the model's weights;
        under ZeRO each mask is cut like its weight's slices and multiplied into them, with no
        optimizer state gathered.

        A mask update (on the schedule, before the step) reads the magnitudes from the whole
        weights, masks the weights the step reads and refreshes the copies
        (``engine.refresh_copies``). At ZeRO-1/2 the model's weights are current. At ZeRO-3 the
        weight slices (only) are joined into the model's weights first: a ZeRO slice is a flat
        range of the weight, not a box of it, so neither criterion is local to a slice (an N:M
        group runs along the input axis, ``shape[-1]`` elements apart in the flat order, and
        unstructured ties are broken by the whole kernel's flat index), while
        :func:`~phalanx.prune.shards.shard_masks` selects over boxes. The join happens only on
        the schedule's update steps, never between them."""
        if not self.on:
            return engine.train_step(batch)
        slices = getattr(engine, "slices", None)
        step = int(self.model.optimizer.iterations.numpy())
        if is_update_step(step, self.pc):
            if slices is not None:
                slices.store(weights=engine.zero == 3, state=False)  # the masks follow the slices' weights
            self.update(step)  # masks the model's weights
            if slices is not None:
                self._multiply_now(self._targets(engine))
            engine.refresh_copies()
        if self.installed:
            pairs = self._targets(engine)
            if self._hooked != (id(engine), len(pairs)):  # new masks to multiply by: the step is traced again
                engine.set_after_update(lambda: _multiply(pairs))
                self._hooked = (id(engine), len(pairs))
        return engine.train_step(batch)

    @property
    def installed(self) -> bool:
        return any(w.masks for w in self.weights)

    def update(self, step: int) -> None:
        """Recompute every mask from the weights' magnitudes for the sparsity of ``step``."""
        sparsity = scheduled_sparsity(step, self.pc.target, self.pc.start, self.pc.end)
        for w in self.weights:
            def install(r, mask, w=w):
                self._install(w, r, mask)
            for shard, mask in shard_masks(_shards(w, install, moved=self.nm is not None), sparsity, self.nm,
                                           nm_mask):
                shard.install(mask)
        self._apply()

    def _install(self, weight: PrunedWeight, r: int, mask: np.ndarray) -> None:
        v = weight.variables[r]
        if not weight.masks:
            with tf.init_scope():
                for var in weight.variables:
                    with tf.device(var.value.device):
                        weight.masks.append(tf.Variable(tf.ones(var.shape, var.dtype), trainable=False,
                                                        name=var.path.replace("/", "_") + "_prune_mask"))
        weight.masks[r].assign(tf.cast(mask, v.dtype))
        self._placed = None  # the masks' slices are cut again from the new masks

    def _apply(self) -> None:
        """Multiply every masked weight by its mask on its device (the caller refreshes the
        data replicas' copies)."""
        self._multiply_now([(v.value, m) for w in self.weights for v, m in zip(w.variables, w.masks)])

    def _multiply_now(self, pairs: list) -> None:
        """``target *= mask`` for every pair, eagerly (one traced function per set of pairs)."""
        key = tuple(id(t) for t, _ in pairs)
        if key not in self._multiply_fns:
            self._multiply_fns[key] = tf.function(lambda: _multiply(pairs), autograph=False)
        self._multiply_fns[key]()

    def _targets(self, engine) -> list:
        """``(weight the optimizer updates, its mask)`` pairs: without ZeRO the model's masked
        weights; under ZeRO their slices, each with its piece of the mask held on the slice's
        device (made at the first call, assigned again after the masks changed)."""
        slices = getattr(engine, "slices", None)
        if slices is None:
            return [(v.value, m) for w in self.weights for v, m in zip(w.variables, w.masks)]
        if self._placed is None:
            for w in self.weights:
                for v, m in zip(w.variables, w.masks):
                    for target, value in zip([s.value for s in slices.slices_of(v)], slices.pieces_of(v, m.value())):
                        held = self._pieces.get(id(target))
                        if held is None:
                            with tf.init_scope(), tf.device(target.device):
                                self._pieces[id(target)] = (target, tf.Variable(value, trainable=False,
                                                                                name="prune_mask_piece"))
                        else:
                            held[1].assign(value)
            self._placed = True
        return list(self._pieces.values())

    # -- checkpoints ------------------------------------------------------------------------------

    def mask_slots(self, parts: dict) -> list[tuple[str, checkpoint.Slot]]:
        """``(device, slot)`` of every pruned kernel's mask for a checkpoint: ``prune/mask/<the
        kernel's logical name>`` (float32 0/1), each variable's mask on its device, boxed like the
        variable in ``parts`` (logical name -> ``[(variable, box)]``, the engine's). Optional: a
        checkpoint written before the first update holds none. Loading one installs it (the masks
        of its kernel made first, all ones); :meth:`restored` then masks the weights. Fetch only
        once :attr:`installed`."""
        if not self.on:
            return []
        held = {id(v): (name, box) for name, pairs in parts.items() for v, box in pairs}
        out = []
        for w in self.weights:
            name = held[id(w.variables[0])][0]
            for r, v in enumerate(w.variables):
                box = held[id(v)][1]
                local = boxes.shape_of(box)

                def fetch(w=w, r=r, local=local):
                    return tf.reshape(tf.cast(w.masks[r].read_value(), tf.float32), local)

                def assign(x, w=w, r=r, v=v):
                    self._install(w, r, np.reshape(np.asarray(x, np.float32), tuple(v.shape)))

                out.append((v.value.device, checkpoint.Slot(MASK_PREFIX + name, w.shape, np.float32, local,
                                                             [(boxes.full(local), box)], fetch=fetch, assign=assign,
                                                             optional=True)))
        return out

    def restored(self) -> None:
        """After masks were loaded (:meth:`mask_slots`): mask the weights (the caller refreshes
        the data replicas' copies)."""
        if self.installed:
            self._apply()

    def load_masks(self, masks: dict[str, np.ndarray]) -> None:
        """Install whole logical masks by weight (``path`` of its first variable -> mask), as a
        resumed run's checkpoint holds them, and mask the weights (the caller refreshes the
        data replicas' copies)."""
        if not self.on or not masks:
            return
        for w in self.weights:
            if w.path in masks:
                whole = np.asarray(masks[w.path])
                if tuple(whole.shape) != w.shape:
                    raise ValueError(f"prune mask of {w.path}: shape {whole.shape} in the checkpoint, {w.shape} in "
                                     f"the model")
                pieces = [whole] if w.axis is None else np.split(whole, len(w.variables), axis=w.axis)
                for r, piece in enumerate(pieces):
                    self._install(w, r, piece)
        self._apply()

    def sparsity(self) -> float:
        """Share of exact zeros over the pruned kernels."""
        zeros = total = 0
        for w in self.weights:
            for v in w.variables:
                a = np.asarray(keras.ops.convert_to_numpy(v.value))
                zeros += int(a.size - np.count_nonzero(a))
                total += int(a.size)
        return zeros / total if total else 0.0


def _multiply(pairs: list) -> None:
    for target, mask in pairs:
        with tf.device(target.device):
            target.assign(target * mask)
