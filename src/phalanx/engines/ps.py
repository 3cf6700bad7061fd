"""Training under ``ParameterServerStrategy``: any Keras model's steps scheduled on the workers by the chief.

:class:`KerasParameterServerEngine` is the one parameter-server engine, for ``phalanx.fit``
(:mod:`phalanx.train.keras_ps`) and ``phalanx train``'s built-in GPT
(:class:`~phalanx.engines.ps_gpt.GPTParameterServerEngine`, the same Keras model every other
layout trains):

* a function builds and compiles the model inside the strategy's scope, so every variable
  (weights, optimizer slots and step, loss scale, metric totals) lives on a ps task (whole,
  round-robin over the ps tasks);
* the chief runs the training loop; a step is handed to the
  :class:`~tf.distribute.experimental.coordinator.ClusterCoordinator`, which runs it on
  whichever worker is free: the worker reads the weights from the ps tasks, computes the
  gradient of the whole batch and has the model's optimizer update the ps variables. It
  returns at once: up to ``max_in_flight`` steps run concurrently on different workers, each
  on the weights it read (asynchronous training, as parameter servers do it), so losses are
  not bit-identical from run to run;
* the data: the chief feeds each step its batch (``phalanx train``: batch ``k`` of the
  deterministic global stream to step ``k``, :mod:`phalanx.data.pipeline`), sent to the
  worker with the step, so a step that TensorFlow runs again after its worker died keeps its
  rows, every example is seen exactly once per epoch whichever worker runs the step, and the
  checkpointed position resumes exactly. (TensorFlow's per-worker datasets,
  ``coordinator.create_per_worker_dataset``, would save that transfer, but give the dataset
  function no worker index to shard by and no position to resume at.)
* a step's results stay on its worker until they are read (:class:`RemoteScalar`,
  ``float()``), so the chief does not wait for each step; a step whose worker died after
  running it is *lost*, not fatal (:class:`StepResult`): its update is in the ps variables;
* :meth:`KerasParameterServerEngine.join` waits for every scheduled step: checkpoints are
  taken after it, the chief's writer reading the ps variables one at a time.

Example (inside a ``phalanx launch --workers 2 --ps 1`` chief)::

    setup = setup_cluster(cfg)            # worker/ps tasks serve in here
    engine = KerasParameterServerEngine(build_model, setup.strategy, setup.coordinator, (x[:32], y[:32]), 2)
    logs = engine.train_step((x[:32], y[:32]))   # scheduled; float(logs["loss"]) waits for it
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import tensorflow as tf



#: tries of the copy of a step's results to the chief, and the pause between them (seconds)
FETCH_TRIES, FETCH_RETRY_S = 3, 0.5


class StepResult:
    """The results of one scheduled step, fetched once to the chief.

    A step's results stay on the worker that ran it until the chief copies them (TensorFlow's
    ``RemoteValue.fetch``, an eager Identity). When a worker dies, that copy can fail
    ("RecvFromRemoteAsync is cancelled ... [Op:Identity]") although the step ran and its
    update is in the ps variables: the copy was cancelled while TensorFlow handled the
    failure (then a second try succeeds), or the results were on the dead worker. The copy is
    tried :data:`FETCH_TRIES` times; a step whose copy still fails is *lost* (:attr:`lost`;
    :meth:`values` returns None) instead of failing the run: the chief goes on, and on a stop
    signal saves its checkpoint. Any other error (the step's own, or a step that never ran)
    is raised as it is. ``on_lost`` is called once, when a step is found lost.

    Example (a step that ran on a worker that has since died)::

        result = StepResult(coordinator.schedule(fn), on_lost=print)
        result.values()   # None; result.lost is True; on_lost(result) was called
    """

    def __init__(self, remote: Any, on_lost: Any = None):
        self._remote, self._on_lost = remote, on_lost
        self._values: Any = None
        self._fetched = False
        self.lost = False

    def done(self) -> bool:
        return self._fetched or _done(self._remote)

    def values(self) -> Any:
        """The step's results as NumPy values (waits for the step); None for a lost step."""
        if not self._fetched:
            for attempt in range(FETCH_TRIES):
                try:
                    self._values = self._remote.fetch()  # a failed copy is not cached: it can be tried again
                    break
                except tf.errors.OpError:
                    if not _ran(self._remote):
                        raise
                    if attempt + 1 < FETCH_TRIES:
                        time.sleep(FETCH_RETRY_S)
            else:
                self.lost = True
                if self._on_lost is not None:
                    self._on_lost(self)
            self._fetched = True
        return self._values


class RemoteScalar:
    """One float of a scheduled step's result; ``float()`` waits for the step. A lost step's
    value (:class:`StepResult`) is NaN, and :attr:`lost` says so."""

    def __init__(self, result: StepResult, key: str):
        self._result, self._key = result, key

    @property
    def lost(self) -> bool:
        return self._result.lost

    def numpy(self) -> np.ndarray:
        values = self._result.values()
        return np.asarray(np.nan, np.float32) if values is None else np.asarray(values[self._key])

    def __float__(self) -> float:
        return float(self.numpy())

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value.astype(dtype) if dtype is not None else value

    def __repr__(self) -> str:
        return f"RemoteScalar({self._key!r})"


class _LostSteps:
    """Counts the lost steps of an engine and says so on stderr the first time."""

    def __init__(self):
        self.count = 0

    def __call__(self, result: StepResult) -> None:
        self.count += 1
        if self.count == 1:
            print("[phalanx] a worker died holding the results of a step it had run: the step's update is in "
                  "the parameter servers, its logged values (loss, gradient norm) are lost and left out of the "
                  "logged means", file=sys.stderr, flush=True)


def replica_function(strategy: tf.distribute.Strategy, step) -> Any:
    """``tf.function`` of ``strategy.run(step, (data,))``: what the coordinator schedules on a
    worker (traced as written: ``step`` is a Keras step or a step written for one replica)."""

    @tf.autograph.experimental.do_not_convert
    def run(data):
        return strategy.run(step, args=(data,))

    return tf.function(run, reduce_retracing=True)


def _done(remote: Any) -> bool:
    status = getattr(remote, "_status", None)
    # RemoteValue has no public "is it ready" query; fall back to "not done" (kept until fetched).
    return status is not None and getattr(status, "name", "") in ("READY", "ABORTED")


def _ran(remote: Any) -> bool:
    """Whether the step of ``remote`` finished without an error (TensorFlow's RemoteValueImpl:
    READY and no error), so that a failing fetch can only be the copy of its results."""
    status = getattr(remote, "_status", None)
    return getattr(status, "name", "") == "READY" and getattr(remote, "_error", True) is None


class KerasParameterServerEngine:
    """Any compiled Keras model trained asynchronously by the workers of a parameter-server
    cluster: the model's own ``train_step`` (its optimizer, loss and compiled metrics, as
    Keras computes them), scheduled by the chief's ``ClusterCoordinator``.

    * ``build`` (a function returning the compiled model) runs inside ``strategy.scope()``,
      so every variable -- weights, optimizer slots and iterations, metric totals -- is
      created on a ps task; the model's compiled state (metrics, optimizer) is then built
      there from ``sample_batch`` (Keras's own ``_maybe_symbolic_build``).
    * :meth:`train_step` schedules ``strategy.run(model.train_step, (batch,))`` on whichever
      worker is free and returns at once: the worker reads the weights from the ps tasks,
      computes the gradient of the batch and has the model's optimizer update the ps
      variables. Up to ``max_in_flight`` steps run concurrently, each on the weights it read
      (stale by the updates of the steps in flight beside it).
    * the batch travels with its step, so a step that TensorFlow reschedules after a worker
      died runs on the same rows.
    * :meth:`join` waits for every scheduled step; the metric variables then hold the
      totals of every step since the last ``model.reset_metrics()``.

    Example (the chief of ``phalanx launch --workers 2 --ps 1``; see
    :mod:`phalanx.train.keras_ps`, which runs the epochs)::

        engine = KerasParameterServerEngine(build_model, strategy, coordinator, (x[:32], y[:32]), 2)
        logs = engine.train_step((x[:32], y[:32]))   # scheduled; float(logs["loss"]) waits for it
        engine.join()
        engine.model.get_metrics_result()
    """

    def __init__(self, build, strategy: tf.distribute.Strategy, coordinator: Any, sample_batch,
                 num_workers: int = 1, max_in_flight: int | None = None):
        if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            raise TypeError(f"KerasParameterServerEngine needs a ParameterServerStrategy, got "
                            f"{type(strategy).__name__}")
        self.strategy, self.coordinator = strategy, coordinator
        self.num_workers = max(1, num_workers)
        # Two steps per worker in flight keep every worker busy while the chief feeds the next.
        self.max_in_flight = max_in_flight or 2 * self.num_workers
        self._pending: list[StepResult] = []
        self.lost_steps = _LostSteps()
        with strategy.scope():
            self.model = build()
            # Metrics, loss and optimizer variables now, on the ps tasks (not in the first step,
            # which runs on a worker).
            self.model._maybe_symbolic_build(data_batch=keras_data(sample_batch))
            if self.model.optimizer is not None and not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)
        self._train_fn = replica_function(strategy, self.model.train_step)
        self._test_fn = replica_function(strategy, self.model.test_step)
        self._keys: dict[str, list[str]] = {}

    def variable_devices(self) -> list[str]:
        """Where the model's variables live (ps tasks)."""
        return [v.value.device for v in self.model.variables]

    def schedule(self, fn, data, kind: str) -> dict[str, RemoteScalar]:
        """Schedule ``fn(data)`` (a ``tf.function`` returning a dict of scalars; ``kind`` names
        its family of results) on a free worker, bounding the steps in flight; its results are
        fetched when read (``float()``), and a step whose worker died after running it is lost,
        not fatal (:class:`StepResult`)."""
        self._pending = [r for r in self._pending if not r.done()]
        while len(self._pending) >= self.max_in_flight:
            self._pending.pop(0).values()
        remote = self.coordinator.schedule(fn, args=(data,))
        result = StepResult(remote, self.lost_steps)
        self._pending.append(result)
        if kind not in self._keys:  # the first step's logs name the keys (a model's own step may add some)
            self._keys[kind] = list(remote.fetch())
        return {k: RemoteScalar(result, k) for k in self._keys[kind]}

    def train_step(self, batch) -> dict[str, RemoteScalar]:
        """Schedule one step on a free worker; the logs are fetched when read (``float()``)."""
        return self.schedule(self._train_fn, keras_data(batch), "train")

    def test_step(self, batch) -> dict[str, RemoteScalar]:
        """Schedule the model's ``test_step`` (its metrics accumulate on the ps tasks)."""
        return self.schedule(self._test_fn, keras_data(batch), "test")

    def join(self) -> None:
        """Wait until every scheduled step has run (a step's error is raised here)."""
        self.coordinator.join()
        self._pending = []

    def release(self, join: bool = True) -> None:
        """Wait for the steps in flight, then hand the model back to Keras: its own
        ``evaluate``/``predict``/``fit`` would distribute their data with the
        ParameterServerStrategy it was built under, which Keras cannot do
        (keras-team/keras#18624), so the model forgets that strategy and its traced
        functions. Its variables stay where they are (on the ps tasks): this process reads
        them as long as the cluster runs. ``join=False``: without waiting (after an error)."""
        if join:
            self.join()
        model = self.model
        model._distribute_strategy = None
        model.train_function = model.test_function = model.predict_function = None


def keras_data(batch) -> tuple:
    """``(x, y, sample_weight)`` without its trailing Nones: the data tuple Keras's steps unpack.

    >>> keras_data((1, 2, None))
    (1, 2)
    """
    batch = tuple(batch)
    while len(batch) > 1 and batch[-1] is None:
        batch = batch[:-1]
    return batch
