"""A ``phalanx.fit`` killed inside an epoch and run again into the same ``run.dir`` ends as the
uninterrupted fit: the same per-step losses, epoch metrics, ``metrics.jsonl`` rows and final
weights, with ``shuffle=True`` (Keras's default), on one device, dp2 and pp2.

The kill is a callback that raises in the middle of an epoch (the last checkpoint is the one of
the epoch before; the half epoch after it is lost, as after a SIGKILL). The rerun builds a fresh
model, as a new process would, so everything it continues from comes out of the checkpoint.

The oracle of the uninterrupted fit is Keras's own one-device ``model.fit``, one epoch at a time on
the rows in the documented order (epoch ``e`` reads the permutation
``numpy.random.default_rng([train.seed, e])``, phalanx.data.keras_inputs), with ``shuffle=False``.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import phalanx

N, BATCH, EPOCHS, KILL_EPOCH = 32, 8, 3, 1  # 4 steps an epoch; killed at step 2 of epoch 1 (0-based)
SEED = 0  # train.seed's default
LAYOUTS = {
    "one": [],
    "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"],
    "pp2": ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"],
}


def build():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)], name="mlp")
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(11)
    return rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, N)


class Killed(BaseException):
    """Not an Exception: nothing in the loop may catch it, as nothing catches a SIGKILL."""


class StepLosses(keras.callbacks.Callback):
    def __init__(self, kill_at=None):
        super().__init__()
        self.kill_at, self.epoch, self.losses = kill_at, None, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        if (self.epoch, batch) == self.kill_at:
            raise Killed()


def weights(model) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.variables]


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def keras_reference():
    """Keras's fit on one device, epoch by epoch, the rows of epoch e in the documented order."""
    x, y = data()
    model, record, history = build(), StepLosses(), {}
    for epoch in range(EPOCHS):
        order = np.random.default_rng([SEED, epoch]).permutation(N)
        logs = model.fit(x[order], y[order], batch_size=BATCH, epochs=epoch + 1, initial_epoch=epoch, shuffle=False,
                         verbose=0, callbacks=[record]).history
        for key, values in logs.items():
            history.setdefault(key, []).extend(values)
    return record.losses, history, weights(model)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_killed_fit_resumes_to_the_uninterrupted_result(layout, tmp_path, keras_reference):
    x, y = data()
    ref_losses, ref_history, ref_weights = keras_reference
    fit = dict(batch_size=BATCH, epochs=EPOCHS, verbose=0)  # shuffle=True: fit's default, as Keras's

    whole = build()
    record = StepLosses()
    history = phalanx.fit(whole, x, y, callbacks=[record], overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / 'a'}"],
                          **fit).history
    # The uninterrupted fit is Keras's fit on the documented order (float32 sums in another order
    # on dp2/pp2: the existing layout tests' 1e-4 bound).
    np.testing.assert_allclose(record.losses, ref_losses, rtol=1e-4, atol=1e-6)
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-4, atol=1e-6, err_msg=key)
    for mine, ref in zip(weights(whole), ref_weights):
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)

    run = LAYOUTS[layout] + [f"run.dir={tmp_path / 'b'}"]
    killed = StepLosses(kill_at=(KILL_EPOCH, 2))
    with pytest.raises(Killed):
        phalanx.fit(build(), x, y, callbacks=[killed], overrides=run, **fit)
    again = build()  # a new process: fresh weights and optimizer, everything else from the checkpoint
    resumed = StepLosses()
    resumed_history = phalanx.fit(again, x, y, callbacks=[resumed], overrides=run, **fit).history

    # The same program on the same layout from the same float32 state: the resumed epochs repeat the
    # uninterrupted run's arithmetic exactly.
    steps = N // BATCH
    assert resumed.losses == record.losses[KILL_EPOCH * steps:]
    assert killed.losses == record.losses[:KILL_EPOCH * steps + 3]
    assert resumed_history == history
    for mine, ref in zip(weights(again), weights(whole)):
        np.testing.assert_array_equal(mine, ref)
    assert rows(tmp_path / "b") == rows(tmp_path / "a")


def test_steps_per_epoch_across_passes_resumes_mid_pass(tmp_path):
    """With steps_per_epoch, one shuffled pass spans epochs: 3 steps an epoch over 4 batches a pass
    read 3, 1 (the pass runs dry: Keras ends that epoch early), 3, 1 batches. Killed in epoch 1, the
    rerun continues pass 0 at its batch 3, then pass 1."""
    x, y = data()
    fit = dict(batch_size=BATCH, epochs=4, steps_per_epoch=3, verbose=0)
    whole, record = build(), StepLosses()
    with pytest.warns(UserWarning, match="ran out of data"):
        phalanx.fit(whole, x, y, callbacks=[record], overrides=[f"run.dir={tmp_path / 'a'}"], **fit)
    assert len(record.losses) == 3 + 1 + 3 + 1
    run = [f"run.dir={tmp_path / 'b'}"]
    with pytest.raises(Killed):
        phalanx.fit(build(), x, y, callbacks=[StepLosses(kill_at=(1, 0))], overrides=run, **fit)
    again, resumed = build(), StepLosses()
    with pytest.warns(UserWarning, match="ran out of data"):
        phalanx.fit(again, x, y, callbacks=[resumed], overrides=run, **fit)
    assert resumed.losses == record.losses[3:]
    for mine, ref in zip(weights(again), weights(whole)):
        np.testing.assert_array_equal(mine, ref)
