"""ZeRO stage 1 on the Keras-model engine (``parallel.zero=1``): each trainable variable and
the optimizer slots Keras creates beside it live with one owner replica, chosen greedily by
bytes; the owner sums the variable's gradient over the replicas and applies the update, the
other replicas read refreshed copies.

The oracle is Keras's own one-device ``model.fit`` with the same optimizer (for the MoE
model: the ghost-batch model of tests/helpers.py, each replica's micro-batch balancing its own
tokens) and, for the built-in MoE GPT, the built-in GPT's one-device engine. The optimizer
state per device is read from the devices of the slot variables themselves.
"""

from __future__ import annotations

import doctest
import types

import keras
import numpy as np
import pytest

import phalanx
from phalanx.config import Config, ConfigError, load_config
from phalanx.engines import keras_model
from phalanx.engines.keras_model import KerasModelEngine
from phalanx.layers import ColumnParallelDense, MoE, ParallelMLP, RowParallelDense
from phalanx.layers.sharding import ShardedLayer, placement_of
from phalanx.mesh import Mesh

from helpers import ghost_batches

N, BATCH, EPOCHS = 16, 8, 2
ZERO = ["parallel.zero=1"]


def replica_of(device: str, mesh_devices: list[str], dp: int) -> int:
    """The data replica of a device of a ``dp x rest`` mesh (parallel.devices order)."""
    index = mesh_devices.index(device)
    return index // (len(mesh_devices) // dp)


def local(i: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:CPU:{i}"


def device_index(variable) -> int:
    return int(variable.value.device.rsplit(":", 1)[-1])


class StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


# -- a plain Keras model: dp2, dp2 x pp2, dp4 -------------------------------------------------


def mlp(opt):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)], name="mlp")
    model.compile(optimizer=opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def mlp_data():
    rng = np.random.default_rng(7)
    return rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, N)


def adamw_clipped():
    """Keras AdamW: weight decay in its apply, and a global norm clip below the gradients'
    norm (the norm of all the variables' gradients, summed on their several owners)."""
    return keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.2)


def adam():
    return keras.optimizers.Adam(0.01)


def sgd_momentum():
    return keras.optimizers.SGD(0.05, momentum=0.5)


LAYOUTS = {
    "dp2": (["parallel.devices=cpu:2", "parallel.dp=2"], adamw_clipped),
    "dp2pp2": (["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"], adam),
    "dp4": (["parallel.devices=cpu:4", "parallel.dp=4"], sgd_momentum),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_zero1_fit_equals_keras_fit_and_partitions_the_state(layout, tmp_path):
    overrides, opt = LAYOUTS[layout]
    x, y = mlp_data()
    reference = mlp(opt)
    ref_steps = StepLosses()
    ref = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[ref_steps])
    model = mlp(opt)
    steps = StepLosses()
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          callbacks=[steps], overrides=overrides + ZERO + [f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    np.testing.assert_allclose(history.history["accuracy"], ref.history["accuracy"], rtol=1e-4)
    for mine, want in zip(model.variables, reference.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)
    assert len(model.optimizer.variables) == len(reference.optimizer.variables)
    for mine, want in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)
    # The weights (and their slots) live with more than one replica: the state is partitioned.
    dp = int(overrides[1].rsplit("=", 1)[1])
    devices = [local(i) for i in range(int(overrides[0].rsplit(":", 1)[1]))]
    owners = {replica_of(v.value.device, devices, dp) for v in model.trainable_variables}
    assert owners == set(range(dp))
    if layout == "dp2":  # the clip is active, so the global norm mattered
        unclipped = mlp(lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1))
        unclipped.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        assert max(np.max(np.abs(a.numpy() - b.numpy())) for a, b in
                   zip(unclipped.trainable_variables, reference.trainable_variables)) > 1e-3


def slot_bytes_per_device(optimizer) -> dict[str, int]:
    """Bytes of the optimizer's slot variables (not its scalar counters) on each device."""
    slots = {id(v): v for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)) if opt is not None
             for v in opt.variables if len(v.shape)}
    out: dict[str, int] = {}
    for slot in slots.values():
        nbytes = int(np.prod(slot.shape)) * np.dtype(slot.dtype).itemsize
        out[slot.value.device] = out.get(slot.value.device, 0) + nbytes
    return out


def wide(opt=adam):
    """Eight layers of assorted widths: enough variables for the partition to balance."""
    keras.utils.set_random_seed(5)
    layers = [keras.Input((12,))] + [keras.layers.Dense(w, activation="tanh") for w in (32, 24, 32, 16, 24, 8, 16)]
    model = keras.Sequential(layers + [keras.layers.Dense(3)], name="wide")
    model.compile(optimizer=opt(), loss="mse")
    return model


def test_optimizer_state_per_device_is_a_dp_th_and_follows_a_built_optimizer(tmp_path):
    """dp4 zero1: measured on the slot variables' devices, every replica holds about a quarter
    of the Adam state (the greedy bound: the even share plus at most the largest variable's
    slots); zero0 holds it all on replica 0. The model was trained by Keras first, so its
    optimizer was built (slots on device 0): the engine moves each slot beside its variable."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(N, 12)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")
    overrides = ["parallel.devices=cpu:4", "parallel.dp=4"]

    model = wide()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # Keras builds the optimizer
    assert set(slot_bytes_per_device(model.optimizer)) == {local(0)}
    reference = wide()
    reference.fit(x, y, batch_size=BATCH, epochs=1 + EPOCHS, shuffle=False, verbose=0)
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                overrides=overrides + ZERO + [f"run.dir={tmp_path / 'z1'}"])
    for mine, want in zip(model.variables + model.optimizer.variables,
                          reference.variables + reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)
    per_device = slot_bytes_per_device(model.optimizer)
    total = sum(per_device.values())
    largest = max(2 * int(np.prod(v.shape)) * 4 for v in model.trainable_variables)  # Adam: 2 slots
    assert total == 2 * sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert sorted(per_device) == [local(i) for i in range(4)], per_device
    assert max(per_device.values()) <= total / 4 + largest, per_device
    assert max(per_device.values()) < total / 2, per_device  # far from whole: a real partition
    for v in model.trainable_variables:  # every slot beside its variable
        prefix = v.path.replace("/", "_") + "_"
        slots = [s for s in model.optimizer.variables if s.name.startswith(prefix) and s.shape == v.shape]
        assert len(slots) == 2 and all(s.value.device == v.value.device for s in slots), v.path

    plain = wide()
    phalanx.fit(plain, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                overrides=overrides + [f"run.dir={tmp_path / 'z0'}"])
    assert slot_bytes_per_device(plain.optimizer) == {local(0): total}


def test_zero1_under_mixed_float16_with_keras_loss_scaling(tmp_path):
    """Keras's LossScaleOptimizer wraps the optimizer; its inner slots are partitioned, and the
    steps equal the same layout without ZeRO (same arithmetic, other devices), and Keras's own
    mixed_float16 fit to the mixed-precision tolerance of tests/test_keras_fit.py."""
    x, y = mlp_data()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        reference = mlp(adam)
        ref = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    finally:
        keras.config.set_dtype_policy("float32")
    runs = {}
    for zero in (0, 1):
        model = mlp(adam)
        runs[zero] = (model, phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                                         overrides=["parallel.devices=cpu:2", "parallel.dp=2",
                                                    "precision.policy=mixed_float16", f"parallel.zero={zero}",
                                                    f"run.dir={tmp_path / str(zero)}"]).history)
    model, history = runs[1]
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    np.testing.assert_allclose(history["loss"], runs[0][1]["loss"], rtol=1e-6)
    for mine, want in zip(model.variables, runs[0][0].variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-6, atol=1e-7, err_msg=mine.path)
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=2e-2)
    assert len(slot_bytes_per_device(model.optimizer)) == 2


# -- tensor parallelism: a model of phalanx.layers ---------------------------------------------


def tp_model(tp: int):
    keras.utils.set_random_seed(3)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="stem")(x)
    h = RowParallelDense(8, tp=tp, name="row")(ColumnParallelDense(16, tp=tp, activation="relu", name="col")(h))
    h = h + ParallelMLP(16, tp=tp, gated=True, activation="silu", name="mlp")(h)
    model = keras.Model(x, keras.layers.Dense(3, name="head")(h), name="tpnet")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def logical(model) -> list[np.ndarray]:
    out = []
    for layer in model.layers:
        out += list(layer.logical_weights().values()) if isinstance(layer, ShardedLayer) else \
            [np.asarray(w) for w in layer.get_weights()]
    return out


def copy_weights(source, target) -> None:
    for a, b in zip(source.layers, target.layers):
        if isinstance(a, ShardedLayer):
            b.set_logical_weights(a.logical_weights())
        elif a.weights:
            b.set_weights(a.get_weights())


def test_zero1_with_tensor_parallelism_equals_keras_fit(tmp_path):
    """dp2 x tp2: each tensor shard's owner is one of the replicas, on its own tensor rank."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 6)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")
    reference = tp_model(1)
    ref_steps = StepLosses()
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[ref_steps])
    model = tp_model(2)
    copy_weights(tp_model(1), model)
    steps = StepLosses()
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2"] + ZERO +
                [f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    for mine, want in zip(logical(model), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
    # mesh (data, pipe, tensor) = (2, 1, 2): device 2d + r is replica d's tensor rank r
    shards = [v for layer in model.layers if isinstance(layer, ShardedLayer)
              for variables, axis, _ in layer._logical.values() if axis is not None for v in variables]
    ranks = {device_index(v) % 2 for v in shards}
    replicas = {device_index(v) // 2 for v in shards}
    assert ranks == {0, 1} and replicas == {0, 1}
    for layer in model.layers:  # shard r on tensor rank r, whichever replica owns it
        if isinstance(layer, ShardedLayer):
            for variables, axis, _ in layer._logical.values():
                if axis is not None:
                    assert [device_index(v) % 2 for v in variables] == [0, 1], layer.name


# -- expert parallelism: a model with phalanx.layers.MoE ----------------------------------------


def moe_model(ep: int = 1):
    keras.utils.set_random_seed(4)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(16, 8)(tokens)
    h = h + MoE(num_experts=4, hidden_dim=16, top_k=2, aux_loss_coef=1.0, z_loss_coef=0.1, ep=ep, name="moe")(h)
    h = keras.layers.LayerNormalization()(h)
    model = keras.Model(tokens, keras.layers.Dense(16)(h))
    moe_compile(model)
    return model


def moe_compile(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.fixture(scope="module")
def moe_reference():
    """Keras's own fit, batches of 8 cut into 4 calls (each balancing its own tokens): the
    micro-batches of dp2 x ep2 with grad_accum 2 and of dp4 x ep2, in ``replicas`` data replicas
    (tests/helpers.py: how the replicas' MoE figures combine)."""
    fits = {}

    def get(replicas: int):
        if replicas not in fits:
            rng = np.random.default_rng(0)
            x = rng.integers(0, 16, (N, 6)).astype("int32")
            y = np.roll(x, 1, axis=1)
            reference = moe_model()
            trained = ghost_batches(reference, 4, average_added_losses=True, replicas=replicas)
            moe_compile(trained)
            history = trained.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
            fits[replicas] = x, y, history, logical(reference)
        return fits[replicas]

    return get


@pytest.mark.parametrize("layout,dp", [
    ("dp2ep2_accum2", 2),
    ("dp4ep2", 4),
])
def test_zero1_with_expert_parallelism_equals_keras_fit(layout, dp, moe_reference, tmp_path):
    """No token dropped (capacity_factor 0). dp2 x ep2: one group holds the experts, ZeRO
    partitions the rest; dp4 x ep2: two groups hold copies of each expert shard, and the
    shards' owners spread over both groups."""
    x, y, ref, want = moe_reference(dp)
    overrides = [f"parallel.devices=cpu:{dp}", f"parallel.dp={dp}", "parallel.ep=2"] + \
        (["train.grad_accum=2"] if dp == 2 else [])
    model = moe_model(ep=2)
    copy_weights(moe_model(), model)
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          overrides=overrides + ZERO + [f"run.dir={tmp_path}"]).history
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=1e-4)
    for mine, reference in zip(logical(model), want):
        np.testing.assert_allclose(mine, reference, rtol=1e-4, atol=1e-5)
    experts = [v for v in model.trainable_variables
               if placement_of(v) is not None and placement_of(v).axis == "expert"]
    for v in experts:  # shard j lives with replica j of its owner group
        assert device_index(v) % 2 == placement_of(v).rank
    others = [v for v in model.trainable_variables if all(v is not e for e in experts)]
    assert {device_index(v) for v in others} == set(range(dp))  # the rest over every replica
    if dp == 4:
        assert {device_index(v) // 2 for v in experts} == {0, 1}  # expert state over both groups


# -- the built-in MoE GPT (what phalanx train runs for parallel.ep > 1) ---------------------------

TINY = ["model.layers=2", "model.d_model=16", "model.heads=2", "model.ffn=16", "model.seq_len=8",
        "model.experts=4", "model.moe_every=1", "model.top_k=2", "model.capacity_factor=0", "train.global_batch=8",
        "train.lr=1e-2", "train.warmup=1", "train.min_lr_ratio=1", "train.clip_norm=0.5", "train.steps=3",
        "precision.policy=float32", "model.aux_loss_coef=0"]


@pytest.mark.slow
def test_builtin_moe_gpt_dp4_ep2_zero1_equals_the_one_device_engine(devices):
    """The factory's engine for ``phalanx train ... parallel.ep=2 parallel.zero=1`` against the
    built-in GPT's own one-device engine (no balancing loss: each replica would balance its own
    rows): loss, lr and clipped norm per step, then every weight and AdamW moment; the moments
    partitioned over the four replicas."""
    from phalanx.cluster.strategies import local_strategy
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.strategy import StrategyEngine
    from phalanx.engines.task import GPTTask

    cfg = load_config(None, TINY + ["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", *ZERO])
    one = load_config(None, TINY)
    ours = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    ref = StrategyEngine(one, GPTTask(one.model, "float32", one.train.seed), local_strategy(devices[:1]))
    assert isinstance(ours, KerasGPTEngine) and ours.engine.zero == 1
    rng = np.random.default_rng(2)
    norms = []
    for _ in range(3):
        batch = rng.integers(0, 256, (8, 9)).astype("int32")
        a, b = ours.train_step(batch), ref.train_step(batch)
        for key in ("loss", "lr", "grad_norm", "skipped"):
            np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=1e-4, err_msg=key)
        norms.append(float(b["grad_norm"]))
    assert max(norms) > 0.5  # train.clip_norm=0.5 clipped
    mine, want = ours.state_dict(), ref.state_dict()
    assert sorted(mine) == sorted(want)
    for name in want:  # slack at the tensor's scale, as tests/test_moe_train.py (the key bias's round-off)
        scale = float(np.max(np.abs(want[name]))) if np.size(want[name]) else 0.0
        np.testing.assert_allclose(mine[name], want[name], rtol=2e-4, atol=5e-4 * scale + 1e-12, err_msg=name)
    moments: dict[str, int] = {}
    for slot in ours.optimizer.m + ours.optimizer.v:
        moments[slot.device] = moments.get(slot.device, 0) + int(np.prod(slot.shape)) * 4
    total = sum(moments.values())
    largest = max(2 * int(np.prod(v.shape)) * 4 for v in ours.model.trainable_variables)
    assert sorted(moments) == [local(i) for i in range(4)], moments
    assert max(moments.values()) <= total / 4 + largest, moments
    for var, m in zip(ours.model.trainable_variables, ours.optimizer.m):
        assert m.device == var.value.device


@pytest.mark.slow
def test_phalanx_train_moe_yaml_at_dp4_ep2_zero1_equals_the_one_device_run(tmp_path):
    """The command itself: configs/moe.yaml made small (8 experts top-2, no token dropped, no
    balancing loss, float32, an active clip) at dp4 x ep2 with parallel.zero=1, against the
    one-device run: the logged losses, learning rates and clipped norms step for step."""
    from pathlib import Path

    from phalanx.cli import main
    from phalanx.train.progress import read_metrics

    config = str(Path(__file__).resolve().parents[1] / "configs" / "moe.yaml")
    small = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=32", "model.seq_len=16",
             "train.global_batch=8", "train.steps=4", "train.lr=1e-2", "train.warmup=1", "train.min_lr_ratio=1",
             "train.clip_norm=0.5", "train.log_every=1", "train.eval_every=0", "model.aux_loss_coef=0",
             "precision.policy=float32", "data.max_bytes=200000", f"data.cache_dir={tmp_path / 'cache'}"]
    rows = {}
    for run, layout in (("one", ["parallel.devices=cpu:1", "parallel.dp=1", "parallel.ep=1"]),
                        ("zero1", ["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", *ZERO])):
        assert main(["train", config, "--quiet", *small, *layout, f"run.dir={tmp_path / run}"]) == 0
        rows[run] = read_metrics(tmp_path / run)
    assert [r["step"] for r in rows["zero1"]] == [1, 2, 3, 4]
    for key in ("loss", "lr", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in rows["zero1"]], [r[key] for r in rows["one"]], rtol=1e-4,
                                   err_msg=key)
    assert max(r["grad_norm"] for r in rows["one"]) > 0.5  # the clip was active


# -- refusals ----------------------------------------------------------------------------------------


def test_what_zero_on_the_keras_engine_does_not_run_is_refused(tmp_path):
    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask

    x, y = mlp_data()
    with pytest.raises(ConfigError, match=r"parallel.zero: 2: .*use parallel.zero=1"):
        phalanx.fit(mlp(adam), x, y, batch_size=BATCH, verbose=0,
                    overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.zero=2", f"run.dir={tmp_path}"])
    assert not (tmp_path / "checkpoints").exists()  # refused before any work
    cfg = load_config(None, ["model.experts=4", "model.moe_every=1", "model.layers=2", "train.global_batch=8",
                             "parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", "parallel.zero=2"])
    with pytest.raises(ConfigError, match=r"parallel.zero: 2"):
        build_engine(cfg, GPTTask(cfg.model))
    # across workers (keras_cluster's WorkerGroup: only its size is read before the refusal)
    model = mlp(adam)
    batch = (x[:BATCH], y[:BATCH], None)
    mesh = Mesh.from_devices([local(0), local(1)], 2, 1, 1)
    with pytest.raises(ConfigError, match=r"parallel.zero: 1: across 2 workers.*parallel.zero=0"):
        KerasModelEngine(model, Config().replace(parallel={"zero": 1, "dp": 2}), mesh, batch,
                         workers=types.SimpleNamespace(size=2))
    with pytest.raises(ConfigError, match=r"parallel.zero: 3: .*0 or 1"):
        keras_model.check_zero(3)


def test_the_docstring_examples_run():
    assert doctest.testmod(keras_model).failed == 0
