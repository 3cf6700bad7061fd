"""Sparse gradients joined across replicas and micro-batches equal one device's, under Adam.

Keras's Adam squares each row of an ``IndexedSlices`` gradient before adding rows with the same
index, so a position table (``pos_emb(range(maxlen))``: each position looked up once per batch on
one device) must reach it with one summed row per position, while a token table keeps one row per
occurrence (phalanx.parallel.gradients). Oracles:

* the rule itself, in one graph: the joined gradient of two micro-batches against one tape over the
  whole batch, compared on what Adam reads of it (the per-index sums of the rows and of their
  squares) for a position lookup, a token lookup and one table read both ways;
* Keras's own one-device ``fit`` under Adam on this file's copies of two keras.io model shapes
  ("Text classification with Transformer": token + position embedding, a transformer block,
  pooling, a softmax head; "miniature GPT": the same embedding, a causal block, per-token logits),
  and a model whose one table is read with token ids and with positions, on dp2, pp2 and
  dp2 x pp2 (float32, no dropout): per-step losses and every weight and optimizer slot, rtol 1e-4.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.parallel.gradients import finish, join_gradients

VOCAB, MAXLEN, EMBED, HEADS, FF = 24, 8, 8, 2, 16
N, BATCH, EPOCHS = 16, 8, 2
LAYOUTS = {
    "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"],
    "pp2": ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"],
    "dp2pp2": ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"],
}


# -- the rule, in one graph ------------------------------------------------------------------------


def adam_view(grad, rows: int):
    """What Keras's Adam reads of a gradient: per index, the sum of its rows and of their squares."""
    if isinstance(grad, tf.IndexedSlices):
        return (tf.math.unsorted_segment_sum(grad.values, grad.indices, rows),
                tf.math.unsorted_segment_sum(tf.square(grad.values), grad.indices, rows))
    return grad, tf.square(grad)


@pytest.mark.parametrize("lookup", ["positions", "tokens", "both"])
def test_joined_micro_batches_equal_one_tape(lookup):
    table = tf.Variable(tf.random.stateless_normal([VOCAB, EMBED], seed=[1, 2]))
    ids = tf.constant(np.random.default_rng(0).integers(0, VOCAB, (4, MAXLEN)), tf.int32)

    def loss_of(x):
        h = tf.zeros([tf.shape(x)[0], MAXLEN, EMBED])
        if lookup in ("tokens", "both"):
            h += tf.gather(table, x)
        if lookup in ("positions", "both"):
            h += tf.gather(table, tf.range(MAXLEN))  # the same indices in every micro-batch
        return tf.reduce_sum(tf.sin(h) * tf.cast(x[..., None] + 1, tf.float32))

    @tf.function
    def both_ways(x):
        with tf.GradientTape() as tape:
            whole = loss_of(x)
        one_tape = tape.gradient(whole, table)
        joined = None
        for part in tf.split(x, 2):
            with tf.GradientTape() as tape:
                piece = loss_of(part)
            joined = join_gradients(joined, tape.gradient(piece, table), origin=0)
        return adam_view(one_tape, VOCAB), adam_view(finish(joined), VOCAB)

    (sum_one, sq_one), (sum_joined, sq_joined) = both_ways(ids)
    # Sums of at most 8 float32 terms of size ~5: round-off ~1e-6.
    np.testing.assert_allclose(sum_joined.numpy(), sum_one.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sq_joined.numpy(), sq_one.numpy(), rtol=1e-5, atol=1e-5)
    if lookup != "tokens":  # the rule matters here: concatenated rows would square the halves
        assert np.abs(sq_joined.numpy()[:MAXLEN]).max() > 1.0


# -- Keras's fit as the oracle ----------------------------------------------------------------------


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras.io's: a token table read with the batch's ids plus a position table read with
    ``range(maxlen)``; ``shared=True`` reads one table both ways."""

    def __init__(self, shared: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(VOCAB, EMBED)
        self.pos_emb = self.token_emb if shared else keras.layers.Embedding(MAXLEN, EMBED)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(keras.layers.Layer):
    def __init__(self, causal: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal
        self.att = keras.layers.MultiHeadAttention(HEADS, key_dim=EMBED)
        self.ffn = keras.Sequential([keras.layers.Dense(FF, activation="relu"), keras.layers.Dense(EMBED)])
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)

    def call(self, x):
        h = self.norm1(x + self.att(x, x, use_causal_mask=self.causal))
        return self.norm2(h + self.ffn(h))


def classifier(shared: bool = False):
    """keras.io "Text classification with Transformer" (tiny, dropout 0)."""
    tokens = keras.Input((MAXLEN,), dtype="int32")
    h = TransformerBlock()(TokenAndPositionEmbedding(shared)(tokens))
    h = keras.layers.Dense(20, activation="relu")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(tokens, keras.layers.Dense(2, activation="softmax")(h))


def miniature_gpt():
    """keras.io "Text generation with a miniature GPT" (tiny, dropout 0)."""
    tokens = keras.Input((MAXLEN,), dtype="int32")
    h = TransformerBlock(causal=True)(TokenAndPositionEmbedding()(tokens))
    return keras.Model(tokens, keras.layers.Dense(VOCAB)(h))


MODELS = {
    "classifier": (classifier, "sparse_categorical_crossentropy"),
    "gpt": (miniature_gpt, keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
    "mixed": (lambda: classifier(shared=True), "sparse_categorical_crossentropy"),
}


# Adam epsilon 1e-3 in Keras's fit and the run under test alike (Keras's default 1e-7): a gradient's
# float32 round-off d (~1e-7: the layouts reorder sums; the attention's key bias, which softmax
# ignores, has nothing else) moves a step by at most ~2 x lr x d / eps (derivation:
# tests/helpers.py ADAM_EPS): 4 x 2 x 1e-2 x 1e-7 / 1e-3 = 8e-6 in the 4 steps, inside atol 1e-5.
# Still Adam, and the embedding rows' gradients (~1e-2) stay well above epsilon, so a join that
# squared concatenated position rows would still move them far outside it.
ADAM_EPS = 1e-3


def build(name: str):
    keras.utils.set_random_seed(5)
    make, loss = MODELS[name]
    model = make()
    model.compile(optimizer=keras.optimizers.Adam(1e-2, epsilon=ADAM_EPS), loss=loss)
    return model


def data(name: str):
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, (N, MAXLEN)).astype("int32")
    y = np.roll(x, -1, axis=1) if name == "gpt" else rng.integers(0, 2, N).astype("int32")
    return x, y


class StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


@pytest.fixture(scope="module")
def references():
    fits = {}

    def get(name: str):
        if name not in fits:
            model, record = build(name), StepLosses()
            model.fit(*data(name), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record])
            fits[name] = (record.losses, model)
        return fits[name]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_position_and_token_tables_under_adam_equal_keras_fit(name, layout, tmp_path, references):
    ref_losses, reference = references(name)
    model, record = build(name), StepLosses()
    phalanx.fit(model, *data(name), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record],
                overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / 'run'}"])
    # float32 throughout; the layouts reorder sums only (~1e-7), which 4 Adam steps keep below
    # atol 1e-5 (see ADAM_EPS). Concatenated position rows were 4e-2 apart after 3 epochs.
    np.testing.assert_allclose(record.losses, ref_losses, rtol=1e-4, atol=1e-6)
    assert [tuple(v.shape) for v in model.variables] == [tuple(v.shape) for v in reference.variables]
    for mine, ref in zip(model.variables + model.optimizer.variables,
                         reference.variables + reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_sparse_join_rule_holds_on_zero_slices(zero, tmp_path, references):
    """Under ZeRO the gradients are cut into each replica's slices before they are joined: the
    table read both ways (token ids and positions) must still reach Adam as one device's."""
    ref_losses, reference = references("mixed")
    model, record = build("mixed"), StepLosses()
    phalanx.fit(model, *data("mixed"), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                callbacks=[record], overrides=LAYOUTS["dp2"] + [f"parallel.zero={zero}", f"run.dir={tmp_path / 'run'}"])
    # As above: the slices reorder sums only.
    np.testing.assert_allclose(record.losses, ref_losses, rtol=1e-4, atol=1e-6)
    for mine, ref in zip(model.variables + model.optimizer.variables,
                         reference.variables + reference.optimizer.variables):
        np.testing.assert_allclose(mine.numpy(), ref.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)
