"""Global batches for ``phalanx.fit / evaluate / predict`` from what Keras's ``fit`` takes.

``x`` may be NumPy arrays (or a list, tuple or dict of them, with ``y`` and
``sample_weight`` alike), or a ``tf.data.Dataset`` whose elements are whole batches
``x``, ``(x, y)`` or ``(x, y, sample_weight)``. Epochs follow Keras's rules
(``keras.src.trainers.epoch_iterator``): without ``steps_per_epoch`` an epoch is one pass
over the data; with it, batches are drawn from one running iterator that is started
again only once the data is used up, and an iterator that runs dry inside an epoch ends
that epoch with a warning.

Arrays are cut into batches of ``batch_size`` (default 32) rows, shuffled every pass by
a permutation that depends on ``(seed, pass)`` only when ``shuffle`` is on, so that a
resumed fit (:meth:`Batches.seek`) reads the data in the order of an uninterrupted one. Any
batch size trains (the engine cuts a batch unevenly when it must, over replicas and over the
workers of a cluster). A batch with fewer samples than there are workers (``divisor``) would
leave a worker without a row: it is refused before the first step when the arrays show it
(``batch_size``, or the last batch of ``samples % batch_size``), and when a dataset yields it.

Data that would train wrong is refused with an error that names the argument, the index and
the sample or batch (:mod:`phalanx.data.checks`): NaN or inf in ``x``, ``y`` or
``sample_weight`` (arrays when they are given, a dataset's batches as they are read, before
the step that would train on them), complex or text arrays, and, once the model's sparse
losses are known (:meth:`Batches.check_labels`), labels that are no class id of theirs.

Example:
    >>> import numpy as np
    >>> batches = Batches(np.zeros([10, 3]), np.zeros([10]), batch_size=4)
    >>> [b[0].shape[0] for b in batches.epoch()]
    [4, 4, 2]
"""

from __future__ import annotations

import math
import warnings
from typing import Iterator

import numpy as np
import tensorflow as tf

from phalanx.data.checks import ClassLabels, check_class_ids, check_finite, named_leaves, resolve


def _unpack(element) -> tuple:
    """``(x, y, sample_weight)`` of a dataset element (Keras's rule)."""
    import keras
    return keras.utils.unpack_x_y_sample_weight(element)


def _leaves(structure) -> list:
    return [t for t in tf.nest.flatten(structure) if t is not None]


def _as_arrays(value, name: str):
    """Lists/tuples/dicts of array-likes -> the same structure of NumPy arrays, checked."""
    def convert(leaf):
        array = np.asarray(leaf)
        if array.dtype == object or array.dtype.kind in "USV":
            raise ValueError(f"{name}: arrays of dtype {array.dtype} cannot be fed to a model; convert them to "
                             f"numbers (e.g. float32 features, int32 class ids)")
        if array.dtype.kind == "c":
            raise ValueError(f"{name}: arrays of dtype {array.dtype} hold complex numbers, whose imaginary part a "
                             f"model's real inputs would drop; pass the real and imaginary parts as two real arrays")
        if array.ndim == 0:
            raise ValueError(f"{name}: got a scalar; pass one row per sample (an array with a leading sample axis)")
        return array
    if isinstance(value, dict):
        return {k: convert(v) for k, v in value.items()}
    # A list or tuple of arrays is several inputs (or outputs); a list of numbers is one array.
    if isinstance(value, (list, tuple)) and value and all(hasattr(v, "shape") for v in value):
        return type(value)(convert(v) for v in value)
    return convert(value)


class Batches:
    """Global batches ``(x, y, sample_weight)`` (see the module docstring)."""

    def __init__(self, x, y=None, sample_weight=None, *, batch_size=None, steps_per_epoch=None, shuffle=False,
                 seed: int = 0, divisor: int = 1, need_y: bool = True):
        if x is None:
            raise ValueError("x: no data given; pass NumPy arrays (with y) or a tf.data.Dataset of batches")
        self.steps_per_epoch = steps_per_epoch
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch: {steps_per_epoch!r} is not a positive integer")
        self.divisor, self.seed, self.shuffle = divisor, seed, shuffle
        self._iterator = None
        self._seen = 0
        self._pass = 0
        self._label_rules: list[ClassLabels] = []
        self._output_names: list[str] | None = None
        if isinstance(x, tf.data.Dataset):
            self._init_dataset(x, y, sample_weight, batch_size)
        elif hasattr(x, "__next__") or type(x).__name__ in ("PyDataset", "Sequence", "generator"):
            raise ValueError(f"x: a {type(x).__name__} is not supported; pass NumPy arrays or a tf.data.Dataset "
                             f"(tf.data.Dataset.from_generator wraps a generator)")
        else:
            self._init_arrays(x, y, sample_weight, batch_size, need_y)

    # -- sources ----------------------------------------------------------------------------

    def _init_dataset(self, dataset, y, sample_weight, batch_size) -> None:
        if y is not None:
            raise ValueError("y: must be None when x is a tf.data.Dataset; the dataset yields (x, y) batches")
        if sample_weight is not None:
            raise ValueError("sample_weight: must be None when x is a tf.data.Dataset; yield (x, y, sample_weight)")
        if batch_size is not None:
            raise ValueError(f"batch_size: {batch_size} cannot be used with a tf.data.Dataset, whose elements are "
                             f"already batches; batch the dataset instead")
        self.dataset, self.arrays = dataset, None
        x_spec, y_spec, sw_spec = _unpack(dataset.element_spec)
        for arg, spec in (("x", x_spec), ("y", y_spec), ("sample_weight", sw_spec)):
            for label, leaf in named_leaves(spec, arg):
                dtype = getattr(leaf, "dtype", None)
                if dtype is not None and (dtype.is_complex or (arg != "x" and dtype == tf.string)):
                    raise ValueError(f"{label}: the dataset yields {dtype.name} values, which cannot be fed to "
                                     f"a model's real inputs and losses; map them to real numbers first")
        cardinality = int(dataset.cardinality())
        self.infinite = cardinality == int(tf.data.INFINITE_CARDINALITY)
        self.num_batches = cardinality if cardinality >= 0 else None
        if self.infinite and self.steps_per_epoch is None:
            raise ValueError("steps_per_epoch: the dataset repeats forever, so say how many batches make an epoch "
                             "(steps_per_epoch=N), or remove .repeat()")

    def _init_arrays(self, x, y, sample_weight, batch_size, need_y) -> None:
        if batch_size is None:
            batch_size = 32  # Keras's default
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size: {batch_size!r} is not a positive integer")
        x = _as_arrays(x, "x")
        y = None if y is None else _as_arrays(y, "y")
        sample_weight = None if sample_weight is None else _as_arrays(sample_weight, "sample_weight")
        if need_y and y is None:
            raise ValueError("y: no targets given; pass y=... with the arrays (or a dataset of (x, y) batches)")
        counts = {}
        for name, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
            for leaf in _leaves(value):
                counts.setdefault(name, set()).add(int(leaf.shape[0]))
        for name, sizes in counts.items():
            if len(sizes) > 1:
                raise ValueError(f"{name}: its arrays have different numbers of samples {sorted(sizes)}")
        sizes = {name: next(iter(s)) for name, s in counts.items()}
        if len(set(sizes.values())) > 1:
            described = ", ".join(f"{name} has {n}" for name, n in sizes.items())
            raise ValueError(f"x and y must have the same number of samples: {described}")
        self.samples = sizes["x"]
        if self.samples == 0:
            raise ValueError("x: has no samples")
        self.arrays, self.dataset, self.infinite = (x, y, sample_weight), None, False
        self.batch_size = int(batch_size)
        self.num_batches = math.ceil(self.samples / self.batch_size)
        last = self.samples - (self.num_batches - 1) * self.batch_size
        for rows, what in ((min(self.batch_size, self.samples), "a batch"), (last, "the last batch")):
            if rows < self.divisor:
                raise ValueError(f"batch_size: {batch_size} over {self.samples} samples gives {what} of {rows} "
                                 f"samples, fewer than the {self.divisor} workers of the fit, so a worker would have "
                                 f"no row to train on; choose a batch_size of at least {self.divisor} whose last "
                                 f"batch (samples % batch_size, when not 0) has at least {self.divisor} samples")
        for arg, value in (("x", x), ("y", y), ("sample_weight", sample_weight)):
            for label, leaf in named_leaves(value, arg):
                check_finite(leaf, label, self._where)

    def _where(self, row: int) -> str:
        if self.arrays is None:
            return f"row {row} of the batch"
        return f"sample {row}, in batch {row // self.batch_size} of batch_size {self.batch_size} in the given order"

    def check_labels(self, rules: list[ClassLabels], output_names: list[str] | None = None) -> None:
        """Refuse targets that are no class ids of the sparse losses ``rules`` (``output_names``:
        the model's, which a rule's path may use on a list of targets): arrays at once, a
        dataset's batches as they are read."""
        self._label_rules, self._output_names = list(rules), output_names
        if self.arrays is not None:
            self._check_labels(self.arrays[1], self._where)

    def _check_labels(self, y, where) -> None:
        for rule in self._label_rules:
            labels = resolve(y, rule.path, self._output_names)
            if labels is not None:
                name = "y" + "".join(f"[{k!r}]" for k in rule.path)
                check_class_ids(np.asarray(labels), name, rule, where)

    def _check_batch(self, batch, index: int) -> None:
        """A dataset's batch ``index``: finite numbers, class ids (arrays are checked whole)."""
        where = lambda row: f"batch {index} of the dataset, row {row}"  # noqa: E731
        for arg, value in zip(("x", "y", "sample_weight"), batch):
            for label, leaf in named_leaves(value, arg):
                if isinstance(leaf, tf.Tensor) and leaf.dtype.is_floating:
                    check_finite(leaf.numpy(), label, where)
        if self._label_rules and batch[1] is not None:
            dense = tf.nest.map_structure(lambda t: t.numpy() if isinstance(t, tf.Tensor) else None, batch[1])
            self._check_labels(dense, where)

    # -- iteration ----------------------------------------------------------------------------

    def _one_pass(self, index: int, start: int = 0) -> Iterator:
        """Pass ``index`` over the data from its batch ``start``: its order depends on
        ``(seed, index)`` only, so that a resumed run sees the order of an uninterrupted one."""
        if self.arrays is not None:
            x, y, sw = self.arrays
            order = np.arange(self.samples)
            if self.shuffle:
                order = np.random.default_rng([self.seed, index]).permutation(self.samples)
            for begin in range(start * self.batch_size, self.samples, self.batch_size):
                rows = order[begin:begin + self.batch_size]
                yield tf.nest.map_structure(lambda a: None if a is None else a[rows], (x, y, sw))
        else:
            for index, element in enumerate(self.dataset.skip(start) if start else self.dataset, start):
                batch = _unpack(element)
                self._check_batch(batch, index)
                yield batch

    def _start_pass(self) -> None:
        self._iterator, self._seen = self._one_pass(self._pass), 0
        self._pass += 1

    def _usable(self, batch) -> bool:
        rows = int(_leaves(batch[0])[0].shape[0])
        if rows < self.divisor:  # arrays were checked up front: a dataset's batch
            raise ValueError(f"x: the dataset yielded a batch of {rows} samples, fewer than the {self.divisor} "
                             f"workers of the fit, so a worker would have no row to train on; batch it with at "
                             f"least {self.divisor} samples per batch (drop_remainder=True drops a short last one)")
        return True

    def epoch(self) -> Iterator:
        """The batches of the next epoch (Keras's rules, see the module docstring)."""
        if self.steps_per_epoch is None:
            self._start_pass()
            for batch in self._iterator:
                if self._usable(batch):
                    yield batch
            self._iterator = None
            return
        for _ in range(self.steps_per_epoch):
            if self._iterator is None:
                self._start_pass()
            if self.num_batches is not None and self._seen >= self.num_batches:
                self._warn_ran_out()
                self._iterator = None
                return
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._warn_ran_out()
                self._iterator = None
                return
            self._seen += 1
            if self._usable(batch):
                yield batch
        if self.num_batches is not None and self._seen >= self.num_batches:
            self._iterator = None

    def seek(self, epochs_done: int) -> None:
        """Stand where ``epochs_done`` whole epochs from the start leave the data: the next
        :meth:`epoch` yields the batches, in the order, that an uninterrupted run's epoch
        ``epochs_done`` sees (a resumed fit starts here).

        Without ``steps_per_epoch`` every epoch is one pass. With it, the running iterator's
        pass and position follow from the batch count; a dataset of unknown length is
        assumed not to have run dry before (the position is then ``epochs_done x
        steps_per_epoch`` batches into it). A dataset's own randomness (``.shuffle()``) is
        its own: only arrays are shuffled here.

        >>> import numpy as np
        >>> a = Batches(np.arange(6.0)[:, None], np.zeros(6), batch_size=2, shuffle=True, steps_per_epoch=2)
        >>> _ = [list(a.epoch()) for _ in range(3)]
        >>> b = Batches(np.arange(6.0)[:, None], np.zeros(6), batch_size=2, shuffle=True, steps_per_epoch=2)
        >>> b.seek(3)
        >>> [float(t[0][0, 0]) for t in a.epoch()] == [float(t[0][0, 0]) for t in b.epoch()]
        True
        """
        self._pass, self._seen, self._iterator = 0, 0, None
        if self.steps_per_epoch is None:
            self._pass = epochs_done
            return
        if self.num_batches is None:  # unknown length: one running iterator, never dry (see above)
            if epochs_done:
                self._seen, self._pass = epochs_done * self.steps_per_epoch, 1
                self._iterator = self._one_pass(0, self._seen)
            return
        running = False
        for _ in range(epochs_done):  # epoch()'s bookkeeping, without reading the data
            for _ in range(self.steps_per_epoch):
                if not running:
                    running, self._seen, self._pass = True, 0, self._pass + 1
                if self._seen >= self.num_batches:
                    running = False
                    break
                self._seen += 1
            if running and self._seen >= self.num_batches:
                running = False
        if running:
            self._iterator = self._one_pass(self._pass - 1, self._seen)

    def _warn_ran_out(self) -> None:
        warnings.warn("your input ran out of data inside an epoch; the epoch ends early. Make sure the data "
                      "holds at least steps_per_epoch x epochs batches (.repeat() a dataset)", stacklevel=3)

    def first(self):
        """One batch, to build the model's state before tracing (not consumed)."""
        for batch in self._one_pass(self._pass):
            return batch
        raise ValueError("x: the dataset yields no batch")

    @property
    def steps(self) -> int | None:
        """Batches per epoch, if known."""
        return self.steps_per_epoch or self.num_batches
