"""A Keras-model engine's state as checkpoint shard sets (format 3, docs/checkpoint_format.md):
one set per device, each variable's part of a logical tensor a slot by logical name and box,
ZeRO slices by flat range, so that no process holds a whole sharded tensor to save or restore it.

What the engine (:class:`~phalanx.engines.keras_model.KerasModelEngine`) knows and this module
reads: where each variable lives (a tensor shard on its rank's device, a pipeline stage's
variables on the stage's device, an expert shard on its owner replica's), and under
``parallel.zero`` the slices (:class:`~phalanx.parallel.keras_zero.ZeroSlices`), which then
are the state (weights and optimizer slots; the whole copies are refreshed from them). What a
model's caller says: the logical name and box of each variable (``parts``; for any Keras model
:func:`logical_parts`), the scalars, and extra slots (pruning masks).

The optimizer's element-wise slots (Keras names one ``<variable path, / -> _>_<slot>``, shaped
like the variable: Adam's ``momentum`` and ``velocity``, phalanx's AdamW's ``m`` and ``v``) are
saved as ``optimizer/<slot>/<logical name>``, boxed like the weight.

Example:
    >>> import keras
    >>> from phalanx.layers import ColumnParallelDense
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6), ColumnParallelDense(4, tp=2)])
    >>> parts = logical_parts(model)
    >>> sorted(parts)
    ['sequential/column_parallel_dense/bias', 'sequential/column_parallel_dense/kernel', \
'sequential/dense/bias', 'sequential/dense/kernel']
    >>> [box for _, box in parts["sequential/column_parallel_dense/kernel"]]
    [((0, 6), (0, 2)), ((0, 6), (2, 4))]
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from phalanx import checkpoint
from phalanx.checkpoint import boxes
from phalanx.checkpoint.sharded import spread
from phalanx.engines import keras_state
from phalanx.engines.joined import JoinedVariable

OPTIMIZER_PREFIX = "optimizer/"


def canonical(device: str) -> str:
    """A device name in the full form variables report (``/job:localhost/replica:0/task:0/device:CPU:1``)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(job=spec.job or "localhost", replica=spec.replica or 0, task=spec.task or 0).to_string()


def _tf(var):
    """The TensorFlow variable behind a ``keras.Variable`` (or the variable itself)."""
    return var.value if isinstance(var, keras.Variable) else var


# -- slots --------------------------------------------------------------------------------------


def scalar_slot(name: str, var) -> checkpoint.Slot:
    """A whole variable (a scalar step counter, a loss scale) as one slot."""
    var = _tf(var)
    shape = tuple(int(n) for n in var.shape)
    dtype = var.dtype.as_numpy_dtype
    return checkpoint.Slot(name, shape, dtype, shape, [(boxes.full(shape),) * 2], fetch=var.read_value,
                           assign=lambda x: var.assign(np.asarray(x).astype(dtype)))


def part_slot(name: str, shape: tuple, var, box) -> checkpoint.Slot:
    """The slot of ``var``, which holds ``box`` of logical tensor ``name`` (of ``shape``) in its
    own shape of that size."""
    var = _tf(var)
    local = boxes.shape_of(box)
    dtype = var.dtype.as_numpy_dtype
    return checkpoint.Slot(name, shape, dtype, local, [(boxes.full(local), box)],
                           fetch=lambda: tf.reshape(var.read_value(), local),
                           # (np.asarray: no copy of a piece already in the dtype; the host holds one)
                           assign=lambda x: var.assign(np.reshape(np.asarray(x, dtype), tuple(var.shape))))


def slice_slot(name: str, shape: tuple, var, offset: int, box) -> checkpoint.Slot:
    """The slot of the flat elements ``[offset, offset + volume(box))`` of a ZeRO slice
    ``var``, which hold ``box`` of logical tensor ``name`` (of ``shape``)."""
    var = _tf(var)
    local = boxes.shape_of(box)
    size = boxes.volume(box)
    dtype = var.dtype.as_numpy_dtype

    def assign(x):  # the slice's other elements (another box, the padding) stay
        flat = np.array(var.numpy()).reshape(-1)
        flat[offset:offset + size] = np.asarray(x).astype(dtype).reshape(-1)
        var.assign(flat.reshape(tuple(var.shape)))

    return checkpoint.Slot(name, shape, dtype, local, [(boxes.full(local), box)],
                           fetch=lambda: tf.reshape(tf.reshape(var.read_value(), [-1])[offset:offset + size], local),
                           assign=assign)


def _joined_slot(name: str, shape: tuple, parts: list, bound) -> checkpoint.Slot:
    """One slot for ``parts`` (``[(variable, box)]`` on one device) tiling ``bound`` of ``name``."""
    joined = JoinedVariable([(var, boxes.relative(box, bound)) for var, box in parts])
    local = boxes.shape_of(bound)
    dtype = joined.dtype.as_numpy_dtype
    return checkpoint.Slot(name, shape, dtype, local, [(boxes.full(local), bound)], fetch=joined.read_value,
                           assign=lambda x: joined.assign(np.asarray(x, dtype)))


def whole_shape(parts: list) -> tuple[int, ...]:
    """The logical shape that ``parts`` (``[(variable, box)]``) tile."""
    return tuple(max(box[a][1] for _, box in parts) for a in range(len(parts[0][1])))


def part_slots(name: str, parts: list, shape: tuple | None = None) -> list[tuple[str, checkpoint.Slot]]:
    """``(device, slot)`` of every variable of ``parts`` (``[(variable, box)]``) holding a box of
    ``name``: a device's parts that tile one box (the q, k, v of a fused kernel) are one slot."""
    shape = whole_shape(parts) if shape is None else shape
    by_device: dict[str, list] = {}
    for var, box in parts:
        var = _tf(var)
        by_device.setdefault(var.device, []).append((var, box))
    out = []
    for device, held in by_device.items():
        bound = tuple((min(b[a][0] for _, b in held), max(b[a][1] for _, b in held)) for a in range(len(shape)))
        if len(held) > 1 and sum(boxes.volume(b) for _, b in held) == boxes.volume(bound):
            out.append((device, _joined_slot(name, shape, held, bound)))
        else:
            out += [(device, part_slot(name, shape, var, box)) for var, box in held]
    return out


# -- logical names of any Keras model ------------------------------------------------------------


def unique_names(names: list[str]) -> list[str]:
    """``names`` (Keras paths without the process's layer counters) made unique in order: the
    ``k``-th repeat of a path gets ``_k`` on its layer's part, the name Keras gives that layer in
    a process that made no other layer before the model.

    >>> unique_names(["seq/dense/kernel", "seq/dense/bias", "seq/dense/kernel", "seq/dense/bias"])
    ['seq/dense/kernel', 'seq/dense/bias', 'seq/dense_1/kernel', 'seq/dense_1/bias']
    """
    seen: dict[str, int] = {}
    out = []
    for name in names:
        k = seen.get(name, 0)
        seen[name] = k + 1
        if k:
            parts = name.split("/")
            at = len(parts) - 2 if len(parts) > 1 else 0
            parts[at] = f"{parts[at]}_{k}"
            name = "/".join(parts)
        out.append(name)
    return out


def logical_parts(model) -> dict[str, list[tuple[Any, tuple]]]:
    """Every variable of ``model`` (the MoE layers' per-step totals aside:
    :func:`~phalanx.engines.keras_state.model_entries`) by logical name: the path without
    Keras's layer counters or the shard suffix (:func:`unique_names`), and for each variable its
    box in the whole (unsharded) weight, so that a checkpoint restores into any layout."""
    entries = keras_state.model_entries(model)
    out = {}
    for name, entry in zip(unique_names([e.name for e in entries]), entries):
        shape = entry.shape
        parts = []
        for r, v in enumerate(entry.variables):
            box = list(boxes.full(shape))
            if entry.axis is not None:
                axis = entry.axis % len(shape)
                n = int(v.shape[axis])
                box[axis] = (r * n, (r + 1) * n)
            parts.append((v, tuple(box)))
        out[name] = parts
    return out


def _optimizers(optimizer) -> list:
    inner = getattr(optimizer, "inner_optimizer", None)
    return [o for o in (optimizer, inner) if o is not None]


def optimizer_variables(optimizer) -> list:
    """Every variable of ``optimizer`` (a ``LossScaleOptimizer``'s and its inner one's), once."""
    out, seen = [], set()
    for opt in _optimizers(optimizer):
        for v in opt.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def slot_owner(slot, variables_by_prefix) -> tuple[Any, str] | None:
    """``(variable, slot name)`` when ``slot`` is Keras's slot of one of the variables
    (``<path, / -> _>_<name>``, the longest matching path; ``variables_by_prefix``:
    ``[(prefix, variable)]`` longest first), else None."""
    for prefix, v in variables_by_prefix:
        if slot.name.startswith(prefix):
            return v, slot.name[len(prefix):]
    return None


def by_prefix(variables) -> list[tuple[str, Any]]:
    """``[(the prefix of Keras's slot names of v, v)]``, the longest first (:func:`slot_owner`)."""
    return sorted(((v.path.replace("/", "_") + "_", v) for v in variables), key=lambda p: -len(p[0]))


# -- the shard sets -------------------------------------------------------------------------------


def saved_slices(engine):
    """The ZeRO slices (:mod:`phalanx.parallel.keras_zero`) that a checkpoint of ``engine`` (a
    :class:`~phalanx.engines.keras_model.KerasModelEngine`) holds and a restore assigns, or None
    when it holds whole variables: without ZeRO, and across workers, where a process holds its
    own slices only and the whole state, gathered into the model and its optimizer on every
    worker before the chief saves, is written instead."""
    return engine.slices if getattr(engine, "workers", None) is None else None


def shard_sets(engine, parts: dict[str, list], scalars: dict[str, Any] | None = None,
               extra: list[tuple[str, checkpoint.Slot]] = ()) -> list[checkpoint.ShardSet]:
    """The state of ``engine`` (a :class:`~phalanx.engines.keras_model.KerasModelEngine`) as one
    shard set per device: every variable of ``parts`` (logical name -> ``[(variable, box)]``)
    and its optimizer slots from where they live, or under ZeRO from their slices; ``scalars``
    (name -> variable) on the first device (None: the optimizer's own variables that are no
    element-wise slot, by their Keras path under ``optimizer/``); ``extra`` ``(device, slot)``
    as given. Sets are named by mesh coordinates (``dp{d}-pp{r}-tp{t}``), in mesh order."""
    slots = _slots(engine.model, saved_slices(engine), engine.mesh.device(0, 0, 0), parts, scalars)
    return _by_device(engine.mesh, slots + list(extra))


def whole_sets(model, parts: dict[str, list], extra: list[tuple[str, checkpoint.Slot]] = ()) \
        -> list[checkpoint.ShardSet]:
    """The state of a model whose variables are whole, wherever they live (a model's own
    train_step, the parameter-server fit), named as :func:`shard_sets` names them, in a few sets of about equal bytes
    (:func:`~phalanx.checkpoint.sharded.spread`); each slot read from its variable when written."""
    slots = _slots(model, None, None, parts, None) + list(extra)
    return spread([slot for _, slot in slots])


def _slots(model, zs, first, parts: dict[str, list], scalars) -> list[tuple[str, checkpoint.Slot]]:
    """``(device, slot)`` of :func:`shard_sets` (``zs``: the engine's ZeRO slices or None;
    ``first``: where the scalars go, None: where they live)."""
    trainable = list(model.trainable_variables)
    prefixes = by_prefix(trainable)
    logical_of = {id(v): name for name, held in parts.items() for v, _ in held}
    # element-wise slots of each whole variable: id(variable) -> [(slot name, slot)]
    slots_of: dict[int, list] = {}
    rest = []  # the optimizer's other variables (counters, learning rate, loss scale, factored slots)
    user = getattr(model, "optimizer", None)
    sliced_slots: dict[int, list] = {}
    rest_sliced: list[tuple[Any, Any]] = []  # (the user's variable, the sliced optimizer's) under ZeRO
    if zs is not None:
        position = {id(layout): i for i, layout in enumerate(zs.layouts)}
        for owner, layout, row in zs.slots:
            v = zs.variables[position[id(layout)]]
            sliced_slots.setdefault(id(v), []).append((owner.name[len(v.path.replace("/", "_")) + 1:], row))
        rest_sliced = list(zs.scalars)
    elif user is not None:
        for s in optimizer_variables(user):
            found = slot_owner(s, prefixes)
            if found is not None and tuple(found[0].shape) == tuple(s.shape):
                slots_of.setdefault(id(found[0]), []).append((found[1], s))
            else:
                rest.append(s)
    out: list[tuple[str, checkpoint.Slot]] = []
    if scalars is None:
        named: list[tuple[str, Any]] = []
        for s in rest:
            found = slot_owner(s, prefixes)
            if found is not None and tuple(s.shape) != () and id(found[0]) in logical_of:
                # a slot of another shape (Adafactor's factored ones): whole, where it lives
                out.append((_tf(s).device, scalar_slot(f"{OPTIMIZER_PREFIX}{found[1]}/{logical_of[id(found[0])]}",
                                                       s)))
            else:
                named.append((OPTIMIZER_PREFIX + keras_state.plain_path(s.path), s))
        named += [(OPTIMIZER_PREFIX + keras_state.plain_path(owner.path), mine) for owner, mine in rest_sliced]
        # (two optimizers' variables may share a path without the counters: numbered, not dropped)
        scalars = dict(zip(unique_names([n for n, _ in named]), [v for _, v in named]))
    out = [(first or _tf(var).device, scalar_slot(name, var)) for name, var in scalars.items()] + out
    sliced = {} if zs is None else zs.index
    for name, held in parts.items():
        shape = whole_shape(held)
        whole = [(v, box) for v, box in held if id(v) not in sliced]
        if whole:
            out += part_slots(name, whole, shape)
            by_slot: dict[str, list] = {}
            for v, box in whole:
                for slot_name, s in slots_of.get(id(v), []):
                    by_slot.setdefault(slot_name, []).append((s, box))
            for slot_name, slot_parts in by_slot.items():
                out += part_slots(f"{OPTIMIZER_PREFIX}{slot_name}/{name}", slot_parts, shape)
        for v, box in held:
            if id(v) in sliced:
                out += _sliced(zs, v, box, name, shape, sliced_slots.get(id(v), []))
    return out


def _sliced(zs, v, box, name: str, shape: tuple, slots: list) -> list[tuple[str, checkpoint.Slot]]:
    """``(device, slot)`` of the ZeRO slices of ``v`` (which holds ``box`` of ``name``) and of its
    optimizer slots' slices: slice ``k`` holds a flat range of ``v``
    (:meth:`~phalanx.parallel.keras_zero.SliceLayout.flat_range`), cut into boxes of the logical
    tensor (:func:`~phalanx.checkpoint.boxes.flat_boxes`); its padding is not saved."""
    layout = zs.layouts[zs.index[id(v)]]
    origin = [lo for lo, _ in box]
    out = []
    for k, piece in enumerate(zs.slices_of(v)):
        lo, hi = layout.flat_range(k)
        holders = [(name, piece)] + [(f"{OPTIMIZER_PREFIX}{slot_name}/{name}", row[k]) for slot_name, row in slots]
        for start, region in boxes.flat_boxes(boxes.shape_of(box), lo, hi):
            logical = boxes.translate(region, origin)
            for key, holder in holders:
                out.append((_tf(holder).device, slice_slot(key, shape, holder, start - lo, logical)))
    return out


def _by_device(mesh, slots: list[tuple[str, checkpoint.Slot]]) -> list[checkpoint.ShardSet]:
    names = {}  # device -> its set's name in mesh order
    for d in range(mesh.dp):
        for r in range(mesh.pp):
            for t in range(mesh.tp):
                names.setdefault(canonical(mesh.device(d, r, t)), f"dp{d}-pp{r}-tp{t}")
    sets: dict[str, checkpoint.ShardSet] = {}
    for device, slot in slots:
        key = canonical(device)
        name = names.get(key) or "dev-" + "".join(c if c.isalnum() else "-" for c in key).strip("-")
        sets.setdefault(name, checkpoint.ShardSet(name)).slots.append(slot)
    order = {name: i for i, name in enumerate(names.values())}
    return sorted(sets.values(), key=lambda s: (order.get(s.name, len(order)), s.name))
