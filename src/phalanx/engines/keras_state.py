"""The variables of a Keras model and its optimizer as *logical* tensors, whatever the layout.

A layer built from :mod:`phalanx.layers` may hold a weight as ``tp`` (or ``ep``) shard
variables, and Keras's optimizer then keeps one slot per shard (its momentum of
``kernel_shard0``, ``kernel_shard1``, ...). An :class:`Entry` is one logical tensor: its name
(the variable path without Keras's layer counters or the shard suffix), its variables in shard
order, and the axis they are cut along (None: one whole variable). A checkpoint names and boxes
each variable by its entry (:func:`phalanx.engines.keras_slots.logical_parts`), so a run saved
at tp=2 resumes at tp=1 or tp=4 (or on another pipeline split) with the same numbers.

:func:`optimizer_entries` and :func:`restore_masks` read the checkpoints ``phalanx.fit`` wrote
before it wrote per device: whole tensors numbered by entry (``model/00003``,
``optimizer/00007``, ``prune/mask/00003``).

Example:
    >>> import keras
    >>> from phalanx.layers import ColumnParallelDense
    >>> model = keras.Sequential([keras.Input((4,)), ColumnParallelDense(6, tp=2, name="col")])
    >>> [(e.name, e.shape) for e in model_entries(model)]
    [('sequential/col/kernel', (4, 6)), ('sequential/col/bias', (6,))]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from phalanx.layers.moe import is_step_total
from phalanx.layers.sharding import ShardedLayer

_SHARD = re.compile(r"_shard\d+")


@dataclass
class Entry:
    name: str
    variables: list
    axis: int | None

    @property
    def shape(self) -> tuple:
        shape = list(self.variables[0].shape)
        if self.axis is not None:
            shape[self.axis] *= len(self.variables)
        return tuple(int(d) for d in shape)

    def value(self) -> np.ndarray:
        values = [np.asarray(v.numpy()) for v in self.variables]
        return values[0] if self.axis is None else np.concatenate(values, axis=self.axis)

    def assign(self, value) -> None:
        value = np.asarray(value)
        pieces = [value] if self.axis is None else np.split(value, len(self.variables), axis=self.axis)
        for v, piece in zip(self.variables, pieces):
            v.assign(piece)


def plain_path(name: str) -> str:
    """``functional_3/dense_2/kernel_shard1`` -> ``functional/dense/kernel``."""
    return "/".join(re.sub(r"_\d+$", "", part) for part in _SHARD.sub("", name).split("/"))


def _groups(model) -> dict[int, tuple[list, int | None]]:
    """Variable id -> (its logical weight's shard variables, cut axis), for sharded weights."""
    out = {}
    for layer in model._flatten_layers(include_self=True):
        if isinstance(layer, ShardedLayer):
            for variables, axis, _ in layer._logical.values():
                if len(variables) > 1:
                    for v in variables:
                        out[id(v)] = (list(variables), axis)
    return out


def _collapse(variables, group_of, name_of) -> list[Entry]:
    entries, seen = [], set()
    for v in variables:
        if id(v) in seen:
            continue
        group = group_of(v)
        if group is None:
            entries.append(Entry(name_of(v), [v], None))
            seen.add(id(v))
        else:
            members, axis = group
            entries.append(Entry(name_of(members[0]), members, axis))
            seen.update(id(m) for m in members)
    return entries


def model_entries(model) -> list[Entry]:
    """The model's variables as logical tensors, in ``model.variables`` order.

    An MoE layer's per-step statistics totals are left out: the engine starts them at
    zero every step, so they carry no state across steps, and leaving them out keeps
    checkpoints written before they existed resumable."""
    groups = _groups(model)
    kept = [v for v in model.variables if not is_step_total(v)]
    return _collapse(kept, lambda v: groups.get(id(v)), lambda v: plain_path(v.path))


def optimizer_entries(model) -> list[Entry]:
    """The optimizer's variables as logical tensors: the slots of a sharded weight's shards
    (Keras names a slot ``<weight path with _ for />_<slot>``) joined like the weight."""
    optimizer = model.optimizer
    groups = _groups(model)
    prefixes = sorted(((v.path.replace("/", "_") + "_", v) for v in model.trainable_variables),
                      key=lambda item: -len(item[0]))
    slot_groups: dict[tuple, list] = {}
    owner = {}
    for slot in optimizer.variables:
        ref = next((v for prefix, v in prefixes if slot.name.startswith(prefix)), None)
        if ref is None or id(ref) not in groups:
            continue
        members, axis = groups[id(ref)]
        suffix = slot.name[len(ref.path.replace("/", "_")) + 1:]
        key = (id(members[0]), suffix)
        rank = next(i for i, m in enumerate(members) if m is ref)
        slot_groups.setdefault(key, [None] * len(members))[rank] = slot
        owner[id(slot)] = (key, axis)

    def group_of(slot):
        if id(slot) not in owner:
            return None
        key, axis = owner[id(slot)]
        members = slot_groups[key]
        return (members, axis) if all(m is not None for m in members) else None

    return _collapse(optimizer.variables, group_of, lambda v: plain_path(v.path))


# -- pruning masks ---------------------------------------------------------------------------------

MASK_KEY = "prune/mask/{:05d}"  # numbered as the kernel's entry among model_entries ("model/{:05d}")


def _mask_keys(model, pruning) -> list[str]:
    first = {id(e.variables[0]): i for i, e in enumerate(model_entries(model))}
    return [MASK_KEY.format(first[id(w.variables[0])]) for w in pruning.weights]


def restore_masks(pruning, tensors: dict) -> None:
    """Install the whole masks a numbered checkpoint holds into ``pruning``; a
    checkpoint written before the first update (or without pruning) holds none, and every
    weight stays unmasked until the next update."""
    if pruning is None:
        return
    pruning.load_masks({w.path: tensors[key] for key, w in zip(_mask_keys(pruning.model, pruning), pruning.weights)
                        if key in tensors})
