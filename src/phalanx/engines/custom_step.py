"""A model's own ``train_step`` / ``test_step`` / ``predict_step``, on one device or over data replicas.

A Keras model that overrides one of these methods defines what a step is, and
:class:`~phalanx.engines.keras_model.KerasModelEngine` (which builds its own step from the
compiled loss and metrics) would silently replace it. :class:`CustomStepEngine` runs the
user's method instead, the way Keras's ``fit`` under ``MirroredStrategy`` does:

* **One device** (``parallel.dp=1``): the method itself, in one ``tf.function`` (eagerly when
  ``model.run_eagerly``): exactly Keras's own one-device step.
* **Data parallelism** (``parallel.dp=N``): every replica runs the user's method on its rows
  of the global batch, under its own device; rows that do not divide evenly go one more to
  the first replicas. While a replica's ``train_step`` runs, the optimizers it reaches through
  the model (``model.optimizer`` and any other Keras optimizer attribute) are stand-ins that
  record the ``(gradients, variables)`` it applies; after the last replica, the real
  optimizer applies, once, each variable's gradients combined over the replicas with weights
  ``rows of the replica / rows of the batch`` (an embedding's ``IndexedSlices`` rows are kept,
  concatenated, as :func:`~phalanx.parallel.pipeline.accumulate_gradient` joins them). For a loss that is a mean over the replica's rows
  (any Keras loss, ``compute_loss``) that is the gradient of the mean over the batch: Keras's
  one-device step, and MirroredStrategy's numbers (its Keras losses scale by ``1/replicas``
  in a replica context and its optimizer sums the replicas' gradients). Clipping
  (``clipnorm``, ``global_clipnorm``) then applies to the combined gradient, as on one device.
  Metrics are shared objects updated by every replica in turn, which is what
  MirroredStrategy's sync-on-read metric variables (summed on read) give; the logs are
  Keras's ``_get_metrics_result_or_logs`` of the step's returned dict: the model's metric
  results when the keys are theirs; otherwise a value named after one of the model's metrics
  is that metric's result after every replica, and any other value its mean over the replicas
  (Keras's ``reduce_per_replica(..., "auto")``): one device's value for a mean over rows
  split evenly, not for a sum (a per-replica sum reads 1/dp of the batch's, as under
  MirroredStrategy). Float state that is not trained (BatchNormalization
  statistics) starts every replica from the step's starting values and ends as the mean of
  the replicas' results (a MEAN-aggregated mirrored variable); integer state (Dropout's seed)
  runs through the replicas in order, so each replica draws its own mask.
  ``predict_step`` outputs are joined along the batch axis.

A step that applies gradients more than once (once per optimizer of two, as a GAN's) needs
every replica's first update before any replica's second: under ``parallel.dp > 1`` it is
refused when the step is traced, before it runs. Other layouts (pipeline, tensor or expert
parallelism, ZeRO, gradient accumulation, micro-batches, several workers) cut the model or
the step where the user's code cannot be: :func:`check_layout` refuses them before any step,
naming the method, the key and what to do instead.

Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from phalanx.config import Config
    >>> from phalanx.mesh import Mesh
    >>> class Halved(keras.Model):
    ...     def train_step(self, data):
    ...         x, y = data
    ...         with tf.GradientTape() as tape:
    ...             loss = 0.5 * self.compute_loss(y=y, y_pred=self(x, training=True))
    ...         self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
    ...         return {"loss": loss}
    >>> inputs = keras.Input((3,))
    >>> model = Halved(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> batch = (np.ones([4, 3], "float32"), np.zeros([4, 1], "float32"), None)
    >>> engine = CustomStepEngine(model, Config(), Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), batch)
    >>> sorted(engine.train_step(batch))
    ['loss']
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters.data_adapter_utils import pack_x_y_sample_weight  # what fit hands a step

from phalanx.config import Config, ConfigError
from phalanx.engines.keras_model import _as_tensors, _even, _rows, _slice, _to_tensor  # the engine's batch cuts
from phalanx.mesh import Mesh
from phalanx.parallel.pipeline import accumulate_gradient

METHODS = ("train_step", "test_step", "predict_step")


def overridden(model, method: str) -> bool:
    """Whether ``model``'s class defines its own ``method`` (one of :data:`METHODS`).

    Example:
        >>> import keras
        >>> overridden(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), "train_step")
        False
    """
    return getattr(type(model), method) is not getattr(keras.Model, method)


def check_layout(model, cfg: Config, mesh: Mesh, methods, workers: int = 1) -> None:
    """Refuse a layout that cannot run ``model``'s own ``methods`` (those it overrides).

    Example:
        >>> import keras, tensorflow as tf
        >>> from phalanx.config import load_config
        >>> class Mine(keras.Sequential):
        ...     def train_step(self, data):
        ...         return {}
        >>> model = Mine([keras.Input((2,)), keras.layers.Dense(1)])
        >>> cfg = load_config(None, ["train.grad_accum=2"])
        >>> try:
        ...     check_layout(model, cfg, Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), ["train_step"])
        ... except ConfigError as err:
        ...     print(err.key)
        train.grad_accum
    """
    p = cfg.parallel
    own = [method for method in methods if overridden(model, method)]
    for method in own:
        where = f"{type(model).__name__}.{method} is overridden"
        runs = f"phalanx runs a model's own {method} on one device or over data replicas (parallel.dp) only"
        training = method == "train_step"
        checks = [
            ("parallel.pp", mesh.pp, 1, "its pipeline cuts the model into stages the method cannot run"),
            ("parallel.tp", mesh.tp, 1, "tensor parallelism splits the step's layers across devices"),
            ("parallel.ep", p.ep, 1, "expert parallelism sends tokens between replicas inside the forward"),
            ("parallel.microbatches", p.microbatches, 1, "micro-batches cut the step's rows into parts"),
        ]
        if training:
            checks += [
                ("parallel.zero", p.zero, 0, "ZeRO applies each weight's update on its owner replica"),
                ("train.grad_accum", cfg.train.grad_accum, 1,
                 "accumulation sums several steps' gradients before one update; set "
                 "gradient_accumulation_steps= on your Keras optimizer instead, which your step's "
                 "optimizer.apply honours"),
                ("parallel.strategy", f"multi_worker over {workers} workers" if workers > 1 else "one process",
                 "one process", "across workers the gradients are exchanged inside phalanx's own step"),
            ]
        for key, value, plain, why in checks:
            if value != plain:
                raise ConfigError(key, f"{value}: {where}; {runs}, and {why}. Remove {key} (use "
                                       f"parallel.dp for more devices), or drop the override to let phalanx "
                                       f"build the step from the compiled loss and metrics")
    if own and p.recompute != "none":
        raise ConfigError("parallel.recompute", f"{p.recompute!r}: recomputation is built for the GPT's blocks "
                                                f"only; use parallel.recompute=none for a Keras model")


class _Recorder:
    """Stands in for a Keras optimizer while one replica's ``train_step`` runs: records what
    the step applies instead of applying it; everything else is the real optimizer's."""

    def __init__(self, real, name: str, method: str, calls: list):
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_method", method)
        object.__setattr__(self, "_calls", calls)  # the applies of this replica's step, every optimizer's
        object.__setattr__(self, "applied", [])

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self._real._trainable_variables
        if self._calls:
            # A second update would read weights the first changed, which are only changed at the end.
            raise ValueError(f"{self._method} applies gradients again ({self._name} after {self._calls[0]}) in one "
                             f"step; over data replicas (parallel.dp > 1) phalanx combines the replicas' gradients "
                             f"and applies them once at the end of the step, so a step may apply once: use "
                             f"parallel.dp=1, or apply once per step")
        self._calls.append(self._name)
        self.applied.append((list(grads), list(trainable_variables)))

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars) if grads_and_vars else ((), ())
        self.apply(list(grads), list(variables))

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __setattr__(self, name, value):
        setattr(self._real, name, value)


def _optimizer_attributes(model) -> dict[str, object]:
    """The model's attributes that hold a Keras optimizer (``optimizer``, a GAN's two ...)."""
    return {name: value for name, value in vars(model).items()
            if isinstance(value, keras.optimizers.Optimizer)}


@contextlib.contextmanager
def _recording(model, method: str, recorders: dict):
    """Swap the model's optimizers for :class:`_Recorder` stand-ins (``recorders``: filled
    with name -> recorder), and back."""
    originals = _optimizer_attributes(model)
    calls: list = []
    for name, real in originals.items():
        recorders[name] = _Recorder(real, f"self.{name}", method, calls)
        object.__setattr__(model, name, recorders[name])  # no tracking: the swap is undone below
    try:
        yield recorders
    finally:
        for name, real in originals.items():
            object.__setattr__(model, name, real)


class CustomStepEngine:
    """The user's own step methods of ``model`` on ``mesh`` (see the module docstring).

    The same interface as :class:`~phalanx.engines.keras_model.KerasModelEngine` for
    :mod:`phalanx.train.keras_api`; ``train_step`` and ``test_step`` return the step's logs
    (:attr:`returns_logs`)."""

    returns_logs = True
    loss_note = None
    pp = accum = microbatches = 1

    def __init__(self, model, cfg: Config, mesh: Mesh, sample_batch, inference_only: bool = False, workers=None,
                 methods=None):
        if methods is None:  # the methods this engine will run
            methods = ["predict_step"] if inference_only else ["train_step", "test_step"]
        check_layout(model, cfg, mesh, methods, 1 if workers is None else workers.size)
        if workers is not None:
            raise ConfigError("parallel.strategy", "multi_worker: phalanx runs a model's own step methods in one "
                                                   "process only; run the fit in one process")
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self.dp = mesh.dp
        self.devices = [mesh.device(d, 0, 0) for d in range(mesh.dp)]
        self.float_state = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        if not model.built:
            model(sample_batch[0])  # a model without an Input builds on its first batch, as in Keras
        if not inference_only:
            x, y, sw = sample_batch
            model._symbolic_build(data_batch=pack_x_y_sample_weight(x, y, sw))
            for optimizer in _optimizer_attributes(model).values():
                if not optimizer.built:
                    optimizer.build(model.trainable_variables)
            self.float_state = [v for v in model.non_trainable_variables if tf.as_dtype(v.dtype).is_floating]
        # Static shapes, one trace per batch shape: the replicas' row counts are cut from them
        # (reduce_retracing would trace a second shape with an unknown batch size).
        wrap = (lambda f: f) if model.run_eagerly else tf.function
        self._train_fn = wrap(self._train)
        self._test_fn = wrap(self._test)
        self._predict_fn = wrap(self._predict)

    # -- traced ------------------------------------------------------------------------------

    def _run_replicas(self, method: str, batch, record: bool):
        """``(per-replica returned values, per-replica row fractions, per-replica recorders)``."""
        x, y, sw = batch
        rows = _rows(x)
        sizes = [n for n in _even(rows, self.dp) if n]  # the larger parts first; an empty replica is left out
        pieces = [(sum(sizes[:d]), n) for d, n in enumerate(sizes)]
        returned, fractions, recorded = [], [], []
        start_state = [tf.convert_to_tensor(v.value) for v in self.float_state] if len(pieces) > 1 else []
        ends = []
        for d, (start, size) in enumerate(pieces):
            part = _slice(batch, start, size) if len(pieces) > 1 else batch
            data = pack_x_y_sample_weight(*part) if method != "predict_step" else pack_x_y_sample_weight(part[0])
            with tf.device(self.devices[d]):
                if d > 0:  # every replica starts from the step's float state
                    for v, value in zip(self.float_state, start_state):
                        v.assign(value)
                recorders: dict = {}
                with _recording(self.model, method, recorders) if record else contextlib.nullcontext():
                    returned.append(getattr(self.model, method)(data))
                recorded.append(recorders)
                if start_state:
                    ends.append([tf.convert_to_tensor(v.value) for v in self.float_state])
            fractions.append(size / rows)
        for k, v in enumerate(self.float_state):  # the replicas' mean, as a MEAN-aggregated mirrored variable
            if ends:
                v.assign(tf.add_n([e[k] for e in ends]) / float(len(ends)))
        return returned, fractions, recorded

    def _apply(self, fractions, recorded) -> None:
        """One apply per optimizer: each variable's gradients combined over the replicas."""
        for name, real in _optimizer_attributes(self.model).items():
            per_replica = [r[name].applied[0] for r in recorded if name in r and r[name].applied]
            if not per_replica:
                continue
            if len(per_replica) != len(recorded):
                raise ValueError(f"train_step applied self.{name} on {len(per_replica)} of {len(recorded)} data "
                                 f"replicas; every replica's step must apply the same way")
            sums: dict[int, object] = {}
            order = []
            for (grads, variables), fraction in zip(per_replica, fractions):
                for g, v in zip(grads, variables):
                    if id(v) not in sums:
                        order.append(v)
                        sums[id(v)] = None
                    if g is None:
                        continue
                    with tf.device(v.value.device if hasattr(v, "value") else None):
                        if isinstance(g, tf.IndexedSlices):  # an embedding's rows: kept, as the engine joins them
                            g = tf.IndexedSlices(g.values * tf.cast(fraction, g.values.dtype), g.indices,
                                                 g.dense_shape)
                        else:
                            g = tf.convert_to_tensor(g) * tf.cast(fraction, g.dtype)
                        sums[id(v)] = accumulate_gradient(sums[id(v)], g, keep_sparse=True)
            real.apply([None if sums[id(v)] is None else tf.cast(sums[id(v)], v.dtype) for v in order], order)

    def _logs(self, returned):
        """Keras's ``_get_metrics_result_or_logs`` of the step's logs over the replicas: a value
        named after one of the model's metrics is that metric's result after every replica's
        update (what sync-on-read metric variables read); any other value is the replicas' mean
        (``reduce_per_replica(..., "auto")``)."""
        if len(returned) == 1:
            logs = returned[0]
        else:
            logs = tf.nest.map_structure(lambda *values: tf.add_n([tf.cast(v, tf.float32) for v in values])
                                         / float(len(values)), *returned)
        if not isinstance(logs, dict):
            return logs
        metric_logs = self.model.get_metrics_result()
        if set(logs.keys()) == set(metric_logs.keys()):
            return metric_logs
        if len(returned) == 1:
            return logs
        return {k: metric_logs[k] if k in metric_logs else v for k, v in logs.items()}

    def _train(self, x, y, sw):
        returned, fractions, recorded = self._run_replicas("train_step", (x, y, sw), record=self.dp > 1)
        if self.dp > 1:
            self._apply(fractions, recorded)
        return self._logs(returned)

    def _test(self, x, y, sw):
        returned, fractions, _ = self._run_replicas("test_step", (x, y, sw), record=False)
        return self._logs(returned)

    def _predict(self, x):
        returned, _, _ = self._run_replicas("predict_step", (x, None, None), record=False)
        if len(returned) == 1:
            return returned[0]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *returned)

    # -- public --------------------------------------------------------------------------------

    def train_step(self, batch):
        """One step of the model's own ``train_step`` on a global batch ``(x, y, sample_weight)``;
        returns its logs (see the module docstring)."""
        return self._train_fn(*_as_tensors(batch))

    def test_step(self, batch):
        """The model's ``test_step`` on a batch; returns its logs."""
        return self._test_fn(*_as_tensors(batch))

    def predict_step(self, x):
        """The model's ``predict_step`` outputs for ``x``, flattened (:meth:`pack_outputs`)."""
        out = self._predict_fn(tf.nest.map_structure(_to_tensor, x))
        self._output_structure = out
        return tf.nest.flatten(out)

    def pack_outputs(self, flat: list):
        return tf.nest.pack_sequence_as(self._output_structure, list(flat))

    def sync_copies(self) -> None:
        """Nothing to refresh: every replica reads the model's own variables."""

    def gather_state(self) -> None:
        """Nothing to gather: the model's own variables are the state (no ZeRO slices here)."""


def logs_as_numbers(logs) -> dict:
    """A step's logs as Python floats (scalars) or NumPy arrays, as callbacks read them."""
    out = {}
    for name, value in dict(logs).items():
        value = np.asarray(value)
        out[name] = float(value) if value.size == 1 else value
    return out
