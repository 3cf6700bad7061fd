"""ZeRO by slices on the Keras-model engine (``parallel.zero=1/2/3``): every trainable variable
cut into one slice per data replica, the user's Keras optimizer applied on the slices; stage 2
reduce-scatters the gradients, stage 3 keeps no whole weight between steps.

The oracle is Keras's own one-device ``model.fit`` with the same optimizer (for the MoE
model: the ghost-batch model of tests/helpers.py, each replica's micro-batch balancing its own
tokens). The state per device is read from the devices of the engine's slice variables.
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
from phalanx.train import keras_api

from helpers import ghost_batches
from test_keras_hub import keras_fit_of  # noqa: F401 (a fixture: Keras's one-device fit of a keras-hub LM, shared)

N, BATCH, EPOCHS = 16, 8, 2
# Adam epsilon 1e-2 in Keras's fit and the run under test alike (Keras's default 1e-7): a gradient's
# float32 round-off d (~1e-7: sums in another order on another layout or CPU) moves a step by at
# most ~2 x lr x d / eps (derivation: tests/helpers.py ADAM_EPS): 2e-7 a step at lr 0.01, 8e-7
# in the 4 steps whose weights are compared at atol 1e-6.
ADAM_EPS = 1e-2


def replica_of(device: str, mesh_devices: list[str], dp: int) -> int:
    """The data replica of a device of a ``dp x rest`` mesh (parallel.devices order)."""
    index = mesh_devices.index(device)
    return index // (len(mesh_devices) // dp)


def local(i: int) -> str:
    return f"/job:localhost/replica:0/task:0/device:CPU:{i}"


def device_index(variable) -> int:
    return cpu_index(variable.value.device)


def cpu_index(device: str) -> int:
    return int(device.rsplit(":", 1)[-1])


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
    return keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.2, epsilon=ADAM_EPS)


def adam():
    return keras.optimizers.Adam(0.01, epsilon=ADAM_EPS)


def sgd_momentum():
    return keras.optimizers.SGD(0.05, momentum=0.5)


LAYOUTS = {
    "dp2": (["parallel.devices=cpu:2", "parallel.dp=2"], adamw_clipped),
    "dp2pp2": (["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"], adam),
    "dp4": (["parallel.devices=cpu:4", "parallel.dp=4"], sgd_momentum),
    "dp2accum2": (["parallel.devices=cpu:2", "parallel.dp=2", "train.grad_accum=2"], adam),
}


@pytest.mark.parametrize("layout,zero", [("dp2", 1), ("dp2", 2), ("dp2", 3), ("dp2pp2", 2), ("dp2pp2", 3), ("dp4", 3),
                                         ("dp2accum2", 3)])
def test_zero_fit_equals_keras_fit(layout, zero, tmp_path):
    """Losses, accuracy, weights and model.optimizer's state (joined from the slices) equal
    Keras's one-device fit to 1e-4 (float32 sums in another order)."""
    overrides, opt = LAYOUTS[layout]
    x, y = mlp_data()
    reference = mlp(opt)
    ref_steps = StepLosses()
    ref = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[ref_steps])
    model = mlp(opt)
    steps = StepLosses()
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          callbacks=[steps], overrides=overrides + [f"parallel.zero={zero}", f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    np.testing.assert_allclose(history.history["accuracy"], ref.history["accuracy"], rtol=1e-4)
    for mine, want in zip(model.variables, reference.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)
    assert len(model.optimizer.variables) == len(reference.optimizer.variables)
    for mine, want in zip(model.optimizer.variables, reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)
    if layout == "dp2":  # the clip is active, so the global norm mattered
        unclipped = mlp(lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1, epsilon=ADAM_EPS))
        unclipped.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        assert max(np.max(np.abs(a.numpy() - b.numpy())) for a, b in
                   zip(unclipped.trainable_variables, reference.trainable_variables)) > 1e-3


def wide(opt=adam):
    """Eight layers of assorted widths: enough variables for the partition to balance."""
    keras.utils.set_random_seed(5)
    layers = [keras.Input((12,))] + [keras.layers.Dense(w, activation="tanh") for w in (32, 24, 32, 16, 24, 8, 16)]
    model = keras.Sequential(layers + [keras.layers.Dense(3)], name="wide")
    model.compile(optimizer=opt(), loss="mse")
    return model


def nbytes(variable) -> int:
    return int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize


@pytest.mark.parametrize("zero", [1, 3])
def test_state_per_device_is_a_dp_th_and_follows_a_built_optimizer(zero, tmp_path):
    """dp4 on devices 1-4 (the host CPU:0 apart), counted by the shapes of the engine's own
    variables on each device: every replica holds a quarter of the weights' slices and of the
    Adam state (padding: the 3-element bias cut into 4 one-element slices); model.optimizer's
    whole slots are on the host. Under ZeRO-3 no whole trainable weight is on a replica's
    device. The model was trained by Keras first (its optimizer built, slots on device 0): the
    engine continues from that state, and the next fit equals Keras's fit continued."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(N, 12)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")
    model = wide()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # Keras builds the optimizer
    reference = wide()
    reference.fit(x, y, batch_size=BATCH, epochs=1 + EPOCHS, shuffle=False, verbose=0)
    mesh = Mesh.from_devices([local(i) for i in range(1, 5)], 4, 1, 1)
    cfg = load_config(None, ["parallel.dp=4", f"parallel.zero={zero}"])
    engine = KerasModelEngine(model, cfg, mesh, (x[:BATCH], y[:BATCH], None))
    weights = sum(nbytes(v) for v in model.trainable_variables)
    per_device: dict[str, int] = {}
    for piece in engine.slices.flat + [v for v in engine.optimizer.variables if len(v.shape)]:
        per_device[piece.value.device] = per_device.get(piece.value.device, 0) + nbytes(piece)
    assert sorted(per_device) == [local(i) for i in range(1, 5)], per_device
    for device, held in per_device.items():  # weights + Adam's 2 slots, a quarter each, + the bias padding
        assert 3 * weights / 4 <= held <= 3 * weights / 4 + 3 * 4, (device, held, weights)
    assert {v.value.device for v in model.optimizer.variables} == {local(0)}
    if zero == 3:
        assert {v.value.device for v in model.trainable_variables} == {local(0)}
        assert engine.copies == {}
    for epoch in range(EPOCHS):
        for start in range(0, N, BATCH):
            engine.train_step((x[start:start + BATCH], y[start:start + BATCH], None))
    engine.gather_state()
    for mine, want in zip(model.variables + model.optimizer.variables,
                          reference.variables + reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)


def test_zero3_checkpoint_resumes_into_the_slices(tmp_path):
    """A ZeRO-3 fit of one epoch, then the same run dir fitted to two epochs by a new model:
    the checkpoint (model.optimizer's state joined from the slices at the epoch's end) is
    restored and cut into the slices again; the result equals Keras's two-epoch fit."""
    x, y = mlp_data()
    reference = mlp(adam)
    reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    overrides = ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.zero=3", f"run.dir={tmp_path}"]
    phalanx.fit(mlp(adam), x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, overrides=overrides)
    model = mlp(adam)
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, overrides=overrides)
    assert int(model.optimizer.iterations.numpy()) == 2 * N // BATCH
    for mine, want in zip(model.variables + model.optimizer.variables,
                          reference.variables + reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)


def embedder():
    keras.utils.set_random_seed(6)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(16, 8)(tokens)
    model = keras.Model(tokens, keras.layers.Dense(16)(keras.layers.LayerNormalization()(h)), name="embedder")
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=ADAM_EPS),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_keeps_an_embeddings_sparse_gradient_sparse(zero, tmp_path):
    """Tokens repeat in every batch: Keras's Adam updates an embedding from its sparse
    gradient (each row's pieces squared on their own), which a densified gradient would not
    equal. Cut by rows, each slice's optimizer sees its rows' sparse gradient: equal to
    Keras's fit to 1e-4."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (N, 6)).astype("int32")
    y = np.roll(x, 1, axis=1)
    reference = embedder()
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    model = embedder()
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"parallel.zero={zero}", f"run.dir={tmp_path}"])
    for mine, want in zip(model.variables + model.optimizer.variables,
                          reference.variables + reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)


def test_zero_under_mixed_float16_with_keras_loss_scaling(tmp_path):
    """Keras's LossScaleOptimizer wraps the optimizer; the sliced one (its loss scale included)
    steps as the same layout without ZeRO (same arithmetic, other devices: 1e-6), and as Keras's
    own mixed_float16 fit to the mixed-precision tolerance of tests/test_keras_fit.py."""
    x, y = mlp_data()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        reference = mlp(adam)
        ref = reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    finally:
        keras.config.set_dtype_policy("float32")
    runs = {}
    for zero in (0, 1, 3):
        model = mlp(adam)
        runs[zero] = (model, phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                                         overrides=["parallel.devices=cpu:2", "parallel.dp=2",
                                                    "precision.policy=mixed_float16", f"parallel.zero={zero}",
                                                    f"run.dir={tmp_path / str(zero)}"]).history)
    for zero in (1, 3):
        model, history = runs[zero]
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        np.testing.assert_allclose(history["loss"], runs[0][1]["loss"], rtol=1e-6)
        for mine, want in zip(model.variables + model.optimizer.variables,
                              runs[0][0].variables + runs[0][0].optimizer.variables):
            np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-6, atol=1e-7, err_msg=mine.path)
        np.testing.assert_allclose(history["loss"], ref["loss"], rtol=2e-2)


# -- tensor parallelism: a model of phalanx.layers ---------------------------------------------


def tp_model(tp: int):
    keras.utils.set_random_seed(3)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh", name="stem")(x)
    h = RowParallelDense(8, tp=tp, name="row")(ColumnParallelDense(16, tp=tp, activation="relu", name="col")(h))
    h = h + ParallelMLP(16, tp=tp, gated=True, activation="silu", name="mlp")(h)
    model = keras.Model(x, keras.layers.Dense(3, name="head")(h), name="tpnet")
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=ADAM_EPS), loss="mse")
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


def test_zero3_with_tensor_parallelism_equals_keras_fit(tmp_path):
    """dp2 x tp2 at ZeRO-3: each tensor shard cut into two slices, on its own tensor rank of
    each replica, gathered there for the forward."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(N, 6)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")
    reference = tp_model(1)
    ref_steps = StepLosses()
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[ref_steps])
    model = tp_model(2)
    copy_weights(tp_model(1), model)
    steps = StepLosses()
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2", "parallel.zero=3"] +
                [f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    for mine, want in zip(logical(model), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)


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
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=ADAM_EPS),
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


@pytest.mark.parametrize("layout,dp,zero", [
    ("dp2ep2_accum2", 2, 2),
    ("dp4ep2", 4, 2),
    ("dp2ep2_accum2", 2, 3),
    ("dp4ep2", 4, 3),
    ("dp2ep2pp2", 2, 3),
])
def test_zero_with_expert_parallelism_equals_keras_fit(layout, dp, zero, moe_reference, tmp_path):
    """No token dropped (capacity_factor 0). dp2 x ep2: one group holds the experts, each
    expert shard is one slice, the rest cut over both replicas; dp4 x ep2: two groups hold
    copies of each expert shard, cut into two slices, one per group. ZeRO-3 gathers each expert
    shard on its group's owner for the group's replicas. Losses to 1e-4 and weights to
    1e-4 / 1e-5 (float32 sums in another order, moved by Adam at eps 1e-2: ADAM_EPS)."""
    x, y, ref, want = moe_reference(dp)
    overrides = {"dp2ep2_accum2": ["parallel.devices=cpu:2", "train.grad_accum=2"],
                 "dp4ep2": ["parallel.devices=cpu:4"],
                 "dp2ep2pp2": ["parallel.devices=cpu:4", "parallel.pp=2", "parallel.microbatches=2"]}[layout]
    overrides = overrides + [f"parallel.dp={dp}", "parallel.ep=2"]
    model = moe_model(ep=2)
    copy_weights(moe_model(), model)
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          overrides=overrides + [f"parallel.zero={zero}", f"run.dir={tmp_path}"]).history
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=1e-4)
    for mine, reference in zip(logical(model), want):
        np.testing.assert_allclose(mine, reference, rtol=1e-4, atol=1e-5)
    experts = [v for v in model.trainable_variables
               if placement_of(v) is not None and placement_of(v).axis == "expert"]
    engine = model.__dict__[keras_api._FIT_ENGINE][1]  # the fit's engine (kept for the model's next fit)
    for v in experts:  # shard j lives with replica j of each group (on the stage that reads it): a slice per group
        home = engine.home[id(v)]
        assert [device_index(piece) for piece in engine.slices.slices_of(v)] == \
            [cpu_index(engine.stage_device(g * 2 + placement_of(v).rank, home)) for g in range(dp // 2)], v.path
        if zero < 3:
            assert device_index(v) == cpu_index(engine.stage_device(placement_of(v).rank, home))
    if zero == 3:  # by shapes: between steps each device holds a dp-th of its stage's weights and Adam slots
        assert engine.copies == {} and {v.value.device for v in model.trainable_variables} == {local(0)}  # the host
        held: dict[int, int] = {}
        for piece in engine.slices.flat + [v for v in engine.optimizer.variables if len(v.shape)]:
            held[device_index(piece)] = held.get(device_index(piece), 0) + nbytes(piece)
        want: dict[int, int] = {}  # (an expert shard's whole slice on replica j, as much as its dp-th on each)
        for v in model.trainable_variables:
            for d in range(dp):
                device = cpu_index(engine.stage_device(d, engine.home[id(v)]))
                want[device] = want.get(device, 0) + 3 * nbytes(v) // dp
        assert held == want, (held, want)  # no padding here


# -- the built-in MoE GPT (what phalanx train runs for parallel.ep > 1) ---------------------------

TINY = ["model.layers=2", "model.d_model=16", "model.heads=2", "model.ffn=16", "model.seq_len=8",
        "model.experts=4", "model.moe_every=1", "model.top_k=2", "model.capacity_factor=0", "train.global_batch=8",
        "train.lr=1e-2", "train.warmup=1", "train.min_lr_ratio=1", "train.clip_norm=0.5", "train.steps=3",
        "precision.policy=float32", "model.aux_loss_coef=0"]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_builtin_moe_gpt_dp4_ep2_zero_equals_the_one_device_engine(devices, zero):
    """The factory's engine for ``phalanx train ... parallel.ep=2 parallel.zero=1|3`` against the
    one-device oracle, Keras's own train_on_batch of the same Keras model (tests/gpt_oracle.py; no
    balancing loss: each replica would balance its own rows): loss, lr and clipped norm per step,
    then every weight and AdamW moment (joined from the slices); the sliced moments (and at
    ZeRO-3 the weights: each expert shard in two slices, one per ep group) a quarter per
    replica, the whole ones on the host."""
    import gpt_oracle
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.task import GPTTask

    cfg = load_config(None, TINY + ["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2",
                                    f"parallel.zero={zero}"])
    one = load_config(None, TINY)
    ours = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    ref = gpt_oracle.KerasGPT(one)
    assert isinstance(ours, KerasGPTEngine) and ours.engine.zero == zero
    rng = np.random.default_rng(2)
    norms = []
    for _ in range(3):
        batch = rng.integers(0, 256, (8, 9)).astype("int32")
        a, b = ours.train_step(batch), ref.train_step(batch)
        for key in ("loss", "lr", "grad_norm", "skipped"):
            np.testing.assert_allclose(float(a[key]), b[key], rtol=1e-4, err_msg=key)
        norms.append(b["grad_norm"])
    assert max(norms) > 0.5  # train.clip_norm=0.5 clipped
    mine, want = ours.state_dict(), ref.state_dict()
    assert sorted(mine) == sorted(want)
    for name in want:  # slack at the tensor's scale, as tests/test_moe_train.py (the key bias's round-off)
        scale = float(np.max(np.abs(want[name]))) if np.size(want[name]) else 0.0
        np.testing.assert_allclose(mine[name], want[name], rtol=2e-4, atol=5e-4 * scale + 1e-12, err_msg=name)
    moments: dict[str, int] = {}
    sliced = ours.engine.optimizer  # PhalanxAdamW.zero_clone, on the slices
    for slot in sliced.m + sliced.v:
        moments[slot.value.device] = moments.get(slot.value.device, 0) + int(np.prod(slot.shape)) * 4
    total = sum(moments.values())
    assert total >= 2 * sum(int(np.prod(v.shape)) * 4 for v in ours.model.trainable_variables)
    assert sorted(moments) == [local(i) for i in range(4)], moments
    assert max(moments.values()) <= 1.1 * total / 4, moments
    assert {m.value.device for m in ours.optimizer.m} == {local(0)}  # the whole moments: the host copy
    if zero == 3:  # between steps no replica holds a whole weight: the model's are the host copy
        engine = ours.engine
        assert engine.copies == {} and {v.value.device for v in ours.model.trainable_variables} == {local(0)}
        held: dict[str, int] = {}
        for piece in engine.slices.flat:
            held[piece.value.device] = held.get(piece.value.device, 0) + nbytes(piece)
        weights = sum(nbytes(v) for v in ours.model.trainable_variables)
        assert sorted(held) == [local(i) for i in range(4)] and sum(held.values()) >= weights, held
        assert max(held.values()) <= 1.1 * weights / 4, (held, weights)  # a quarter, plus padding
        for v in ours.model.trainable_variables:
            if placement_of(v) is not None and placement_of(v).axis == "expert":  # on replicas j and 2 + j
                assert [device_index(p) for p in engine.slices.slices_of(v)] == \
                    [placement_of(v).rank, 2 + placement_of(v).rank], v.path


@pytest.mark.slow
def test_phalanx_train_moe_yaml_at_dp4_ep2_zero1_and_3_equals_the_one_device_run(tmp_path):
    """The command itself: configs/moe.yaml made small (8 experts top-2, no token dropped, no
    balancing loss, float32, an active clip) at dp4 x ep2 with parallel.zero=1 and 3, against the
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
                        ("zero1", ["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", "parallel.zero=1"]),
                        ("zero3", ["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", "parallel.zero=3"])):
        assert main(["train", config, "--quiet", *small, *layout, f"run.dir={tmp_path / run}"]) == 0
        rows[run] = read_metrics(tmp_path / run)
    for run in ("zero1", "zero3"):
        assert [r["step"] for r in rows[run]] == [1, 2, 3, 4]
        for key in ("loss", "lr", "grad_norm"):
            np.testing.assert_allclose([r[key] for r in rows[run]], [r[key] for r in rows["one"]], rtol=1e-4,
                                       err_msg=f"{run} {key}")
    assert max(r["grad_norm"] for r in rows["one"]) > 0.5  # the clip was active


# -- refusals ----------------------------------------------------------------------------------------


def test_what_zero_on_the_keras_engine_does_not_run_is_refused(tmp_path):
    x, y = mlp_data()
    two = ["parallel.devices=cpu:2", "parallel.dp=2"]
    for opt, match in ((lambda: keras.optimizers.Adam(0.01, clipnorm=1.0), r"parallel.zero: 2: Adam\(clipnorm=1.0\)"),
                       (lambda: keras.optimizers.Adafactor(), r"parallel.zero: 2: Adafactor .*element-wise")):
        with pytest.raises(ConfigError, match=match):
            phalanx.fit(mlp(opt), x, y, batch_size=BATCH, verbose=0,
                        overrides=two + ["parallel.zero=2", f"run.dir={tmp_path}"])
    assert not (tmp_path / "checkpoints").exists()  # refused before any work
    with pytest.raises(ConfigError, match=r"parallel.zero: 4 is not valid; choose 0, 1, 2 or 3"):
        load_config(None, ["parallel.zero=4"])
    # ZeRO-3 with expert parallelism across workers (in one process it runs)
    with pytest.raises(ConfigError, match=r"parallel.zero: 3 with parallel.ep=2 across 2 workers: .*parallel.zero=2"):
        keras_model.check_zero(3, workers=2, ep=2)
    # across workers: an optimizer with its own apply on the slices (phalanx's AdamW) would see one
    # worker's slices only (keras_cluster's WorkerGroup: only its size and rank are read before it)
    from phalanx.parallel.keras_zero import ZeroSlices

    class OwnApply(keras.optimizers.SGD):
        def zero_clone(self):
            return keras.optimizers.SGD()

    model = mlp(OwnApply)
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(ConfigError, match=r"parallel.zero: 1 across 2 workers: OwnApply .*only this worker's"):
        ZeroSlices(model.trainable_variables, [[local(1)]] * len(model.trainable_variables), model.optimizer, 1,
                   workers=types.SimpleNamespace(size=2, rank=1, device=local(0)))


def test_across_two_workers_each_replica_holds_a_quarter_of_every_variable():
    """2 workers of 2 replicas each: every variable is cut into 4 slices; worker 1's replicas
    hold slices 2 and 3, each beside its quarter of Adam's state (checked against a cut written
    here with NumPy: blocks of ceil(rows / 4) rows, or the flat values when a variable has fewer
    than 4 rows, zero-padded at the end)."""
    from phalanx.parallel.keras_zero import ZeroSlices

    model = mlp(adam)
    model.optimizer.build(model.trainable_variables)
    variables = model.trainable_variables
    group = types.SimpleNamespace(size=2, rank=1, device=local(0))  # what ZeroSlices reads of a WorkerGroup
    zs = ZeroSlices(variables, [[local(1), local(2)]] * len(variables), model.optimizer, 3, workers=group)
    assert any(v.shape[0] < 4 for v in variables) and any(v.shape[0] % 4 for v in variables)
    padding = 0  # bytes of zero padding of a variable's 4 slices, summed over the variables
    for v, row in zip(variables, zs.slices):
        whole = v.numpy()
        rows = whole.shape[0] if whole.shape[0] >= 4 else whole.size
        view = whole if whole.shape[0] >= 4 else whole.reshape(-1)
        per = -(-rows // 4)
        padded = np.concatenate([view, np.zeros((4 * per - rows,) + view.shape[1:], view.dtype)])
        padding += padded.nbytes - view.nbytes
        assert [s.value.device for s in row] == [local(1), local(2)]
        for k, piece in zip((2, 3), row):
            np.testing.assert_array_equal(piece.numpy(), padded[k * per:(k + 1) * per], err_msg=v.path)
    held = {local(1): 0, local(2): 0}
    for piece in zs.flat + [s for s in zs.optimizer.variables if len(s.shape)]:
        held[piece.value.device] += nbytes(piece)
    weights = sum(nbytes(v) for v in variables)
    for device, size in held.items():  # weights + Adam's 2 slots: a quarter each, + their padding
        assert 3 * weights / 4 <= size <= 3 * (weights / 4 + padding), (device, size, weights, padding)


def test_the_docstring_examples_run():
    from phalanx.parallel import keras_zero

    assert doctest.testmod(keras_model).failed == 0
    assert doctest.testmod(keras_zero).failed == 0


def cnn():
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, padding="same"),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(), keras.layers.Flatten(),
                              keras.layers.Dense(3)], name="cnn")
    model.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.5, epsilon=ADAM_EPS), loss="mse")
    return model


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_cnn_with_batchnorm_equals_keras_fit(zero, tmp_path):
    """A CNN with BatchNormalization at dp2 x ZeRO-2/3 (global_clipnorm active on Adam): each
    replica normalises its 4 rows, so the oracle is Keras's fit of the ghost-batch model
    (tests/helpers.py: each batch of 8 run as two calls of 4, two replicas whose moving
    statistics are averaged once per step). Losses, weights and the moving statistics to 1e-4
    (float32 sums in another order)."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(N, 6, 6, 2)).astype("float32"), rng.normal(size=(N, 3)).astype("float32")
    reference = cnn()
    trained = ghost_batches(reference, 2, replicas=2)
    trained.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.5, epsilon=ADAM_EPS), loss="mse")
    ref = trained.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    model = cnn()
    history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                          overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"parallel.zero={zero}",
                                     f"run.dir={tmp_path}"]).history
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=1e-4)
    for mine, want in zip(model.variables, reference.variables):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)


# -- memory at ZeRO-3 -----------------------------------------------------------------------------


def heavy():
    """Weight-heavy: four 192 x 192 layers, so weights, gradients and Adam's state dominate
    a step on 8 rows."""
    keras.utils.set_random_seed(2)
    layers = [keras.Input((192,))] + [keras.layers.Dense(192, activation="tanh") for _ in range(4)]
    model = keras.Sequential(layers, name="heavy")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


@pytest.mark.memory_peak
def test_zero3_holds_a_dp_th_of_the_state_per_device_plus_the_gathered_stage():
    """dp2 x pp2 at ZeRO-3 on devices 1-4 (the host CPU:0, which holds model's and
    model.optimizer's whole copies, apart). Counted by shapes: each device holds half of its
    stage's weights and Adam state (3 x weights / dp), and no whole weight. Measured (the
    allocator's record of a step, tests/test_step_memory.py's machinery): each device's step
    peak, activations and Adam's temporaries included, is within 10% of one device's
    parameters + gradients + Adam state (4 x its stage's weights) over dp, plus the largest
    weights gathered at once (a stage's: the engine gathers a stage for its forward and keeps
    it to its last backward). Measured ~0.6 MB against the bound's ~0.98 MB."""
    from phalanx.train.calibrate import _short, _trace_placement, measure_step_memory

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 192)).astype("float32"), rng.normal(size=(8, 192)).astype("float32")
    model = heavy()
    mesh = Mesh.from_devices([local(i) for i in range(1, 5)], 2, 2, 1)
    cfg = load_config(None, ["parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.zero=3"])
    engine = KerasModelEngine(model, cfg, mesh, (x, y, None))
    stage_weights: dict[str, int] = {}  # a stage's whole weights, on each of its devices
    for s, stage in enumerate(engine.stages):
        for d in range(2):
            dev = _short(engine.stage_device(d, s))
            stage_weights[dev] = stage_weights.get(dev, 0) + sum(nbytes(v) for v in stage.trainable_variables)
    state: dict[str, int] = {}
    for piece in engine.slices.flat + [v for v in engine.optimizer.variables if len(v.shape)]:
        state[_short(piece.value.device)] = state.get(_short(piece.value.device), 0) + nbytes(piece)
    assert sorted(state) == sorted(stage_weights) == [f"CPU:{i}" for i in range(1, 5)], (state, stage_weights)
    for dev in state:
        assert state[dev] == 3 * stage_weights[dev] / 2, (dev, state, stage_weights)  # 192 rows: no padding
    assert engine.copies == {} and {v.value.device for v in model.trainable_variables} == {local(0)}
    batch = (x, y, None)
    placement = _trace_placement(engine, batch)  # the first step traces and allocates
    peaks = [measure_step_memory(engine, batch, placement)[0] for _ in range(2)]
    print("zero3 dp2 x pp2 step peaks", peaks, "state", state, "stage weights", stage_weights)
    for dev in state:
        least = min(p[dev] for p in peaks)
        bound = 1.1 * (4 * stage_weights[dev] / 2 + stage_weights[dev])  # (P + G + Adam's 2) / dp + gathered
        assert least <= bound, (dev, least, bound, state[dev], stage_weights[dev])


# -- keras-hub GPT-2 -------------------------------------------------------------------------------


def test_keras_hub_gpt2_zero3_dp2_tp2_pp2_equals_keras_fit(keras_fit_of, tmp_path):
    """keras-hub's GPT-2 (small random config, tests/test_keras_hub.py) at ZeRO-3 on dp2 x
    tp2 x pp2: tensor shards sliced over the replicas on their own ranks, each stage gathered
    for its forward; per-step losses and every weight (after unparallelize) equal Keras's
    one-device fit to 1e-4 (tests/test_keras_hub_tp.py's tolerances)."""
    from test_keras_hub import StepLosses as HubSteps, build, data  # build: Adam epsilon 1e-4 on both sides

    x, y = data()
    reference, ref_steps, _ = keras_fit_of("gpt2")
    model, steps = build("gpt2"), HubSteps()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["parallel.devices=cpu:8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                           "parallel.microbatches=2", "parallel.zero=3", f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    phalanx.unparallelize(model)
    for mine, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)


HUB_LAYOUTS = {
    "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"],
    "dp2tp2": ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2"],
}


@pytest.mark.parametrize("kind,zero,layout", [("gpt2", 2, "dp2"), ("llama", 2, "dp2"), ("llama", 3, "dp2tp2")])
def test_keras_hub_zero_equals_keras_fit(kind, zero, layout, keras_fit_of, tmp_path):
    """keras-hub GPT-2 and Llama (tests/test_keras_hub.py's small random configs: a tied embedding
    for GPT-2, grouped-query heads and an untied head for Llama) at ZeRO-2 (gradients
    reduce-scattered) and, for Llama, ZeRO-3 on dp2 x tp2 (each head-split shard sliced over the
    replicas on its tensor rank): per-step losses and every weight (after unparallelize) equal
    Keras's one-device fit to the keras-hub tests' 1e-4 / 1e-5 (Adam epsilon 1e-4 on both sides:
    test_keras_hub.build); without tp, model.optimizer's state joined from the slices too."""
    from test_keras_hub import StepLosses as HubSteps, build, data

    x, y = data()
    reference, ref_steps, _ = keras_fit_of(kind)
    model, steps = build(kind), HubSteps()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=HUB_LAYOUTS[layout] + [f"parallel.zero={zero}", f"run.dir={tmp_path}"])
    engine = model.__dict__[keras_api._FIT_ENGINE][1]
    assert engine.zero == zero and len(engine.slices.flat) >= 2 * len(reference.trainable_variables)
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    if layout == "dp2":
        assert len(model.optimizer.variables) == len(reference.optimizer.variables)
        for mine, want in zip(model.optimizer.variables, reference.optimizer.variables):
            np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)
    phalanx.unparallelize(model)
    assert len(model.weights) == len(reference.weights)
    for mine, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)
