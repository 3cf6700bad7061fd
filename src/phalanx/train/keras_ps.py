"""``phalanx.fit`` of any Keras model on parameter servers (``parallel.strategy=parameter_server``).

Keras 3's own ``model.fit`` cannot train under ``ParameterServerStrategy`` (it wants a
``ClusterCoordinator`` per-worker dataset: keras-team/keras#18624). Here the chief runs
Keras's epoch loop and schedules the model's own ``train_step`` on the workers
(:class:`~phalanx.engines.ps.KerasParameterServerEngine`). Every process of
``phalanx launch --workers 2 --ps 1 -- python train.py`` runs the same script::

    cfg = phalanx.init("parallel.strategy=parameter_server")  # worker and ps tasks serve in here
    def build():                                               # called inside the strategy's scope
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        return model
    history = phalanx.fit(build, x, y, batch_size=64, epochs=3, config=cfg)   # the chief trains
    history.model.save("model.keras")                         # the trained model

What holds, and what does not (asynchronous training; docs/clusters.md):

* **The model** must be passed as a function that builds and compiles it: its variables
  have to be created inside the strategy's scope to live on the ps tasks. A model object
  built outside is refused. ``history.model`` is the trained model: its variables are the
  ps variables, so ``model.evaluate``, ``model.predict`` and ``model.save`` on the chief
  read the trained weights.
* **Epochs** are Keras's: one pass over the arrays (shuffled with ``train.seed``) or the
  dataset, or ``steps_per_epoch`` batches; every batch is one step, sent with the step to
  the worker that runs it (a step rescheduled after a worker died keeps its rows).
* **Logs**: the epoch's loss and metrics are the model's compiled metrics after every step
  of the epoch has run (the mean of the steps' losses, each computed on the weights its
  worker read); ``History`` holds them per epoch; validation runs at the epoch's end.
  Batch-level callbacks get the step's logs as values that wait for the step when read
  (``float(logs["loss"])``); ``verbose=1`` prints per epoch, like ``verbose=2``, since a
  per-batch bar would wait for every step.
* **Checkpoints**: at the end of every epoch the chief waits for the steps in flight and
  writes the weights, optimizer state and history into ``run.dir`` (the checkpoint of
  :mod:`phalanx.train.keras_api`: the same model fitted in one process resumes from it).
* **Not equal to one-device fit**: steps run concurrently on weights that others are
  updating (stale gradients), so losses and weights differ from Keras's one-device
  ``fit`` and from run to run. Refused: what cannot be honoured asynchronously or is not
  built here (tensor/pipeline/expert parallelism, ZeRO, recomputation, micro-batches,
  ``train.grad_accum``, pruning, sequence parallelism), each naming its key.
"""

from __future__ import annotations

import sys
from typing import Any

import keras
import yaml

from phalanx.cluster import strategies
from phalanx.cluster.tf_config import ClusterInfo, cluster_info_from_env
from phalanx.config import Config, ConfigError
from phalanx.data.keras_inputs import Batches
from phalanx.engines.custom_step import logs_as_numbers
from phalanx.engines.keras_model import apply_precision
from phalanx.engines.ps import KerasParameterServerEngine
from phalanx.fsutil import RunLock
from phalanx.train import keras_api


def ps_mode(cfg: Config, info: ClusterInfo | None = None) -> bool:
    """Whether a Keras fit with ``cfg`` trains on parameter servers: ``parameter_server``,
    or ``auto`` under a TF_CONFIG cluster with ps tasks. ``parameter_server`` without such a
    cluster is an error that says how to start one.

    >>> ps_mode(Config(), ClusterInfo.single_process())
    False
    """
    info = cluster_info_from_env() if info is None else info
    name = cfg.parallel.strategy
    if name == "auto":
        return bool(info.is_distributed and info.num_ps)
    if name != strategies.PARAMETER_SERVER:
        return False
    if not (info.is_distributed and info.num_ps and info.has_chief):
        raise ConfigError("parallel.strategy", "parameter_server needs a TF_CONFIG cluster with a chief, workers and "
                                               "ps tasks; run the script under e.g. phalanx launch --workers 2 --ps 1 "
                                               "-- python train.py")
    return True


def setup(cfg: Config, info: ClusterInfo | None = None) -> bool:
    """For :func:`phalanx.init`: under ``ps_mode``, a worker or ps task becomes a server here
    and never returns (it exits 0 once the chief has gone); the chief returns True. False
    when ``cfg`` does not train on parameter servers."""
    info = cluster_info_from_env() if info is None else info
    if not ps_mode(cfg, info):
        return False
    check_config(cfg, info)  # before any server starts
    strategies.serve_if_server_task(info)
    return True


def check_config(cfg: Config, info: ClusterInfo) -> None:
    """Refuse, naming the key, what a parameter-server fit would silently not honour."""
    strategies.resolve_strategy_name(cfg, info)  # tp/pp/ep, zero, recompute, micro-batches, devices
    p, t = cfg.parallel, cfg.train
    refusals = (
        ("parallel.dp", p.dp not in (1, -1), f"{p.dp}: under parameter_server every step is one worker's "
                                             f"(the cluster's workers run steps concurrently); leave parallel.dp=1"),
        ("parallel.sequence_parallel", p.sequence_parallel, "true needs tensor parallelism, which parameter_server "
                                                            "does not run; set it false"),
        ("train.grad_accum", t.grad_accum != 1, f"{t.grad_accum} is not honoured by parameter_server (each step "
                                                f"applies the gradient of its own batch); set train.grad_accum=1 "
                                                f"and choose the batch size"),
        ("train.prune.target", t.prune.target > 0, f"{t.prune.target}: pruning is not built for parameter_server "
                                                   f"(steps in flight would race the mask updates); use one process "
                                                   f"or multi_worker, or set train.prune.target=0"),
    )
    for key, bad, why in refusals:
        if bad:
            raise ConfigError(key, why)


def refuse(what: str) -> None:
    """:func:`phalanx.evaluate` / :func:`phalanx.predict` under parameter_server."""
    raise ConfigError("parallel.strategy", f"parameter_server: phalanx.{what} does not run on parameter servers. "
                                           f"After phalanx.fit the model (history.model) holds the trained weights: "
                                           f"call model.{what}(...) on the chief, or run phalanx.{what} in a process "
                                           f"without parameter_server")


def fit(model, cfg: Config, x=None, y=None, *, batch_size=None, epochs=1, steps_per_epoch=None,
        validation_data=None, validation_steps=None, validation_batch_size=None, validation_freq=1,
        initial_epoch=0, callbacks=None, shuffle=True, sample_weight=None, verbose="auto", validation_split=0.0,
        class_weight=None):
    """See :func:`phalanx.fit` and the module docstring; runs on the chief."""
    info = cluster_info_from_env()
    if isinstance(model, keras.layers.Layer) or not callable(model):
        raise TypeError(f"model: under parallel.strategy=parameter_server the model's variables must be created on "
                        f"the parameter servers, inside the strategy's scope, but a {type(model).__name__} object "
                        f"already holds its own; pass a function that builds and compiles it: "
                        f"phalanx.fit(build_model, ...), and use history.model afterwards")
    check_config(cfg, info)
    keras_api._check_positive("epochs", epochs)
    keras_api._check_positive("validation_freq", validation_freq)
    keras_api._check_positive("validation_steps", validation_steps, allow_none=True)
    if not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
        raise ValueError(f"initial_epoch: {initial_epoch!r} must be an integer in [0, epochs={epochs})")
    verbose = min(keras_api._verbose(verbose), 2) and 2  # per epoch: a per-batch bar would wait for every step
    (x, y, sample_weight), validation_data = keras_api.split_validation(x, y, sample_weight, validation_split,
                                                                         validation_data)
    x, sample_weight = keras_api.class_weights(x, y, sample_weight, class_weight)
    for c in callbacks or []:
        if isinstance(c, keras.callbacks.BackupAndRestore):
            raise ValueError("callbacks: BackupAndRestore is not supported under parameter_server; set run.dir "
                             "instead: phalanx.fit checkpoints every epoch there and resumes after the last one")
    train = Batches(x, y, sample_weight, batch_size=batch_size, steps_per_epoch=steps_per_epoch, shuffle=shuffle,
                    seed=cfg.train.seed, divisor=1)
    val = keras_api._validation_batches(validation_data, validation_batch_size or batch_size, cfg, None)
    first = train.first()

    strategy = strategies.parameter_server_strategy(info)
    coordinator = strategies.make_coordinator(strategy)

    def build():
        built = keras_api.resolve_model(model, cfg)  # under the precision policy; compiled, with a loss
        apply_precision(built, cfg)  # as phalanx.fit on one device (loss scaling under mixed_float16)
        if built.optimizer is None:
            built.optimizer = keras_api.default_optimizer(cfg, (train.steps or 1) * epochs)
        return built

    engine = KerasParameterServerEngine(build, strategy, coordinator, first, info.num_workers)
    model = engine.model
    keras_api.check_config_for_keras(cfg, model)
    keras_api._check_labels(model, first, train, val)
    run_dir = keras_api.run_directory(cfg)
    try:
        with RunLock(run_dir):
            history = _fit_loop(engine, model, cfg, run_dir, train, val, epochs=epochs, initial_epoch=initial_epoch,
                                callbacks=callbacks, verbose=verbose, validation_steps=validation_steps,
                                validation_freq=validation_freq, workers=info.num_workers)
    except BaseException:
        engine.release(join=False)  # the error as raised, not a step's error from waiting
        raise
    engine.release()
    return history


def _fit_loop(engine: KerasParameterServerEngine, model, cfg: Config, run_dir, train: Batches, val, *, epochs,
              initial_epoch, callbacks, verbose, validation_steps, validation_freq, workers):
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if verbose else (lambda text: None)
    run_dir.mkdir(parents=True, exist_ok=True)
    done, saved_history = keras_api._restore(run_dir, model, say)
    history = keras.callbacks.History()
    history.set_model(model)
    if done >= epochs:
        history.history = {k: list(v) for k, v in saved_history.items()}
        history.epoch = list(range(done))
        model.history = history
        say(f"nothing to do: {run_dir} already holds {done} of {epochs} epochs; raise epochs or use a new run.dir "
            f"to train more")
        return history
    start = max(initial_epoch, done)
    train.seek(start)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    step_count = int(model.optimizer.iterations.numpy())
    callback_list = keras_api._callbacks(callbacks, model, verbose, epochs, train.steps, history)
    model.stop_training = False
    with keras_api._metrics_output(run_dir, step_count) as output:
        callback_list.on_train_begin()
        history.history = {k: list(v)[:start] for k, v in saved_history.items()}
        history.epoch = list(range(start)) if saved_history else []
        say(f"phalanx.fit: {model.name!r} on parameter servers: {workers} workers, asynchronous steps "
            f"(up to {engine.max_in_flight} in flight); run dir {run_dir}")
        epoch_logs: dict = {}
        for epoch in range(start, epochs):
            model.reset_metrics()  # no step in flight: the previous epoch joined
            callback_list.on_epoch_begin(epoch)
            steps_run, last = 0, {}
            for step, batch in enumerate(train.epoch()):
                callback_list.on_train_batch_begin(step)
                last = engine.train_step(batch)
                steps_run += 1
                callback_list.on_train_batch_end(step, last)
                if model.stop_training:
                    break
            engine.join()
            step_count += steps_run
            if steps_run == 0:
                say(f"epoch {epoch + 1}: no batch to train on; stopping")
                break
            epoch_logs = logs_as_numbers(model._get_metrics_result_or_logs({k: v.numpy() for k, v in last.items()}))
            if val is not None and (epoch + 1) % validation_freq == 0:
                val_logs = _evaluate(engine, model, val, callback_list, validation_steps)
                epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
            callback_list.on_epoch_end(epoch, epoch_logs)
            keras_api._save(run_dir, cfg, model, epoch + 1, history.history, step_count)
            output.log(keras_api._jsonable({"epoch": epoch + 1, "step": step_count, **epoch_logs}))
            if model.stop_training:
                break
        callback_list.on_train_end(logs=epoch_logs)
    return model.history if getattr(model, "history", None) is history else history


def _evaluate(engine: KerasParameterServerEngine, model, batches: Batches, callbacks, steps=None) -> dict:
    model.reset_metrics()
    callbacks.on_test_begin()
    for step, batch in enumerate(batches.epoch()):
        if steps is not None and step >= steps:
            break
        callbacks.on_test_batch_begin(step)
        callbacks.on_test_batch_end(step, engine.test_step(batch))
    engine.join()
    logs = logs_as_numbers(model.get_metrics_result())
    callbacks.on_test_end(logs)
    return logs

