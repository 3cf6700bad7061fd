"""The mixture-of-experts layer against a plain reference written here (a loop over
tokens and experts in NumPy), and trained through phalanx.fit against Keras's own fit."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import ConfigError
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


# Adam epsilon 1e-3 (Keras's default 1e-7) in the reference and the run under test alike: the
# weights after 4 steps are compared at atol 1e-5, and Adam moves a step by at most
# ~2 x lr x d / epsilon for a gradient round-off d (~1e-7: sums in another order on another
# layout or CPU): 4 x 2 x 0.01 x 1e-7 / 1e-3 = 8e-6 (derivation: tests/helpers.py ADAM_EPS).
ADAM_EPS = 1e-3


def moe_model(ep: int = 1):
    keras.utils.set_random_seed(4)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(16, 8)(tokens)
    h = keras.layers.Dense(8, activation="tanh")(h)
    h = h + MoE(num_experts=4, hidden_dim=16, top_k=2, aux_loss_coef=0.05, z_loss_coef=0.01, ep=ep)(h)
    h = keras.layers.LayerNormalization()(h)
    out = keras.layers.Dense(16)(h)
    model = keras.Model(tokens, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=ADAM_EPS),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def logical_weights(model) -> list[np.ndarray]:
    """Every weight of ``model`` as one whole tensor (a MoE's expert shards joined)."""
    out = []
    for layer in model.layers:
        out += list(layer.logical_weights().values()) if isinstance(layer, MoE) else \
            [np.asarray(w) for w in layer.get_weights()]
    return out


@pytest.mark.parametrize("layout,overrides,chunks,ep", [
    ("one", [], 1, 1),
    ("dp2", ["parallel.devices=cpu:2", "parallel.dp=2"], 2, 1),
    ("pp2", ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"], 2, 1),
    ("ep2", ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"], 2, 2),
    ("dp4ep2", ["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2"], 4, 2),
    ("ep2pp2", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                "parallel.microbatches=2"], 4, 2),
])
def test_moe_model_trains_through_phalanx_fit_like_keras(layout, overrides, chunks, ep, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (16, 6)).astype("int32")
    y = np.roll(x, 1, axis=1)
    reference = moe_model()
    replicas = int(next((o.split("=")[1] for o in overrides if o.startswith("parallel.dp=")), 1))
    trained = ghost_batches(reference, chunks, average_added_losses=True, replicas=replicas) if chunks > 1 \
        else reference
    if chunks > 1:
        trained.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=ADAM_EPS),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = logical_weights(reference)
    ref = trained.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    model = moe_model(ep)
    for layer, other in zip(model.layers, moe_model().layers):  # the reference's starting weights
        if isinstance(layer, MoE):
            layer.set_logical_weights(other.logical_weights())
    np.testing.assert_array_equal(np.concatenate([w.ravel() for w in logical_weights(model)]),
                                  np.concatenate([w.ravel() for w in start]))
    ours = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                       overrides=overrides + [f"run.dir={tmp_path / layout}"]).history
    np.testing.assert_allclose(ours["loss"], ref["loss"], rtol=1e-4)
    for mine, want in zip(logical_weights(model), logical_weights(reference)):
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
    if ep > 1:  # expert shard j lives with data replica j (the first pipeline stage's device)
        moe = next(layer for layer in model.layers if isinstance(layer, MoE))
        pp = 2 if "pp2" in layout else 1
        assert [v.value.device.split(":")[-1] for v in moe.w_in] == [str(j * pp) for j in range(ep)]
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
    from phalanx.models import gpt, transformer
    from phalanx.core.costs import ModelSpec, param_count

    cfg = load_config(None, MOE_GPT)
    model = transformer.gpt(cfg.model, seed=None)
    built = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert built == gpt.num_params(cfg.model) == param_count(ModelSpec.from_config(cfg.model))
    blocks = [b.moe is not None for b in transformer.blocks(model)]
    assert blocks == [False, True, False, True]  # every moe_every-th block holds the experts
    # and `phalanx plan` prints that count for the same keys
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", "plan", *MOE_GPT, "--devices", "1"],
                         capture_output=True, text=True, timeout=300)
    assert f"({built:,})" in out.stdout, out.stdout + out.stderr


def test_moe_gpt_trains_data_parallel_and_refuses_what_is_not_built(devices):
    import gpt_oracle
    from phalanx.config import ConfigError, load_config
    from phalanx.mesh import Mesh
    from phalanx.engines.factory import make_engine
    from phalanx.engines.task import GPTTask

    # Without the balancing loss (which depends on the batch a replica sees), one device and dp2
    # on the engine phalanx train builds equal Keras's one-device train_on_batch of the same model.
    cfg = load_config(None, MOE_GPT + ["model.aux_loss_coef=0"])
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 256, (4, 17)).astype("int32") for _ in range(4)]
    want, _, _ = gpt_oracle.run(cfg, batches)
    for dp in (1, 2):
        one = cfg.replace(parallel={"dp": dp})
        engine = make_engine(GPTTask(one.model), Mesh.from_devices(devices[:dp], dp, 1, 1), one)
        np.testing.assert_allclose([float(engine.train_step(b)["loss"]) for b in batches], want, rtol=1e-5)
    # With it, the loss includes the balancing loss and still falls on a repeated batch.
    cfg = load_config(None, MOE_GPT + ["model.aux_loss_coef=0.1"])
    engine = make_engine(GPTTask(cfg.model), Mesh.from_devices(devices[:1], 1, 1, 1), cfg)
    losses = [float(engine.train_step(batches[0])["loss"]) for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5
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
        assert row["moe_balance"] >= 1.0 - 1e-6        # E x sum f_e P_e >= 1, = 1 when uniform
        blocks = cfg.model.layers // cfg.model.moe_every
        assert row["moe_aux_loss"] == pytest.approx(cfg.model.aux_loss_coef * blocks * row["moe_balance"], rel=1e-5)
        assert 0.0 < row["moe_dropped"] < 1.0          # capacity 0.5 drops assignments
        assert row["moe_load_min"] <= 1.0 <= row["moe_load_max"]


def test_expert_parallel_layouts_that_cannot_run_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (8, 6)).astype("int32")
    # ep must divide dp; the model's experts must be cut into ep shards.
    with pytest.raises(ConfigError, match="parallel.ep.*divide parallel.dp=2"):
        phalanx.fit(moe_model(), x, x, batch_size=8, verbose=0,
                    overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=4", f"run.dir={tmp_path}/a"])
    with pytest.raises(ConfigError, match=r"parallel.ep.*MoE\(..., ep=2\)"):
        phalanx.fit(moe_model(), x, x, batch_size=8, verbose=0,
                    overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2", f"run.dir={tmp_path}/b"])
    with pytest.raises(ConfigError, match=r"cut into \[4\] shards"):
        phalanx.fit(moe_model(ep=4), x, x, batch_size=8, verbose=0,
                    overrides=["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2", f"run.dir={tmp_path}/c"])
    with pytest.raises(ValueError, match="divides num_experts=4"):
        MoE(num_experts=4, hidden_dim=4, ep=3)
    # (ep for the built-in GPT under `phalanx train`: tests/test_moe_train.py)


def test_expert_parallel_runs_each_expert_on_its_shards_device():
    """ep2 on dp2: each replica runs experts 0-1 on CPU:0 and experts 2-3 on CPU:1 (its
    tokens travel to the shard), read from the traced training step."""
    import collections

    from phalanx.config import load_config
    from phalanx.mesh import Mesh
    from phalanx.engines.factory import make_engine

    cfg = load_config(None, ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"])
    x = np.zeros((4, 6), "int32")
    engine = make_engine(moe_model(ep=2), Mesh.from_devices(["/device:CPU:0", "/device:CPU:1"], 2, 1, 1), cfg,
                         sample_batch=(x, x, None))
    graph = engine._train_fn.get_concrete_function(tf.constant(x), tf.constant(x), None).graph
    forward = collections.Counter()  # (replica, device) -> MatMuls of the MoE layer's forward pass
    for op in graph.get_operations():
        if op.type == "MatMul" and "/mo_e" in op.name and "gradients" not in op.name:
            forward[(op.name.split("_")[0], op.device.rsplit(":", 1)[-1])] += 1
    # 2 experts x (w_in, w_out) on each shard's device; the router on the replica's own.
    assert forward == {("dp0", "0"): 5, ("dp0", "1"): 4, ("dp1", "0"): 4, ("dp1", "1"): 5}
    # One dispatch per shard, not per expert: each replica selects, gathers and scatters
    # back its tokens once per shard (2), and only the shard's own device splits them by expert.
    dispatch = collections.Counter()
    for op in graph.get_operations():
        if "/mo_e" in op.name and "gradients" not in op.name and op.type in (
                "Where", "GatherV2", "TensorScatterAdd", "DynamicPartition"):
            dispatch[(op.name.split("_")[0], op.type, op.device.rsplit(":", 1)[-1])] += 1
    for d, other in (("dp0", "1"), ("dp1", "0")):
        mine = str(int(d[-1]))
        assert dispatch[(d, "Where", mine)] == dispatch[(d, "TensorScatterAdd", mine)] == 2
        assert dispatch[(d, "GatherV2", mine)] == 2 and dispatch[(d, "Where", other)] == 0
        assert dispatch[(d, "DynamicPartition", mine)] == dispatch[(d, "DynamicPartition", other)] == 2
