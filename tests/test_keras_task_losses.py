"""KerasTask's loss is Keras's ``compute_loss``: the compiled loss plus ``model.losses`` (the
losses the layers add with ``add_loss`` in the call, and the weights' regularisation losses).
The oracle is Keras's own train step (``train_on_batch``) of the same model on one device,
with Keras's AdamW set as phalanx's (constant lr, no weight decay, epsilon 1e-12: the two
place epsilon differently, test_moe_train.py). On dp2 each replica adds its own rows'
``add_loss`` term (their mean over the replicas is the whole batch's here: a mean over rows
of equal count)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from phalanx.config import Config
from phalanx.engines.factory import build_engine
from phalanx.engines.task import KerasTask

CFG = Config().replace(train={"global_batch": 8, "lr": 0.05, "warmup": 0, "weight_decay": 0.0, "eps": 1e-12,
                              "clip_norm": 0.0, "min_lr_ratio": 1.0, "steps": 10},
                       precision={"policy": "float32"})


class ActivityPenalty(keras.layers.Layer):
    """Adds ``coef x mean(x^2)`` of its input with ``add_loss``."""

    def __init__(self, coef: float, **kwargs):
        super().__init__(**kwargs)
        self.coef = coef

    def call(self, x):
        self.add_loss(self.coef * keras.ops.mean(keras.ops.square(x)))
        return x


def build() -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((5,))
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05))(x)
    h = ActivityPenalty(0.5)(h)
    return keras.Model(x, keras.layers.Dense(1)(h))


def batches(n: int = 3):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(8, 5)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")) for _ in range(n)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_keras_task_adds_the_models_own_losses_as_keras_fit(devices, replicas):
    reference = build()
    t = CFG.train
    reference.compile(optimizer=keras.optimizers.AdamW(learning_rate=t.lr, weight_decay=0.0, beta_1=t.beta1,
                                                       beta_2=t.beta2, epsilon=t.eps),
                      loss=keras.losses.MeanSquaredError())
    # the engine phalanx train builds for the Trainer's Keras task on `replicas` data replicas
    cfg = CFG.replace(parallel={"dp": replicas, "devices": f"cpu:{replicas}"})
    ours = build_engine(cfg, KerasTask(build, keras.losses.MeanSquaredError()))
    assert ours.dp == replicas
    data = batches()
    x, y = data[0]
    plain = float(keras.losses.MeanSquaredError()(y, reference(x)))
    assert float(reference.evaluate(x, y, verbose=0)) - plain > 1e-2  # the added losses are a real part of it
    for x, y in data:
        want = reference.train_on_batch(x, y, return_dict=True)["loss"]
        np.testing.assert_allclose(float(ours.train_step((x, y))["loss"]), want, rtol=1e-5)
    for got, want in zip(ours.model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(np.asarray(got.numpy()), np.asarray(want.numpy()), rtol=1e-4, atol=1e-6,
                                   err_msg=want.path)
