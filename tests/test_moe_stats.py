"""The mixture-of-experts figures in the rows phalanx.fit writes (metrics.jsonl and
TensorBoard), against the same figures computed here: the layer's loop reference of
tests/test_moe.py (outputs, balancing loss, dropped assignments) and a NumPy count of
each expert's kept assignments, from the weights each step started with, over the whole
batch: every data replica's every micro-batch (dp2 and ep2 with gradient accumulation,
ep2 x pp2 with pipeline micro-batches), each call with its own capacity."""

from __future__ import annotations

import json
import math

import keras
import numpy as np
import pytest

import phalanx
from phalanx.layers import MoE
from phalanx.train.progress import read_metrics

from test_moe import reference

LAYERS = {"moe_a": dict(top_k=2, aux_loss_coef=0.01), "moe_b": dict(top_k=1, aux_loss_coef=0.05)}
EXPERTS, HIDDEN, D, SEQ = 4, 12, 8, 6


def moe_model(capacity: float, ep: int = 1) -> keras.Model:
    """Two MoE layers with residuals (top-2 then top-1), a Dense head, MSE."""
    keras.utils.set_random_seed(3)
    x = keras.Input((SEQ, D))
    h = x
    for name, kwargs in LAYERS.items():
        h = h + MoE(EXPERTS, HIDDEN, capacity_factor=capacity, ep=ep, name=name, **kwargs)(h)
    model = keras.Model(x, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for name in LAYERS:  # an uneven router: expert 3 is rarely chosen (the inputs' feature 0 is ~ +1)
        layer = model.get_layer(name)
        router = layer.logical_weights()["router"].copy()
        router[0, 3] = -4.0
        layer.set_logical_weights({"router": router})
    return model


def count(layer: MoE, router: np.ndarray, tokens: np.ndarray) -> dict:
    """A layer's statistics by counting: the first choices of every token take the
    experts' slots first, then the second choices; an assignment past capacity drops."""
    tokens = tokens.reshape(-1, tokens.shape[-1]).astype(np.float64)
    n, e, k = len(tokens), layer.num_experts, layer.top_k
    logits = tokens @ router.astype(np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    choices = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    capacity = n if layer.capacity_factor == 0 else max(1, math.ceil(layer.capacity_factor * n * k / e))
    taken, kept = np.zeros(e), np.zeros(e)
    for j in range(k):
        for t in range(n):
            expert = choices[t, j]
            kept[expert] += taken[expert] < capacity
            taken[expert] += 1
    first = np.bincount(choices[:, 0], minlength=e) / n
    return {"balance": e * float(first @ probs.mean(0)), "dropped": float(n * k - kept.sum()),
            "assignments": n * k, "kept": kept}


def expected_row(snapshot: dict, calls: list[np.ndarray]) -> dict:
    """The figures of one step whose layers were called on each of ``calls`` (its
    micro-batches on every replica), from the weights the step started with: counts
    summed over the calls (each with its own capacity), balances averaged over them."""
    totals = {name: {"balance": 0.0, "dropped": 0.0, "assignments": 0, "load": np.zeros(EXPERTS)} for name in LAYERS}
    for x in calls:
        h = x
        for name, kwargs in LAYERS.items():
            twin = MoE(EXPERTS, HIDDEN, capacity_factor=snapshot["capacity"], **kwargs)  # one device, same weights
            twin.build(h.shape)
            twin.set_logical_weights(snapshot[name])
            out, aux_loss, _, dropped_ref = reference(twin, h)
            mine = count(twin, snapshot[name]["router"], h)
            assert mine["dropped"] == dropped_ref  # the count agrees with the loop reference
            np.testing.assert_allclose(kwargs["aux_loss_coef"] * mine["balance"], aux_loss, rtol=1e-9)
            t = totals[name]
            t["balance"] += mine["balance"] / len(calls)
            t["dropped"] += mine["dropped"]
            t["assignments"] += mine["assignments"]
            t["load"] += mine["kept"]
            h = (h + out).astype(np.float32)
    loads = [t["load"] / t["load"].sum() * EXPERTS for t in totals.values()]
    return {"moe_aux_loss": sum(LAYERS[n]["aux_loss_coef"] * t["balance"] for n, t in totals.items()),
            "moe_balance": float(np.mean([t["balance"] for t in totals.values()])),
            "moe_dropped": sum(t["dropped"] for t in totals.values()) / sum(t["assignments"] for t in totals.values()),
            "moe_load_min": float(min(load.min() for load in loads)),
            "moe_load_max": float(max(load.max() for load in loads))}


class Snapshots(keras.callbacks.Callback):
    """The MoE layers' whole weights at the start of every training step."""

    def __init__(self, model, capacity):
        super().__init__()
        self.layers, self.capacity, self.steps = [model.get_layer(n) for n in LAYERS], capacity, []

    def on_train_batch_begin(self, batch, logs=None):
        self.steps.append({"capacity": self.capacity, **{m.name: m.logical_weights() for m in self.layers}})


def tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
    import tensorflow as tf

    out: dict[str, dict[int, float]] = {}
    for path in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = float(tf.make_ndarray(value.tensor))
    return out


@pytest.mark.parametrize("layout,overrides,ep,calls", [
    ("one", [], 1, 1),
    ("dp2_accum2", ["parallel.devices=cpu:2", "parallel.dp=2", "train.grad_accum=2"], 1, 4),
    ("ep2_accum2", ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2", "train.grad_accum=2"], 2, 4),
    ("ep2pp2", ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.ep=2", "parallel.pp=2",
                "parallel.microbatches=2"], 2, 4),
])
@pytest.mark.parametrize("capacity", [0.5, 0.0])
def test_fit_rows_carry_the_moe_figures(layout, overrides, ep, calls, capacity, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, SEQ, D)).astype("float32")
    x[..., 0] += 1.0
    y = rng.normal(size=(16, SEQ, 3)).astype("float32")
    model = moe_model(capacity, ep)
    snapshots = Snapshots(model, capacity)
    run_dir = tmp_path / "run"
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[snapshots],
                overrides=overrides + [f"run.dir={run_dir}"])
    rows = read_metrics(run_dir)
    assert [(r["epoch"], r["step"]) for r in rows] == [(1, 2), (2, 4)]
    # A step's figures are the whole batch's: every replica's every micro-batch (the
    # layer's calls), each call with its own capacity. A row: the epoch's mean of its steps.
    steps = [expected_row(snap, np.split(x[8 * (i % 2):8 * (i % 2) + 8], calls)) for i, snap in
             enumerate(snapshots.steps)]
    assert len(steps) == 4
    for epoch, row in enumerate(rows):
        want = {k: np.mean([s[k] for s in steps[2 * epoch:2 * epoch + 2]]) for k in steps[0]}
        got = {k: row[k] for k in want}
        np.testing.assert_allclose([got[k] for k in want], [want[k] for k in want], rtol=1e-5, atol=1e-6,
                                   err_msg=json.dumps({"got": got, "want": want}))
        if capacity == 0:
            assert row["moe_dropped"] == 0.0
        else:
            assert 0.0 < row["moe_dropped"] < 1.0
        assert row["moe_load_min"] < 1.0 < row["moe_load_max"]  # expert 3 is starved
    if calls > 1:  # the whole batch differs from its last call: the figures are not the last call's
        last = [expected_row(snap, np.split(x[8 * (i % 2):8 * (i % 2) + 8], calls)[-1:]) for i, snap in
                enumerate(snapshots.steps)]
        assert any(abs(np.mean([s[k] for s in last[:2]]) - rows[0][k]) > 1e-3 for k in steps[0])
    if layout == "one" and capacity:  # the same figures as TensorBoard scalars, at the row's step
        scalars = tensorboard_scalars(run_dir)
        for key in ("loss", "moe_aux_loss", "moe_balance", "moe_dropped", "moe_load_min", "moe_load_max"):
            assert scalars[key] == pytest.approx({r["step"]: r[key] for r in rows}, rel=1e-6), key


def test_statistics_totals_add_up_calls_until_reset():
    """Outside phalanx.fit the totals sum every training call until reset_statistics();
    the four scalars are the last call's."""
    model = moe_model(0.5)
    layer = model.get_layer("moe_a")
    rng = np.random.default_rng(1)
    a, b = (rng.normal(size=(n, SEQ, D)).astype("float32") for n in (2, 3))
    router = layer.logical_weights()["router"]
    for x in (a, b):
        layer(x, training=True)
    layer(a, training=False)  # inference adds nothing
    counts = [count(layer, router, x) for x in (a, b)]
    calls, balance, assignments, load = (np.asarray(v.numpy()) for v in layer.statistics_totals())
    assert calls == 2 and assignments == sum(c["assignments"] for c in counts)
    np.testing.assert_allclose(balance, sum(c["balance"] for c in counts), rtol=1e-5)
    np.testing.assert_array_equal(load, sum(c["kept"] for c in counts))
    np.testing.assert_allclose(float(layer.dropped_fraction.numpy()), counts[1]["dropped"] / counts[1]["assignments"],
                               rtol=1e-6)
    layer.reset_statistics()
    assert all(not np.any(np.asarray(v.numpy())) for v in layer.statistics_totals())
    path_names = {v.path.split("/")[-1] for v in layer.weights}
    assert {"total_calls", "total_load"} <= path_names
    # .keras files hold the logical weights only (statistics are not state)
    assert len(layer.logical_weights()) == 9


def test_rows_of_a_model_without_experts_have_no_moe_figures(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 4), "float32")
    phalanx.fit(model, x, x[:, :2], batch_size=4, epochs=1, verbose=0, overrides=[f"run.dir={tmp_path}"])
    (row,) = read_metrics(tmp_path)
    assert set(row) == {"epoch", "step", "loss"}
    assert set(tensorboard_scalars(tmp_path)) == {"epoch", "loss"}
