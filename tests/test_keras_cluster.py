"""``phalanx.fit`` of a Keras model on 2 workers under ``phalanx launch`` (loopback), against
the independent oracle: Keras's own one-device ``model.fit`` on the whole global batch.

Every process of ``phalanx launch --workers 2 -- python script.py`` runs the same script:
``phalanx.init("parallel.strategy=multi_worker")`` first, then a small Functional model
(each worker with its *own* random initial weights: the chief's are broadcast), then
``phalanx.fit``. Each worker writes its per-step losses, history, final weights and optimizer
state to JSON; the test compares both workers with Keras's ``fit`` in this process (float32,
rtol 1e-4). Each launch is bounded by the launcher's --timeout and a subprocess timeout.

* 2 workers x 1 device: an MLP with Adam, accuracy and validation data; the chief alone
  writes the run directory and prints; fitting again with more epochs resumes on both;
* 2 workers x 2 local devices (dp2 each): a token table and a position table (read with
  ``range(8)`` by every replica) under Adam against Keras's fit of the model itself;
* 2 workers x 2 local devices (dp2 each): an Embedding (IndexedSlices gradients) and
  BatchNorm model against Keras's fit of a 4-chunk "ghost batch" wrapper whose 4 replicas'
  moving statistics are averaged per step (equal on both workers);
* 2 workers x 1 device: the same model equals dp2 in this process, statistics included;
* 2 workers x 2 local devices: 53 rows in batches of 16, a last batch of 5 rows shared
  unevenly (3 rows, 2 rows; then 2 and 1 replica rows) equals Keras's fit of every batch;
  a batch with fewer rows than workers is refused, naming batch_size;
* workers fed different data stop with an error that says so;
* in one process: parameter_server asks for a model-building function; a cluster joined too late.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from helpers import ghost_batches

N, BATCH = 16, 8

# The model and data, shared by the workers' script and the reference in this process.
MODELS = '''
import keras
import numpy as np

class TokenAndPosition(keras.layers.Layer):
    """A token table read with the batch's ids plus a position table read with range(8)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = keras.layers.Embedding(20, 16), keras.layers.Embedding(8, 16)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(0, keras.ops.shape(x)[-1], 1))

def build(kind, seed, optimizer="adam"):
    keras.utils.set_random_seed(seed)
    if kind == "positions":
        tokens = keras.Input((8,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(16, activation="tanh")(TokenAndPosition()(tokens)))
        model = keras.Model(tokens, keras.layers.Dense(3)(h), name="positions")
    elif kind == "embed":
        tokens = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(20, 16)(tokens)
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(16, activation="relu")(h))
        h = keras.layers.BatchNormalization()(h)
        model = keras.Model(tokens, keras.layers.Dense(3)(h), name="embed")
    else:
        inputs = keras.Input((6,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.Dense(16, activation="tanh")(h)
        model = keras.Model(inputs, keras.layers.Dense(3)(h), name="mlp")
    return model

def compile_model(model, clip=None):
    # Adam epsilon 1e-2 in Keras's fit and the workers alike (Keras's default 1e-7): a gradient's
    # float32 round-off d (~1e-7: sums in another order) moves a step by at most ~2 x lr x d / eps
    # (derivation: tests/helpers.py ADAM_EPS): 2e-7 a step at lr 0.01, so 1.2e-6 in the 6 steps
    # compared with Keras at atol 1e-5 and 8e-7 in the 4 compared with one process at atol 1e-6.
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-2, global_clipnorm=clip),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

def data(kind, n, seed=7):
    rng = np.random.default_rng(seed)
    if kind in ("embed", "positions"):
        x = rng.integers(0, 20, (n, 8)).astype("int32")
    else:
        x = rng.normal(size=(n, 6)).astype("float32")
    return x, rng.integers(0, 3, n)
'''

SCRIPT = '''
import json, os, sys
import phalanx
args = json.loads(sys.argv[1])
cfg = phalanx.init("parallel.strategy=multi_worker", "run.dir=" + args["run_dir"], *args["overrides"])
exec(args["models"])
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
model = build(args["kind"], 3 + 100 * rank)  # each worker its own initial weights
compile_model(model, args.get("clip"))
x, y = data(args["kind"], args["n"])
if args.get("bad_data") and rank == 1:
    x = x[::-1].copy()
val = data(args["kind"], 8, seed=11) if args.get("val") else None
losses = []
record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
history = phalanx.fit(model, x, y, batch_size=args["batch"], epochs=args["epochs"], shuffle=False,
                      validation_data=val, callbacks=[record], verbose=2, config=cfg)
with open(args["out"] + "." + str(rank) + ".json", "w") as f:
    json.dump({"losses": losses, "history": history.history,
               "weights": [np.asarray(v.numpy()).tolist() for v in model.variables],
               "optimizer": [np.asarray(v.numpy()).tolist() for v in model.optimizer.variables]}, f)
'''


def namespace() -> dict:
    ns: dict = {}
    exec(MODELS, ns)
    return ns


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    e["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return e


def launch(tmp_path: Path, name: str, kind: str, epochs: int, overrides=(), run_dir: Path | None = None,
           **extra) -> tuple[subprocess.CompletedProcess, list[dict]]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / name
    args = {"run_dir": str(run_dir or tmp_path / f"{name}-run"), "overrides": list(overrides), "models": MODELS,
            "kind": kind, "n": N, "batch": BATCH, "epochs": epochs, "out": str(out), **extra}
    cmd = [sys.executable, "-m", "phalanx.cli", "launch", "--workers", "2", "--timeout", "100", "--grace", "3", "--",
           sys.executable, str(script), json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env=env())
    results = [json.loads(Path(f"{out}.{k}.json").read_text()) for k in (0, 1)
               if Path(f"{out}.{k}.json").is_file()]
    return proc, results


def keras_reference(kind: str, epochs: int, chunks: int = 1, val: bool = False, replicas: int = 1, n: int = N,
                    batch: int = BATCH, clip: float | None = None):
    """(per-step losses, history, model, optimizer) of Keras's own fit on one device (of the
    ghost-batch wrapper over ``chunks`` pieces in ``replicas`` groups, tests/helpers.py)."""
    ns = namespace()
    model = ns["build"](kind, 3)
    trained = ghost_batches(model, chunks, replicas=replicas) if chunks > 1 else model
    ns["compile_model"](trained, clip)
    x, y = ns["data"](kind, n)
    losses: list[float] = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
    history = trained.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[record],
                          validation_data=ns["data"](kind, 8, seed=11) if val else None)
    return losses, history.history, model, trained.optimizer


def assert_equal_to_keras(result: dict, reference, skip_non_trainable: bool = False) -> None:
    losses, history, model, optimizer = reference
    np.testing.assert_allclose(result["losses"], losses[-len(result["losses"]):], rtol=1e-4, atol=1e-6)
    assert sorted(result["history"]) == sorted(history)
    for key in history:
        np.testing.assert_allclose(result["history"][key], history[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert len(result["weights"]) == len(model.variables)
    for mine, ref in zip(result["weights"], model.variables):
        if ref.trainable or not skip_non_trainable:
            np.testing.assert_allclose(mine, ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=ref.path)
    assert len(result["optimizer"]) == len(optimizer.variables)
    for mine, ref in zip(result["optimizer"], optimizer.variables):
        np.testing.assert_allclose(mine, ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=ref.path)


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("mlp")
    proc, results = launch(tmp_path, "mlp", "mlp", epochs=2, val=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp_path, proc, results


@pytest.mark.slow
def test_two_workers_equal_keras_fit(mlp_run):
    tmp_path, proc, results = mlp_run
    reference = keras_reference("mlp", 2, val=True)
    assert len(results) == 2 and len(results[0]["losses"]) == 2 * N // BATCH
    for result in results:  # both workers: global losses, metrics and weights
        assert_equal_to_keras(result, reference)
    assert "val_loss" in results[0]["history"]
    # Only the chief writes the run directory and prints progress.
    run_dir = tmp_path / "mlp-run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    np.testing.assert_allclose([r["loss"] for r in rows], reference[1]["loss"], rtol=1e-4)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004"]
    assert "[worker:0] phalanx.fit: 'mlp' on layout dp=1 tp=1 pp=1 " in proc.stderr and " workers=2" in proc.stderr
    assert "[worker:1] phalanx.fit" not in proc.stderr and "[worker:1] Epoch" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_workers_resume_from_the_chiefs_checkpoint(mlp_run, tmp_path):
    first_dir, _, _ = mlp_run
    run_dir = tmp_path / "run"
    shutil.copytree(first_dir / "mlp-run", run_dir)
    proc, results = launch(tmp_path, "resumed", "mlp", epochs=3, run_dir=run_dir, val=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[worker:0] resumed from" in proc.stderr
    reference = keras_reference("mlp", 3, val=True)
    for result in results:  # worker 1 resumed from the chief's checkpoint too (broadcast)
        assert len(result["losses"]) == N // BATCH
        assert_equal_to_keras(result, reference)


@pytest.mark.slow
def test_two_workers_with_two_devices_each_sparse_gradients_and_batchnorm(tmp_path):
    proc, results = launch(tmp_path, "embed", "embed", epochs=2, overrides=["parallel.devices=cpu:2",
                                                                            "parallel.dp=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on layout dp=2 tp=1 pp=1 " in proc.stderr and " workers=2" in proc.stderr
    # 2 workers x 2 replicas: each quarter of a batch is normalised with its own statistics, and
    # the 4 replicas' moving statistics are averaged once per step (locally, then across workers).
    reference = keras_reference("embed", 2, chunks=4, replicas=4)
    for result in results:
        assert_equal_to_keras(result, reference)
    # The moving statistics are equal everywhere, and moved: 4 updates at momentum 0.99 move them by
    # ~4e-2 x the batch statistics (~2e-2 here), ten times and more the 1e-5 they equal Keras's at.
    model = reference[2]
    for i, v in enumerate(model.variables):
        if not v.trainable:
            np.testing.assert_array_equal(results[0]["weights"][i], results[1]["weights"][i])
            initial = 0.0 if "mean" in v.path else 1.0
            assert np.abs(np.asarray(results[0]["weights"][i]) - initial).max() > 1e-4, v.path


@pytest.mark.slow
def test_two_workers_with_two_devices_each_join_a_position_table_as_one_device(tmp_path):
    # 4 replicas each look every position up once: one device sees each position once, with the
    # summed gradient, which Adam squares once (rows of the token table: one per occurrence).
    proc, results = launch(tmp_path, "positions", "positions", epochs=2,
                           overrides=["parallel.devices=cpu:2", "parallel.dp=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on layout dp=2 tp=1 pp=1 " in proc.stderr and " workers=2" in proc.stderr
    reference = keras_reference("positions", 2)
    assert len(results) == 2
    for result in results:
        assert_equal_to_keras(result, reference)


@pytest.mark.slow
def test_batchnorm_statistics_of_two_workers_equal_dp2_in_one_process(tmp_path):
    import phalanx

    proc, results = launch(tmp_path, "bn", "embed", epochs=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on layout dp=1 tp=1 pp=1 " in proc.stderr and " workers=2" in proc.stderr
    ns = namespace()
    model = ns["build"]("embed", 3)
    ns["compile_model"](model)
    phalanx.fit(model, *ns["data"]("embed", N), batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"run.dir={tmp_path / 'dp2'}"])
    # The same global layout in one process gives the same numbers, the moving statistics included
    # (only the order of float32 sums differs: ~1e-7, kept below 1e-6 over 4 Adam steps by the
    # epsilon of compile_model) ...
    assert sum(not v.trainable for v in model.variables) == 2  # BatchNorm's moving mean and variance
    for i, v in enumerate(model.variables):
        for result in results:
            np.testing.assert_allclose(result["weights"][i], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=v.path)
    reference = keras_reference("embed", 2, chunks=2, replicas=2)
    for result in results:  # ... both equal Keras's fit of 2 replicas' pieces, averaged per step
        assert_equal_to_keras(result, reference)


@pytest.mark.slow
def test_two_workers_train_an_uneven_last_batch_as_keras(tmp_path):
    # 53 rows in batches of 16: a last batch of 5 rows, 3 on worker 0 (its replicas 2 and 1) and 2
    # on worker 1 (1 and 1). Each piece's mean loss is weighted by its share of the 5 rows, so the
    # summed gradient is that of the batch's mean loss: Keras's, up to float32 summation order.
    proc, results = launch(tmp_path, "uneven", "mlp", epochs=2, n=53, batch=16,
                           overrides=["parallel.devices=cpu:2", "parallel.dp=2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on layout dp=2 tp=1 pp=1 " in proc.stderr and " workers=2" in proc.stderr
    assert "skipped" not in proc.stderr
    reference = keras_reference("mlp", 2, n=53, batch=16)
    assert len(results) == 2
    for result in results:
        assert len(result["losses"]) == 2 * 4  # every batch trained, the short one included
        assert_equal_to_keras(result, reference)


@pytest.mark.slow
@pytest.mark.parametrize("zero,clip", [(1, None), (3, 0.05)])
def test_zero_across_two_workers_of_two_replicas_equals_keras_fit(zero, clip, tmp_path):
    # 2 workers x dp2: every variable cut into 4 slices over the workers' replicas (a [6, 16] kernel
    # into 4 blocks of 2 rows, the last all padding; a [3] bias into 4 flat pieces of 1, one padding).
    # Keras's numbers up to float32 summation order: the tolerances of assert_equal_to_keras (Adam's
    # epsilon of compile_model). global_clipnorm=0.05 clips every step here (the gradient norm of
    # this MLP is ~0.5-1), so each worker's optimizer must use the norm over all 4 slices, the other
    # worker's included (one worker's alone would scale its update differently: off by far more).
    proc, results = launch(tmp_path, f"zero{zero}", "mlp", epochs=2, val=True, clip=clip,
                           overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"parallel.zero={zero}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on layout dp=2 tp=1 pp=1 " in proc.stderr and " workers=2" in proc.stderr
    reference = keras_reference("mlp", 2, val=True, clip=clip)
    assert len(results) == 2
    for result in results:  # weights and the whole optimizer state, gathered from every worker's slices
        assert_equal_to_keras(result, reference)


def test_a_batch_with_fewer_rows_than_workers_is_refused_before_training():
    import tensorflow as tf

    from phalanx.data.keras_inputs import Batches

    x, y = np.zeros([17, 3], "float32"), np.zeros([17], "float32")
    Batches(x, y, batch_size=8, divisor=1)  # in one process any batch trains
    Batches(x[:16], y[:16], batch_size=8, divisor=2)  # no short last batch
    with pytest.raises(ValueError, match=r"batch_size: 8 over 17 samples gives the last batch of 1 samples, fewer "
                                         r"than the 2 workers"):
        Batches(x, y, batch_size=8, divisor=2)
    with pytest.raises(ValueError, match=r"batch_size: 1 over 17 samples gives a batch of 1 samples"):
        Batches(x, y, batch_size=1, divisor=2)
    batches = Batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), divisor=2)
    with pytest.raises(ValueError, match=r"x: the dataset yielded a batch of 1 samples, fewer than the 2 workers"):
        list(batches.epoch())


@pytest.mark.slow
def test_workers_fed_different_data_stop_with_an_error(tmp_path):
    proc, results = launch(tmp_path, "bad", "mlp", epochs=1, bad_data=True)
    assert proc.returncode != 0
    assert "the workers trained on different global batches" in proc.stderr, proc.stderr[-4000:]
    assert not results


# -- refusals in one process ------------------------------------------------------------------------

TWO_WORKERS = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}
WITH_PS = {"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]},
           "task": {"type": "chief", "index": 0}}


def small_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_parameter_server_takes_a_model_building_function(monkeypatch, tmp_path):
    """parameter_server (or auto with ps tasks) trains on the chief (phalanx.train.keras_ps,
    tests/test_keras_ps.py): a model object is refused, asking for a function."""
    import phalanx

    x = np.ones([8, 3], "float32")
    monkeypatch.setenv("TF_CONFIG", json.dumps(WITH_PS))
    for strategy in ("parameter_server", "auto"):
        with pytest.raises(TypeError, match="pass a function that builds and compiles it"):
            phalanx.fit(small_model(), x, x[:, :1], batch_size=4, verbose=0,
                        overrides=[f"parallel.strategy={strategy}", f"run.dir={tmp_path}"])


def test_joining_a_cluster_after_tensorflow_started_says_what_to_move(monkeypatch, tmp_path):
    import tensorflow as tf

    import phalanx
    from phalanx.config import ConfigError

    tf.constant(1.0)  # TensorFlow has started in this process
    monkeypatch.setenv("TF_CONFIG", json.dumps(TWO_WORKERS))
    with pytest.raises(ConfigError, match=r"Move `phalanx.init\('parallel.strategy=multi_worker'\)` to the top"):
        phalanx.init("parallel.strategy=multi_worker")
    x = np.ones([8, 3], "float32")
    with pytest.raises(ConfigError, match=r"call `cfg = phalanx.init\(...\)` first"):
        phalanx.fit(small_model(), x, x[:, :1], batch_size=4, verbose=0,
                    overrides=["parallel.strategy=multi_worker", f"run.dir={tmp_path}"])
