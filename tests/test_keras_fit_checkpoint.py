"""``phalanx.fit``'s checkpoints are written per device by logical name (format 3): each device
writes the slices it holds (a tensor shard's ZeRO slices on its tensor rank of each replica), the
state is written once, and a checkpoint restores into any layout.

The oracle is Keras's own one-device ``model.fit`` of the same model on the same data.
"""

from __future__ import annotations

import doctest
import json

import keras
import numpy as np

import phalanx
from phalanx import checkpoint
from phalanx.engines import keras_slots, keras_state

from test_keras_zero import ADAM_EPS, StepLosses, copy_weights, logical, tp_model

N, BATCH = 16, 8  # 2 steps an epoch
TP_LAYOUT = ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2", "parallel.zero=3"]


def latest(run_dir):
    return checkpoint.latest(run_dir / "checkpoints")


def test_dp2_zero3_tp2_resumes_on_one_device_and_back(tmp_path):
    """Epoch 1 at dp2 x zero3 x tp2, epoch 2 resumed on one device (tp=1: whole weights), epoch 3
    resumed at dp2 x zero3 x tp2 again: the losses and weights of Keras's uninterrupted 3-epoch
    fit (float32 sums in another order: the layout tests' 1e-4; Adam epsilon 1e-2 keeps the
    round-off of a step below 1e-6, test_keras_zero.ADAM_EPS)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 6)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")
    reference, ref_steps = tp_model(1), StepLosses()
    reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[ref_steps])
    run = [f"run.dir={tmp_path}"]
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)

    losses = []
    first = tp_model(2)
    copy_weights(tp_model(1), first)
    steps = StepLosses()
    phalanx.fit(first, x, y, epochs=1, callbacks=[steps], overrides=TP_LAYOUT + run, **fit)
    losses += steps.losses
    written_at_tp2 = latest(tmp_path)

    one = tp_model(1)  # fresh weights: everything comes from the tp2 x zero3 checkpoint
    steps = StepLosses()
    phalanx.fit(one, x, y, epochs=2, callbacks=[steps], overrides=run, **fit)
    losses += steps.losses
    assert int(one.optimizer.iterations.numpy()) == 2 * N // BATCH

    back = tp_model(2)
    steps = StepLosses()
    phalanx.fit(back, x, y, epochs=3, callbacks=[steps], overrides=TP_LAYOUT + run, **fit)
    losses += steps.losses

    np.testing.assert_allclose(losses, ref_steps.losses, rtol=1e-4)
    for mine, want in zip(logical(back), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
    assert int(back.optimizer.iterations.numpy()) == 3 * N // BATCH
    assert_each_device_wrote_its_slices(written_at_tp2)


def assert_each_device_wrote_its_slices(path) -> None:
    """Read with NumPy and JSON alone: the state is written once (the data files hold every
    logical tensor's bytes once, plus the 64-byte alignment), every device wrote a share, and a
    tensor-parallel weight's pieces are the boxes of (replica k's ZeRO slice) x (tensor rank t):
    ``col/kernel`` [8, 16] is cut by columns over tp=2 (8 each), each shard [8, 8] by rows over
    dp=2 (4 each); the Adam moments beside it alike."""
    index = json.loads((path / "index.json").read_text())["tensors"]
    state = sum(int(np.prod(e["shape"])) * np.dtype(e["dtype"]).itemsize for e in index.values())
    files = sorted((path / "shards").iterdir())
    assert [f.name for f in files] == [f"dp{d}-pp0-tp{t}.bin" for d in range(2) for t in range(2)]
    pieces = sum(len(e["pieces"]) for e in index.values())
    written = sum(f.stat().st_size for f in files)
    assert state <= written <= state + 64 * pieces
    for name, e in index.items():  # no device holds more than its replica's slice of its tensor shard
        volume = int(np.prod(e["shape"]))
        cut = 4 if any("tp1" in p["file"] for p in e["pieces"]) else 2  # (tensor shards) x dp, or dp alone
        if e["shape"]:
            assert all(int(np.prod([b - a for a, b in p["box"]])) <= -(-volume // cut) for p in e["pieces"]), name
            assert len({p["file"] for p in e["pieces"]}) == cut, name
    for name in ("col/kernel", "optimizer/momentum/col/kernel", "optimizer/velocity/col/kernel"):
        got = sorted((p["file"], tuple(map(tuple, p["box"]))) for p in index[name]["pieces"])
        want = sorted((f"shards/dp{k}-pp0-tp{t}.bin", ((4 * k, 4 * k + 4), (8 * t, 8 * t + 8)))
                      for k in range(2) for t in range(2))
        assert index[name]["shape"] == [8, 16] and got == want, name


def mlp():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)], name="mlp")
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=ADAM_EPS),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def write_numbered(root, model, epoch: int, history: dict) -> None:
    """A checkpoint as phalanx.fit wrote them before it wrote per device (its ``_save``): every
    logical tensor whole, numbered by the model's (and optimizer's) logical variables."""
    tensors = {f"model/{i:05d}": e.value() for i, e in enumerate(keras_state.model_entries(model))}
    tensors.update({f"optimizer/{i:05d}": e.value() for i, e in enumerate(keras_state.optimizer_entries(model))})
    signature = [[e.name, list(e.shape)] for e in keras_state.model_entries(model)]
    checkpoint.save(root / "checkpoints", int(model.optimizer.iterations.numpy()), tensors,
                    meta={"epoch": epoch, "history": history, "keras_variables": signature, "model": model.name})


def test_a_checkpoint_of_whole_numbered_tensors_still_loads(tmp_path):
    """A checkpoint written the way phalanx.fit wrote them before (whole tensors, ``model/00000``)
    of Keras's own first epoch resumes into dp2 x zero1; the second epoch ends as Keras's
    two-epoch fit, and the checkpoint the resumed fit writes is per device."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, N)
    reference = mlp()
    ref = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    first = mlp()
    history = first.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    write_numbered(tmp_path, first, 1, history)

    model = mlp()
    resumed = phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                          overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.zero=1",
                                     f"run.dir={tmp_path}"]).history
    np.testing.assert_allclose(resumed["loss"], ref["loss"], rtol=1e-4)
    for mine, want in zip(model.variables + model.optimizer.variables,
                          reference.variables + reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)
    meta = json.loads((latest(tmp_path) / "meta.json").read_text())
    index = json.loads((latest(tmp_path) / "index.json").read_text())["tensors"]
    assert meta["step"] == 2 * N // BATCH and sorted(p.name for p in (latest(tmp_path) / "shards").iterdir()) == \
        ["dp0-pp0-tp0.bin", "dp1-pp0-tp0.bin"]
    assert "mlp/dense_1/kernel" in index and "optimizer/momentum/mlp/dense_1/kernel" in index, sorted(index)
    assert not any(name.startswith("model/") for name in index)


def test_the_docstring_examples_run():
    assert doctest.testmod(keras_slots).failed == 0
    assert doctest.testmod(keras_state).failed == 0


def test_pruning_masks_saved_per_tensor_rank_resume_on_one_device(tmp_path):
    """train.prune.* at tp2 for one epoch (masks updated at steps 0 and 1), resumed on one device
    for a second (no update after the resume: the masks come from the checkpoint, each tensor
    rank having written its shard's part of a kernel's mask): the weights and masks of the
    uninterrupted one-device run, whose pruning tests/test_keras_prune.py holds to Keras's fit
    with NumPy masks. Without the masks the Adam moments would revive the pruned weights."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 6)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")
    prune_keys = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=1", "train.prune.every=1"]
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    straight = tp_model(1)
    phalanx.fit(straight, x, y, epochs=2, overrides=prune_keys + [f"run.dir={tmp_path / 'straight'}"], **fit)

    run = prune_keys + [f"run.dir={tmp_path / 'resumed'}"]
    first = tp_model(2)
    copy_weights(tp_model(1), first)
    phalanx.fit(first, x, y, epochs=1, overrides=["parallel.devices=cpu:2", "parallel.tp=2"] + run, **fit)
    index = json.loads((latest(tmp_path / "resumed") / "index.json").read_text())["tensors"]
    col = index["prune/mask/col/kernel"]["pieces"]
    assert sorted((p["file"], tuple(map(tuple, p["box"]))) for p in col) == \
        [("shards/dp0-pp0-tp0.bin", ((0, 8), (0, 8))), ("shards/dp0-pp0-tp1.bin", ((0, 8), (8, 16)))]
    resumed = tp_model(1)
    phalanx.fit(resumed, x, y, epochs=2, overrides=run, **fit)
    assert int(resumed.optimizer.iterations.numpy()) == 2 * N // BATCH
    # float32 sums in another order at tp2 for the first epoch: the layout tests' 1e-4
    for mine, want in zip(logical(resumed), logical(straight)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
        assert np.array_equal(mine == 0, want == 0) or mine.ndim < 2
