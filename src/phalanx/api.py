"""The Python API: your compiled Keras 3 model, the Keras way, on any phalanx layout.

    import phalanx
    cfg = phalanx.init("parallel.devices=cpu:2", "parallel.dp=2")   # first, before any TensorFlow work
    import keras, numpy as np
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    x = np.random.rand(512, 8).astype("float32"); y = x.sum(1, keepdims=True)
    history = phalanx.fit(model, x, y, batch_size=64, epochs=3, config=cfg)
    phalanx.evaluate(model, x, y, config=cfg)

:func:`init` makes the devices the layout needs (logical CPUs included) before
TensorFlow starts; :func:`fit`, :func:`evaluate` and :func:`predict` take Keras's own
arguments plus ``config=`` (from :func:`init`) or ``overrides=``. The model's compiled
optimizer, loss and metrics rule; phalanx's config supplies the layout (``parallel.*``),
precision (``precision.*``), ``train.grad_accum``, ``train.seed`` (shuffling), the run
directory and checkpoints. Results equal Keras's own one-device ``model.fit`` (see
``tests/test_keras_fit.py``).

Example:
    >>> import keras, numpy as np, tempfile
    >>> cfg = init(f"run.dir={tempfile.mkdtemp()}")
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> x = np.ones([8, 3], "float32")
    >>> history = fit(model, x, x[:, :1], batch_size=4, epochs=2, config=cfg, verbose=0)
    >>> len(history.history["loss"])
    2
"""

from __future__ import annotations

from typing import Sequence

from phalanx.cluster.tf_config import cluster_info_from_env
from phalanx.config import Config, ConfigError, load_config, parse_override
from phalanx.engines import keras_cluster
from phalanx.mesh import build_mesh
from phalanx.train import keras_api, keras_ps


def _config(config: Config | None, overrides: Sequence[str]) -> Config:
    if isinstance(overrides, str):
        overrides = [overrides]
    if config is None:
        return load_config(None, list(overrides))
    if not isinstance(config, Config):
        raise TypeError(f"config: expected a phalanx Config (from phalanx.init or load_config), got "
                        f"{type(config).__name__}")
    changes: dict[str, dict] = {}
    for item in overrides:
        key, value = parse_override(item)
        section, _, name = key.partition(".")
        changes.setdefault(section, {})[name] = value
    return config.replace(**changes) if changes else config


def init(*overrides: str, config: Config | None = None) -> Config:
    """Set up the devices of the layout (logical CPUs included) and return the Config.

    Call it first, right after ``import phalanx``: TensorFlow fixes its devices the first
    time anything (a dataset, a model, a tensor) touches it. Calling it again with the
    same layout is harmless. Pass the returned Config to :func:`fit` and friends.

    Under a TF_CONFIG cluster (``phalanx launch --workers N -- python script.py``) with
    ``parallel.strategy=multi_worker`` (or ``auto``), every process joins the cluster here
    (a MultiWorkerMirroredStrategy is made first, as ``phalanx train`` does) and the
    layout's devices are that worker's own; see :mod:`phalanx.engines.keras_cluster`.

    Example:
        >>> cfg = init("parallel.devices=cpu:1")
        >>> cfg.parallel.devices
        'cpu:1'
    """

    cfg = _config(config, overrides)
    args = ", ".join(repr(o) for o in overrides) if overrides else "config=..."
    if keras_ps.setup(cfg):  # parameter servers: worker and ps tasks serve in here; the chief goes on
        return cfg
    if keras_cluster.setup(cfg, init_line=f"phalanx.init({args})"):  # every worker of a cluster joins it first
        _mesh(cfg, overrides)
        return cfg
    try:
        build_mesh(cfg)
    except ConfigError as err:
        if "already initialised" in str(err):
            args = ", ".join(repr(o) for o in overrides) if overrides else "config=..."
            raise ConfigError(err.key, f"{str(err).split(': ', 1)[-1]}. Move `phalanx.init({args})` to the top of your script, "
                                       f"right after `import phalanx` and before any dataset, model or tensor is "
                                       f"made") from None
        raise
    return cfg


def _mesh(cfg: Config, overrides: Sequence[str], what: str = "fit"):

    info = cluster_info_from_env()
    if keras_ps.ps_mode(cfg, info):  # the chief's own loop (phalanx.train.keras_ps), no mesh
        if what != "fit":
            keras_ps.refuse(what)
        return None
    if keras_cluster.cluster_mode(cfg, info):  # this worker's own devices
        return build_mesh(cfg, keras_cluster.local_devices(cfg, info))
    try:
        return build_mesh(cfg)
    except ConfigError as err:
        if "already initialised" in str(err):
            args = ", ".join(repr(o) for o in overrides) or "..."
            raise ConfigError(err.key, f"{str(err).split(': ', 1)[-1]}. Call `cfg = phalanx.init({args})` as the first line after "
                                       f"`import phalanx` and pass config=cfg") from None
        raise


def fit(model, x=None, y=None, *, batch_size=None, epochs=1, steps_per_epoch=None, validation_data=None,
        validation_steps=None, validation_batch_size=None, validation_freq=1, initial_epoch=0, callbacks=None,
        shuffle=True, sample_weight=None, validation_split=0.0, class_weight=None, overrides: Sequence[str] = (),
        config: Config | None = None, verbose="auto"):
    """Train a compiled Keras model like ``model.fit``, on the layout of ``config``.

    ``model``: a compiled ``keras.Model`` (Sequential, Functional or subclassed), or a
    function returning one (called under the precision policy). ``x``/``y``/
    ``sample_weight``: NumPy arrays (or lists/dicts of them), or ``x`` a ``tf.data.Dataset``
    of batches. Epochs, steps, validation (``validation_split`` included), ``class_weight``
    and callbacks follow Keras's rules; a batch of any size trains (a last, smaller one too). Returns a
    ``keras.callbacks.History``; the model object holds the trained weights, statistics
    and optimizer state afterwards, on every layout.

    Under ``parallel.strategy=parameter_server`` pass the function, not the model: the chief
    builds the model inside the strategy's scope and trains it asynchronously on the workers;
    ``history.model`` is the trained model (:mod:`phalanx.train.keras_ps`).

    Each call writes to its own run directory (``runs/fit-<time>``) unless ``run.dir`` is
    set; fitting the same model into a ``run.dir`` that holds its checkpoints resumes after
    the last finished epoch (another model there is an error). Calling ``fit`` again on the
    same model continues from its weights and optimizer state, as Keras's ``fit`` does, and
    reuses the step the last call built (no new trace) while the model's variables, its
    compiled optimizer/loss/metrics, the layout, the precision and the batch's shapes are the
    same; anything else builds a new one (docs/keras.md, "Fitting again").
    """

    cfg = _config(config, overrides)
    return keras_api.fit(model, cfg, _mesh(cfg, overrides), x, y, batch_size=batch_size, epochs=epochs,
                         steps_per_epoch=steps_per_epoch, validation_data=validation_data,
                         validation_steps=validation_steps, validation_batch_size=validation_batch_size,
                         validation_freq=validation_freq, initial_epoch=initial_epoch, callbacks=callbacks,
                         shuffle=shuffle, sample_weight=sample_weight, verbose=verbose,
                         validation_split=validation_split, class_weight=class_weight)


def evaluate(model, x=None, y=None, *, batch_size=None, steps=None, sample_weight=None, callbacks=None,
             return_dict=False, overrides: Sequence[str] = (), config: Config | None = None, verbose="auto"):
    """``model.evaluate`` on the layout of ``config``: the loss and compiled metrics.

    Runs on the engine the model's last :func:`fit` built when it still applies (the rules of a
    second fit; any number of rows), else builds one and keeps it for the next call
    (docs/keras.md, "Fitting again")."""

    cfg = _config(config, overrides)
    return keras_api.evaluate(model, cfg, _mesh(cfg, overrides, "evaluate"), x, y, batch_size=batch_size, steps=steps,
                              sample_weight=sample_weight, callbacks=callbacks, return_dict=return_dict,
                              verbose=verbose)


def predict(model, x, *, batch_size=None, steps=None, callbacks=None, overrides: Sequence[str] = (),
            config: Config | None = None, verbose="auto"):
    """``model.predict`` on the layout of ``config``: NumPy outputs in the model's structure.

    Reuses a built engine as :func:`evaluate` does."""

    cfg = _config(config, overrides)
    return keras_api.predict(model, cfg, _mesh(cfg, overrides, "predict"), x, batch_size=batch_size, steps=steps,
                             callbacks=callbacks, verbose=verbose)
