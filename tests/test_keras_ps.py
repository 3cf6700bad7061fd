"""``phalanx.fit`` of a Keras model on parameter servers (``parallel.strategy=parameter_server``).

A real cluster on loopback: ``phalanx launch --workers 2 --ps 1 --keep-going-without-workers``
runs the same script in every process; ``phalanx.init`` turns the worker and ps tasks into
servers, and the chief fits a Keras MLP built by a function (its variables on the ps task),
asynchronously. Mid-fit (epoch 2, step 3) worker:1 is SIGKILLed: the chief's
``ClusterCoordinator`` runs the rest of the steps on worker:0 and the fit finishes.

Asynchronous steps are not bit-equal to Keras's one-device fit (docs/clusters.md), so what
is asserted is what must hold anyway: the loss falls by a clear margin; the model object
returned (``history.model``) holds the trained weights: Keras's own ``evaluate`` on the
chief gives the mean squared error a NumPy computation in this process gets from the saved
model's predictions, and the saved model reloads and predicts what the chief's model
predicted; the last epoch's val_loss is the MSE of those weights on the validation data; the
checkpoint of the last epoch holds those weights; a model with its own train_step trains and
logs what its step returns; every epoch wrote its
checkpoint and metrics row; the variables lived on the ps task.

In one process (fast): the refusals, each naming its key or argument.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from cluster_helpers import PHALANX, Background, assert_gone, task_pids
from test_keras_cluster import WITH_PS, small_model  # a chief with a ps task; a compiled model

EPOCHS, KILL_EPOCH, KILL_STEP = 4, 1, 3

# The model, built by the chief and by the test in one process.
BUILD = '''
import keras


def build():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)], name="mlp")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model
'''

# Every process runs this; only the chief returns from phalanx.init.
SCRIPT = '''
import json, os, sys, time
import phalanx
args = json.loads(sys.argv[1])
cfg = phalanx.init("parallel.strategy=parameter_server", "run.dir=" + args["run_dir"])
import keras
import numpy as np

exec(args["build"])  # build(): the MLP, the same as the test's

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 6)).astype("float32")
y = np.sin(x).sum(axis=1, keepdims=True).astype("float32")


class KillPoint(keras.callbacks.Callback):
    """Stops the chief at one step until the test has killed a worker (a deterministic 'mid-fit')."""

    def __init__(self):
        super().__init__()
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == tuple(args["kill_at"]):
            open(args["out"] + ".paused", "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(args["out"] + ".killed") and time.monotonic() < deadline:
                time.sleep(0.05)


class OwnStep(keras.Model):
    """A model with its own train_step (its logs are its own, not the compiled metrics)."""

    def train_step(self, data):
        import tensorflow as tf
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss, "double": 2.0 * loss}


def build_own_step():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,))
    model = OwnStep(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


# First, a fit of a model with its own train_step (the same process and cluster).
own = phalanx.fit(build_own_step, x, y, batch_size=64, epochs=3, verbose=0, config=cfg,
                  overrides=["run.dir=" + args["run_dir"] + "-own-step"])


history = phalanx.fit(build, x, y, batch_size=16, epochs=args["epochs"], callbacks=[KillPoint()], verbose=2,
                      validation_data=(x[:64] * 0.5, y[:64]), config=cfg)
model = history.model
result = {"history": history.history, "own_step": own.history,
          "evaluate": model.evaluate(x, y, verbose=0, return_dict=True),
          "predict": model.predict(x, verbose=0).tolist(),
          "devices": sorted({v.value.device for v in model.variables + model.optimizer.variables})}
model.save(args["out"] + ".keras")


with open(args["out"] + ".json", "w") as f:
    json.dump(result, f)
'''


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype("float32")
    return x, np.sin(x).sum(axis=1, keepdims=True).astype("float32")


@pytest.mark.slow
def test_keras_fit_on_parameter_servers_survives_a_killed_worker(tmp_path, data):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out, run_dir = tmp_path / "result", tmp_path / "run"
    args = {"run_dir": str(run_dir), "out": str(out), "epochs": EPOCHS, "build": BUILD, "kill_at": [KILL_EPOCH, KILL_STEP]}
    cmd = [*PHALANX, "launch", "--workers", "2", "--ps", "1", "--keep-going-without-workers", "--timeout", "150",
           "--grace", "5", "--", sys.executable, str(script), json.dumps(args)]
    with Background(cmd, tmp_path / "launch", timeout=180) as run:
        run.wait_for(lambda: Path(f"{out}.paused").exists(), "the chief to reach the kill point")
        pids = task_pids(run.stderr())
        os.kill(pids["worker:1"], signal.SIGKILL)
        Path(f"{out}.killed").touch()
        code = run.wait()
        err = run.stderr()
    assert code == 0, err[-4000:]
    assert "worker:1 was killed by signal 9 (SIGKILL); going on without it" in err
    assert "the chief finished with status 0" in err
    assert_gone(pids.values())
    result = json.loads(Path(f"{out}.json").read_text())

    # Every variable (weights, Adam's slots and iterations) lived on the ps task.
    assert result["devices"] == ["/job:ps/replica:0/task:0/device:CPU:0"], result["devices"]
    # The loss falls by a clear margin (asynchronous steps: not Keras's one-device numbers).
    losses = result["history"]["loss"]
    assert len(losses) == EPOCHS and all(np.isfinite(losses)), losses
    assert losses[-1] < 0.5 * losses[0], losses
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, EPOCHS + 1))
    np.testing.assert_allclose([r["loss"] for r in rows], losses, rtol=1e-6)
    assert len(list((run_dir / "checkpoints").glob("step-*"))) >= 1

    # A model's own train_step runs as its step: the epoch's logs are its last step's (Keras's rule
    # when a step returns other keys than the compiled metrics), and it trains.
    own = result["own_step"]
    assert sorted(own) == ["double", "loss"]
    np.testing.assert_allclose(own["double"], 2 * np.asarray(own["loss"]), rtol=1e-6)
    assert own["loss"][-1] < own["loss"][0], own

    # The model object holds the trained weights: the saved model reloads and predicts what the
    # chief's model predicted; Keras's evaluate on the chief is the MSE of those predictions
    # (NumPy, here), and of the order of the last epoch's loss (which was averaged over the
    # epoch's steps while the weights moved).
    x, y = data
    reloaded = keras.models.load_model(f"{out}.keras")
    predicted = reloaded.predict(x, verbose=0)
    np.testing.assert_allclose(predicted, np.asarray(result["predict"]), rtol=1e-5, atol=1e-6)
    mse = float(np.mean((predicted - y) ** 2))
    np.testing.assert_allclose(result["evaluate"]["loss"], mse, rtol=1e-4)
    assert losses[-1] / 3 < mse < losses[-1] * 3, (mse, losses)
    # Validation runs after the epoch's steps have all finished: the last epoch's val_loss is the
    # MSE of the final weights on the validation data (float32 sums in another order: rtol 1e-5).
    val_x, val_y = x[:64] * 0.5, y[:64]
    val_mse = float(np.mean((reloaded.predict(val_x, verbose=0) - val_y) ** 2))
    assert len(result["history"]["val_loss"]) == EPOCHS
    np.testing.assert_allclose(result["history"]["val_loss"][-1], val_mse, rtol=1e-5)

    # The last checkpoint holds the same weights: the same model fitted in one process (here,
    # no cluster) into the run directory resumes from it with nothing left to do.
    import phalanx

    namespace: dict = {}
    exec(BUILD, namespace)
    model = namespace["build"]()
    history = phalanx.fit(model, x, y, batch_size=16, epochs=EPOCHS, verbose=0,
                          overrides=["parallel.devices=cpu:1", f"run.dir={run_dir}"])
    assert history.history["loss"] == pytest.approx(losses, rel=1e-6)
    for mine, saved in zip(model.get_weights(), reloaded.get_weights()):
        np.testing.assert_array_equal(mine, saved)


# -- refusals in one process -------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("parallel.zero=1", "parallel.zero"),
    ("parallel.recompute=full", "parallel.recompute"),
    ("parallel.tp=2", "parallel.strategy"),
    ("parallel.pp=2", "parallel.strategy"),
    ("parallel.ep=2", "parallel.ep"),
    ("parallel.microbatches=2", "parallel.microbatches"),
    ("train.grad_accum=2", "train.grad_accum"),
    ("train.prune.target=0.5", "train.prune.target"),
    ("parallel.dp=2", "parallel.dp"),
])
def test_what_parameter_servers_cannot_honour_is_refused(monkeypatch, tmp_path, override, key):
    import phalanx
    from phalanx.config import ConfigError

    monkeypatch.setenv("TF_CONFIG", json.dumps(WITH_PS))
    x = np.ones([8, 3], "float32")
    with pytest.raises(ConfigError, match=rf"^{key}: "):
        phalanx.fit(small_model, x, x[:, :1], batch_size=4, verbose=0,
                    overrides=["parallel.strategy=parameter_server", override, f"run.dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_model_object_is_refused_and_a_function_asked_for(monkeypatch, tmp_path):
    import phalanx

    monkeypatch.setenv("TF_CONFIG", json.dumps(WITH_PS))
    x = np.ones([8, 3], "float32")
    for strategy in ("parameter_server", "auto"):  # auto: TF_CONFIG has ps tasks
        with pytest.raises(TypeError, match=r"pass a function that builds and compiles it"):
            phalanx.fit(small_model(), x, x[:, :1], batch_size=4, verbose=0,
                        overrides=[f"parallel.strategy={strategy}", f"run.dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_parameter_server_without_a_cluster_says_how_to_start_one(monkeypatch, tmp_path):
    import phalanx
    from phalanx.config import ConfigError

    monkeypatch.delenv("TF_CONFIG", raising=False)
    x = np.ones([8, 3], "float32")
    with pytest.raises(ConfigError, match=r"phalanx launch --workers 2 --ps 1"):
        phalanx.fit(small_model, x, x[:, :1], batch_size=4, verbose=0,
                    overrides=["parallel.strategy=parameter_server", f"run.dir={tmp_path}"])


def test_evaluate_and_predict_point_to_the_trained_model(monkeypatch):
    import phalanx
    from phalanx.config import ConfigError

    monkeypatch.setenv("TF_CONFIG", json.dumps(WITH_PS))
    x = np.ones([8, 3], "float32")
    with pytest.raises(ConfigError, match=r"call model.evaluate\(...\) on the chief"):
        phalanx.evaluate(small_model(), x, x[:, :1], overrides=["parallel.strategy=parameter_server"])
    with pytest.raises(ConfigError, match=r"call model.predict\(...\) on the chief"):
        phalanx.predict(small_model(), x, overrides=["parallel.strategy=parameter_server"])
