"""ZeRO by slices for a Keras model: each trainable variable cut into ``n`` slices, one per
data replica that holds a copy of it, and the user's Keras optimizer applied on the slices.

This module holds what does not depend on where the engine runs a stage: how a variable is
cut (:class:`SliceLayout`), the slice variables and the second instance of the user's
optimizer that updates them (:class:`ZeroSlices`), and the gradient reductions of the three
stages. The engine (:class:`~phalanx.engines.keras_model.KerasModelEngine`) says on which
device each slice lives and where each gradient was formed.

* **The cut.** A variable whose first dimension has at least ``n`` rows is cut into ``n``
  blocks of ``ceil(rows / n)`` rows (the last ones padded with zero rows): an embedding's
  sparse gradient (``IndexedSlices``) then splits by rows, as one device's Keras optimizer
  sees it. A smaller variable (a scalar, a ``[1, d]`` kernel at ``n = 2``) is flattened and
  cut into ``n`` equal 1-D pieces, zero-padded at the end. Padding holds zeros, receives zero
  gradients, and an element-wise optimizer keeps it at zero.
* **The optimizer.** A second instance of the user's optimizer class, made from its config
  (its learning-rate schedule, ``global_clipnorm``, ``clipvalue``, weight decay), is built on
  the slice variables, which carry the model variables' names and paths (AdamW's
  ``exclude_from_weight_decay`` by name or by variable still matches). One ``apply`` over
  every slice: ``global_clipnorm`` sees the norm of all gradients and ``iterations`` counts
  once. An element-wise optimizer then gives the unsliced update exactly. Per-variable
  ``clipnorm`` and optimizers that look at a whole matrix (Adafactor, LAMB, Muon) are
  refused (:func:`check_sliceable`). An optimizer whose constructor takes more than its
  Keras config (phalanx's own) provides ``zero_clone()``.
* **The user's optimizer** (``model.optimizer``) keeps whole-shaped slots for checkpoints and
  for ``evaluate``/``save`` after the fit: :meth:`ZeroSlices.load` cuts its state (and the
  model's weights) into the slices, :meth:`ZeroSlices.store` joins them back. The engine calls
  them when a fit starts or a checkpoint was restored, and at each epoch end.

Example:
    >>> import numpy as np
    >>> layout = SliceLayout((5, 2), 2)
    >>> [tuple(p.shape) for p in layout.pieces(np.arange(10.0).reshape(5, 2))]
    [(3, 2), (3, 2)]
    >>> layout.join(layout.pieces(np.arange(10.0).reshape(5, 2))).numpy().ravel().tolist() == list(range(10))
    True
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from phalanx.config import ConfigError
from keras.src.optimizers.base_optimizer import global_norm  # Keras's own, for its global_clipnorm across workers

from phalanx.parallel.gradients import SparseGradient, densify, finish, join_gradients

# Optimizers that scale an update by statistics of a whole weight (a slice does not see them).
MATRIX_WISE = ("Adafactor", "Lamb", "Muon")


class SliceLayout:
    """How a variable of ``shape`` is cut into ``n`` slices (module docstring).

    ``rows``: the length of the axis that is cut (the first dimension, or the flat size);
    ``per``: rows per slice; ``slice_shape``: each slice's shape."""

    def __init__(self, shape, n: int):
        self.shape = tuple(int(d) for d in shape)
        self.n = n
        self.by_rows = len(self.shape) >= 1 and self.shape[0] >= n
        self.rows = self.shape[0] if self.by_rows else int(np.prod(self.shape, dtype=np.int64))
        self.rest = self.shape[1:] if self.by_rows else ()
        self.per = -(-self.rows // n)
        self.slice_shape = (self.per,) + self.rest

    def flat_range(self, k: int) -> tuple[int, int]:
        """The row-major flat range ``[lo, hi)`` of the whole variable that slice ``k`` holds,
        as its first ``hi - lo`` elements (the rest of the slice is padding).

        >>> SliceLayout((5, 2), 2).flat_range(1), SliceLayout((3,), 4).flat_range(3)
        ((6, 10), (3, 3))
        """
        inner = int(np.prod(self.rest, dtype=np.int64))
        return min(k * self.per, self.rows) * inner, min((k + 1) * self.per, self.rows) * inner

    def _view(self, value):
        value = tf.convert_to_tensor(value)
        return value if self.by_rows else tf.reshape(value, [-1])

    def piece(self, value, k: int) -> tf.Tensor:
        """Slice ``k`` of a whole value (zero rows past the end)."""
        view = self._view(value)
        start, stop = min(k * self.per, self.rows), min((k + 1) * self.per, self.rows)
        part = view[start:stop]
        if stop - start < self.per:
            part = tf.pad(part, [[0, self.per - (stop - start)]] + [[0, 0]] * len(self.rest))
        return part

    def pieces(self, value) -> list[tf.Tensor]:
        return [self.piece(value, k) for k in range(self.n)]

    def join(self, pieces: Sequence) -> tf.Tensor:
        """The whole value from its ``n`` slices (the all-gather: a concat where it runs)."""
        return self.from_concat(tf.concat([tf.convert_to_tensor(p) for p in pieces], axis=0))

    def from_concat(self, joined) -> tf.Tensor:
        """The whole value from the concatenation of its ``n`` slices (or that, flattened)."""
        if joined.shape.rank != 1 + len(self.rest):
            joined = tf.reshape(joined, (self.per * self.n,) + self.rest)
        if self.per * self.n != self.rows:  # (no slice op otherwise: an embedding's gradient stays sparse)
            joined = joined[:self.rows]
        return joined if self.by_rows else tf.reshape(joined, self.shape)

    def grad_piece(self, grad, k: int):
        """Slice ``k`` of a gradient; an ``IndexedSlices`` of a variable cut by rows stays
        sparse (its rows of the slice, re-indexed), as a whole variable's optimizer sees it,
        and so does a :class:`~phalanx.parallel.gradients.SparseGradient` being joined (each
        of its lookups cut alike, so that joining the slices follows the same rule as joining
        the whole gradients)."""
        if isinstance(grad, SparseGradient):
            if not self.by_rows:
                return self.piece(densify(grad), k)
            shape = tf.constant(self.slice_shape, tf.int64)
            return SparseGradient(shape, {key: self.grad_piece(p, k) for key, p in grad.shared.items()},
                                  [self.grad_piece(r, k) for r in grad.rows])
        if isinstance(grad, tf.IndexedSlices) and self.by_rows:
            start = k * self.per
            keep = tf.logical_and(grad.indices >= start, grad.indices < start + self.per)
            return tf.IndexedSlices(tf.boolean_mask(grad.values, keep),
                                    tf.boolean_mask(grad.indices, keep) - tf.cast(start, grad.indices.dtype),
                                    tf.constant(self.slice_shape, grad.indices.dtype))
        return self.piece(grad, k)


def check_sliceable(optimizer, zero: int) -> None:
    """Refuse an optimizer whose update of a slice is not the slice of the whole update.

    Example:
        >>> check_sliceable(keras.optimizers.AdamW(global_clipnorm=1.0), 3)
        >>> try:
        ...     check_sliceable(keras.optimizers.Adam(clipnorm=1.0), 1)
        ... except ConfigError as err:
        ...     print(err.key)
        parallel.zero
    """
    if zero == 0 or optimizer is None:
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    name = type(inner).__name__
    if getattr(inner, "clipnorm", None):
        raise ConfigError("parallel.zero", f"{zero}: {name}(clipnorm={inner.clipnorm}) clips each weight by its own "
                                           f"norm, which a weight cut into slices over the data replicas does not "
                                           f"have; use global_clipnorm (the norm over all weights), or "
                                           f"parallel.zero=0")
    if name in MATRIX_WISE:
        raise ConfigError("parallel.zero", f"{zero}: {name} scales each update by statistics of the whole weight "
                                           f"matrix, which a slice of it does not see; use an element-wise optimizer "
                                           f"(SGD, Adam, AdamW, RMSprop, Adagrad, Lion, ...) or parallel.zero=0")


def _clone(optimizer, zero: int):
    if hasattr(optimizer, "zero_clone"):
        return optimizer.zero_clone()
    try:
        return type(optimizer).from_config(optimizer.get_config())
    except (TypeError, ValueError) as err:
        raise ConfigError("parallel.zero", f"{zero}: the sliced optimizer is a second {type(optimizer).__name__} "
                                           f"made from its get_config(), which failed ({err}); give the optimizer "
                                           f"a complete get_config/from_config, or use parallel.zero=0") from None


@contextlib.contextmanager
def _scope_of(path: str):
    """Keras name scopes that give a new variable the ``path`` of a model variable."""
    with contextlib.ExitStack() as stack:
        for part in path.split("/")[:-1]:
            stack.enter_context(keras.name_scope(part))
        yield


class ZeroSlices:
    """The slices of ``variables`` and the user's ``optimizer`` applied on them.

    ``devices[i]``: the device of each slice of ``variables[i]`` this process holds. In one
    process that is every slice. Across the ``W`` workers of a fit (``workers``, a
    :class:`~phalanx.engines.keras_cluster.WorkerGroup`) every worker lists its own ``L``
    devices, the variable is cut into ``W x L`` slices, and worker ``w`` holds slices
    ``w L .. w L + L - 1`` (see :meth:`gather_many`, :meth:`cut`). ``optimizer`` is the user's
    (built); its state is cut into the slices by :meth:`load`, which runs here once.
    """

    def __init__(self, variables: Sequence, devices: Sequence[Sequence[str]], optimizer, zero: int, workers=None):
        check_sliceable(optimizer, zero)
        self.zero = zero
        self.workers = workers
        self.world = 1 if workers is None else workers.size
        self.variables = list(variables)
        self.layouts = [SliceLayout(v.shape, len(d) * self.world) for v, d in zip(self.variables, devices)]
        # the index of this process's first slice of each variable
        self.first = [(0 if workers is None else workers.rank) * len(d) for d in devices]
        self.devices = [list(d) for d in devices]
        self.slices: list[list] = []
        for v, layout, where in zip(self.variables, self.layouts, self.devices):
            row = []
            with _scope_of(v.path):
                for device in where:
                    with tf.init_scope(), tf.device(device):
                        row.append(keras.Variable(tf.zeros(layout.slice_shape, v.dtype), trainable=True,
                                                  name=v.name))
            self.slices.append(row)
        self.flat = [s for row in self.slices for s in row]
        self.index = {id(v): i for i, v in enumerate(self.variables)}
        self.user = optimizer
        self.optimizer = _clone(optimizer, zero)
        if self.world > 1:
            self._agree_across_workers()
        self._map_state()
        self.load()

    def _agree_across_workers(self) -> None:
        """Across workers each worker's optimizer applies on its own slices only: what it
        decides from all gradients together is decided from every worker's. ``global_clipnorm``
        clips by the norm of every worker's slice gradients (Keras's formula, the squared norms
        summed across workers); a ``LossScaleOptimizer`` skips a step when any worker's slice
        gradients are not finite. An optimizer with its own apply (``zero_clone``) takes a
        ``sum_across_workers`` function for what it decides from all gradients, or is refused."""
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        workers = self.workers
        if hasattr(self.optimizer, "sum_across_workers"):
            self.optimizer.sum_across_workers = lambda t: workers.sum_all([t])[0]
            return
        if hasattr(self.user, "zero_clone"):
            raise ConfigError("parallel.zero", f"{self.zero} across {self.world} workers: {type(self.user).__name__} "
                                               f"applies on ZeRO slices with its own update (zero_clone), which sees "
                                               f"only this worker's slices; use parallel.zero=0 across workers")
        clipnorm = getattr(inner, "global_clipnorm", None)
        if clipnorm:
            def clip(grads):  # keras.src.optimizers.base_optimizer.clip_by_global_norm, over all workers
                local = global_norm(grads)
                use_norm = keras.ops.sqrt(workers.sum_all([keras.ops.square(local)])[0])
                scale = clipnorm * keras.ops.minimum(1.0 / use_norm, 1.0 / clipnorm) + (use_norm - use_norm)
                return [g * scale if g is not None else g for g in grads]

            inner._clip_gradients = clip
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            own = self.optimizer.check_finite

            def check_finite(grads):
                bad = tf.cast(tf.logical_not(tf.convert_to_tensor(own(grads))), tf.int32)
                return tf.equal(workers.sum_all([bad])[0], 0)

            self.optimizer.check_finite = check_finite

    # -- the optimizer's state, the user's and the slices' ------------------------------------

    def _map_state(self) -> None:
        """Build the sliced optimizer and pair its variables with the user's: each slot of a
        slice with the user's slot of the whole variable (Keras names a slot
        ``<variable path, / -> _>_<slot>``), the scalars (iterations, learning rate, loss scale)
        by position."""
        user_inner = getattr(self.user, "inner_optimizer", self.user)
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        by_slice = {id(s): (i, k) for i, row in enumerate(self.slices) for k, s in enumerate(row)}
        made: list[tuple[int, int, str, object]] = []
        original = inner.add_variable_from_reference

        def recording(reference_variable, name=None, initializer="zeros"):
            slot = original(reference_variable, name=name, initializer=initializer)
            where = by_slice.get(id(reference_variable))
            if where is not None:
                made.append((*where, name or "var", slot))
            return slot

        inner.add_variable_from_reference = recording
        excluded = getattr(user_inner, "_exclude_from_weight_decay", None)
        if excluded:  # exclude_from_weight_decay(var_list=...): by variable; the slices of those
            inner._exclude_from_weight_decay = {inner._var_key(s) for v, row in zip(self.variables, self.slices)
                                                if user_inner._var_key(v) in excluded for s in row}
        pattern = getattr(user_inner, "_exclude_from_weight_decay_pattern", None)
        if pattern is not None:
            inner._exclude_from_weight_decay_pattern = pattern
        try:
            self.optimizer.build(self.flat)
        finally:
            del inner.add_variable_from_reference
        pools: dict[str, list] = {}
        for slot in self.user.variables:
            pools.setdefault(slot.name, []).append(slot)
        # (user slot, layout, the slices' slots) per slot of every variable
        self.slots: list[tuple[object, SliceLayout, list]] = []
        grouped: dict[tuple[int, str], list] = {}
        for i, k, name, slot in made:
            grouped.setdefault((i, name), []).append(slot)
        taken = set()
        for (i, name), slots in grouped.items():
            v = self.variables[i]
            want = f"{v.path.replace('/', '_')}_{name}"
            match = next((u for u in pools.get(want, []) if id(u) not in taken and tuple(u.shape) == tuple(v.shape)),
                         None)
            if match is None or len(slots) != len(self.slices[i]):
                raise ValueError(f"parallel.zero: the optimizer's slot {want!r} of {v.path} has no whole-variable "
                                 f"counterpart in model.optimizer")
            taken.add(id(match))
            self.slots.append((match, self.layouts[i], slots))
        sliced_slots = {id(s) for _, _, row in self.slots for s in row}
        mine = [s for s in self.optimizer.variables if id(s) not in sliced_slots]
        theirs = [s for s in self.user.variables if id(s) not in taken]
        if [tuple(s.shape) for s in mine] != [tuple(s.shape) for s in theirs]:
            raise ValueError(f"parallel.zero: the sliced {type(self.optimizer).__name__} holds scalars "
                             f"{[s.path for s in mine]}, model.optimizer {[s.path for s in theirs]}")
        self.scalars = list(zip(theirs, mine))

    def load(self) -> None:
        """Cut the model's weights and ``model.optimizer``'s state into the slices (eagerly)."""
        firsts = dict(zip(map(id, self.layouts), self.first))
        for v, layout, row in zip(self.variables, self.layouts, self.slices):
            value = tf.convert_to_tensor(v.value)
            for k, s in enumerate(row):
                s.assign(layout.piece(value, firsts[id(layout)] + k))
        for user, layout, row in self.slots:
            value = tf.convert_to_tensor(user.value)
            for k, s in enumerate(row):
                s.assign(layout.piece(value, firsts[id(layout)] + k))
        for user, mine in self.scalars:
            mine.assign(user.value)

    def store(self, weights: bool = True, state: bool = True) -> None:
        """Join the slices into the model's weights (``weights``) and ``model.optimizer``'s state
        (``state``; across workers every worker must call it: the slices are all-gathered)."""
        pairs = ([(v.value, layout, row) for v, layout, row in zip(self.variables, self.layouts, self.slices)]
                 if weights else []) + ([(user.value, layout, row) for user, layout, row in self.slots]
                                        if state else [])
        for (target, _, _), whole in zip(pairs, self._whole([(layout, row) for _, layout, row in pairs],
                                                          [t.device for t, _, _ in pairs])):
            target.assign(whole)
        for user, mine in (self.scalars if state else []):
            user.assign(mine.value)

    def _whole(self, items: Sequence[tuple[SliceLayout, list]], devices: Sequence[str]) -> list[tf.Tensor]:
        """The whole value of each ``(layout, this process's slices)``, on its device in
        ``devices``: the concat of the slices (the all-gather of one process), or across workers
        this worker's slices concatenated and all-gathered in worker order (one collective per
        dtype for all of them), then cut to the variable's shape."""
        if self.world == 1:
            out = []
            for (layout, row), device in zip(items, devices):
                with tf.device(device):
                    out.append(layout.join(row))
            return out
        with tf.device(self.workers.device):
            local = [tf.concat([tf.reshape(tf.convert_to_tensor(s), [-1]) for s in row], 0) for _, row in items]
        gathered = self.workers.concat_all(local) if local else []
        out = []
        for (layout, _), flat, device in zip(items, gathered, devices):
            with tf.device(device):
                out.append(layout.from_concat(tf.identity(flat)))
        return out

    # -- a step --------------------------------------------------------------------------------

    def gather(self, variable, device: str) -> tf.Tensor:
        """``variable``'s whole value on ``device``: the concat of its slices there."""
        return self.gather_many([variable], [device])[0]

    def gather_many(self, variables: Sequence, devices: Sequence[str], cache: dict | None = None) -> list[tf.Tensor]:
        """Each of ``variables``' whole value on its device in ``devices``. Across workers the
        all-gather runs once for all of them, on this worker's collective device, and a ``cache``
        (a dict kept for one step) keeps its result for the worker's other replicas, which copy it
        to their device."""
        if self.world == 1:
            return self._whole([(self.layouts[self.index[id(v)]], self.slices_of(v)) for v in variables], devices)
        cache = {} if cache is None else cache
        need = [v for v in variables if ("workers", id(v)) not in cache]
        for v, whole in zip(need, self._whole([(self.layouts[self.index[id(v)]], self.slices_of(v)) for v in need],
                                              [self.workers.device] * len(need))):
            cache[("workers", id(v))] = whole
        out = []
        for v, device in zip(variables, devices):
            with tf.device(device):
                out.append(tf.identity(cache[("workers", id(v))]))
        return out

    def slices_of(self, variable) -> list:
        return self.slices[self.index[id(variable)]]

    def pieces_of(self, variable, value) -> list[tf.Tensor]:
        """This process's slices of a whole ``value`` shaped like ``variable`` (a mask of it), cut
        as ``variable`` is (zero padding included), each on its slice's device."""
        i = self.index[id(variable)]
        out = []
        for k, s in enumerate(self.slices[i]):
            with tf.device(s.value.device):
                out.append(self.layouts[i].piece(value, self.first[i] + k))
        return out

    def reduce(self, parts: dict[int, list[tuple[str, object]]]) -> list:
        """Slice gradients, aligned with :attr:`flat`, from each variable's whole-gradient
        ``parts`` (``id(variable) -> [(device where formed, gradient), ...]``).

        ``zero == 1``: the summed gradient is formed on every slice's device (an all-reduce)
        and that device keeps its slice. ``zero >= 2``: each part is cut where it was formed and
        slice ``k`` of every part is summed on slice ``k``'s device (a reduce-scatter): no
        device holds a whole summed gradient."""
        out = []
        for v, layout, where in zip(self.variables, self.layouts, self.devices):
            mine = parts.get(id(v), [])
            if not mine:
                out.extend([None] * len(where))
                continue
            if self.zero == 1:
                for k, device in enumerate(where):
                    with tf.device(device):
                        total = None
                        for _, g in mine:
                            total = join_gradients(total, g)
                        out.append(self.cast(finish(layout.grad_piece(total, k)), v.dtype))
                continue
            cut = []
            for device, g in mine:
                with tf.device(device):  # classified (parallel.gradients) before it is cut
                    g = join_gradients(None, g)
                    cut.append([layout.grad_piece(g, k) for k in range(len(where))])
            for k, device in enumerate(where):
                with tf.device(device):
                    total = None
                    for pieces in cut:
                        total = join_gradients(total, pieces[k])
                    out.append(self.cast(finish(total), v.dtype))
        return out

    def cut(self, grads: list) -> list:
        """Across workers: slice gradients, aligned with :attr:`flat`, from each variable's whole
        gradient summed over every worker (``grads``, aligned with :attr:`variables`): each
        device keeps its slice of the sum."""
        out = []
        for g, v, layout, where, first in zip(grads, self.variables, self.layouts, self.devices, self.first):
            for k, device in enumerate(where):
                if g is None:
                    out.append(None)
                    continue
                with tf.device(device):
                    out.append(self.cast(finish(layout.grad_piece(g, first + k)), v.dtype))
        return out

    @staticmethod
    def cast(g, dtype):
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(g.values, dtype), g.indices, g.dense_shape)
        return tf.cast(g, dtype)

    def apply(self, grads: list) -> None:
        """One optimizer step on the slices; the user's optimizer's learning rate (a callback
        may have set it) is read first and its ``iterations`` follows."""
        user_inner = getattr(self.user, "inner_optimizer", self.user)
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        lr = getattr(user_inner, "_learning_rate", None)
        deps = []
        if isinstance(lr, keras.Variable) and isinstance(inner._learning_rate, keras.Variable):
            deps.append(inner._learning_rate.assign(lr.value))
        with tf.control_dependencies(deps):
            self.optimizer.apply(grads, self.flat)
        self.user.iterations.assign(self.optimizer.iterations.value)

    def refresh(self, targets: Callable[[object], list]) -> None:
        """The all-gather: assign each variable's joined slices to every whole copy
        ``targets(variable)`` lists (gathered on the copy's device; across workers gathered once
        on this worker's collective device and copied)."""
        if self.world == 1:
            for v, layout, row in zip(self.variables, self.layouts, self.slices):
                for copy in targets(v):
                    with tf.device(copy.device):
                        copy.assign(layout.join(row))
            return
        wholes = self.gather_many(self.variables, [self.workers.device] * len(self.variables))
        for v, whole in zip(self.variables, wholes):
            for copy in targets(v):
                with tf.device(copy.device):
                    copy.assign(whole)
