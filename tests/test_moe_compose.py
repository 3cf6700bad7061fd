"""Expert parallelism composed with gradient accumulation, tensor parallelism and mixed
precision (bfloat16; float16 with loss scaling), through phalanx.fit, against Keras's own one-device fit of the same model
(a ghost-batch model: each micro-batch balances its own tokens, as phalanx's calls do).
No token is dropped (capacity_factor=0)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import phalanx
from phalanx.layers import ColumnParallelDense, MoE, RowParallelDense
from phalanx.layers.sharding import ShardedLayer

from helpers import ghost_batches


def build(ep: int = 1, tp: int = 0):
    """Embedding -> [column (relu) -> row, with tp] -> residual MoE -> LayerNorm -> head."""
    keras.utils.set_random_seed(4)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(16, 8)(tokens)
    if tp:
        h = RowParallelDense(8, tp=tp, name="row")(ColumnParallelDense(16, tp=tp, activation="relu", name="col")(h))
    h = h + MoE(num_experts=4, hidden_dim=16, top_k=2, aux_loss_coef=1.0, z_loss_coef=0.1, ep=ep, name="moe")(h)
    h = keras.layers.LayerNormalization()(h)
    model = keras.Model(tokens, keras.layers.Dense(16)(h))
    compile_(model)
    return model


# Adam epsilon 1e-3 (Keras's default 1e-7) in the reference and the run under test alike: the
# weights after 4 steps are compared at atol 1e-5, and Adam moves a step by at most
# ~2 x lr x d / epsilon for a gradient round-off d (~1e-7: sums in another order on another
# layout or CPU): 4 x 2 x 0.01 x 1e-7 / 1e-3 = 8e-6 (derivation: tests/helpers.py ADAM_EPS).
ADAM_EPS = 1e-3


def compile_(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=ADAM_EPS),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


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


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (16, 6)).astype("int32")
    return x, np.roll(x, 1, axis=1)


def keras_reference(chunks: int, tp: int = 0, policy: str = "float32", replicas: int = 1):
    """(history, model) of Keras's own fit: batches of 8 cut into ``chunks`` calls (in ``replicas``
    data replicas, tests/helpers.py)."""
    x, y = data()
    keras.config.set_dtype_policy(policy)
    try:
        reference = build(tp=1 if tp else 0)
        start = [w.copy() for w in logical(reference)]
        trained = ghost_batches(reference, chunks, average_added_losses=True, replicas=replicas)
        compile_(trained)
        history = trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    finally:
        keras.config.set_dtype_policy("float32")
    return history, reference, start


@pytest.mark.parametrize("layout,overrides,chunks,tp", [
    ("ep2_accum2", ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2", "train.grad_accum=2"], 4, 0),
    ("dp2tp2_ep2", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2"], 2, 2),
])
def test_expert_parallel_composes_like_keras(layout, overrides, chunks, tp, tmp_path):
    x, y = data()
    ref, reference, start = keras_reference(chunks, tp, replicas=2)  # both layouts: dp2
    model = build(ep=2, tp=tp)
    for layer, want in zip(model.layers, build(tp=1 if tp else 0).layers):  # the reference's starting weights
        if isinstance(layer, ShardedLayer):
            layer.set_logical_weights(want.logical_weights())
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in logical(model)]),
                                  np.concatenate([w.ravel() for w in start]))
    ours = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                       overrides=overrides + [f"run.dir={tmp_path / layout}"]).history
    np.testing.assert_allclose(ours["loss"], ref["loss"], rtol=1e-4)
    for mine, want in zip(logical(model), logical(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
    moe = model.get_layer("moe")
    assert [v.value.device.rsplit(":", 1)[-1] for v in moe.w_in] == (["0", "2"] if tp else ["0", "1"])
    if tp:  # the tensor shards of replica 0 on its two tensor devices; the experts whole per ep shard
        assert [v.value.device.rsplit(":", 1)[-1] for v in model.get_layer("col").weights[:2]] == ["0", "1"]
        assert [tuple(v.shape) for v in moe.w_in] == [(2, 8, 16), (2, 8, 16)]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_expert_parallel_under_mixed_precision_like_keras(policy, tmp_path):
    x, y = data()
    ref, reference, start = keras_reference(2, policy=policy, replicas=2)
    model = build(ep=2)
    copy_weights(build(), model)
    history = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                          overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2",
                                     f"precision.policy={policy}", f"run.dir={tmp_path / 'mixed'}"]).history
    moe = model.get_layer("moe")
    assert moe.compute_dtype == policy.split("_")[1] and moe.w_in[0].dtype == "float32"
    assert moe.router.dtype == "float32"
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=2e-2)  # as the other mixed-precision tests
    float32 = phalanx.fit(build(ep=2), x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                          overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2",
                                     f"run.dir={tmp_path / 'f32'}"]).history
    assert history["loss"] != float32["loss"]  # the mixed policy really ran


def test_layouts_expert_parallelism_cannot_run_are_refused():
    with pytest.raises(ValueError, match=r"MoE.*tp: 2.*not cut over tensor devices.*parallel.ep"):
        MoE(num_experts=4, hidden_dim=8, tp=2)
