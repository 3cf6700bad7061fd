"""The mixture-of-experts layer against a plain reference written here (a loop over
tokens and experts in NumPy), and trained through phalanx.fit against Keras's own fit."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest

import phalanx
from phalanx.layers import MoE

from helpers import ghost_batches


def gelu(x):
    """Keras's default (exact) GELU: x * Phi(x)."""
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / np.sqrt(2.0)))


def reference(layer: MoE, x: np.ndarray):
    """(output, aux loss, z loss, dropped assignments) by loops, in float64."""
    w = {v.name: np.asarray(v.numpy(), np.float64) for v in layer.weights}
    tokens = x.reshape(-1, x.shape[-1]).astype(np.float64)
    n, e, k = len(tokens), layer.num_experts, layer.top_k
    logits = tokens @ w["router"]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    choices = [list(np.argsort(-p, kind="stable")[:k]) for p in probs]
    capacity = n if layer.capacity_factor == 0 else max(1, math.ceil(layer.capacity_factor * n * k / e))
    used = [0] * e
    kept = {}
    for j in range(k):              # every token's j-th choice before any (j+1)-th
        for t in range(n):
            expert = choices[t][j]
            kept[(t, j)] = used[expert] < capacity
            used[expert] += 1
    out = np.zeros_like(tokens)
    for t in range(n):
        gates = np.array([probs[t][c] for c in choices[t]])
        if k > 1:
            gates = gates / gates.sum()
        for j, expert in enumerate(choices[t]):
            if not kept[(t, j)]:
                continue
            h = tokens[t] @ w["w_in"][expert] + w["b_in"][expert]
            h = gelu(tokens[t] @ w["w_gate"][expert]) * h if layer.gated else gelu(h)
            out[t] += gates[j] * (h @ w["w_out"][expert] + w["b_out"][expert])
    first = np.zeros(e)
    for t in range(n):
        first[choices[t][0]] += 1.0 / n
    aux = layer.aux_loss_coef * e * float(np.sum(first * probs.mean(0)))
    lse = np.log(np.exp(logits).sum(1))
    z = layer.z_loss_coef * float(np.mean(lse ** 2))
    dropped = sum(not v for v in kept.values())
    return out.reshape(x.shape), aux, z, dropped


@pytest.mark.parametrize("top_k,capacity,gated", [(1, 0.0, False), (2, 0.0, False), (2, 0.0, True),
                                                   (1, 0.5, False), (2, 0.75, True)])
def test_moe_equals_a_loop_over_tokens_and_experts(top_k, capacity, gated):
    keras.utils.set_random_seed(0)
    layer = MoE(num_experts=4, hidden_dim=12, top_k=top_k, capacity_factor=capacity, aux_loss_coef=0.01,
                z_loss_coef=0.001, gated=gated)
    x = np.random.default_rng(1).normal(size=(3, 5, 8)).astype("float32")
    got = np.asarray(layer(x, training=True))
    want, aux, z, dropped = reference(layer, x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    losses = [float(v) for v in layer.losses]
    np.testing.assert_allclose(losses, [aux, z], rtol=1e-5)
    np.testing.assert_allclose(float(layer.dropped_fraction.numpy()), dropped / (15 * top_k), atol=1e-7)
    if capacity == 0:
        assert dropped == 0
    else:
        assert dropped > 0  # the small capacity really drops tokens
    assert float(layer.load_min.numpy()) <= 1.0 <= float(layer.load_max.numpy())


def test_moe_arguments_are_checked():
    with pytest.raises(ValueError, match="top_k"):
        MoE(num_experts=2, hidden_dim=4, top_k=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(num_experts=2, hidden_dim=4, capacity_factor=-1)
    with pytest.raises(ValueError, match="num_experts"):
        MoE(num_experts=0, hidden_dim=4)


def moe_model():
    keras.utils.set_random_seed(4)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(16, 8)(tokens)
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = h + MoE(num_experts=4, hidden_dim=16, top_k=2, aux_loss_coef=0.05, z_loss_coef=0.01)(h)
    h = keras.layers.LayerNormalization()(h)
    out = keras.layers.Dense(16)(h)
    model = keras.Model(tokens, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("layout,overrides,chunks", [
    ("one", [], 1),
    ("dp2", ["parallel.devices=cpu:2", "parallel.dp=2"], 2),
    ("pp2", ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"], 2),
])
def test_moe_model_trains_through_phalanx_fit_like_keras(layout, overrides, chunks, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (16, 6)).astype("int32")
    y = np.roll(x, 1, axis=1)
    reference = moe_model()
    trained = ghost_batches(reference, chunks, average_added_losses=True) if chunks > 1 else reference
    if chunks > 1:
        trained.compile(optimizer=keras.optimizers.Adam(0.01),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ref = trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    model = moe_model()
    ours = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                       overrides=overrides + [f"run.dir={tmp_path / layout}"]).history
    np.testing.assert_allclose(ours["loss"], ref["loss"], rtol=1e-4)
    for mine, want in zip(model.trainable_weights, reference.trainable_weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)
    path = tmp_path / "moe.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


# -- the built-in GPT with experts, through config keys ----------------------------------------

MOE_GPT = ["model.layers=4", "model.d_model=32", "model.heads=2", "model.ffn=48", "model.seq_len=16",
           "model.experts=4", "model.top_k=1", "model.moe_every=2", "model.tie_embeddings=false",
           "train.global_batch=4", "train.lr=1e-2", "train.warmup=1"]


def test_plan_counts_the_parameters_train_builds():
    from phalanx.config import load_config
    from phalanx.models import gpt
    from phalanx.plan.arithmetic import ModelSpec, param_count

    cfg = load_config(None, MOE_GPT)
    model = gpt.GPT(cfg.model)
    built = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert built == gpt.num_params(cfg.model) == param_count(ModelSpec.from_config(cfg.model))
    blocks = [b.moe is not None for b in model.blocks]
    assert blocks == [False, True, False, True]  # every moe_every-th block holds the experts
    # and `phalanx plan` prints that count for the same keys
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", "plan", *MOE_GPT, "--devices", "1"],
                         capture_output=True, text=True, timeout=300)
    assert f"({built:,})" in out.stdout, out.stdout + out.stderr


def test_moe_gpt_trains_data_parallel_and_refuses_what_is_not_built(devices):
    from phalanx.config import ConfigError, load_config
    from phalanx.mesh import Mesh
    from phalanx.parallel.mesh_engine import MeshEngine
    from phalanx.train.engine import StrategyEngine, default_strategy
    from phalanx.train.task import GPTTask

    # Without the balancing loss (which depends on the batch a replica sees), dp2 = one device.
    cfg = load_config(None, MOE_GPT + ["model.aux_loss_coef=0"])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (4, 17)).astype("int32") for _ in range(4)]
    runs = []
    for devs in (devices[:1], devices[:2]):
        engine = StrategyEngine(cfg, GPTTask(cfg.model), default_strategy(devs))
        runs.append([float(engine.train_step(b)["loss"]) for b in batches])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)
    # With it, the loss includes the balancing loss and still falls on a repeated batch.
    cfg = load_config(None, MOE_GPT + ["model.aux_loss_coef=0.1"])
    engine = StrategyEngine(cfg, GPTTask(cfg.model), default_strategy(devices[:1]))
    losses = [float(engine.train_step(batches[0])["loss"]) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5
    with pytest.raises(ConfigError, match="model.experts"):
        MeshEngine(cfg.replace(parallel={"pp": 2}), Mesh.from_devices(devices[:2], 1, 2, 1), GPTTask(cfg.model))
    with pytest.raises(ConfigError, match="model.top_k"):
        load_config(None, MOE_GPT + ["model.top_k=5"])
    with pytest.raises(ConfigError, match="model.experts"):
        load_config(None, MOE_GPT + ["model.experts=1"])


def test_moe_gpt_logs_balance_dropped_share_and_load(tmp_path):
    from helpers import tiny_overrides, write_corpus

    from phalanx.config import load_config
    from phalanx.train.progress import read_metrics
    from phalanx.train.trainer import Trainer

    corpus = write_corpus(tmp_path / "corpus", files=2, lines=100)
    cfg = load_config(None, tiny_overrides(tmp_path, corpus) + [
        "model.experts=4", "model.top_k=2", "model.capacity_factor=0.5", "train.steps=3"])
    Trainer(cfg, quiet=True).fit()
    rows = read_metrics(tmp_path / "run")
    for row in rows:
        assert row["moe_aux_loss"] >= 1.0 - 1e-6       # E x sum f_e P_e >= 1, = 1 when uniform
        assert 0.0 < row["moe_dropped"] < 1.0          # capacity 0.5 drops assignments
        assert row["moe_load_min"] <= 1.0 <= row["moe_load_max"]
