"""BatchNormalization's moving statistics follow one rule on every layout (parallel.replica_state).

Oracle: the statistics computed here in NumPy from the definition, independently of Keras and
phalanx. The model normalises its input first, so each micro-batch's batch statistics are those
of its rows of ``x`` whatever the weights do: within a data replica the micro-batches move the
averages in order (``m <- momentum*m + (1-momentum)*stat``), and the replicas — each from the
step's starting value — are averaged once per step, as Keras's MirroredStrategy does. The
trainable weights are checked against Keras's own fit of a ghost-batch model (each micro-batch
normalised with its own statistics, its statistics combined by the same rule: it is checked against
the NumPy figures too). Dropout's seed state and an MoE layer's step totals are
checked by the same rule: integer state equal on every replica, totals summed.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import phalanx
from phalanx.parallel.replica_state import combine_replicas, rule_of

from helpers import ghost_batches

N, BATCH, FEATURES, MOMENTUM, EPSILON = 32, 16, 4, 0.8, 1e-3
LAYOUTS = {  # (overrides, replicas, micro-batches per replica)
    "dp2": (["parallel.devices=cpu:2", "parallel.dp=2"], 2, 1),
    "pp2": (["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"], 1, 2),
    "dp2pp2": (["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"], 2, 2),
    "accum2": (["train.grad_accum=2"], 1, 2),
}


def data():
    rng = np.random.default_rng(4)
    # Columns of different means and scales, so that every micro-batch's statistics differ.
    x = (rng.normal(size=(N, FEATURES)) * [1.0, 2.0, 0.5, 3.0] + [0.5, -1.0, 2.0, 0.0]).astype("float32")
    return x, rng.integers(0, 3, N).astype("int32")


def build():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((FEATURES,))
    h = keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPSILON)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def expected_statistics(x, replicas: int, micro: int, epochs: int):
    """Moving mean and variance after ``epochs`` over ``x`` in batches of BATCH (NumPy, float64)."""
    mean, var = np.zeros(FEATURES), np.ones(FEATURES)
    for _ in range(epochs):
        for b in range(0, N, BATCH):
            ends = []
            for rows in np.split(x[b:b + BATCH].astype("float64"), replicas):
                m, v = mean, var  # every replica from the step's starting value
                for piece in np.split(rows, micro):  # its micro-batches in order
                    m = MOMENTUM * m + (1 - MOMENTUM) * piece.mean(0)
                    v = MOMENTUM * v + (1 - MOMENTUM) * piece.var(0)  # Keras: the biased batch variance
                ends.append((m, v))
            mean, var = np.mean([e[0] for e in ends], 0), np.mean([e[1] for e in ends], 0)
    return mean, var


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moving_statistics_follow_the_rule(layout, tmp_path):
    overrides, replicas, micro = LAYOUTS[layout]
    x, y = data()
    model = build()
    phalanx.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                overrides=overrides + [f"run.dir={tmp_path / 'r'}"])
    bn = model.layers[1]
    mean, var = expected_statistics(x, replicas, micro, 2)
    # float32 statistics of 4-16 rows: ~1e-7 relative; 4 updates keep it there.
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, rtol=1e-5, atol=1e-6)
    # The other rule (every micro-batch threaded) would be measurably different here.
    threaded, _ = expected_statistics(x, 1, replicas * micro, 2)
    if replicas > 1:
        assert np.abs(threaded - mean).max() > 1e-2
    # Trainable weights: Keras's fit of the ghost-batch model, each micro-batch normalised on its own.
    reference = build()
    ghost = ghost_batches(reference, replicas * micro, replicas=replicas)
    ghost.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ghost.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for mine, ref in zip(model.variables, reference.variables):
        np.testing.assert_allclose(mine.numpy(), ref.numpy(), rtol=1e-4, atol=1e-6, err_msg=mine.path)


def test_the_rule_for_seeds_totals_and_statistics():
    import tensorflow as tf

    from phalanx.layers.moe import MoE

    moe = MoE(num_experts=2, hidden_dim=4, top_k=1)
    moe.build((None, 3))
    dropout = keras.layers.Dropout(0.5, seed=1)
    bn = keras.layers.BatchNormalization()
    bn.build((None, 3))
    variables = [moe.total_calls, moe.total_load, dropout.seed_generator.state, bn.moving_mean]
    rules = [rule_of(v) for v in variables]
    assert rules == ["sum", "sum", "first", "mean"]
    seed = dropout.seed_generator.state.dtype
    start = [tf.constant(0.0), tf.zeros([2]), tf.constant([1, 0], seed), tf.zeros([3])]
    ends = [[tf.constant(2.0), tf.constant([3.0, 1.0]), tf.constant([1, 2], seed), tf.fill([3], 1.0)],
            [tf.constant(2.0), tf.constant([2.0, 2.0]), tf.constant([1, 2], seed), tf.fill([3], 3.0)]]
    joined = combine_replicas(start, ends, rules)
    assert float(joined[0]) == 4.0 and joined[1].numpy().tolist() == [5.0, 3.0]
    assert joined[2].numpy().tolist() == [1, 2] and joined[3].numpy().tolist() == [2.0, 2.0, 2.0]
    assert combine_replicas(start, [list(start), list(start)], rules)[3] is start[3]  # unchanged: nothing to write
