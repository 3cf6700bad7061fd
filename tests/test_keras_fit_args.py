"""Keras's fit arguments phalanx.fit takes as Keras does, against Keras's own one-device fit:
a last batch of any size (53 rows at dp2 and pp2, 3 rows at dp2 x pp2: fewer rows than
micro-batches), ``validation_split`` and ``class_weight``.

Every run starts from the same weights; float32 and SGD with momentum, so the two systems
differ only by the order of additions in each step's sums (~1e-7 relative): rtol 1e-4
over two epochs holds with a wide margin.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import phalanx

LAYOUTS = {
    "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"],
    "pp2": ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"],
    "dp2pp2": ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"],
}


def _mlp():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)], name="mlp")


def _data(n: int):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, (np.abs(x[:, 0] * 2 + x[:, 1]) % 3).astype("int32")


def _compiled(weights=None):
    keras.utils.set_random_seed(5)
    model = _mlp()
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _both(layout: str, tmp_path, **fit_args):
    """(Keras's history and weights, phalanx's history and weights) of the same fit."""
    start = _compiled().get_weights()
    oracle = _compiled(start)
    want = oracle.fit(**fit_args, shuffle=False, verbose=0)
    model = _compiled(start)
    got = phalanx.fit(model, **fit_args, shuffle=False, verbose=0,
                      overrides=[*LAYOUTS[layout], f"run.dir={tmp_path}"])
    return (want.history, oracle.get_weights()), (got.history, model.get_weights())


def _assert_same(want, got):
    (wh, ww), (gh, gw) = want, got
    assert sorted(gh) == sorted(wh)
    for key in wh:
        np.testing.assert_allclose(gh[key], wh[key], rtol=1e-4, err_msg=key)
    for i, (a, b) in enumerate(zip(gw, ww)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=f"weight {i}")


@pytest.mark.parametrize("layout, rows", [("dp2", 64 + 53), ("pp2", 64 + 53), ("dp2pp2", 64 + 3)])
def test_a_last_batch_of_any_size_trains_as_in_keras(layout, rows, tmp_path):
    x, y = _data(rows)
    want, got = _both(layout, tmp_path, x=x, y=y, batch_size=64, epochs=2)
    _assert_same(want, got)


def test_class_weight_as_in_keras(tmp_path):
    x, y = _data(64)
    want, got = _both("dp2", tmp_path, x=x, y=y, batch_size=16, epochs=2, class_weight={0: 0.5, 2: 3.0})
    _assert_same(want, got)
    unweighted = _both("dp2", tmp_path / "plain", x=x, y=y, batch_size=16, epochs=2)[1]
    assert not np.allclose(unweighted[0]["loss"], got[0]["loss"])  # the weights changed the loss


def test_validation_split_as_in_keras(tmp_path):
    x, y = _data(80)
    want, got = _both("pp2", tmp_path, x=x, y=y, batch_size=16, epochs=2, validation_split=0.25)
    assert "val_loss" in got[0]
    _assert_same(want, got)


@pytest.mark.parametrize("args, message", [
    ({"validation_split": 1.5}, "validation_split: 1.5"),
    ({"class_weight": {0: 1.0}, "sample_weight": np.ones(16, "float32")}, "class_weight: cannot be used together"),
    ({"class_weight": [1.0]}, "class_weight: \\[1.0\\] must be a dict"),
])
def test_bad_arguments_name_themselves(args, message, tmp_path):
    x, y = _data(16)
    with pytest.raises(ValueError, match=message):
        phalanx.fit(_compiled(), x, y, batch_size=8, verbose=0, overrides=[f"run.dir={tmp_path / 'r'}"], **args)
    assert not (tmp_path / "r").exists()


def test_doctests():
    import doctest

    from phalanx.engines import keras_model
    from phalanx.train import keras_api

    assert doctest.testmod(keras_api).failed == 0
    assert doctest.testmod(keras_model).failed == 0


class _Crash(keras.callbacks.Callback):
    """Raises once, in the second batch of the third epoch."""

    def __init__(self):
        super().__init__()
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 2 and batch == 1:
            raise RuntimeError("crash")


def _crash_and_rerun(fit, backup_dir) -> keras.callbacks.History:
    with pytest.raises(RuntimeError, match="crash"):
        fit([keras.callbacks.BackupAndRestore(str(backup_dir)), _Crash()])
    return fit([keras.callbacks.BackupAndRestore(str(backup_dir))])


def test_backup_and_restore_resumes_as_in_keras(tmp_path):
    """A crash in epoch 3 of 4, then the same fit again: Keras resumes at epoch 3, so both
    runs together take 4 epochs of optimizer steps (not 6), ending at the same weights."""
    x, y = _data(64)
    start = _compiled().get_weights()
    oracle = _compiled(start)
    want = _crash_and_rerun(lambda cbs: oracle.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                                                   callbacks=cbs), tmp_path / "keras")
    model = _compiled(start)
    runs = iter(["a", "b"])
    got = _crash_and_rerun(lambda cbs: phalanx.fit(
        model, x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=cbs,
        overrides=[*LAYOUTS["dp2"], f"run.dir={tmp_path / next(runs)}"]), tmp_path / "phalanx")
    assert int(oracle.optimizer.iterations) == 16  # 4 epochs of 4 steps
    assert int(model.optimizer.iterations) == int(oracle.optimizer.iterations)
    assert len(got.history["loss"]) == len(want.history["loss"]) == 2
    _assert_same((want.history, oracle.get_weights()), (got.history, model.get_weights()))
