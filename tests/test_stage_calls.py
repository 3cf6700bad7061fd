"""phalanx.parallel.stage_calls: a stage's forward traced once and called per micro-batch.

The oracle is Keras's own one-device ``train_on_batch`` on a clone with the same weights; the
step under test runs 4 micro-batches per replica on dp2 x pp2, so its trace must hold one stage
function per (replica, stage), every call (forward, and the backward TensorFlow derives from
it) placed on that stage's device.
"""

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf

from phalanx.config import Config
from phalanx.engines.keras_model import KerasModelEngine
from phalanx.layers import ColumnParallelDense, RowParallelDense
from phalanx.mesh import Mesh
from phalanx.parallel import stage_calls
from phalanx.parallel.stage_calls import StageCalls

DP, PP, MICRO = 2, 2, 4
CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def test_doctest():
    assert doctest.testmod(stage_calls, raise_on_error=True).failed == 0


def _mlp(seed):
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,))
    h = keras.layers.Dense(16, activation="tanh")(x)
    h = keras.layers.Dense(16, activation="relu")(h)
    h = keras.layers.Dense(16, activation="tanh")(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


@pytest.fixture(scope="module")
def trained():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    oracle, model = _mlp(1), _mlp(1)
    model.set_weights(oracle.get_weights())
    for m in (oracle, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:DP * PP]
    cfg = Config().replace(parallel={"dp": DP, "pp": PP, "microbatches": MICRO})
    engine = KerasModelEngine(model, cfg, Mesh.from_devices(devices, DP, PP, 1), (x, y, None))
    losses = [float(engine.train_step((x, y, None))["loss"]) for _ in range(2)]
    expected = [float(oracle.train_on_batch(x, y)) for _ in range(2)]
    graph = engine._train_fn.get_concrete_function(tf.constant(x), tf.constant(y), None).graph
    return engine, model, oracle, losses, expected, graph


def test_one_trace_per_replica_and_stage_equals_keras(trained):
    engine, model, oracle, losses, expected, _ = trained
    assert engine.stage_calls is not None and engine.stage_calls.traced == DP * PP and not engine.stage_calls.inline
    # float32, 16 rows in 8 micro-batches vs one batch: the sums differ by rounding only
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for a, b in zip(model.get_weights(), oracle.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_every_forward_and_backward_call_runs_on_its_stage_device(trained):
    engine, _, _, _, _, graph = trained
    calls = [op for op in graph.get_operations() if op.type in CALL_OPS]
    stage_devices = {tf.DeviceSpec.from_string(engine.stage_device(d, s)).to_string()
                     for d in range(DP) for s in range(PP)}
    placed = {}
    for op in calls:
        name = op.get_attr("f").name
        kind = "backward" if "backward" in name else "forward"
        device = tf.DeviceSpec.from_string(op.device).to_string()
        assert device in stage_devices, (op.name, name, op.device)
        placed.setdefault(kind, []).append(device)
    # each (replica, stage) device: one forward and one backward call per micro-batch
    for kind in ("forward", "backward"):
        assert sorted(placed[kind]) == sorted(list(stage_devices) * MICRO), kind


def test_a_lookup_with_the_same_indices_in_every_micro_batch_runs_inline():
    table = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [6, 2]))
    calls = StageCalls()

    def by_ids(values, state, inputs):
        return {"y": tf.gather(values[0], inputs["ids"])}, [], []

    def by_position(values, state, inputs):
        return {"y": tf.gather(values[0], tf.range(tf.shape(inputs["ids"])[0]))}, [], []

    @tf.function(autograph=False)
    def step(ids):
        value = tf.convert_to_tensor(table)
        a = calls.call("ids", by_ids, [value], [], {"ids": ids})[0]["y"]
        b = calls.call("positions", by_position, [value], [], {"ids": ids})[0]["y"]
        return tf.gradients(tf.reduce_sum(a) + tf.reduce_sum(b), [value])[0]

    grad = tf.convert_to_tensor(step(tf.constant([4, 5, 4])))
    assert calls.traced == 2 and calls.inline == {"positions"}
    np.testing.assert_array_equal(grad.numpy()[:, 0], [1, 1, 1, 0, 2, 1])


# -- tensor shards inside a stage call ------------------------------------------------------

TP = 2


def _tp_mlp(seed, dense):
    """Column, row, column, row Dense layers (``dense(units, activation)`` makes each)."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,))
    h = dense(0, 16, "tanh")(x)
    h = dense(1, 16, "relu")(h)
    h = dense(0, 16, "tanh")(h)
    return keras.Model(x, dense(1, 3, None)(h))


@pytest.fixture(scope="module")
def trained_tp():
    """A tensor-parallel MLP on tp2 x pp2 with 4 micro-batches, and Keras's one-device
    ``train_on_batch`` of the plain Dense MLP with the same weights."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    oracle = _tp_mlp(1, lambda kind, units, act: keras.layers.Dense(units, activation=act))
    model = _tp_mlp(1, lambda kind, units, act: (ColumnParallelDense, RowParallelDense)[kind](
        units, tp=TP, activation=act))
    for layer, plain in zip(model.layers[1:], oracle.layers[1:]):
        layer.set_logical_weights(dict(zip(["kernel", "bias"], plain.get_weights())))
    for m in (oracle, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:TP * PP]
    cfg = Config().replace(parallel={"tp": TP, "pp": PP, "microbatches": MICRO})
    engine = KerasModelEngine(model, cfg, Mesh.from_devices(devices, 1, PP, TP), (x, y, None))
    losses = [float(engine.train_step((x, y, None))["loss"]) for _ in range(2)]
    expected = [float(oracle.train_on_batch(x, y)) for _ in range(2)]
    graph = engine._train_fn.get_concrete_function(tf.constant(x), tf.constant(y), None).graph
    return engine, model, oracle, losses, expected, graph


def test_tensor_shards_one_trace_per_stage_equals_keras(trained_tp):
    engine, model, oracle, losses, expected, _ = trained_tp
    assert engine.stage_calls is not None and engine.stage_calls.traced == PP and not engine.stage_calls.inline
    # float32, 16 rows in 4 micro-batches and shard partial sums vs one batch: rounding only
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for layer, plain in zip(model.layers[1:], oracle.layers[1:]):
        for got, want in zip(layer.logical_weights().values(), plain.get_weights()):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_tensor_shard_ops_run_on_their_rank_inside_forward_and_backward_calls(trained_tp):
    """Each stage's forward and backward call is placed on the stage's rank-0 device; inside
    both, the shard ops run on their own rank's device (TensorFlow builds a function's backward
    without devices: here each gradient op follows the op it differentiates)."""
    engine, _, _, _, _, graph = trained_tp
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    seen = {}
    for op in graph.get_operations():
        if op.type not in CALL_OPS:
            continue
        name = op.get_attr("f").name
        stage = next(s for s in range(PP) if tf.DeviceSpec.from_string(op.device).to_string()
                     == tf.DeviceSpec.from_string(engine.stage_device(0, s)).to_string())
        kind = "backward" if "backward" in name else "forward"
        seen[(stage, kind)] = seen.get((stage, kind), 0) + 1
        inside = {tf.DeviceSpec.from_string(n.device).to_string() for n in library[name].node_def if n.device}
        ranks = {tf.DeviceSpec.from_string(engine.mesh.device(0, stage, r)).to_string() for r in range(TP)}
        assert inside == ranks, (kind, stage, inside)
        # the matmuls of the shards: at least one on each rank
        for rank in ranks:
            assert any(n.op == "MatMul" and tf.DeviceSpec.from_string(n.device).to_string() == rank
                       for n in library[name].node_def), (kind, stage, rank)
    assert seen == {(s, k): MICRO for s in range(PP) for k in ("forward", "backward")}


# -- what a call keeps for its backward ----------------------------------------------------


def test_a_call_keeps_no_tensor_only_a_pruned_gradient_reads():
    """``softmax(x @ w * 0.125)``: its backward reads the softmax output, ``x`` and ``w``;
    only the (unused) gradient with respect to the constant 0.125 reads the product ``x @ w``.
    TensorFlow's function backward would make that product an extra output of every forward
    call, held until the backward call (inline the graph optimiser prunes its reader). The
    forward function returns no MatMul output (the softmax output, ``x`` and ``w`` only), and
    the gradients equal a GradientTape's over the same ops inline (same kernels: to round-off)."""
    rng = np.random.default_rng(0)
    w = tf.constant(rng.normal(size=(16, 32)).astype("float32"))
    xs = tf.constant(rng.normal(size=(3, 8, 16)).astype("float32"))
    upstream = tf.constant(rng.normal(size=(8, 32)).astype("float32"))
    calls = StageCalls()

    def run(values, state, inputs):
        return {"y": tf.nn.softmax(tf.matmul(inputs["x"], values[0]) * 0.125)}, [], []

    @tf.function(autograph=False)
    def step(xs):
        ys = [calls.call("attention", run, [w], [], {"x": xs[i]})[0]["y"] for i in range(3)]
        return tf.gradients(ys, [w, xs], grad_ys=[upstream] * 3)

    graph = step.get_concrete_function(xs).graph
    forwards = [op for op in graph.get_operations() if op.type in CALL_OPS and not op.name.startswith("gradients")]
    assert len(forwards) == 3 and calls.traced == 1
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    forward = library[forwards[0].get_attr("f").name]
    node_types = {n.name: n.op for n in forward.node_def}
    returned = [node_types.get(ref.split(":")[0], "argument") for ref in forward.ret.values()]
    assert "Softmax" in returned and "MatMul" not in returned, returned
    got = step(xs)
    with tf.GradientTape() as tape:
        tape.watch([w, xs])
        ys = [tf.nn.softmax(tf.matmul(xs[i], w) * 0.125) for i in range(3)]
    expected = tape.gradient(ys, [w, xs], output_gradients=[upstream] * 3)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6, atol=1e-6)
