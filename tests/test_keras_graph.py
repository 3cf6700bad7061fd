"""phalanx.parallel.keras_graph: cutting Keras models into stateless pipeline stages.

The oracle is always the unsplit model's own call (``model(x, training=...)``) or
``model.stateless_call`` for the new non-trainable state.
"""

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

from phalanx.parallel import keras_graph
from phalanx.parallel.keras_graph import UncuttableModelError, split_keras_model

RTOL = 1e-6


def assert_close(a, b, rtol=RTOL):
    keras.tree.assert_same_structure(a, b)
    for u, v in zip(keras.tree.flatten(a), keras.tree.flatten(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=1e-7)


def snapshot(model):
    return [np.array(v.numpy()) for v in model.variables]


def chain(split, x, training, values=None):
    """Run the stages as an engine would: only model inputs and crossing(s) are handed on.
    ``values``: id(variable) -> value to use instead of the variable's (default: its value)."""
    values = values or {}
    inputs = dict(zip(split.input_keys, split.flatten_inputs(x)))
    carried, new_state = {}, {}
    for s, st in enumerate(split.stages):
        assert all(k.startswith("in:") or k in carried for k in st.input_keys), (s, st.input_keys)
        feed = {k: inputs[k] if k.startswith("in:") else carried[k] for k in st.input_keys}
        out, nt = st.apply([values.get(id(v), v.value) for v in st.trainable_variables],
                           [values.get(id(v), v.value) for v in st.non_trainable_variables], feed, training)
        assert sorted(out) == sorted(st.output_keys)
        new_state.update((id(v), t) for v, t in zip(st.non_trainable_variables, nt))
        everything = {**carried, **out}
        if s < len(split.stages) - 1:
            crossing = split.crossing(s)
            assert all(k.startswith("t:") for k in crossing)
            carried = {k: everything[k] for k in crossing}
        else:
            carried = everything
    return split.pack_outputs([carried[k] for k in split.output_keys]), new_state


def check(model, x, stages_list=(1, 2, 3), trainings=(False, True), balance="flops"):
    """Split for each stage count and compare outputs and new state with the model's own."""
    splits = []
    for stages in stages_list:
        split = split_keras_model(model, stages, balance=balance)
        assert len(split.stages) == stages
        # every variable of the model is in a stage; only trainable (tied) ones in several
        listed = [id(v) for st in split.stages for v in st.trainable_variables + st.non_trainable_variables]
        assert set(listed) == {id(v) for v in model.variables}
        state = [id(v) for st in split.stages for v in st.non_trainable_variables]
        assert len(state) == len(set(state))
        for training in trainings:
            before = snapshot(model)
            got = split.run(x, training=training)
            chained, new_state = chain(split, x, training)
            for u, v in zip(before, snapshot(model)):  # apply never assigns a variable
                np.testing.assert_array_equal(u, v)
            _, ref_state = model.stateless_call([v.value for v in model.trainable_variables],
                                                [v.value for v in model.non_trainable_variables],
                                                x, training=training)
            for v, ref in zip(model.non_trainable_variables, ref_state):
                assert_close(new_state[id(v)], ref)
            want = model(x, training=training)  # last: in training mode it moves the model's state
            assert_close(got, want)
            assert_close(chained, want)
        splits.append(split)
    return splits


def conv_model():
    return keras.Sequential([
        keras.Input((8, 8, 1)), layers.Conv2D(4, 3, padding="same", activation="relu"),
        layers.BatchNormalization(), layers.MaxPooling2D(), layers.Flatten(), layers.Dropout(0.3),
        layers.Dense(16, activation="relu"), layers.BatchNormalization(), layers.Dense(3)])


def transformer_model(seq=6, dim=8, classes=3):
    x_in = keras.Input((seq, dim))
    h = layers.Dense(dim)(x_in)
    for _ in range(2):
        a = layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.2)(h, h)
        h = layers.LayerNormalization()(layers.Add()([h, a]))
        f = layers.Dense(2 * dim, activation="gelu")(h)
        f = layers.Dropout(0.1)(layers.Dense(dim)(f))
        h = layers.LayerNormalization()(h + f)
    out = layers.Dense(classes)(layers.GlobalAveragePooling1D()(h))
    return keras.Model(x_in, out)


def data(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def test_doctest():
    assert doctest.testmod(keras_graph).failed == 0


def test_sequential_conv_batchnorm_dropout():
    keras.utils.set_random_seed(1)
    model = conv_model()
    x = data(5, 8, 8, 1)
    model(x, training=True)  # move BatchNorm statistics away from their initial values
    splits = check(model, x)
    # Dropout's seed generator state comes back advanced, BatchNorm statistics updated
    split = splits[1]
    dropout = next(lay for lay in model.layers if isinstance(lay, layers.Dropout))
    bn = next(lay for lay in model.layers if isinstance(lay, layers.BatchNormalization))
    _, new_state = chain(split, x, training=True)
    seed = dropout.seed_generator.state
    assert not np.array_equal(np.asarray(new_state[id(seed)]), seed.numpy())
    assert not np.allclose(np.asarray(new_state[id(bn.moving_mean)]), bn.moving_mean.numpy())
    _, same = chain(split, x, training=False)
    np.testing.assert_array_equal(np.asarray(same[id(bn.moving_mean)]), bn.moving_mean.numpy())


def test_lstm_rows_as_time_steps():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((8, 8)), layers.LSTM(8, return_sequences=True),
                              layers.LSTM(6), layers.Dense(3)])
    check(model, data(4, 8, 8))
    # LSTM cost: time steps x 2 x (kernel + recurrent kernel)
    split = split_keras_model(model, 3)
    assert split.stages[0].cost == 8 * 2 * (8 * 32 + 8 * 32)


def test_transformer_residuals_cross_cuts():
    keras.utils.set_random_seed(3)
    model = transformer_model()
    splits = check(model, data(4, 6, 8), stages_list=(1, 2, 3, 5))
    # several tensors cross some cut (a residual branch spans it)
    widths = [len(sp.crossing(s)) for sp in splits for s in range(len(sp.stages) - 1)]
    assert max(widths) >= 2, widths
    assert all(st.ops for sp in splits for st in sp.stages)


def test_dict_inputs_and_outputs_keras_hub_style():
    keras.utils.set_random_seed(4)
    tokens = keras.Input((6,), dtype="int32", name="token_ids")
    mask = keras.Input((6,), dtype="int32", name="padding_mask")
    e = layers.Embedding(20, 8)(tokens)
    aux = layers.Dense(2, name="aux")(layers.GlobalAveragePooling1D()(e))
    h = layers.Dense(16, activation="relu")(e)
    h = layers.Dense(8)(h)
    attention_mask = ops.cast(ops.expand_dims(mask, 1), "bool")  # raw ops in the graph
    h = layers.MultiHeadAttention(2, 4)(h, h, attention_mask=attention_mask)
    logits = layers.Dense(5, name="logits")(layers.GlobalAveragePooling1D()(h))
    model = keras.Model({"token_ids": tokens, "padding_mask": mask}, {"logits": logits, "aux": aux})
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, 20, (3, 6)).astype("int32"),
         "padding_mask": np.array([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], "int32")}
    splits = check(model, x)
    mask_key = f"in:{[t.name for t in split_keras_model(model, 1).graph.inputs].index('padding_mask')}"
    for split in splits[1:]:
        readers = [st.index for st in split.stages if mask_key in st.input_keys]
        assert readers and readers[0] > 0  # the mask is read by a late stage directly...
        aux_key = split.output_keys[0]  # ...and the early output passes through every cut
        assert split.producer[aux_key] == 0
        assert all(aux_key in split.crossing(s) for s in range(len(split.stages) - 1))


def test_list_inputs_outputs_second_input_read_late():
    keras.utils.set_random_seed(5)
    a, b = keras.Input((4,)), keras.Input((3,))
    h = layers.Dense(8, activation="relu")(a)
    early = layers.Dense(2)(h)
    h = layers.Dense(8, activation="relu")(h)
    h = layers.Dense(8)(layers.Concatenate()([h, b]))
    model = keras.Model([a, b], [early, h])
    splits = check(model, [data(3, 4), data(3, 3, seed=1)])
    assert [st.index for st in splits[2].stages if "in:1" in st.input_keys] == [2]
    assert all("in:1" not in splits[2].crossing(s) for s in range(2))


def test_nested_models_are_inlined_and_cut_inside():
    keras.utils.set_random_seed(6)
    inner_seq = keras.Sequential([keras.Input((8,)), layers.Dense(16, activation="relu"),
                                  layers.BatchNormalization(), layers.Dense(8)], name="inner_seq")
    i = keras.Input((8,))
    j = layers.Dense(8, activation="relu")(i)
    inner_fn = keras.Model(i, layers.Add()([i, layers.Dense(8)(j)]), name="inner_fn")

    class Doubled(keras.Model):  # a Functional model with its own call: kept as one op
        def call(self, inputs, training=None):
            return super().call(inputs, training=training) * 2.0

    k = keras.Input((8,))
    doubled = Doubled(k, layers.Dropout(0.5)(layers.Dense(8)(k)), name="doubled")
    x_in = keras.Input((4,))
    h = layers.Dense(8)(x_in)
    h = inner_seq(h)
    h = inner_fn(h, training=False)
    model = keras.Model(x_in, layers.Dense(2)(doubled(h)))
    model(data(4, 4), training=True)
    splits = check(model, data(4, 4))
    inner_names = {lay.name for lay in inner_seq.layers + inner_fn.layers}
    stages_with_inner = [st.index for st in splits[2].stages if inner_names & set(st.op_names)]
    assert len(stages_with_inner) >= 2  # a cut fell inside a nested model
    names = [n for st in splits[2].stages for n in st.op_names]
    assert "inner_seq" not in names and "inner_fn" not in names and "doubled" in names
    assert splits[0].stages[0].ops[names.index("doubled")].flops == 2 * 8 * 8 + 2  # its graph's sum


def test_shared_weights_may_span_stages_but_shared_state_may_not():
    keras.utils.set_random_seed(7)
    shared = layers.Dense(8, name="shared")
    x_in = keras.Input((8,))
    h = shared(layers.Dense(8, activation="relu")(x_in))
    h = shared(layers.Dense(8, activation="relu")(h))
    model = keras.Model(x_in, layers.Dense(2)(h))
    check(model, data(3, 8))
    split = split_keras_model(model, 4)  # tied weights: both stages list them
    assert sum(id(shared.kernel) in {id(v) for v in st.trainable_variables} for st in split.stages) == 2
    # A layer with state (moving statistics) called twice stays in one stage.
    norm = layers.BatchNormalization(name="shared_bn")
    h = norm(layers.Dense(8)(x_in))
    h = norm(layers.Dense(8)(h))
    model = keras.Model(x_in, layers.Dense(2)(h))
    for split in check(model, data(3, 8)):
        assert sum("shared_bn" in st.op_names for st in split.stages) == 1
    with pytest.raises(UncuttableModelError, match="shared_bn"):
        split_keras_model(model, 4)


def test_frozen_layer_weights_are_non_trainable():
    keras.utils.set_random_seed(8)
    frozen = layers.Dense(8, name="frozen")
    model = keras.Sequential([keras.Input((4,)), frozen, layers.Dense(8), layers.Dense(2)])
    frozen.trainable = False
    splits = check(model, data(3, 4))
    for split in splits:
        nt = [id(v) for st in split.stages for v in st.non_trainable_variables]
        tr = [id(v) for st in split.stages for v in st.trainable_variables]
        assert id(frozen.kernel) in nt and id(frozen.kernel) not in tr


def test_apply_uses_the_given_values():
    keras.utils.set_random_seed(9)
    model = conv_model()
    x = data(4, 8, 8, 1)
    split = split_keras_model(model, 3)
    values = {id(v): v.numpy() * 0.5 + 0.1 for v in model.trainable_variables}
    for v in model.non_trainable_variables:
        values[id(v)] = v.numpy() + (1 if "seed" in v.path else 0.3)
    for training in (False, True):
        got, state = chain(split, x, training, values)
        want, want_state = model.stateless_call([values[id(v)] for v in model.trainable_variables],
                                                [values[id(v)] for v in model.non_trainable_variables],
                                                x, training=training)
        assert_close(got, want)
        for v, ref in zip(model.non_trainable_variables, want_state):
            assert_close(state[id(v)], ref)


@pytest.mark.parametrize("build", [transformer_model, conv_model])
def test_gradients_through_two_stages(build):
    keras.utils.set_random_seed(10)
    model = build()
    x = data(4, 6, 8) if build is transformer_model else data(4, 8, 8, 1)
    weights = tf.constant(data(4, 3, seed=3))
    split = split_keras_model(model, 2)
    tv = [v.value for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        out, _ = chain(split, x, training=True)
        loss = tf.reduce_sum(out * weights)
    got = tape.gradient(loss, tv)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True) * weights)
    want = tape.gradient(loss, tv)
    assert all(g is not None for g in got)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-6)


def test_flops_and_params_balance():
    model = keras.Sequential([keras.Input((64,)), layers.Dense(256), layers.Dense(256), layers.Dense(2)])
    split = split_keras_model(model, 2)
    assert [st.op_names for st in split.stages] == [[model.layers[0].name], [lay.name for lay in model.layers[1:]]]
    assert [st.cost for st in split.stages] == [2 * 64 * 256 + 1, 2 * 256 * 256 + 2 * 256 * 2 + 2]
    conv = split_keras_model(conv_model(), 1).stages[0].ops[0]
    assert conv.flops == 2 * 3 * 3 * 1 * 4 * 8 * 8 + 1  # 2 x kernel x output positions
    check(model, data(2, 64), stages_list=(1, 2, 3), trainings=(False,), balance="params")
    with pytest.raises(ValueError, match="flops, params"):
        split_keras_model(model, 2, balance="layers")


def test_errors_say_what_to_do():
    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = layers.Dense(2)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    sub(data(2, 3))
    with pytest.raises(UncuttableModelError, match="Functional or Sequential API.*parallel.pp=1"):
        split_keras_model(sub, 2)
    with pytest.raises(UncuttableModelError, match="call it on a batch of data.*keras.Input"):
        split_keras_model(keras.Sequential([layers.Dense(2)]), 1)
    two = keras.Sequential([keras.Input((3,)), layers.Dense(4), layers.Dense(2)])
    with pytest.raises(UncuttableModelError, match="at most 2"):
        split_keras_model(two, 3)
    with pytest.raises(ValueError, match="positive"):
        split_keras_model(two, 0)


def test_implicit_keras_mask_crosses_cuts():
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((5,), dtype="int32"), layers.Embedding(10, 4, mask_zero=True),
                              layers.LSTM(4), layers.Dense(2)])
    x = np.array([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]], "int32")
    split = check(model, x)[2]
    # the mask (a NotEqual node of the graph, passed to LSTM as mask=) is computed
    # from the model input by the LSTM's stage, not handed on
    lstm_stage = next(st for st in split.stages if model.layers[1].name in st.op_names)
    assert lstm_stage.index > 0 and "in:0" in lstm_stage.input_keys
    assert split.crossing(0) == split.stages[0].output_keys
