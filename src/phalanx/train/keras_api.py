"""The Keras workflow on any phalanx layout: fit / evaluate / predict of a compiled model.

The loop is Keras's own (``keras.src.backend.tensorflow.trainer``): epochs and steps
follow Keras's rules, Keras callbacks get the same hooks and logs (``History``,
``EarlyStopping``, ``ModelCheckpoint``, ``CSVLogger``, ``LearningRateScheduler``,
``ReduceLROnPlateau``, ``model.stop_training``...), and the logs are the model's compiled
metrics. What phalanx adds is *where* each step runs
(:class:`~phalanx.engines.keras_model.KerasModelEngine`) and a run directory: one
checkpoint at the end of every epoch (weights, optimizer state, history), resumed when
the same model is fitted into the same ``run.dir`` again, and one row per epoch in
``metrics.jsonl`` and as TensorBoard scalars under ``tb/`` (the epoch's logs; for a model
with :class:`phalanx.layers.MoE` layers also ``moe_aux_loss``, ``moe_balance``,
``moe_dropped``, ``moe_load_min``, ``moe_load_max``: :mod:`phalanx.train.moe_stats`).

Under a TF_CONFIG cluster (``parallel.strategy=multi_worker``, every worker runs the same
script) each worker trains on its rows of every global batch and the workers all-reduce
gradients and metrics (:mod:`phalanx.engines.keras_cluster`); only the chief writes the
run directory and prints. Under ``parameter_server`` the chief trains a model built by a
function, asynchronously, on the workers (:mod:`phalanx.train.keras_ps`).

Use it through :func:`phalanx.fit`, :func:`phalanx.evaluate` and :func:`phalanx.predict`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import keyword
import sys
import time
from pathlib import Path

import keras
import numpy as np
import yaml

from phalanx import checkpoint
from phalanx.config import Config, ConfigError, describe_layout, given
from phalanx.data.keras_inputs import Batches
from phalanx.engines import custom_step, keras_cluster, keras_slots, keras_state
from phalanx.engines.keras_model import KerasModelEngine, apply_precision, precision_of
from phalanx.fsutil import RunLock
from phalanx.layers import TransformerBlock
from phalanx.mesh import Mesh
from phalanx.models import parallelize
from phalanx.prune.keras import KerasPruning
from phalanx.train import keras_targets
from phalanx.train.moe_stats import MoEStats
from phalanx.train.progress import RunOutput

DEFAULT_RUN_DIR = "runs/default"
METRICS_FILE = "metrics.jsonl"

# Keys that configure the built-in GPT's trainer, and what a Keras model uses instead.
_GPT_ONLY = {
    "train.global_batch": "fit's batch_size= (arrays) or the batches of your dataset",
    "train.steps": "fit's epochs= and steps_per_epoch=",
    "train.eval_every": "fit's validation_freq=",
    "train.eval_batches": "fit's validation_steps=",
    "train.log_every": "fit's verbose= and Keras callbacks",
    "train.peak_flops": "nothing (fit reports no MFU)",
    "checkpoint.every": "nothing: fit checkpoints at the end of every epoch",
    "checkpoint.async": "nothing: fit writes its end-of-epoch checkpoints synchronously",
}
_OPTIMIZER_KEYS = ("lr", "min_lr_ratio", "warmup", "clip_norm", "weight_decay", "beta1", "beta2", "eps")


# -- arguments -------------------------------------------------------------------------------


def resolve_model(model, cfg: Config):
    """The user's compiled ``keras.Model`` (calling a zero-argument builder under the
    precision policy first), checked before any work starts."""
    if not isinstance(model, keras.Model) and callable(model) and not isinstance(model, keras.layers.Layer):
        previous = keras.config.dtype_policy()
        if cfg.precision.policy != "float32":
            keras.config.set_dtype_policy(cfg.precision.policy)
        try:
            model = model()
        finally:
            keras.config.set_dtype_policy(previous)
    if not isinstance(model, keras.Model):
        raise TypeError(f"model: expected a compiled keras.Model or a function returning one, got "
                        f"{type(model).__name__}")
    if not getattr(model, "compiled", False):
        raise ValueError(f"model: {model.name!r} is not compiled; call model.compile(optimizer=..., loss=..., "
                         f"metrics=[...]) first")
    custom_loss = type(model).compute_loss is not keras.Model.compute_loss
    if model._compile_loss is None and not custom_loss and not custom_step.overridden(model, "train_step"):
        raise ValueError(f"model: {model.name!r} was compiled without a loss; call model.compile(loss=...)")
    return model


def check_config_for_keras(cfg: Config, model) -> None:
    """Refuse config keys that a Keras model's fit would silently ignore."""
    defaults = Config()
    for section in ("model", "data"):
        if getattr(cfg, section) != getattr(defaults, section):
            changed = [f.name for f in dataclasses.fields(getattr(cfg, section))
                       if getattr(getattr(cfg, section), f.name) != getattr(getattr(defaults, section), f.name)]
            raise ConfigError(f"{section}.{changed[0]}", "configures the built-in GPT (phalanx train); your Keras "
                                                         "model and the data you pass to fit define their own")
    for key, instead in _GPT_ONLY.items():
        section, name = key.split(".")
        name = name + "_" if keyword.iskeyword(name) else name  # checkpoint.async is the field async_
        value = getattr(getattr(cfg, section), name)
        if value != getattr(getattr(defaults, section), name):
            raise ConfigError(key, f"{value!r} is for the built-in GPT's trainer; a Keras model uses {instead}")
    if model.optimizer is not None:
        for name in _OPTIMIZER_KEYS:
            value = getattr(cfg.train, name)
            if value != getattr(defaults.train, name):
                raise ConfigError(f"train.{name}", f"{value!r} configures phalanx's AdamW, but model "
                                                   f"{model.name!r} is compiled with "
                                                   f"{type(model.optimizer).__name__}, whose settings rule; set it "
                                                   f"on that optimizer")
    policy, _ = precision_of(model, cfg)  # the model's own mixed policy may rule under auto
    for key in ("precision.loss_scale_init", "precision.loss_scale_growth_interval"):
        if given(cfg, key) and policy != "mixed_float16":
            raise ConfigError(key, f"is ignored: model {model.name!r} trains under {policy}, and loss scaling "
                                   f"applies to precision.policy=mixed_float16 only; set that, or remove {key}")
    # Refuses a strategy that cannot span a cluster's workers; multi_worker runs on every worker
    # of a TF_CONFIG cluster (phalanx.engines.keras_cluster), parameter_server on the chief
    # (phalanx.train.keras_ps).
    from phalanx.train import keras_ps
    if not keras_ps.ps_mode(cfg):
        keras_cluster.cluster_mode(cfg)


def split_for_tensor_parallel(model, cfg: Config, mesh: Mesh, verbose) -> None:
    """With ``parallel.tp > 1``, give a model that has no tensor-parallel layers yet those of
    its keras-hub family's preset (:func:`phalanx.parallelize`, in place: the same object,
    the same weights). Any other model is left as it is: the engine then refuses the
    layout, saying how to build the model for it. ``parallel.sequence_parallel=true`` turns
    on sequence parallelism in every :class:`phalanx.layers.TransformerBlock`."""
    if mesh.tp > 1 and not parallelize.is_parallelized(model):
        rules = parallelize.preset_for(model, mesh.tp)
        if rules is not None:
            parallelize.parallelize(model, mesh.tp, rules)
            if verbose:
                print(f"parallel.tp={mesh.tp}: {model.name!r} ({type(model).__name__}) split by its keras-hub "
                      f"preset (phalanx.unparallelize(model) puts plain keras-hub layers back)", file=sys.stderr,
                      flush=True)
    if cfg.parallel.sequence_parallel:
        blocks = [layer for layer in model._flatten_layers() if isinstance(layer, TransformerBlock)]
        if not blocks:
            raise ConfigError("parallel.sequence_parallel", f"true: model {model.name!r} has no layer that runs "
                                                            f"sequence parallel; build its blocks from "
                                                            f"phalanx.layers.TransformerBlock")
        if mesh.tp == 1:
            raise ConfigError("parallel.sequence_parallel", "true cuts the sequence over the tensor devices; it "
                                                            "needs parallel.tp > 1")
        for block in blocks:
            block.sequence_parallel = True


def default_optimizer(cfg: Config, total_steps: int):
    """The optimizer for a model compiled with ``optimizer=None``: Keras's AdamW set from
    ``train.*`` (linear warm-up, cosine decay to ``lr x min_lr_ratio``, global-norm clip)."""
    t = cfg.train
    decay_steps = max(total_steps - t.warmup, 1)
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if t.warmup else t.lr, decay_steps=decay_steps, alpha=t.min_lr_ratio,
        warmup_target=t.lr if t.warmup else None, warmup_steps=t.warmup)
    return keras.optimizers.AdamW(learning_rate=schedule, weight_decay=t.weight_decay, beta_1=t.beta1,
                                  beta_2=t.beta2, epsilon=t.eps, global_clipnorm=t.clip_norm or None)


def _check_positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: {value!r} is not a positive integer")


def _verbose(verbose) -> int:
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    if verbose not in (0, 1, 2):
        raise ValueError(f"verbose: {verbose!r} is not one of 'auto', 0, 1, 2")
    return int(verbose)


def _logs(model) -> dict:
    return custom_step.logs_as_numbers(model.get_metrics_result())


# -- run directory ---------------------------------------------------------------------------


def run_directory(cfg: Config) -> Path:
    """``run.dir``, or a new time-named directory under ``runs/`` when it is the default."""
    if cfg.run.dir != DEFAULT_RUN_DIR:
        return Path(cfg.run.dir).expanduser()
    base = Path("runs") / time.strftime("fit-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = Path(f"{base}-{n}")
    return path


def _variables_signature(model) -> list[list]:
    """What makes a checkpoint "of the same model": its logical weights' names and shapes,
    in order — without the counters Keras appends to layer names (``dense_3`` -> ``dense``),
    which depend on how many layers the process made before, and with a weight cut into
    tensor or expert shards counted once, whole (:mod:`phalanx.train.keras_state`), so that
    a checkpoint does not depend on the layout."""
    return [[e.name, list(e.shape)] for e in keras_state.model_entries(model)]


#: ``meta.json``'s ``keras_state`` of a checkpoint written per device by logical name
#: (:meth:`KerasModelEngine.checkpoint_slots`); one without it holds whole tensors numbered
#: ``model/00000``, ``optimizer/00000`` (phalanx.fit's checkpoints before), loaded by
#: :func:`_load_numbered`
PER_DEVICE = "per-device"


def _restore(run_dir: Path, model, say, pruning=None, engine=None) -> tuple[int, dict]:
    """Load the newest valid checkpoint of ``run_dir`` into ``model``; (epochs done, history).
    With a placing ``engine`` (:meth:`KerasModelEngine.checkpoint_slots`) each device's slots
    read only the boxes they hold, whatever layout wrote them; otherwise (a model's own
    train_step, the parameter-server fit) each whole variable reads its tensor.

    As ``phalanx train`` resumes (:func:`phalanx.checkpoint.resume_latest`): a damaged newer
    checkpoint, or one that fails while loaded (NaN pieces, a dtype of another family), is
    skipped with a ``warning:`` line on stderr whatever ``verbose`` is, and moved to
    ``checkpoints/damaged/``."""

    def accept(restored) -> None:
        meta = restored.meta
        saved = meta.get("keras_variables")
        if saved is None:
            raise ConfigError("run.dir", f"{str(run_dir)!r} holds checkpoints of phalanx's built-in GPT, not of a "
                                         f"Keras model; pass another run.dir")
        mine = _variables_signature(model)
        if saved != mine:
            first = next((f"{a} vs {b}" for a, b in zip(saved, mine) if a != b),
                         f"{len(saved)} variables saved vs {len(mine)} in the model")
            raise ConfigError("run.dir", f"{str(run_dir)!r} holds checkpoints of a different model (first "
                                         f"difference: checkpoint {first}); pass a new run.dir, or fit the same "
                                         f"model to resume")
        if meta.get("keras_state") != PER_DEVICE:
            _load_numbered(run_dir, restored, model, pruning)
            return
        parts = keras_slots.logical_parts(model)
        sets = _state_sets(engine, model, parts, pruning.mask_slots(parts) if pruning is not None else [])
        wanted = {s.name for each in sets for s in each.slots if s.name.startswith(keras_slots.OPTIMIZER_PREFIX)}
        have = {n for n in restored.reader.names() if n.startswith(keras_slots.OPTIMIZER_PREFIX)}
        if wanted != have:
            odd = sorted(wanted ^ have)
            raise ConfigError("run.dir", f"{str(run_dir)!r}: the checkpoint's optimizer state has {len(have)} tensors "
                                         f"but {type(model.optimizer).__name__} has {len(wanted)} (e.g. {odd[:2]} "
                                         f"in one only); compile with the optimizer (and precision policy) of the "
                                         f"saved run, or pass a new run.dir")
        try:
            checkpoint.load_shard_sets(restored.reader, sets)  # each piece checked finite as it is read
        except (KeyError, ValueError) as err:
            raise checkpoint.CheckpointError(restored.path / checkpoint.INDEX, f"does not fit this model: "
                                             f"{err.args[0] if err.args else err}") from None
        if hasattr(engine, "restored"):
            engine.restored()
        if pruning is not None:
            pruning.restored()

    restored = checkpoint.resume_latest(run_dir / "checkpoints", accept=accept)
    if restored is None:
        return 0, {}
    say(f"resumed from {restored.path} (epoch {restored.meta['epoch']})")
    return int(restored.meta["epoch"]), restored.meta.get("history", {})


def _load_numbered(run_dir: Path, restored, model, pruning) -> None:
    """Load a checkpoint of whole tensors numbered by the model's logical weights
    (``model/00000``, ``optimizer/00000``, ``prune/mask/00003``: what phalanx.fit wrote before
    it wrote per device) into the model and ``model.optimizer``, one tensor at a time (the
    caller then cuts them into the replicas' copies and slices). Its next checkpoint is
    written per device."""
    optimizer_vars = keras_state.optimizer_entries(model)
    wanted = {f"optimizer/{i:05d}" for i in range(len(optimizer_vars))}
    have = {k for k in restored.tensors if k.startswith("optimizer/")}
    if wanted != have:
        raise ConfigError("run.dir", f"{str(run_dir)!r}: the checkpoint's optimizer state has {len(have)} tensors "
                                     f"but {type(model.optimizer).__name__} has {len(wanted)}; compile with the "
                                     f"optimizer (and precision policy) of the saved run, or pass a new run.dir")
    entries = [(f"model/{i:05d}", e) for i, e in enumerate(keras_state.model_entries(model))]
    entries += [(f"optimizer/{i:05d}", e) for i, e in enumerate(optimizer_vars)]
    missing = [key for key, _ in entries if key not in restored.reader]
    try:
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for key, entry in entries:
            checkpoint.check_dtype(key, restored.reader.dtype(key), entry.variables[0].dtype)
    except (KeyError, ValueError) as err:
        raise checkpoint.CheckpointError(restored.path / checkpoint.INDEX, f"does not fit this model: "
                                         f"{err.args[0] if err.args else err}") from None
    for key, entry in entries:
        entry.assign(restored.tensors[key])  # each piece checked finite as it is read
    keras_state.restore_masks(pruning, restored.tensors)


def _save(run_dir: Path, cfg: Config, model, epoch: int, history: dict, step: int, pruning=None,
          engine=None) -> Path:
    """Checkpoint ``step`` of the fit: every device of ``engine`` writes the slices it holds
    (:meth:`KerasModelEngine.checkpoint_slots`, the masks of ``train.prune.*`` beside them once
    installed); otherwise (:func:`_state_sets`) whole variables, one at a time."""
    meta = {"epoch": epoch, "history": _jsonable(history), "keras_variables": _variables_signature(model),
            "keras_state": PER_DEVICE, "config": cfg.to_dict(), "model": model.name}
    parts = keras_slots.logical_parts(model)
    masks = pruning.mask_slots(parts) if pruning is not None and pruning.installed else []
    return checkpoint.save(run_dir / "checkpoints", step, _state_sets(engine, model, parts, masks), meta=meta,
                           keep=cfg.checkpoint.keep)


def _state_sets(engine, model, parts: dict, masks: list) -> list:
    """The checkpoint shard sets of a fit: the engine's per device (a placing engine's
    :meth:`KerasModelEngine.checkpoint_slots`), else whole variables wherever they live (a
    model's own train_step, the parameter-server fit), by the same logical names."""
    if hasattr(engine, "checkpoint_slots"):
        return engine.checkpoint_slots(parts, extra=masks)
    return keras_slots.whole_sets(model, parts, extra=masks)


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def _metrics_output(run_dir: Path | None, start_step: int):
    """Where the epochs' rows go: ``metrics.jsonl`` and TensorBoard events under ``tb/``
    (the writer of ``phalanx train``, quiet: fit prints through Keras's callbacks). Rows
    past ``start_step`` (left by a run that died after its last checkpoint) are dropped
    first. A worker other than the chief (``run_dir`` None) writes nothing."""
    if run_dir is None:
        return contextlib.nullcontext(None)
    return RunOutput(run_dir, total_steps=0, start_step=start_step, quiet=True)


def _epoch_row(epoch: int, step: int, logs: dict, moe: MoEStats) -> dict:
    """One epoch's row: its logs (metrics, ``val_*``) and the MoE layers' figures."""
    return _jsonable({"epoch": epoch, "step": step, **logs, **moe.epoch_row()})


# -- the loops ------------------------------------------------------------------------------------


def _callbacks(callbacks, model, verbose: int, epochs: int, steps, history=None):
    given = list(callbacks or [])
    if history is not None:
        given.append(history)
    return keras.callbacks.CallbackList(given, add_history=False, add_progbar=verbose != 0, model=model,
                                        verbose=verbose, epochs=epochs, steps=steps)


def _step_logs(engine, model, returned) -> dict:
    """A step's logs for the callbacks: a model's own step returns them (Keras's rules,
    :mod:`phalanx.engines.custom_step`); phalanx's step leaves them in the compiled metrics."""
    if getattr(engine, "returns_logs", False):
        return custom_step.logs_as_numbers(returned)
    return _logs(model)


def _engine(model, cfg: Config, mesh: Mesh, sample_batch, method: str, workers=None, inference_only=False,
            validating=False):
    """The engine that runs ``method`` of ``model``: the model's own (overridden) step
    (:class:`~phalanx.engines.custom_step.CustomStepEngine`), or phalanx's; a kept one when still
    valid (:func:`_kept_engine`). A validating fit whose model overrides ``test_step`` only
    validates with that (``engine.evaluator``, kept with the engine)."""
    use = {"train_step": "fit", "test_step": "evaluate", "predict_step": "predict"}[method]
    if custom_step.overridden(model, method):
        methods = ["train_step", "test_step"] if method == "train_step" else [method]

        def own():
            return custom_step.CustomStepEngine(model, cfg, mesh, sample_batch, inference_only=inference_only,
                                                workers=workers, methods=methods)
        return _kept_engine(model, cfg, mesh, sample_batch, own, use, "own", workers)
    engine = _kept_engine(model, cfg, mesh, sample_batch,
                          lambda: KerasModelEngine(model, cfg, mesh, sample_batch, inference_only=inference_only,
                                                   workers=workers), use, workers=workers)
    if method == "train_step" and validating and custom_step.overridden(model, "test_step") and \
            getattr(engine, "evaluator", None) is None:
        engine.evaluator = custom_step.CustomStepEngine(model, cfg, mesh, sample_batch, methods=["test_step"])
    return engine


def _evaluate_loop(engine: KerasModelEngine, model, batches: Batches, callbacks, steps=None) -> dict:
    engine = getattr(engine, "evaluator", engine)  # a model's own test_step, when it has one
    model.reset_metrics()
    callbacks.on_test_begin()
    logs = {}
    for step, batch in enumerate(batches.epoch()):
        if steps is not None and step >= steps:
            break
        callbacks.on_test_batch_begin(step)
        logs = _step_logs(engine, model, engine.test_step(batch))
        callbacks.on_test_batch_end(step, logs)
    logs = logs if getattr(engine, "returns_logs", False) else _logs(model)
    callbacks.on_test_end(logs)
    return logs


def split_validation(x, y, sample_weight, validation_split, validation_data):
    """``((x, y, sample_weight), validation_data)`` after Keras's ``validation_split`` rule: the
    last ``validation_split`` of the samples, taken before any shuffling, validate
    (``keras.src.trainers.data_adapters.array_slicing.train_validation_split``, Keras's own
    code); ignored when ``validation_data`` is given, as in Keras.

    Example:
        >>> import numpy as np
        >>> (tx, ty, _), (vx, vy, _) = split_validation(np.arange(10), np.arange(10), None, 0.2, None)
        >>> vx.tolist()
        [8, 9]
    """
    if not validation_split or validation_data is not None:
        return (x, y, sample_weight), validation_data
    if isinstance(validation_split, bool) or not isinstance(validation_split, (float, int)) or \
            not 0 < validation_split < 1:
        raise ValueError(f"validation_split: {validation_split!r} must be a fraction in (0, 1)")
    import tensorflow as tf
    if isinstance(x, tf.data.Dataset):
        raise ValueError("validation_split: works on arrays only (Keras's rule); with a tf.data.Dataset pass "
                         "validation_data=... instead")
    from keras.src.trainers.data_adapters.array_slicing import train_validation_split  # Keras's own split
    try:
        return train_validation_split((x, y, sample_weight), validation_split=validation_split)
    except ValueError as err:
        raise ValueError(f"validation_split: {err}") from None


def class_weights(x, y, sample_weight, class_weight):
    """``(x, sample_weight)`` with Keras's ``class_weight`` turned into sample weights, by
    Keras's own helpers (``class_weight_to_sample_weights`` for arrays,
    ``make_class_weight_map_fn`` mapped over a dataset's batches).

    Example:
        >>> import numpy as np
        >>> class_weights(np.zeros((3, 2)), np.array([0, 1, 1]), None, {1: 2.0})[1].tolist()
        [1.0, 2.0, 2.0]
    """
    if class_weight is None:
        return x, sample_weight
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError(f"class_weight: {class_weight!r} must be a dict {{class index: weight}}")
    import tensorflow as tf
    from keras.src.trainers.data_adapters import data_adapter_utils, tf_dataset_adapter
    if isinstance(x, tf.data.Dataset):
        return x.map(tf_dataset_adapter.make_class_weight_map_fn(class_weight)), sample_weight
    if sample_weight is not None:
        raise ValueError("class_weight: cannot be used together with sample_weight (Keras's rule); fold the class "
                         "weights into sample_weight")
    if y is None or keras.tree.is_nested(y):
        raise ValueError("class_weight: only for a model with a single output and one y array (Keras's rule); "
                         "pass sample_weight per output instead")
    return x, data_adapter_utils.class_weight_to_sample_weights(np.asarray(y), class_weight)


def fit(model, cfg: Config, mesh: Mesh, x=None, y=None, *, batch_size=None, epochs=1, steps_per_epoch=None,
        validation_data=None, validation_steps=None, validation_batch_size=None, validation_freq=1,
        initial_epoch=0, callbacks=None, shuffle=True, sample_weight=None, verbose="auto", validation_split=0.0,
        class_weight=None):
    """See :func:`phalanx.fit`."""
    from phalanx.train import keras_ps
    if keras_ps.ps_mode(cfg):  # the chief of a parameter-server cluster: its own loop
        return keras_ps.fit(model, cfg, x, y, batch_size=batch_size, epochs=epochs, steps_per_epoch=steps_per_epoch,
                            validation_data=validation_data, validation_steps=validation_steps,
                            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
                            initial_epoch=initial_epoch, callbacks=callbacks, shuffle=shuffle,
                            sample_weight=sample_weight, verbose=verbose, validation_split=validation_split,
                            class_weight=class_weight)
    model = resolve_model(model, cfg)
    check_config_for_keras(cfg, model)
    _check_positive("epochs", epochs)
    _check_positive("validation_freq", validation_freq)
    _check_positive("validation_steps", validation_steps, allow_none=True)
    if not isinstance(initial_epoch, int) or not 0 <= initial_epoch < epochs:
        raise ValueError(f"initial_epoch: {initial_epoch!r} must be an integer in [0, epochs={epochs})")
    verbose = _verbose(verbose)
    (x, y, sample_weight), validation_data = split_validation(x, y, sample_weight, validation_split, validation_data)
    x, sample_weight = class_weights(x, y, sample_weight, class_weight)
    # Across the workers of a cluster (None in one process): every worker runs this fit.
    workers = keras_cluster.join(cfg)
    world = 1 if workers is None else workers.size
    _check_callbacks(callbacks, workers)
    # A model's own steps this fit runs (test_step only to validate): a layout they refuse, before any data is read.
    own_steps = ["train_step"] + (["test_step"] if validation_data is not None else [])
    custom_step.check_layout(model, cfg, mesh, own_steps, world)
    train = Batches(x, y, sample_weight, batch_size=batch_size, steps_per_epoch=steps_per_epoch, shuffle=shuffle,
                    seed=cfg.train.seed, divisor=world)  # any batch splits over a worker's replicas
    val = _validation_batches(validation_data, validation_batch_size or batch_size, cfg, mesh)
    split_for_tensor_parallel(model, cfg, mesh, verbose)
    apply_precision(model, cfg)
    if model.optimizer is None:
        model.optimizer = default_optimizer(cfg, (train.steps or 1) * epochs)
    first = train.first()
    engine = _engine(model, cfg, mesh, first, "train_step", workers=workers, validating=val is not None)
    _check_labels(model, first, train, val)
    # train.prune.*: checked on the built model before anything is written, run around every step
    pruning = KerasPruning(cfg, model, workers=world)
    run_dir = run_directory(cfg)
    loop = dict(epochs=epochs, initial_epoch=initial_epoch, callbacks=callbacks, verbose=verbose,
                validation_steps=validation_steps, validation_freq=validation_freq, pruning=pruning)
    if workers is not None and not workers.is_chief:
        # Only the chief writes the run directory, prints, and runs the callbacks that write files.
        loop.update(callbacks=keras_cluster.chief_callbacks_only(callbacks), verbose=0)
        return _fit_loop(engine, model, cfg, None, train, val, workers=workers, **loop)
    with RunLock(run_dir):
        return _fit_loop(engine, model, cfg, run_dir, train, val, workers=workers, **loop)


def _check_labels(model, first, *batches) -> None:
    """Refuse targets that are no class ids of the model's sparse losses, before step 1 (the
    engine has built the compiled loss)."""
    rules = keras_targets.sparse_label_rules(model, first[0])
    for each in batches:
        if each is not None and rules:
            each.check_labels(rules, list(getattr(model, "output_names", None) or []) or None)


#: where a Keras model keeps the engines phalanx built for it, ``(key, engine, per-row signature)``
#: each (set past Keras's attribute tracking, so that the engines' variables do not become the
#: model's): the last :func:`fit`'s, and the last :func:`evaluate`'s and :func:`predict`'s that
#: could not use it (:func:`_kept_engine`)
_FIT_ENGINE = "_phalanx_fit_engine"
_SLOTS = {"fit": _FIT_ENGINE, "evaluate": "_phalanx_evaluate_engine", "predict": "_phalanx_predict_engine"}
#: which kept engines each call may run on: an engine built for a fit also evaluates and predicts
#: (its validation does), one built for evaluate also predicts; predict's own (``inference_only``,
#: no optimizer) only predicts
_SERVES = {"fit": ("fit",), "evaluate": ("fit", "evaluate"), "predict": ("fit", "evaluate", "predict")}


def kept_engines(model) -> dict:
    """The engines ``model`` keeps for its next :func:`fit`, :func:`evaluate` and :func:`predict`
    (``{"fit" | "evaluate" | "predict": engine}``, the calls that built them): a test hook, to
    count builds and traces (``engine._test_fn.experimental_get_tracing_count()``).

    Example:
        >>> import keras
        >>> kept_engines(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
        {}
    """
    return {use: model.__dict__[attr][1] for use, attr in _SLOTS.items() if model.__dict__.get(attr) is not None}


def _storage(variables) -> tuple:
    """Which TensorFlow variable holds each Keras variable now: placing a variable on another
    device (an engine of another layout, :func:`~phalanx.engines.keras_model.place_variable`)
    replaces it, and a traced step reads the one it captured."""
    return tuple(id(getattr(v, "_value", v)) for v in variables)


def _signature(batch, rows: bool = True) -> str:
    """The structure, dtypes and shapes of ``batch``'s tensors; ``rows=False``: without the
    leading (batch) dimension, the shape of one row."""
    leaves = keras.tree.flatten(batch)
    structure = keras.tree.map_structure(lambda _: 0, batch) if leaves else None
    return repr((structure, tuple((tuple(getattr(t, "shape", ()))[0 if rows else 1:],
                                   str(getattr(t, "dtype", type(t).__name__))) for t in leaves)))


def _engine_key(model, cfg: Config, mesh: Mesh, sample_batch, kind: str = "phalanx") -> tuple:
    """What a built engine depends on: the model's variables (by identity, where each is stored,
    whether it trains) and compiled optimizer, loss and metrics (by identity; a new
    ``model.compile`` makes new ones), the optimizer's variables (where each is stored), the keys
    the engine reads (``parallel``, ``precision``, ``train.grad_accum``), the mesh, ``kind``:
    phalanx's step or the model's own (``model.run_eagerly`` with it), and last the batch's
    structure, shapes and dtypes."""
    compiled = tuple(id(getattr(model, name, None)) for name in ("optimizer", "loss", "_compile_loss",
                                                                  "_compile_metrics"))
    optimizer = getattr(model, "optimizer", None)
    slots = [v for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)) if opt is not None
             for v in opt.variables]
    return (kind, bool(model.run_eagerly) if kind == "own" else None, tuple(id(v) for v in model.variables),
            _storage(model.variables), tuple(bool(v.trainable) for v in model.variables), compiled,
            tuple(id(v) for v in slots), _storage(slots), cfg.parallel, cfg.precision, cfg.train.grad_accum,
            tuple(mesh.devices), mesh.dp, mesh.pp, mesh.tp, _signature(sample_batch))


def _kept_engine(model, cfg: Config, mesh: Mesh, sample_batch, build, use: str, kind: str = "phalanx",
                 workers=None):
    """The engine for this ``use`` (``fit``, ``evaluate``, ``predict``): a kept one (:data:`_SERVES`)
    when nothing it depends on changed (:func:`_engine_key`), its replicas' weight copies (and ZeRO
    slices) refreshed from the model's weights and its traced steps reused, else ``build()``'s,
    kept. A fit needs the batch shapes it was built for; evaluate and predict need the same
    structure, dtypes and row shapes of the batch (of ``x`` only, for predict), any number of rows:
    the traced evaluation and prediction steps take any (a fit's validation too). Keras's own
    ``fit`` keeps its traced step the same way, until the next ``model.compile``. A fit drops the
    evaluate and predict engines (their weight copies), so that at most one engine a call holds
    memory beside the fit's. Across workers every fit builds its own (the workers' group is joined
    per fit)."""
    if workers is not None:
        return build()
    key = _engine_key(model, cfg, mesh, sample_batch, kind)
    rows = tuple(_signature(part, rows=False) for part in sample_batch)
    if use == "fit":
        for slot in ("evaluate", "predict"):
            object.__setattr__(model, _SLOTS[slot], None)
    for slot in _SERVES[use]:
        kept = model.__dict__.get(_SLOTS[slot])
        if kept is None or kept[0][:-1] != key[:-1]:
            continue
        read = 1 if use == "predict" else 3  # predict reads x only
        if kept[0][-1] == key[-1] if use == "fit" else kept[2][:read] == rows[:read]:
            kept[1].sync_copies()  # the weights may have been set since (a fit, model.set_weights, a restore)
            return kept[1]
    object.__setattr__(model, _SLOTS[use], None)  # the old engine (its weight copies) can go before the new is built
    engine = build()
    # (the key after the build: building places the variables and builds the optimizer)
    object.__setattr__(model, _SLOTS[use], (_engine_key(model, cfg, mesh, sample_batch, kind), engine, rows))
    return engine


def _validation_batches(validation_data, batch_size, cfg: Config, mesh: Mesh):
    if validation_data is None:
        return None
    import tensorflow as tf
    if isinstance(validation_data, tf.data.Dataset):
        return Batches(validation_data, divisor=1)
    if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
        raise ValueError("validation_data: pass (x_val, y_val), (x_val, y_val, sample_weight) or a tf.data.Dataset")
    vx, vy, vsw = (tuple(validation_data) + (None,))[:3]
    return Batches(vx, vy, vsw, batch_size=batch_size, divisor=1)


def _fit_loop(engine, model, cfg, run_dir: Path | None, train: Batches, val, *, epochs, initial_epoch, callbacks,
              verbose, validation_steps, validation_freq, workers=None, pruning=None):
    """``run_dir`` None: a worker other than the chief, which writes nothing there."""
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if verbose else (lambda text: None)
    done, saved_history = 0, {}
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        done, saved_history = _restore(run_dir, model, say, pruning, engine)
    if workers is not None:  # every worker starts from the chief's weights, optimizer state and epoch
        resume = workers.start(model, model.optimizer, {"done": done, "history": _jsonable(saved_history)})
        done, saved_history = int(resume["done"]), resume["history"]
    engine.sync_copies()  # the replicas' weight copies: the restored (or broadcast) weights
    history = keras.callbacks.History()
    if done >= epochs:
        history.set_model(model)
        history.history = {k: list(v) for k, v in saved_history.items()}
        history.epoch = list(range(done))
        model.history = history
        last = history.history.get("loss", [float("nan")])[-1]
        say(f"nothing to do: {run_dir} already holds {done} of {epochs} epochs (last loss {last:.4f}); "
            f"raise epochs or use a new run.dir to train more")
        return history
    start = max(initial_epoch, done)
    train.seek(start)  # epoch e reads the data in the order of an uninterrupted run's epoch e
    if run_dir is not None:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    # a resumed run repeats no row: the rows past the restored step are dropped
    with _metrics_output(run_dir, int(model.optimizer.iterations.numpy())) as output:
        return _train_epochs(engine, model, cfg, run_dir, output, train, val, history, saved_history, start=start,
                             epochs=epochs, callbacks=callbacks, verbose=verbose, validation_steps=validation_steps,
                             validation_freq=validation_freq, workers=workers, say=say, pruning=pruning)


def _callback_start(model, start: int, engine, say) -> int:
    """The first epoch after the callbacks' ``on_train_begin``: Keras's fit starts at
    ``model._initial_epoch`` when a callback set it (``keras.callbacks.BackupAndRestore``
    restores its weights, optimizer state and epoch there), and the replicas' weight copies
    then take the restored weights."""
    restored = getattr(model, "_initial_epoch", None)
    engine.sync_copies()
    if restored and restored > start:
        say(f"resumed at epoch {restored + 1} (a callback restored the model: Keras's BackupAndRestore rule)")
        return int(restored)
    return start


def _check_callbacks(callbacks, workers) -> None:
    """Refuse a callback this fit cannot honour."""
    for c in callbacks or []:
        if workers is not None and isinstance(c, keras.callbacks.BackupAndRestore):
            raise ValueError(f"callbacks: BackupAndRestore across {workers.size} workers would have every worker "
                             f"write the same backup; set run.dir instead: phalanx.fit checkpoints every epoch "
                             f"there and resumes the same model after the last finished epoch")


def _train_epochs(engine, model, cfg, run_dir: Path | None, output: RunOutput | None, train: Batches, val, history,
                  saved_history: dict, *, start, epochs, callbacks, verbose, validation_steps, validation_freq,
                  workers, say, pruning=None):
    """Epochs ``start..epochs-1`` of :func:`_fit_loop`; ``output`` writes each epoch's row
    (None: a worker other than the chief, which writes none)."""
    moe = MoEStats(model if output is not None else None)  # nothing read where nothing is written
    callback_list = _callbacks(callbacks, model, verbose, epochs, train.steps, history)
    model.stop_training = False
    callback_list.on_train_begin()
    start = _callback_start(model, start, engine, say)
    history.history = {k: list(v)[:start] for k, v in saved_history.items()}
    history.epoch = list(range(start)) if saved_history else []
    step_count = int(model.optimizer.iterations.numpy())
    policy, why = precision_of(model, cfg)
    layout = describe_layout(cfg, dp=engine.dp, tp=engine.mesh.tp, pp=engine.pp, precision=policy,
                             workers=1 if workers is None else workers.size)
    say(f"phalanx.fit: {model.name!r} on layout {layout}; run dir {run_dir}")
    say(f"precision: {policy} ({why})")
    if engine.loss_note:  # a vocabulary-parallel head: whether its loss reads the shard logits
        say(engine.loss_note)
    epoch_logs: dict = {}
    for epoch in range(start, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        logs = {}
        steps_run = 0
        for step, batch in enumerate(train.epoch()):
            callback_list.on_train_batch_begin(step)
            returned = engine.train_step(batch) if pruning is None else \
                pruning.train_step(engine, batch)  # the masks around the step (train.prune.*)
            moe.update()
            steps_run += 1
            logs = _step_logs(engine, model, returned)
            callback_list.on_train_batch_end(step, logs)
            if model.stop_training:
                break
        step_count += steps_run
        if steps_run == 0:
            say(f"epoch {epoch + 1}: no batch to train on; stopping")
            break
        epoch_logs = dict(logs)
        engine.gather_state()  # under ZeRO: the sliced state into the model and model.optimizer
        if val is not None and (epoch + 1) % validation_freq == 0:
            val_logs = _evaluate_loop(engine, model, val, callback_list, validation_steps)
            epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
        callback_list.on_epoch_end(epoch, epoch_logs)
        if run_dir is not None:
            _save(run_dir, cfg, model, epoch + 1, history.history, step_count, pruning, engine)
        if output is not None:
            output.log(_epoch_row(epoch + 1, step_count, epoch_logs, moe))
        if model.stop_training:
            break
    callback_list.on_train_end(logs=epoch_logs)
    return model.history if getattr(model, "history", None) is history else history


def evaluate(model, cfg: Config, mesh: Mesh, x=None, y=None, *, batch_size=None, steps=None, sample_weight=None,
             callbacks=None, return_dict=False, verbose="auto"):
    """See :func:`phalanx.evaluate`."""
    model = resolve_model(model, cfg)
    _check_positive("steps", steps, allow_none=True)
    verbose = _verbose(verbose) if keras_cluster.is_chief(cfg) else 0  # every worker evaluates; the chief prints
    batches = Batches(x, y, sample_weight, batch_size=batch_size, divisor=1)
    if custom_step.overridden(model, "test_step"):
        custom_step.check_layout(model, cfg, mesh, ["test_step"])
    split_for_tensor_parallel(model, cfg, mesh, verbose)
    apply_precision(model, cfg)
    first = batches.first()
    engine = _engine(model, cfg, mesh, first, "test_step")
    _check_labels(model, first, batches)
    callback_list = _callbacks(callbacks, model, verbose, 1, steps or batches.steps)
    logs = _evaluate_loop(engine, model, batches, callback_list, steps)
    if return_dict:
        return logs
    return model._flatten_metrics_in_order(logs)


def predict(model, cfg: Config, mesh: Mesh, x, *, batch_size=None, steps=None, callbacks=None, verbose="auto"):
    """See :func:`phalanx.predict`."""
    if not isinstance(model, keras.Model) and callable(model):
        model = model()
    if not isinstance(model, keras.Model):
        raise TypeError(f"model: expected a keras.Model, got {type(model).__name__}")
    _check_positive("steps", steps, allow_none=True)
    verbose = _verbose(verbose) if keras_cluster.is_chief(cfg) else 0  # every worker predicts; the chief prints
    batches = Batches(x, batch_size=batch_size, divisor=1, need_y=False)
    split_for_tensor_parallel(model, cfg, mesh, verbose)
    apply_precision(model, cfg)
    first = batches.first()
    if custom_step.overridden(model, "predict_step"):
        custom_step.check_layout(model, cfg, mesh, ["predict_step"])
    engine = _engine(model, cfg, mesh, (first[0], None, None), "predict_step", inference_only=True)
    callback_list = _callbacks(callbacks, model, verbose, 1, steps or batches.steps)
    callback_list.on_predict_begin()
    outputs = []
    for step, (bx, _, _) in enumerate(batches.epoch()):
        if steps is not None and step >= steps:
            break
        callback_list.on_predict_batch_begin(step)
        flat = [np.asarray(t) for t in engine.predict_step(bx)]
        outputs.append(flat)
        callback_list.on_predict_batch_end(step, {"outputs": engine.pack_outputs(flat)})
    callback_list.on_predict_end()
    if not outputs:
        raise ValueError("x: no batch to predict on")
    joined = [np.concatenate([o[i] for o in outputs], axis=0) for i in range(len(outputs[0]))]
    return engine.pack_outputs(joined)
