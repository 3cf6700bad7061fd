"""``train.prune.*`` for any Keras model through ``phalanx.fit``.

Oracle: Keras's own one-device ``fit`` with :class:`NumpyPruning`, a callback written here
that computes magnitude masks with NumPy on the same schedule (before the batches that follow
``start, start + every, ... end`` completed steps) and multiplies the kernels by them before
those batches and after every batch. SGD, so the compared weights carry only the round-off of
reordered sums (rtol 1e-5; 1e-4 where the tensor-parallel layout reorders the sums further).
Across layouts the masks themselves are compared exactly, and the sparsity and the N:M
structure are counted directly.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx import checkpoint
from phalanx.prune import MASK_PREFIX
from phalanx.config import ConfigError
from phalanx.engines import keras_slots
from phalanx.prune.keras import prunable_weights

from test_keras_hub import StepLosses, data
from test_keras_recompute import gpt2

PRUNE = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=4", "train.prune.every=2"]


def kernels_of(model) -> list:
    """Dense / EinsumDense / Conv kernels (what phalanx prunes), in ``model.weights`` order."""
    kinds = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D, keras.layers.Conv2D)
    kernels = {id(layer._kernel) for layer in model._flatten_layers(include_self=False) if isinstance(layer, kinds)}
    return [v for v in model.weights if id(v) in kernels]


def input_axes(model) -> list[int]:
    """The axis N:M groups run along for each of :func:`kernels_of`: axis -2 of a Dense or Conv
    kernel, the last axis an EinsumDense's equation contracts."""
    axes = {}
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.EinsumDense):
            lhs, out = layer.equation.split("->")
            axes[id(layer._kernel)] = max(i for i, c in enumerate(lhs.split(",")[1]) if c not in out)
    return [axes.get(id(v), len(v.shape) - 2) for v in kernels_of(model)]


class NumpyPruning(keras.callbacks.Callback):
    """Gradual magnitude pruning as phalanx documents it, in NumPy, for Keras's own fit."""

    def __init__(self, kernels, target, start, end, every, nm=None, nm_axes=None):
        super().__init__()
        self.kernels, self.target, self.start, self.end, self.every = kernels, target, start, end, every
        self.nm, self.nm_axes = nm, nm_axes
        self.masks = None

    def mask(self, w, sparsity, axis):
        if self.nm is None:
            k = int(round(sparsity * w.size))
            mask = np.ones(w.size, np.float32)
            mask[np.argsort(np.abs(w).ravel(), kind="stable")[:k]] = 0.0
            return mask.reshape(w.shape)
        n, m = self.nm
        zeros = min(m - n, int(round(sparsity * m)))
        moved = np.moveaxis(np.abs(w), axis, -1)
        groups = moved.reshape(moved.shape[:-1] + (moved.shape[-1] // m, m))
        mask = np.ones(groups.shape, np.float32)
        np.put_along_axis(mask, np.argsort(groups, axis=-1, kind="stable")[..., :zeros], 0.0, axis=-1)
        return np.moveaxis(mask.reshape(moved.shape), -1, axis)

    def apply(self):
        for v, m in zip(self.kernels, self.masks):
            v.assign(v.numpy() * m)

    def on_train_batch_begin(self, batch, logs=None):
        t = int(self.model.optimizer.iterations.numpy())
        if self.start <= t <= self.end and ((t - self.start) % self.every == 0 or t == self.end):
            frac = 0.0 if t <= self.start else min(1.0, (t - self.start) / (self.end - self.start))
            sparsity = self.target * (1 - (1 - frac) ** 3) if t > self.start else 0.0
            axes = self.nm_axes or [len(v.shape) - 2 for v in self.kernels]
            self.masks = [self.mask(v.numpy(), sparsity, a) for v, a in zip(self.kernels, axes)]
            self.apply()

    def on_train_batch_end(self, batch, logs=None):
        if self.masks is not None:
            self.apply()


def mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 4)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def xy(shape=(16,), rows=48):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, *shape)).astype("float32"), rng.normal(size=(rows, 4)).astype("float32")


def reference(build, x, y, epochs=2, **prune):
    model, steps = build(), StepLosses()
    callback = NumpyPruning(kernels_of(model), **{"target": 0.5, "start": 0, "end": 4, "every": 2, **prune})
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[callback, steps])
    return model, steps, callback


def saved_masks(run_dir) -> dict[str, np.ndarray]:
    restored = checkpoint.restore_latest(run_dir / "checkpoints")
    return {k: v for k, v in restored.tensors.items() if k.startswith("prune/mask/")}


def assert_same(model, ref, steps, ref_steps, rtol=1e-5, what=""):
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=rtol, err_msg=what)
    for mine, want in zip(model.weights, ref.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=rtol, atol=1e-6, err_msg=f"{what} {mine.path}")


@pytest.mark.parametrize("layout", [[], ["parallel.devices=cpu:2", "parallel.dp=2"],
                                    ["parallel.devices=cpu:2", "parallel.pp=2"]], ids=["one_device", "dp2", "pp2"])
def test_unstructured_pruning_equals_keras_fit_with_numpy_masks(layout, tmp_path):
    x, y = xy()
    ref, ref_steps, callback = reference(mlp, x, y)
    model, steps = mlp(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=layout + PRUNE + [f"run.dir={tmp_path}"])
    assert_same(model, ref, steps, ref_steps, what=str(layout))
    masks = saved_masks(tmp_path)
    assert len(masks) == 3
    for v, want, got in zip(kernels_of(model), callback.masks, [masks[k] for k in sorted(masks)]):
        np.testing.assert_array_equal(got, want)
        # exactly round(0.5 x size) weights of every kernel are zero: the optimizer revived none
        assert int(np.count_nonzero(v.numpy() == 0)) == round(0.5 * v.numpy().size), v.path


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
@pytest.mark.parametrize("layout", [[], ["parallel.devices=cpu:2", "parallel.pp=2"]], ids=["one_device", "pp2"])
def test_pruning_a_cnn_with_batchnorm_equals_keras_fit(layout, pattern, tmp_path):
    """The Conv2D kernel (2:4 groups along its input channels, axis -2) and the Dense head's, on
    one device and cut into two pipeline stages (one micro-batch: BatchNorm sees Keras's
    batches): Keras's fit with the NumPy masks, and the checkpointed masks are those masks."""
    x, y = xy((8, 8, 4), rows=32)
    ref, ref_steps, callback = reference(cnn, x, y, nm=None if pattern == "unstructured" else (2, 4))
    model, steps = cnn(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=layout + PRUNE + [f"train.prune.pattern={pattern}", f"run.dir={tmp_path}"])
    assert_same(model, ref, steps, ref_steps, what=f"{layout} {pattern}")
    masks = saved_masks(tmp_path)
    assert len(masks) == 2
    for want, got in zip(callback.masks, [masks[k] for k in sorted(masks)]):
        np.testing.assert_array_equal(got, want)
    conv = kernels_of(model)[0].numpy()  # [3, 3, 4, 8]
    assert np.count_nonzero(conv == 0) == round(0.5 * conv.size)
    if pattern == "2:4":  # two zeros in every group of 4 input channels
        assert (np.count_nonzero(conv.reshape(9, 1, 4, 8) == 0, axis=2) == 2).all()


def test_two_four_pruning_equals_keras_fit_and_keeps_two_of_every_four(tmp_path):
    x, y = xy()
    ref, ref_steps, callback = reference(mlp, x, y, nm=(2, 4))
    model, steps = mlp(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["train.prune.target=0.5", "train.prune.pattern=2:4", "train.prune.start=0",
                           "train.prune.end=4", "train.prune.every=2", f"run.dir={tmp_path}"])
    assert_same(model, ref, steps, ref_steps)
    for v in kernels_of(model):
        w = v.numpy()  # [in, out]: groups of 4 consecutive inputs
        groups = w.T.reshape(w.shape[1], w.shape[0] // 4, 4)
        assert (np.count_nonzero(groups == 0, axis=-1) == 2).all(), v.path


def test_a_model_built_on_its_first_batch_is_pruned(tmp_path):
    """No keras.Input: the kernels exist once the engine has built the model."""
    x, y = xy()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                overrides=PRUNE + [f"run.dir={tmp_path}"])
    for v in kernels_of(model):
        assert int(np.count_nonzero(v.numpy() == 0)) == round(0.5 * v.numpy().size), v.path


def test_masks_resume_from_the_epoch_checkpoint(tmp_path):
    """Two epochs in one fit equal one epoch, then a second fit resuming from its checkpoint:
    the masks installed at step 4 come back from the checkpoint (the schedule has no update
    after it), and keep the revived weights at zero."""
    x, y = xy()
    prune = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=4", "train.prune.every=4"]
    straight = mlp()
    phalanx.fit(straight, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                overrides=prune + [f"run.dir={tmp_path / 'straight'}"])
    first = mlp()
    phalanx.fit(first, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                overrides=prune + [f"run.dir={tmp_path / 'resumed'}"])
    assert len(saved_masks(tmp_path / "resumed")) == 3
    resumed = mlp()  # a fresh model object: its weights and masks come from the checkpoint
    phalanx.fit(resumed, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                overrides=prune + [f"run.dir={tmp_path / 'resumed'}"])
    for mine, want in zip(resumed.weights, straight.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-6, atol=1e-7, err_msg=mine.path)
    for v in kernels_of(resumed):
        assert int(np.count_nonzero(v.numpy() == 0)) == round(0.5 * v.numpy().size), v.path


def llama():
    """tests/test_keras_hub.py's small Llama (4 query heads, 2 key/value heads, untied head),
    compiled with SGD as :func:`gpt2`."""
    from test_keras_hub import build

    model = build("llama")
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


CAUSAL_LMS = {"gpt2": lambda: gpt2(dropout=0.0), "llama": llama}
# Prunable kernels of 2 blocks: GPT-2's q, k, v, out + fc, proj; Llama's q, k, v, out + gate, up, down
KERNELS = {"gpt2": 12, "llama": 14}


@pytest.mark.parametrize("kind,pattern", [("gpt2", "unstructured"), ("gpt2", "2:4"), ("llama", "2:4")])
def test_pruning_keras_hub_on_tp2_equals_one_device_and_keras_fit(kind, pattern, tmp_path):
    """The attention's EinsumDense kernels and the MLP's Dense kernels of GPT-2 and Llama; at
    tp=2 they are the preset's tensor-parallel layers, and each shard's mask is its part of the
    mask over the whole kernel: the joined masks equal the one-device run's and the NumPy
    reference's. 2:4 groups along the input axis: hidden for q/k/v (GPT-2 [16, 2, 8]; Llama's
    key/value [16, 2, 4], grouped-query heads), head_dim for the output (cut along heads), the
    input of the MLP's kernels."""
    x, y = data()
    prune = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=2", "train.prune.every=1",
             f"train.prune.pattern={pattern}"]
    build = CAUSAL_LMS[kind]
    ref, ref_steps = build(), StepLosses()
    callback = NumpyPruning(kernels_of(ref), 0.5, 0, 2, 1, nm=None if pattern == "unstructured" else (2, 4),
                            nm_axes=input_axes(ref))
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[callback, ref_steps])
    runs = {}
    for layout, overrides in {"one_device": [], "tp2": ["parallel.devices=cpu:2", "parallel.tp=2"]}.items():
        model, steps = build(), StepLosses()
        phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                    overrides=overrides + prune + [f"run.dir={tmp_path / layout}"])
        # each mask is named by its kernel's logical name in this layout's model: in the kernels' order
        name_of = {id(v): name for name, parts in keras_slots.logical_parts(model).items() for v, _ in parts}
        keys = [MASK_PREFIX + name_of[id(w.variables[0])] for w in prunable_weights(model)]
        phalanx.unparallelize(model)
        assert_same(model, ref, steps, ref_steps, rtol=1e-4, what=layout)
        masks = saved_masks(tmp_path / layout)
        assert sorted(masks) == sorted(keys), layout
        runs[layout] = [masks[key] for key in keys]
    assert len(runs["one_device"]) == len(kernels_of(ref)) == KERNELS[kind]
    assert len(runs["tp2"]) == len(runs["one_device"])
    for layout, masks in runs.items():
        for i, (mask, want) in enumerate(zip(masks, callback.masks)):
            np.testing.assert_array_equal(mask, want, err_msg=f"{layout} kernel {i}")


def test_bad_prune_settings_are_refused_before_anything_is_written(tmp_path):
    x, y = xy()
    with pytest.raises(ConfigError, match="train.prune.pattern.*input axis"):
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse")
        phalanx.fit(model, x[:, :6], y, batch_size=8, verbose=0,
                    overrides=["train.prune.target=0.5", "train.prune.pattern=2:4", f"run.dir={tmp_path / 'a'}"])
    embedding_only = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 4)])
    embedding_only.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ConfigError, match="train.prune.target.*no kernel"):
        phalanx.fit(embedding_only, np.zeros((8, 3), "int32"), np.zeros((8, 3, 4), "float32"), batch_size=8,
                    verbose=0, overrides=["train.prune.target=0.5", f"run.dir={tmp_path / 'b'}"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_pruning_under_zero_equals_keras_fit(zero, tmp_path):
    """dp2 with the weights (3), or the optimizer state (1) and the gradients (2) sliced over the replicas: the masks
    are applied to the weights the optimizer updates, and its state and step count carry on
    across the mask updates: Keras's fit with the NumPy masks."""
    x, y = xy()
    ref, ref_steps, callback = reference(mlp, x, y)
    model, steps = mlp(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"parallel.zero={zero}"] + PRUNE +
                [f"run.dir={tmp_path}"])
    assert_same(model, ref, steps, ref_steps, what=f"zero={zero}")
    for mine, want in zip(model.optimizer.variables, ref.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=mine.path)
    masks = saved_masks(tmp_path)
    for want, got in zip(callback.masks, [masks[k] for k in sorted(masks)]):
        np.testing.assert_array_equal(got, want)


def test_pruning_under_zero3_joins_no_slices_between_mask_updates(monkeypatch, tmp_path):
    """Under ZeRO-3 the masks are applied to the weights' slices where they live: outside the
    step, nothing is joined from the slices (ZeroSlices._whole, the all-gather) or cut into them
    again (ZeroSlices.load) after a step that updates no mask; only the mask updates (before the
    steps that follow 0, 2, 4 completed steps) join the weights, never the optimizer state, which
    is joined only at the epochs' ends (after 6 and 12 steps). The values: Keras's fit with the
    NumPy masks (rtol as in test_pruning_under_zero_equals_keras_fit)."""
    from phalanx.parallel.keras_zero import ZeroSlices

    calls = []  # (what, optimizer steps completed, whether model.optimizer's state was joined)
    whole, load, store = ZeroSlices._whole, ZeroSlices.load, ZeroSlices.store

    def step_of(slices):
        return int(slices.user.iterations.numpy())

    def spy_whole(self, items, devices):
        if tf.executing_eagerly():  # (the step's own gathers of ZeRO-3 are traced into it)
            calls.append(("join", step_of(self)))
        return whole(self, items, devices)

    def spy_load(self):
        calls.append(("cut", step_of(self)))
        return load(self)

    def spy_store(self, weights=True, state=True):
        calls.append(("store", step_of(self), state))
        return store(self, weights, state)

    monkeypatch.setattr(ZeroSlices, "_whole", spy_whole)
    monkeypatch.setattr(ZeroSlices, "load", spy_load)
    monkeypatch.setattr(ZeroSlices, "store", spy_store)
    x, y = xy()
    ref, ref_steps, _ = reference(mlp, x, y)
    model, steps = mlp(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.zero=3"] + PRUNE +
                [f"run.dir={tmp_path}"])
    assert_same(model, ref, steps, ref_steps, what="zero=3")
    assert len(steps.losses) == 12
    assert {step for what, step, *_ in calls if what == "cut"} <= {0}, calls  # cut once, when the fit starts
    assert {step for what, step, *_ in calls if what == "join"} <= {0, 2, 4, 6, 12}, calls
    assert {step for what, step, state in (c for c in calls if c[0] == "store") if state} == {6, 12}, calls


@pytest.mark.parametrize("zero", [1, 3])
def test_masks_resume_under_zero_equal_keras_fit(zero, tmp_path):
    """dp2 under ZeRO, one epoch, then a second fit resuming from its checkpoint: the masks of
    step 4 (the schedule's last update) come back from the checkpoint and are cut into the
    slices (and the replicas' copies) again: Keras's fit of two epochs with the NumPy masks."""
    x, y = xy()
    ref, _, _ = reference(mlp, x, y, every=4)
    prune = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=4", "train.prune.every=4"]
    layout = ["parallel.devices=cpu:2", "parallel.dp=2", f"parallel.zero={zero}", f"run.dir={tmp_path}"]
    phalanx.fit(mlp(), x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, overrides=prune + layout)
    resumed = mlp()  # a fresh model object: its weights and masks come from the checkpoint
    phalanx.fit(resumed, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, overrides=prune + layout)
    for mine, want in zip(resumed.weights, ref.weights):  # SGD: rtol as in assert_same
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=mine.path)
    for v in kernels_of(resumed):
        assert int(np.count_nonzero(v.numpy() == 0)) == round(0.5 * v.numpy().size), v.path


def test_pruning_tensor_shards_under_zero3_equals_one_device(tmp_path):
    """dp2 x tp2 at ZeRO-3: each tensor shard's mask (its part of the whole kernel's) is cut
    like that shard's slices. The weights and zeros of the one-device pruned fit, which
    test_unstructured_pruning_equals_keras_fit_with_numpy_masks holds to Keras's fit; Adam, and
    float32 sums in another order at tp2: the layout tests' rtol 1e-4."""
    from test_keras_zero import copy_weights, logical, tp_model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")
    fit = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
    one = tp_model(1)
    phalanx.fit(one, x, y, overrides=PRUNE + [f"run.dir={tmp_path / 'one'}"], **fit)
    sharded = tp_model(2)
    copy_weights(tp_model(1), sharded)
    phalanx.fit(sharded, x, y, overrides=["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2",
                                          "parallel.zero=3"] + PRUNE + [f"run.dir={tmp_path / 'sharded'}"], **fit)
    for mine, want in zip(logical(sharded), logical(one)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
        assert np.array_equal(mine == 0, want == 0) or mine.ndim < 2
