"""Tensor parallelism for a user's own Keras model through ``phalanx.fit``.

The oracle is Keras's own one-device ``model.fit`` of the same model built at tp=1 (plain
Dense-equivalent layers) from the same logical weights: per-step losses and every final
weight agree to rtol 1e-4 on tp2, tp2 x pp2 and dp2 x tp2 x pp2 (8 logical CPUs).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import phalanx
from phalanx.config import ConfigError
from phalanx.layers import ColumnParallelDense, ParallelMLP, RowParallelDense
from phalanx.layers.sharding import ShardedLayer

LAYOUTS = {
    "tp2": ["parallel.devices=cpu:2", "parallel.tp=2"],
    "tp2pp2": ["parallel.devices=cpu:4", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"],
    "dp2tp2pp2": ["parallel.devices=cpu:8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                  "parallel.microbatches=2"],
}
N, BATCH = 16, 8
# Adam epsilon 2e-2 (Keras's default 1e-7) in the reference and the run under test alike: the
# weights after up to 6 steps are compared at atol 1e-6, and Adam moves a step by at most
# ~2 x lr x d / epsilon for a gradient round-off d (~1e-7: sums in another order on another
# layout or CPU): 6 x 2 x 0.01 x 1e-7 / 2e-2 = 6e-7 (derivation: tests/helpers.py ADAM_EPS).
ADAM_EPS = 2e-2


def build(tp: int, optimizer=None):
    """Dense -> column (relu) -> row -> residual MLP block -> Dense head."""
    keras.utils.set_random_seed(3)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="stem")(x)
    h = RowParallelDense(8, tp=tp, name="row")(ColumnParallelDense(16, tp=tp, activation="relu", name="col")(h))
    h = h + ParallelMLP(16, tp=tp, gated=True, activation="silu", name="mlp")(h)
    out = keras.layers.Dense(3, name="head")(h)
    model = keras.Model(x, out, name="tpnet")
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01, epsilon=ADAM_EPS), loss="mse")
    return model


def logical(model) -> list[np.ndarray]:
    out = []
    for layer in model.layers:
        if isinstance(layer, ShardedLayer):
            out += list(layer.logical_weights().values())
        else:
            out += [np.asarray(w) for w in layer.get_weights()]
    return out


def copy_weights(source, target) -> None:
    for a, b in zip(source.layers, target.layers):
        if isinstance(a, ShardedLayer):
            b.set_logical_weights(a.logical_weights())
        elif a.weights:
            b.set_weights(a.get_weights())


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 6)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")


class StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tensor_parallel_fit_equals_keras_fit(layout, tmp_path):
    x, y = data()
    reference = build(1)
    ref_steps = StepLosses()
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[ref_steps])
    model = build(2)
    copy_weights(build(1), model)
    steps = StepLosses()
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=LAYOUTS[layout] + [f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    for mine, want in zip(logical(model), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
    # Shard r of every cut weight lives on tensor rank r's device of its stage.
    col = model.get_layer("col")
    assert [v.value.device[-1] for v in col.kernel] != [col.kernel[0].value.device[-1]] * 2


def test_weights_and_optimizer_state_per_device_are_one_tp_th(tmp_path):
    """Measured on the devices: bytes of the sharded layers' weights and Adam slots."""
    x, y = data()
    model = build(2)
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0,
                overrides=LAYOUTS["tp2"] + [f"run.dir={tmp_path}"])
    sharded = {id(v) for layer in model.layers if isinstance(layer, ShardedLayer)
               for variables, axis, _ in layer._logical.values() if axis is not None for v in variables}
    on = {"0": 0, "1": 0}
    total = 0
    for v in model.variables:
        if id(v) in sharded:
            nbytes = int(np.prod(v.shape)) * 4
            on[v.value.device[-1]] += nbytes
            total += nbytes
    slots = {"0": 0, "1": 0}
    for slot in model.optimizer.variables:
        if "_shard" in slot.name:
            slots[slot.value.device[-1]] += int(np.prod(slot.shape)) * 4
    assert on["0"] == on["1"] == total // 2
    assert slots["0"] == slots["1"] == 2 * total // 2  # Adam: momentum + velocity, next to each shard


def test_checkpoints_are_logical_and_resume_on_another_layout(tmp_path):
    """Two epochs at tp2 x pp2, the third resumed on one device: Keras's three epochs."""
    x, y = data()
    reference = build(1)
    ref = reference.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0).history
    run = [f"run.dir={tmp_path / 'run'}"]
    first = build(2)
    copy_weights(build(1), first)
    phalanx.fit(first, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, overrides=LAYOUTS["tp2pp2"] + run)
    resumed = build(1)  # fresh weights: the checkpoint rules
    history = phalanx.fit(resumed, x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, overrides=run)
    np.testing.assert_allclose(history.history["loss"], ref["loss"], rtol=1e-4)
    for mine, want in zip(logical(resumed), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)


def test_layouts_the_model_or_optimizer_cannot_honour_are_refused(tmp_path):
    x, y = data()
    run = [f"run.dir={tmp_path}"]
    plain = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    plain.compile(optimizer="adam", loss="mse")
    with pytest.raises(ConfigError, match="parallel.tp.*no tensor-parallel layers"):
        phalanx.fit(plain, x, y, batch_size=BATCH, verbose=0, overrides=LAYOUTS["tp2"] + run)
    with pytest.raises(ConfigError, match=r"parallel.tp.*cut into \[2\] tensor shards"):
        phalanx.fit(build(2), x, y, batch_size=BATCH, verbose=0,
                    overrides=["parallel.devices=cpu:4", "parallel.tp=4"] + run)
    with pytest.raises(ConfigError, match="clipnorm"):
        phalanx.fit(build(2, keras.optimizers.Adam(clipnorm=1.0)), x, y, batch_size=BATCH, verbose=0,
                    overrides=LAYOUTS["tp2"] + run)
    with pytest.raises(ConfigError, match="Adafactor"):
        phalanx.fit(build(2, keras.optimizers.Adafactor()), x, y, batch_size=BATCH, verbose=0,
                    overrides=LAYOUTS["tp2"] + run)
    assert not (tmp_path / "checkpoints").exists()  # refused before any work


def test_a_pipeline_cut_between_a_column_and_a_row_layer_trains_right(tmp_path):
    """The cut falls between ColumnParallelDense and RowParallelDense: the row layer in stage 1
    must not read the column shards of stage 0 directly (the concat handed on would get no
    gradient, and stage 0 would train on zeros)."""
    def two_layers(tp):
        keras.utils.set_random_seed(5)
        x = keras.Input((6,))
        h = ColumnParallelDense(16, tp=tp, activation="relu", name="col")(x)
        out = RowParallelDense(3, tp=tp, name="row")(h)
        model = keras.Model(x, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    x, y = data()
    reference = two_layers(1)
    ref = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history
    model = two_layers(2)
    copy_weights(two_layers(1), model)
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                          overrides=LAYOUTS["tp2pp2"] + [f"run.dir={tmp_path}"]).history
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=1e-4)
    for mine, want in zip(logical(model), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)


def test_sequence_parallel_key_runs_the_transformer_blocks_sequence_parallel(tmp_path):
    from phalanx.layers import TransformerBlock

    def net(tp):
        keras.utils.set_random_seed(7)
        x = keras.Input((8, 16))
        h = TransformerBlock(num_heads=4, head_dim=4, ffn_dim=32, tp=tp, name="block")(x)
        model = keras.Model(x, keras.layers.Dense(2, name="out")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 8, 16)).astype("float32"), rng.normal(size=(8, 8, 2)).astype("float32")
    reference = net(1)
    ref = reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
    model = net(2)
    copy_weights(net(1), model)
    history = phalanx.fit(model, x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                          overrides=LAYOUTS["tp2"] + ["parallel.sequence_parallel=true", f"run.dir={tmp_path}/a"])
    assert model.get_layer("block").sequence_parallel
    np.testing.assert_allclose(history.history["loss"], ref["loss"], rtol=1e-4)
    with pytest.raises(ConfigError, match="parallel.sequence_parallel.*TransformerBlock"):
        phalanx.fit(build(2), *data(), batch_size=BATCH, verbose=0,
                    overrides=LAYOUTS["tp2"] + ["parallel.sequence_parallel=true", f"run.dir={tmp_path}/b"])
    with pytest.raises(ConfigError, match="parallel.sequence_parallel.*tp > 1"):
        phalanx.fit(net(1), x, y, batch_size=4, verbose=0,
                    overrides=["parallel.sequence_parallel=true", f"run.dir={tmp_path}/c"])
    from phalanx.config import load_config
    from phalanx.engines.task import GPTTask
    from phalanx.engines.factory import build_engine
    with pytest.raises(ConfigError, match="parallel.sequence_parallel.*parallel.tp > 1"):  # refused as it is read
        load_config(None, ["parallel.sequence_parallel=true"])
    cfg = load_config(None, ["parallel.sequence_parallel=true", "parallel.tp=-1", "parallel.devices=cpu:1"])
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):  # tp=-1 filled with 1 device: at build
        build_engine(cfg, GPTTask(cfg.model))


@pytest.mark.parametrize("layout", ["tp2", "tp2pp2", "dp2"])
def test_adamw_weight_decay_equals_keras_fit(layout, tmp_path):
    """Keras's AdamW decays every weight in its ``apply``, before the Adam update: on a layout
    the apply must wait for all the gradients (decaying during the forward would take them at
    decayed weights) and decay each shard as its part of the logical weight. Oracle: Keras's
    one-device fit with the same AdamW."""
    def adamw():
        return keras.optimizers.AdamW(0.01, weight_decay=0.1, epsilon=ADAM_EPS)  # see ADAM_EPS

    x, y = data()
    reference = build(1, adamw())
    ref_steps = StepLosses()
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[ref_steps])
    # the decay is large enough to see at these tolerances: without it the weights differ
    undecayed = build(1, keras.optimizers.AdamW(0.01, weight_decay=0.0, epsilon=ADAM_EPS))
    undecayed.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))
               for a, b in zip(logical(undecayed), logical(reference))) > 1e-2

    tp = 1 if layout == "dp2" else 2
    model = build(tp, adamw())
    copy_weights(build(1), model)
    overrides = ["parallel.devices=cpu:2", "parallel.dp=2"] if layout == "dp2" else LAYOUTS[layout]
    steps = StepLosses()
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=overrides + [f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    for mine, want in zip(logical(model), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
