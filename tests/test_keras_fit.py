"""phalanx.fit / evaluate / predict against the independent oracle: Keras's own one-device
``model.fit`` with the same optimizer.

Every model here is trained twice from the same initial weights: by Keras itself on one
device, and by phalanx on a layout (dp2, pp2, dp2 x pp2, grad_accum 2). The per-step losses,
the epoch metrics and every final weight must agree to rtol 1e-4 (float32, no dropout).

BatchNormalization on a layout with several micro-batches normalises each micro-batch with
its own statistics (GPipe's rule), so its oracle is Keras's ``fit`` of a "ghost batch"
wrapper (tests/helpers.py): a model that cuts each batch into the same chunks, in the same order,
and calls the user's model on each, the data replicas' moving statistics averaged once per step.
"""

from __future__ import annotations

import csv
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import ConfigError

from helpers import ghost_batches

LAYOUTS = {
    "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"],
    "pp2": ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"],
    "dp2pp2": ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"],
    "accum2": ["train.grad_accum=2"],
    # the pipeline run once per accumulation step, the gradient sums carried from one into the next
    "pp2accum2": ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2", "train.grad_accum=2"],
}
CHUNKS = {"one": 1, "dp2": 2, "pp2": 2, "dp2pp2": 4, "accum2": 2, "pp2accum2": 4}
REPLICAS = {"dp2": 2, "dp2pp2": 2}
N, BATCH, EPOCHS = 16, 8, 2


# -- models (each a function of a seed, so that both systems start from the same weights) ----


def mlp():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)], name="mlp")


def cnn():
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, padding="same", use_bias=False),  # BN cancels a bias: its gradient is noise
                             keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.MaxPooling2D(),
                             keras.layers.Flatten(), keras.layers.Dense(3)], name="cnn")


def lstm():
    return keras.Sequential([keras.Input((8, 8)), keras.layers.LSTM(8), keras.layers.Dense(3)], name="lstm")


def transformer():
    tokens = keras.Input((8,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 16)(tokens)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(16)(keras.layers.Dense(16, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(tokens, out, name="transformer")


def two_inputs():
    a, b = keras.Input((5,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(a)
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([h, b]))
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(1)(h), name="two_inputs")


def two_outputs():
    x = keras.Input((6,))
    h = keras.layers.Dense(16, activation="tanh")(x)
    cls = keras.layers.Dense(3, name="cls")(h)
    g = keras.layers.Dense(16, activation="tanh")(h)
    reg = keras.layers.Dense(1, name="reg")(keras.layers.Dense(8, activation="tanh")(g))
    return keras.Model(x, {"cls": cls, "reg": reg}, name="two_outputs")


def data(name: str):
    rng = np.random.default_rng(7)
    cls = rng.integers(0, 3, N)
    if name == "cnn":
        return rng.normal(size=(N, 8, 8, 1)).astype("float32"), cls
    if name == "lstm":
        return rng.normal(size=(N, 8, 8)).astype("float32"), cls
    if name == "transformer":
        return rng.integers(0, 20, (N, 8)).astype("int32"), cls
    if name == "two_inputs":
        x = {"a": rng.normal(size=(N, 5)).astype("float32"), "b": rng.normal(size=(N, 3)).astype("float32")}
        return x, (x["a"].sum(1, keepdims=True) - x["b"][:, :1]).astype("float32")
    x = rng.normal(size=(N, 6)).astype("float32")
    if name == "two_outputs":
        return x, {"cls": cls, "reg": x[:, :1] * 2.0}
    return x, cls


BUILDERS = {"mlp": mlp, "cnn": cnn, "lstm": lstm, "transformer": transformer, "two_inputs": two_inputs,
            "two_outputs": two_outputs}


def optimizer(name: str):
    # Adam with epsilon 1e-3 (Keras's default 1e-7): the weights after 4 steps are compared at
    # atol 1e-5, and Adam divides a gradient's float32 round-off (~1e-7 absolute: sums in
    # another order on another layout or CPU) by sqrt(v_hat) + epsilon. With 1e-7 an element
    # whose gradient is near zero can turn that round-off into a large part of a 0.01 step;
    # with 1e-3 a step moves by at most ~2 x 0.01 x 1e-7 / 1e-3 = 2e-6 (8e-6 in four), on any CPU.
    return keras.optimizers.SGD(0.05, momentum=0.5) if name == "sgd" else keras.optimizers.Adam(0.01, epsilon=1e-3)


def compile_args(name: str) -> dict:
    sce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "two_inputs":
        return {"loss": "mse", "metrics": ["mae"]}
    if name == "two_outputs":
        return {"loss": {"cls": sce, "reg": "mse"}, "loss_weights": {"cls": 1.0, "reg": 0.5},
                "metrics": {"cls": ["accuracy"]}}
    return {"loss": sce, "metrics": ["accuracy"]}


def build(name: str, opt: str, seed: int = 3):
    keras.utils.set_random_seed(seed)
    model = BUILDERS[name]()
    model.compile(optimizer=optimizer(opt), **compile_args(name))
    return model


class StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def keras_reference(name: str, opt: str, chunks: int = 1, replicas: int = 1):
    """(per-step losses, history, model, optimizer) of Keras's own fit on one device."""
    model = build(name, opt)
    trained = model
    if chunks > 1 and name == "cnn":
        trained = ghost_batches(model, chunks, replicas=replicas)
        trained.compile(optimizer=optimizer(opt), **compile_args(name))
    x, y = data(name)
    record = StepLosses()
    history = trained.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record])
    return record.losses, history.history, model, trained.optimizer


def phalanx_run(name: str, opt: str, layout: str, tmp_path, **kwargs):
    model = build(name, opt)
    x, y = data(name)
    record = StepLosses()
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          callbacks=[record], overrides=LAYOUTS.get(layout, []) + [f"run.dir={tmp_path / layout}"],
                          **kwargs)
    return record.losses, history.history, model


def assert_same_weights(model, reference, rtol=1e-4, atol=1e-5):
    # Layer names differ (Keras numbers them as they are made); the order and shapes do not.
    assert [tuple(v.shape) for v in model.variables] == [tuple(v.shape) for v in reference.variables]
    for mine, ref in zip(model.variables, reference.variables):
        np.testing.assert_allclose(np.asarray(mine.numpy(), "float64"), np.asarray(ref.numpy(), "float64"),
                                   rtol=rtol, atol=atol, err_msg=mine.path)


@pytest.fixture(scope="module")
def references():
    """:func:`keras_reference`, each fit once per module: the oracle of every layout with the same
    ghost-batch chunks is the same fit (and only the cnn's BatchNorm sees the chunks). Read, never
    changed, by the tests."""
    fits = {}

    def get(name: str, opt: str, chunks: int, replicas: int = 1):
        key = (name, opt, chunks if name == "cnn" else 1, replicas if name == "cnn" else 1)
        if key not in fits:
            fits[key] = keras_reference(*key)
        return fits[key]

    return get


@pytest.mark.parametrize("layout", ["one", "dp2", "pp2", "dp2pp2", "accum2"])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_fit_equals_keras_fit(name, opt, layout, tmp_path, references):
    _fit_equals_keras_fit(name, opt, layout, tmp_path, references)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_pipeline_with_grad_accum_equals_keras_fit(name, tmp_path, references):
    """pp2 with 2 micro-batches and train.grad_accum=2 (Adam): the engine carries the gradient sums
    from one accumulation step into the next and orders the steps on each rank; Keras's fit of
    the whole batch (the cnn's of 4 ghost batches, the micro-batches in order) is the oracle."""
    _fit_equals_keras_fit(name, "adam", "pp2accum2", tmp_path, references)


def _fit_equals_keras_fit(name, opt, layout, tmp_path, references):
    ref_losses, ref_history, reference, ref_optimizer = references(name, opt, CHUNKS[layout], REPLICAS.get(layout, 1))
    losses, history, model = phalanx_run(name, opt, layout, tmp_path)
    assert len(losses) == len(ref_losses) == EPOCHS * N // BATCH
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
    assert sorted(history) == sorted(ref_history)
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-4, atol=1e-6, err_msg=key)
    # The user's model object holds the trained weights and BatchNorm statistics ...
    assert_same_weights(model, reference)
    # ... and the optimizer state, on every layout.
    assert len(model.optimizer.variables) == len(ref_optimizer.variables)
    for mine, ref in zip(model.optimizer.variables, ref_optimizer.variables):
        np.testing.assert_allclose(np.asarray(mine.numpy(), "float64"), np.asarray(ref.numpy(), "float64"),
                                   rtol=1e-4, atol=1e-5, err_msg=mine.path)


class Builds:
    """Counts the engines phalanx.fit / evaluate build (each a new step to trace)."""

    def __init__(self, monkeypatch):
        from phalanx.train import keras_api
        self.count = 0
        real = keras_api.KerasModelEngine

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(keras_api, "KerasModelEngine", counted)


def fit_engine(model):
    """The engine the model's last phalanx.fit built and keeps for its next fit."""
    return model.__dict__["_phalanx_fit_engine"][1]


REFIT_LAYOUTS = {**LAYOUTS, "dp2zero2": LAYOUTS["dp2"] + ["parallel.zero=2"]}  # + the optimizer state in slices


@pytest.mark.parametrize("layout", ["dp2", "pp2", "dp2zero2"])
def test_a_second_fit_reuses_the_built_step_and_equals_keras(layout, tmp_path, monkeypatch):
    """Two one-epoch ``phalanx.fit`` calls of the same model on the same layout (ZeRO-2 too): the second
    builds no engine and traces nothing (the first's engine and traced step), and the two together
    equal two one-epoch calls of Keras's own ``fit`` (losses, weights, optimizer state: the
    second continues from the first). A recompile, another layout and another batch shape build
    a new engine."""
    ref, model = build("mlp", "adam"), build("mlp", "adam")
    x, y = data("mlp")
    ref_losses, losses = StepLosses(), StepLosses()
    ref_logs = [ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[ref_losses]).history
                for _ in range(2)]
    builds = Builds(monkeypatch)
    logs, traces, engines = [], [], []
    for call in range(2):
        logs.append(phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[losses],
                                overrides=REFIT_LAYOUTS[layout] + [f"run.dir={tmp_path / str(call)}"]).history)
        engines.append(fit_engine(model))
        traces.append(engines[-1]._train_fn.experimental_get_tracing_count())
    assert builds.count == 1 and engines[0] is engines[1] and traces == [1, 1]
    # each fit wrote its own run directory and checkpoint, the second's at the step it reached
    assert [p.name for p in (tmp_path / "1" / "checkpoints").iterdir() if p.name.startswith("step")] == \
        [f"step-{2 * N // BATCH:08d}"]
    np.testing.assert_allclose(losses.losses, ref_losses.losses, rtol=1e-4, atol=1e-6)
    for mine, want in zip(logs, ref_logs):
        np.testing.assert_allclose(mine["loss"], want["loss"], rtol=1e-4, atol=1e-6)
    assert_same_weights(model, ref)
    for mine, want in zip(model.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)
    again = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.compile(optimizer=optimizer("adam"), **compile_args("mlp"))  # recompiled: new optimizer, loss, metrics
    phalanx.fit(model, x, y, **again, overrides=REFIT_LAYOUTS[layout] + [f"run.dir={tmp_path / 'recompiled'}"])
    assert builds.count == 2 and fit_engine(model) is not engines[0]
    other = "pp2" if layout == "dp2" else "dp2"
    phalanx.fit(model, x, y, **again, overrides=LAYOUTS[other] + [f"run.dir={tmp_path / 'other'}"])
    assert builds.count == 3
    phalanx.fit(model, x, y, **{**again, "batch_size": BATCH // 2},
                overrides=LAYOUTS[other] + [f"run.dir={tmp_path / 'shape'}"])
    assert builds.count == 4


def test_a_fit_after_another_layout_moved_the_weights_rebuilds(tmp_path, monkeypatch):
    """``phalanx.evaluate`` on another layout places the weights on its own devices (new
    TensorFlow variables behind the same Keras variables): the next fit on the first layout
    builds its step again, and trains the model's weights as Keras's two fits (with an evaluate
    between them) do, not the storage the first fit's traced step held."""
    ref, model = build("mlp", "sgd"), build("mlp", "sgd")
    x, y = data("mlp")
    ref_losses, losses = StepLosses(), StepLosses()
    ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[ref_losses])
    ref_eval = ref.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[ref_losses])
    builds = Builds(monkeypatch)
    args = dict(batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[losses])
    phalanx.fit(model, x, y, **args, overrides=LAYOUTS["pp2"] + [f"run.dir={tmp_path / 'a'}"])
    first = fit_engine(model)
    ours = phalanx.evaluate(model, x, y, batch_size=BATCH, verbose=0, return_dict=True, overrides=LAYOUTS["dp2"])
    for key in ref_eval:
        np.testing.assert_allclose(ours[key], ref_eval[key], rtol=1e-5, err_msg=key)
    phalanx.fit(model, x, y, **args, overrides=LAYOUTS["pp2"] + [f"run.dir={tmp_path / 'b'}"])
    assert builds.count == 3 and fit_engine(model) is not first  # fit, evaluate, fit
    np.testing.assert_allclose(losses.losses, ref_losses.losses, rtol=1e-5, atol=1e-6)
    assert_same_weights(model, ref, rtol=1e-5, atol=1e-6)


# -- the same object afterwards ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["pp2", "dp2pp2"])
def test_model_after_phalanx_fit_works_with_keras_and_phalanx(layout, tmp_path):
    name = "two_outputs"
    _, _, model = phalanx_run(name, "adam", layout, tmp_path)
    x, y = data(name)
    keras_eval = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    ours = phalanx.evaluate(model, x, y, batch_size=BATCH, return_dict=True, verbose=0,
                            overrides=LAYOUTS[layout])
    assert sorted(ours) == sorted(keras_eval)
    for key in keras_eval:
        np.testing.assert_allclose(ours[key], keras_eval[key], rtol=1e-5, err_msg=key)
    keras_pred = model.predict(x, batch_size=BATCH, verbose=0)
    our_pred = phalanx.predict(model, x, batch_size=BATCH, verbose=0, overrides=LAYOUTS[layout])
    assert sorted(our_pred) == sorted(keras_pred)
    for key in keras_pred:
        np.testing.assert_allclose(our_pred[key], keras_pred[key], rtol=1e-5, atol=1e-6)
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0)["reg"], keras_pred["reg"], rtol=1e-5, atol=1e-6)
    # Keras's own fit keeps training the same object (its optimizer state included).
    before = model.optimizer.iterations.numpy()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert model.optimizer.iterations.numpy() == before + N // BATCH
    # and compiling anew then evaluating works (no strategy was left behind).
    model.compile(optimizer="sgd", loss=compile_args(name)["loss"])
    model.evaluate(x, y, verbose=0)


def test_subclassed_model_trains_data_parallel_and_pp_is_refused_with_advice(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)

        def call(self, x):
            return self.b(self.a(x))

    def make():
        keras.utils.set_random_seed(3)
        net = Net()
        net.compile(optimizer=keras.optimizers.Adam(0.01),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return net

    x, y = data("mlp")
    reference = make()
    ref = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    ours = phalanx.fit(make(), x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                       overrides=LAYOUTS["dp2"] + [f"run.dir={tmp_path / 'dp'}"]).history
    np.testing.assert_allclose(ours["loss"], ref["loss"], rtol=1e-5)
    with pytest.raises(ValueError, match="Functional or Sequential"):
        phalanx.fit(make(), x, y, batch_size=BATCH, verbose=0, overrides=LAYOUTS["pp2"] + [f"run.dir={tmp_path / 'p'}"])


# -- Keras's rules for data, epochs and callbacks -------------------------------------------------


def test_datasets_finite_and_infinite_and_string_losses(tmp_path):
    x, y = data("mlp")

    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    reference = make()
    ref = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    finite = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    ours = phalanx.fit(make(), finite, epochs=2, verbose=0, overrides=LAYOUTS["dp2"] + [f"run.dir={tmp_path / 'a'}"])
    np.testing.assert_allclose(ours.history["loss"], ref["loss"], rtol=1e-5)
    infinite = finite.repeat()
    ours = phalanx.fit(make(), infinite, epochs=2, steps_per_epoch=N // BATCH, verbose=0,
                       overrides=[f"run.dir={tmp_path / 'b'}"])
    np.testing.assert_allclose(ours.history["loss"], ref["loss"], rtol=1e-5)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        phalanx.fit(make(), infinite, epochs=1, verbose=0, overrides=[f"run.dir={tmp_path / 'c'}"])


def test_callbacks_behave_as_in_keras(tmp_path):
    x, y = data("mlp")
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1))

    def make():
        return build("mlp", "sgd")

    reference = make()
    ref = reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1))])
    model = make()
    csv_path, ckpt_path = tmp_path / "log.csv", tmp_path / "best.keras"
    stops = []

    class Stopper(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.params["epochs"] == 3 and len(stops) == 0 and batch == 1:
                stops.append(logs["loss"])

    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                          validation_data=(x, y),
                          callbacks=[schedule, keras.callbacks.CSVLogger(str(csv_path)),
                                     keras.callbacks.ModelCheckpoint(str(ckpt_path), monitor="val_loss",
                                                                     save_best_only=True),
                                     keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=5), Stopper()],
                          overrides=LAYOUTS["pp2"] + [f"run.dir={tmp_path / 'run'}"])
    np.testing.assert_allclose(history.history["loss"], ref.history["loss"], rtol=1e-4)
    np.testing.assert_allclose(history.history["learning_rate"], [0.05, 0.025, 0.05 / 3], rtol=1e-6)
    assert "val_loss" in history.history and len(history.history["val_loss"]) == 3
    rows = list(csv.DictReader(csv_path.open()))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert ckpt_path.is_file() and stops
    # EarlyStopping through model.stop_training, with the best weights restored.
    model = make()
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0, restore_best_weights=True)
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=5, verbose=0, callbacks=[stop],
                          overrides=LAYOUTS["dp2"] + [f"run.dir={tmp_path / 'early'}"])
    assert len(history.history["loss"]) == 2


# -- errors before any step runs -----------------------------------------------------------------


def test_bad_input_is_refused_naming_the_argument(tmp_path):
    x, y = data("mlp")
    model = build("mlp", "sgd")
    run = [f"run.dir={tmp_path / 'r'}"]
    with pytest.raises(ValueError, match="x has 16.*y has 15"):
        phalanx.fit(model, x, y[:15], verbose=0, overrides=run)
    with pytest.raises(ValueError, match="x: arrays of dtype"):
        phalanx.fit(model, np.array([["a"] * 6] * 16), y, verbose=0, overrides=run)
    with pytest.raises(ValueError, match="not compiled"):
        phalanx.fit(mlp(), x, y, verbose=0, overrides=run)
    with pytest.raises(ValueError, match="loss"):
        bad = mlp()
        bad.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        phalanx.fit(bad, x, np.zeros([16, 5, 2], "float32"), batch_size=8, verbose=0, overrides=run)
    with pytest.raises(ValueError, match="batch_size"):
        phalanx.fit(model, x, y, batch_size=0, verbose=0, overrides=run)
    with pytest.raises(ConfigError, match="train.lr"):
        phalanx.fit(model, x, y, verbose=0, overrides=run + ["train.lr=0.5"])
    with pytest.raises(ConfigError, match="checkpoint.async.*synchronously"):
        phalanx.fit(model, x, y, verbose=0, overrides=run + ["checkpoint.async=true"])
    assert model.optimizer.iterations.numpy() == 0  # nothing ran
    assert not (tmp_path / "r" / "checkpoints").exists()


# -- run directories ----------------------------------------------------------------------------------


def test_run_directories_resume_and_refuse(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    x, y = data("mlp")
    phalanx.fit(build("mlp", "sgd"), x, y, batch_size=BATCH, verbose=0)
    phalanx.fit(build("mlp", "sgd"), x, y, batch_size=BATCH, verbose=0)
    assert len(list((tmp_path / "runs").iterdir())) == 2  # two default runs never collide
    run = [f"run.dir={tmp_path / 'shared'}"]
    reference = build("mlp", "sgd")
    ref = reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history
    model = build("mlp", "sgd")
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, overrides=run)
    resumed = build("mlp", "sgd")  # a new process would start from fresh weights: the checkpoint rules
    history = phalanx.fit(resumed, x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=1, overrides=run)
    np.testing.assert_allclose(history.history["loss"], ref["loss"], rtol=1e-5)
    assert_same_weights(resumed, reference)
    rows = [json.loads(line) for line in (tmp_path / "shared" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]  # one row per epoch across the resume
    again = phalanx.fit(build("mlp", "sgd"), x, y, batch_size=BATCH, epochs=3, verbose=1, overrides=run)
    assert "nothing to do" in capsys.readouterr().err
    np.testing.assert_allclose(again.history["loss"], ref["loss"], rtol=1e-5)
    with pytest.raises(ConfigError, match="different model"):
        phalanx.fit(build("lstm", "sgd"), *data("lstm"), batch_size=BATCH, epochs=4, verbose=0, overrides=run)


# -- precision -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_applies_to_the_users_model(policy, tmp_path):
    x, y = data("mlp")
    keras.config.set_dtype_policy(policy)
    try:
        reference = build("mlp", "adam")
        ref = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    finally:
        keras.config.set_dtype_policy("float32")
    model = build("mlp", "adam")
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                          overrides=LAYOUTS["dp2"] + [f"precision.policy={policy}", f"run.dir={tmp_path / 'r'}"])
    assert model.layers[0].compute_dtype == policy.split("_")[1]
    assert model.layers[0].kernel.dtype == "float32"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
    np.testing.assert_allclose(history.history["loss"], ref["loss"], rtol=2e-2)
    float32 = phalanx.fit(build("mlp", "adam"), x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                          overrides=[f"run.dir={tmp_path / 'f'}"]).history
    assert history.history["loss"] != float32["loss"]


# -- micro-batch semantics ----------------------------------------------------------------------------


def test_dropout_draws_a_mask_per_micro_batch(tmp_path):
    def make():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dropout(0.5),
                                  keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = data("mlp")
    reference = make()
    reference.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    model = make()
    phalanx.fit(model, x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0,
                overrides=LAYOUTS["pp2"] + [f"run.dir={tmp_path / 'r'}"])
    seed_state = [v for v in model.non_trainable_variables if "seed" in v.path][0].numpy()
    ref_state = [v for v in reference.non_trainable_variables if "seed" in v.path][0].numpy()
    start = make().non_trainable_variables[0].numpy()
    # Keras draws once per step; the pipeline once per micro-batch (2 here).
    assert (ref_state - start).sum() > 0
    assert (seed_state - start).sum() == 2 * (ref_state - start).sum()


def test_init_too_late_names_the_line_to_move():
    # TensorFlow is running with 8 logical CPUs (conftest): asking for 16 is too late.
    with pytest.raises(ConfigError, match=r"phalanx.init\('parallel.devices=cpu:16', 'parallel.dp=16'\)"):
        phalanx.init("parallel.devices=cpu:16", "parallel.dp=16")
    cfg = phalanx.init("parallel.devices=cpu:2", "parallel.dp=2")
    assert phalanx.init(config=cfg) == cfg  # idempotent


@pytest.mark.parametrize("layout", ["dp2", "pp2", "dp2pp2"])
def test_regularisers_and_added_losses_count_as_in_keras(layout, tmp_path):
    """Weight regularisers, activity regularisers and a layer's own add_loss (in the first
    stage of a cut model) reach the loss and the gradients exactly as in Keras."""

    class Penalty(keras.layers.Layer):
        def call(self, x):
            self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
            return x

    def make():
        keras.utils.set_random_seed(3)
        inp = keras.Input((6,))
        h = keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01),
                               activity_regularizer=keras.regularizers.L1(0.001))(inp)
        h = Penalty()(h)
        h = keras.layers.Dense(16, activation="tanh")(h)
        out = keras.layers.Dense(3, kernel_regularizer="l2")(h)
        model = keras.Model(inp, out)
        # optimizer("adam"): epsilon 1e-3, as the weights are compared at atol 1e-5 (see optimizer)
        model.compile(optimizer=optimizer("adam"), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = data("mlp")
    reference, ref_steps = make(), StepLosses()
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[ref_steps])
    model, steps = make(), StepLosses()
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[steps],
                overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / 'r'}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    assert_same_weights(model, reference)


@pytest.mark.parametrize("layout", ["one", "dp2"])
def test_a_last_smaller_batch_trains_and_evaluates_as_in_keras(layout, tmp_path):
    """20 samples in batches of 8: the last batch has 4 rows (split 2 + 2 on dp2)."""
    x, y = data("mlp")
    x, y = np.concatenate([x, x[:4]]), np.concatenate([y, y[:4]])
    reference, ref_steps = build("mlp", "adam"), StepLosses()
    ref = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[ref_steps],
                        validation_data=(x[:12], y[:12]), validation_batch_size=8).history
    model, steps = build("mlp", "adam"), StepLosses()
    ours = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[steps],
                       validation_data=(x[:12], y[:12]), validation_batch_size=8,
                       overrides=LAYOUTS.get(layout, []) + [f"run.dir={tmp_path / 'r'}"]).history
    assert len(steps.losses) == len(ref_steps.losses) == EPOCHS * 3
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    for key in ref:
        np.testing.assert_allclose(ours[key], ref[key], rtol=1e-4, err_msg=key)
    assert_same_weights(model, reference)
