"""A model's own train_step / test_step / predict_step under phalanx.fit / evaluate / predict,
against Keras's own one-device fit / evaluate / predict of the same model from the same weights.

The model is the shape of keras.io's "Customizing what happens in fit": its train_step
updates only its head and tracks its own metrics. On one device phalanx runs the method as
Keras does; over two data replicas each replica runs it on half the rows and the recorded
gradients are averaged before one apply (MirroredStrategy's numbers). float32, SGD: the
sums differ from one device's only by the order of additions (~1e-7 relative per step), so
rtol 1e-4 over a few steps holds with a wide margin.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import ConfigError

from test_keras_fit import StepLosses

LAYOUTS = {"one": ["parallel.devices=cpu:1"], "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"]}
N, BATCH, EPOCHS = 32, 8, 2


class HeadOnly(keras.Model):
    """Trains its head only; tracks its loss and a mean absolute error of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = keras.layers.Dense(8, activation="tanh", name="body")
        self.head = keras.layers.Dense(1, name="head")
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, x):
        return self.head(self.body(x))

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.head.trainable_variables)
        self.optimizer.apply(grads, self.head.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        self.mae.update_state(y, y_pred)
        # "centre" is no metric's: Keras returns the last batch's value (the replicas' mean here)
        return {"mae": self.mae.result(), "centre": keras.ops.mean(y_pred)}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        y_pred = self(x, training=False)
        return {"pred": y_pred, "shifted": y_pred + 1.0}


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [1.5]], "float32")).astype("float32")


def _model(weights=None):
    model = HeadOnly(name="head_only")
    model(np.zeros((1, 4), "float32"))  # builds the layers
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.fixture(scope="module")
def oracle():
    """Keras's own one-device fit, evaluate and predict: (initial weights, history, weights, eval, pred)."""
    x, y = _data()
    keras.utils.set_random_seed(0)
    model = _model()
    start = [w.copy() for w in model.get_weights()]
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                        validation_data=(x[:12], y[:12]))
    evaluated = model.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    return start, history.history, model.get_weights(), evaluated, predicted


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_own_steps_equal_keras(layout, oracle, tmp_path):
    start, history, weights, evaluated, predicted = oracle
    x, y = _data()
    cfg = phalanx.init(*LAYOUTS[layout], f"run.dir={tmp_path}")
    model = _model(start)
    got = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, config=cfg, verbose=0,
                      validation_data=(x[:12], y[:12]))  # 12 rows: a last batch of 4, 2 rows a replica
    assert sorted(got.history) == ["loss", "mae", "val_centre", "val_mae"]  # validation: the model's test_step
    for key in got.history:
        np.testing.assert_allclose(got.history[key], history[key], rtol=1e-4, err_msg=key)
    assert history["mae"][-1] > 0  # the custom metric is tracked
    for name, w, want, before in zip([v.path for v in model.weights], model.get_weights(), weights, start):
        np.testing.assert_allclose(w, want, rtol=1e-4, atol=1e-6, err_msg=name)
        if "body" in name:  # the step never updates the body
            np.testing.assert_array_equal(w, before, err_msg=name)
        else:
            assert not np.allclose(w, before), name
    ev = phalanx.evaluate(model, x, y, batch_size=BATCH, return_dict=True, config=cfg, verbose=0)
    assert sorted(ev) == ["centre", "mae"]
    for key in ev:
        np.testing.assert_allclose(ev[key], evaluated[key], rtol=1e-4, atol=1e-6, err_msg=key)
    pred = phalanx.predict(model, x, batch_size=BATCH, config=cfg, verbose=0)
    assert sorted(pred) == ["pred", "shifted"]
    for key in pred:
        np.testing.assert_allclose(pred[key], predicted[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("layout", ["one", "dp2"])
def test_a_second_fit_reuses_the_own_step(layout, tmp_path):
    """Two one-epoch fits of the same model: its own train_step is traced once (the second fit
    reuses the first's engine, as Keras's ``fit`` keeps its ``train_function`` until the next
    compile), and the two equal two one-epoch calls of Keras's own ``fit``."""
    x, y = _data()
    ref, model = _model(), _model()
    model.set_weights(ref.get_weights())
    ref_losses, losses, engines = StepLosses(), StepLosses(), []
    for call in range(2):
        ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[ref_losses])
        phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[losses],
                    overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / str(call)}"])
        engines.append(model.__dict__["_phalanx_fit_engine"][1])
    assert engines[0] is engines[1] and engines[0]._train_fn.experimental_get_tracing_count() == 1
    np.testing.assert_allclose(losses.losses, ref_losses.losses, rtol=1e-4)
    for mine, want in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")  # a recompile: traced again
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / 'recompiled'}"])
    assert model.__dict__["_phalanx_fit_engine"][1] is not engines[0]


@pytest.mark.parametrize("overrides, key", [
    (["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"], "parallel.pp"),
    (["train.grad_accum=2"], "train.grad_accum"),
])
def test_other_layouts_refuse_before_any_step(overrides, key, tmp_path):
    x, y = _data()
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ConfigError) as err:
        phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, overrides=[*overrides, f"run.dir={tmp_path / 'r'}"],
                    verbose=0)
    assert err.value.key == key and "HeadOnly.train_step is overridden" in str(err.value)
    assert not (tmp_path / "r").exists()
    for w, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, b)
    if key == "parallel.pp":  # evaluate runs no accumulation: there only the pipeline is refused
        with pytest.raises(ConfigError, match="HeadOnly.test_step is overridden"):
            phalanx.evaluate(model, x, y, batch_size=BATCH, overrides=overrides, verbose=0)


class TwoUpdates(HeadOnly):
    """Applies twice per step: with one optimizer, or (``two_optimizers``) with two, as a GAN."""

    two_optimizers = False

    def train_step(self, data):
        x, y = data
        for layer, optimizer in ((self.head, self.optimizer),
                                 (self.body, self.other if self.two_optimizers else self.optimizer)):
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            optimizer.apply(tape.gradient(loss, layer.trainable_variables), layer.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("two_optimizers", [False, True])
def test_two_updates_per_step_refused_over_replicas(two_optimizers, tmp_path):
    x, y = _data()
    model = TwoUpdates(name="two")
    model(np.zeros((1, 4), "float32"))
    model.two_optimizers = two_optimizers
    model.other = keras.optimizers.SGD(0.05)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.other.build(model.trainable_variables)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="applies gradients again .* in one step"):
        phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0,
                    overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"run.dir={tmp_path}"])
    for w, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, b)


def test_compute_loss_override_still_phalanx_step():
    """A model that overrides compute_loss only keeps phalanx's own step (every layout)."""
    from phalanx.engines import custom_step

    class Scaled(keras.Sequential):
        def compute_loss(self, *args, **kwargs):
            return 2.0 * super().compute_loss(*args, **kwargs)

    model = Scaled([keras.Input((2,)), keras.layers.Dense(1)])
    assert not any(custom_step.overridden(model, m) for m in custom_step.METHODS)


def test_doctests():
    import doctest

    from phalanx.engines import custom_step

    assert doctest.testmod(custom_step).failed == 0


class OwnTestStep(keras.Sequential):
    """Overrides test_step only: phalanx's own step trains it on every layout."""

    def test_step(self, data):
        x, y = data
        # Not a metric: over replicas Keras's MirroredStrategy (and phalanx) report its mean
        return {"mse": keras.ops.mean(keras.ops.square(self(x, training=False) - y))}


def test_a_test_step_override_refuses_only_the_validation_it_cannot_run(tmp_path):
    x, y = _data()
    model = OwnTestStep([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    pp2 = ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"]
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0,
                          overrides=[*pp2, f"run.dir={tmp_path / 'a'}"])
    assert sorted(history.history) == ["loss"]
    with pytest.raises(ConfigError, match="OwnTestStep.test_step is overridden") as err:
        phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(x, y),
                    overrides=[*pp2, f"run.dir={tmp_path / 'b'}"])
    assert err.value.key == "parallel.pp"
    dp2 = ["parallel.devices=cpu:2", "parallel.dp=2"]
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, validation_data=(x, y),
                          overrides=[*dp2, f"run.dir={tmp_path / 'c'}"])
    want = float(np.mean((model.predict(x[-BATCH:], verbose=0) - y[-BATCH:]) ** 2))  # Keras: the last batch's
    np.testing.assert_allclose(history.history["val_mse"], [want], rtol=1e-4)
