"""``phalanx.parallelize`` / ``unparallelize`` on keras-hub LLMs and on a user's own model.

The oracle is the unmodified model's own output: a one-device keras-hub model (GPT-2,
Llama, Mistral; small random configs, float32, no dropout) computes its logits, then is
parallelized in place at tp=2 and tp=4 and must give the same logits (eagerly and in a
``tf.function``, on one device), with the same parameter count and none of the replaced
layers' variables left. ``unparallelize`` gives plain keras-hub layers back, with the same
logits and weight paths; the model saves, reloads with Keras and keras-hub alone, and
generates. Every way a rule set can give a wrong split is an error naming the layer.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import keras
import keras_hub  # installed by the Makefile with the test tools (no skip: a missing install must fail)
import tensorflow as tf

import phalanx
from phalanx.layers import ColumnParallelDense, ParallelMLP, RowParallelDense, VocabParallelEmbedding
from phalanx.layers.sharding import ShardedLayer, placement_of
from phalanx.models.parallelize import match, preset_for
from phalanx.models.presets.adapters import (
    ParallelLlamaAttention,
    ParallelMistralAttention,
    ParallelMultiHeadAttention,
    ParallelReversibleEmbedding,
)

VOCAB, SEQ = 64, 8


def build(family: str, seed: int = 1, **overrides):
    keras.utils.set_random_seed(seed)
    if family == "gpt2":
        config = dict(vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=16, intermediate_dim=32,
                      max_sequence_length=16, dropout=0.0)
        config.update(overrides)
        return keras_hub.models.GPT2CausalLM(backbone=keras_hub.models.GPT2Backbone(**config), preprocessor=None)
    config = dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=8, num_key_value_heads=4, hidden_dim=32,
                  intermediate_dim=64)
    if family == "llama":
        config.update(overrides)
        return keras_hub.models.LlamaCausalLM(backbone=keras_hub.models.LlamaBackbone(**config), preprocessor=None)
    config.update(sliding_window=3)  # shorter than the sequence: the window shows in the mask
    config.update(overrides)
    return keras_hub.models.MistralCausalLM(backbone=keras_hub.models.MistralBackbone(**config), preprocessor=None)


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = np.ones((3, SEQ), "int32")
    mask[0, 5:] = 0  # a right-padded row
    mask[1, :2] = 0  # a left-padded row: its first queries attend to nothing
    return {"token_ids": rng.integers(0, VOCAB, (3, SEQ)).astype("int32"), "padding_mask": mask}


def assert_logits(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    # rtol 1e-5 of the logits' scale (elementwise rtol is meaningless at logits ~0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=what)


ATTENTION = {"gpt2": ParallelMultiHeadAttention, "llama": ParallelLlamaAttention, "mistral": ParallelMistralAttention}


def replaced_layers(model, family):
    """The plain layers a preset replaces (held only weakly by the caller)."""
    backbone = model.backbone
    out = [backbone.token_embedding]
    for block in backbone.transformer_layers:
        out.append(block._self_attention_layer)
        out += [block._feedforward_intermediate_dense, block._feedforward_output_dense]
        if family != "gpt2":
            out.append(block._feedforward_gate_dense)
    return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral"])
def test_keras_hub_preset_gives_the_plain_model_logits(family, tp, tmp_path):
    model, x = build(family), batch()
    want = np.asarray(model(x))
    paths = [w.path for w in model.weights]
    n_params = model.count_params()
    old = replaced_layers(model, family)
    old_vars = {id(v) for layer in old for v in layer.weights}
    refs = [weakref.ref(layer) for layer in old]
    del old

    assert phalanx.parallelize(model, tp) is model
    backbone = model.backbone
    assert type(backbone.token_embedding).__name__ == "ReversibleEmbedding"
    assert isinstance(backbone.token_embedding, ParallelReversibleEmbedding)
    for block in backbone.transformer_layers:
        assert type(block._self_attention_layer) is ATTENTION[family]
        if family == "gpt2":
            assert isinstance(block._feedforward_intermediate_dense, ColumnParallelDense)
            assert isinstance(block._feedforward_output_dense, RowParallelDense)
        else:
            assert isinstance(block._phalanx_mlp, ParallelMLP)
    assert model.count_params() == n_params
    assert not old_vars & {id(v) for v in model.weights}
    gc.collect()
    assert [r for r in refs if r() is not None] == []  # nothing keeps a replaced layer alive
    shards = {placement_of(v).shards for v in model.weights if placement_of(v) is not None}
    assert shards == {tp}

    assert_logits(model(x), want, "eager")
    assert_logits(tf.function(lambda inputs: model(inputs))(x), want, "tf.function")
    with pytest.raises(NotImplementedError, match="unparallelize"):
        model.generate(x, stop_token_ids=None)

    if tp == 2:
        # a tensor-parallel keras-hub model saves the plain model's file
        model.save(tmp_path / "parallel.keras")
        plain = keras.models.load_model(tmp_path / "parallel.keras")
        assert not any(isinstance(layer, ShardedLayer) for layer in plain.backbone._flatten_layers())
        assert_logits(plain(x), want, "parallel save -> plain load")
        # and loads a plain model's weights
        other = phalanx.parallelize(build(family, seed=7), tp)
        plain.save_weights(tmp_path / "plain.weights.h5")
        other.load_weights(tmp_path / "plain.weights.h5")
        assert_logits(other(x), want, "plain weights -> parallel model")

    assert phalanx.unparallelize(model) is model
    assert not any(isinstance(layer, ShardedLayer) for layer in model._flatten_layers())
    assert [w.path for w in model.weights] == paths
    assert_logits(model(x), want, "unparallelized")
    if tp == 2:
        model.save(tmp_path / "plain.keras")
        reloaded = keras.models.load_model(tmp_path / "plain.keras")
        assert_logits(reloaded(x), want, "saved and reloaded")
        prompt = {key: value[:1] for key, value in x.items()}  # 5 tokens, 3 to generate
        out = reloaded.generate(prompt, stop_token_ids=None)  # token ids in, no preprocessor
        np.testing.assert_array_equal(out["token_ids"][:, :5], prompt["token_ids"][:, :5])
        assert out["padding_mask"].all()


def test_gpt2_with_dropout_equals_in_inference():
    # keras-hub's default GPT-2 dropout (0.1) sends Keras's attention down its Softmax path,
    # where a query that attends to nothing (the left-padded row) gets zero probabilities
    model, x = build("gpt2", dropout=0.1), batch()
    want = np.asarray(model(x, training=False))
    phalanx.parallelize(model, 2)
    assert_logits(model(x, training=False), want)


def test_trained_weights_go_back_to_the_plain_model():
    model, x = build("llama"), batch()
    phalanx.parallelize(model, 2)
    mlp = model.backbone.transformer_layers[0]._phalanx_mlp
    changed = {name: value + 0.01 for name, value in mlp.logical_weights().items()}
    mlp.set_logical_weights(changed)
    after = np.asarray(model(x))
    phalanx.unparallelize(model)
    block = model.backbone.transformer_layers[0]
    np.testing.assert_array_equal(block._feedforward_gate_dense.kernel.numpy(), changed["gate"])
    np.testing.assert_array_equal(block._feedforward_output_dense.kernel.numpy(), changed["down"])
    assert_logits(model(x), after)


def test_presets():
    gpt2 = build("gpt2")
    assert [kind for _, kind in preset_for(gpt2)] == ["vocab", "attention", "column", "row"]
    assert preset_for(gpt2.backbone) == preset_for(gpt2)
    # GPT-2's real vocabulary (50257) is odd: the token embedding stays whole at tp=2
    odd = build("gpt2", vocabulary_size=63)
    assert [kind for _, kind in preset_for(odd, 2)][0] == "replicated"
    phalanx.parallelize(odd, 2)
    assert type(odd.backbone.token_embedding) is keras.layers.ReversibleEmbedding
    assert preset_for(build("llama")) == preset_for(build("mistral"))
    assert preset_for(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])) is None
    llama = build("llama")
    hits = match(llama, preset_for(llama))
    prefix = llama.backbone.name
    assert [(m.path, m.kind) for m in hits][:3] == [
        (f"{prefix}/token_embedding", "vocab"), (f"{prefix}/transformer_layer_0", "mlp"),
        (f"{prefix}/transformer_layer_0/self_attention", "attention")]


# ---------------------------------------------------------------------------------------------
# A user's own transformer
# ---------------------------------------------------------------------------------------------

def user_transformer(d=16, heads=4, ffn=32, vocab=32, t=SEQ, mha=False):
    keras.utils.set_random_seed(3)
    ids = keras.Input((t,), dtype="int32", name="ids")
    x = keras.layers.Embedding(vocab, d, name="embed")(ids)
    h = keras.layers.LayerNormalization(name="ln1")(x)
    if mha:
        attended = keras.layers.MultiHeadAttention(heads, d // heads, name="mha")(h, h, use_causal_mask=True)
    else:
        def split(z):
            return keras.ops.transpose(keras.ops.reshape(z, (-1, t, heads, d // heads)), (0, 2, 1, 3))

        q, k, v = (split(keras.layers.Dense(d, name=n)(h)) for n in ("q", "k", "v"))
        scores = keras.ops.matmul(q, keras.ops.transpose(k, (0, 1, 3, 2))) / float(np.sqrt(d // heads))
        causal = np.tril(np.ones((t, t), "float32"))
        scores = scores + (1.0 - causal) * -1e9
        o = keras.ops.matmul(keras.ops.softmax(scores, axis=-1), v)
        o = keras.ops.reshape(keras.ops.transpose(o, (0, 2, 1, 3)), (-1, t, d))
        attended = keras.layers.Dense(d, name="out")(o)
    x = x + attended
    h = keras.layers.LayerNormalization(name="ln2")(x)
    x = x + keras.layers.Dense(d, name="fc2")(keras.layers.Dense(ffn, activation="gelu", name="fc1")(h))
    logits = keras.layers.Dense(vocab, name="head")(keras.layers.LayerNormalization(name="ln3")(x))
    return keras.Model(ids, logits)


USER_RULES = [("^embed$", "vocab"), ("^(q|k|v)$", "column"), ("^out$", "row"), ("^fc1$", "column"),
              ("^fc2$", "row")]


@pytest.mark.parametrize("mha", [False, True], ids=["dense-qkv", "keras-mha"])
def test_user_functional_transformer(mha, tmp_path):
    model = user_transformer(mha=mha)
    x = np.random.default_rng(1).integers(0, 32, (2, SEQ)).astype("int32")
    want = np.asarray(model(x))
    n_params = model.count_params()
    rules = ([("^embed$", "vocab"), ("^mha$", "attention"), ("^fc1$", "column"), ("^fc2$", "row")]
             if mha else USER_RULES)
    phalanx.parallelize(model, 2, rules=rules)
    kinds = {layer.name: type(layer) for layer in model.layers}
    assert kinds["embed"] is VocabParallelEmbedding and kinds["fc1"] is ColumnParallelDense
    assert kinds["fc2"] is RowParallelDense and kinds["head"] is keras.layers.Dense
    assert (kinds["mha"] is ParallelMultiHeadAttention) if mha else (kinds["out"] is RowParallelDense)
    assert model.count_params() == n_params
    assert_logits(model(x), want, "eager")
    assert_logits(tf.function(lambda ids: model(ids))(x), want, "tf.function")
    # the parallel model saves and reloads as itself (config and logical weights)
    model.save(tmp_path / "user.keras")
    reloaded = keras.models.load_model(tmp_path / "user.keras")
    assert type(reloaded.get_layer("fc1")) is ColumnParallelDense
    assert_logits(reloaded(x), want, "reloaded")
    phalanx.unparallelize(model)
    assert {type(layer) for layer in model.layers if layer.name in ("embed", "fc1", "fc2", "mha")} == {
        keras.layers.Embedding, keras.layers.Dense, *([keras.layers.MultiHeadAttention] if mha else [])}
    assert_logits(model(x), want, "unparallelized")
    # a parallel model loaded from a file (no record of its plain layers) becomes plain too
    phalanx.unparallelize(reloaded)
    assert not any(isinstance(layer, ShardedLayer) for layer in reloaded.layers)
    assert_logits(reloaded(x), want, "reloaded, unparallelized")
    # the trainable graph still works after the swaps: one step of Keras's own fit
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, x, epochs=1, verbose=0)


def test_einsum_dense_that_is_a_dense():
    keras.utils.set_random_seed(4)
    x = keras.Input((SEQ, 8))
    h = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 16), bias_axes="d", activation="relu",
                                 name="up")(x)
    model = keras.Model(x, keras.layers.EinsumDense("...c,cd->...d", output_shape=8, name="down")(h))
    data = np.random.default_rng(0).normal(size=(2, SEQ, 8)).astype("float32")
    want = np.asarray(model(data))
    phalanx.parallelize(model, 2, rules=[("up", "column"), ("down", "row")])
    assert [type(layer) for layer in model.layers[1:]] == [ColumnParallelDense, RowParallelDense]
    assert_logits(model(data), want)
    phalanx.unparallelize(model)
    assert [type(layer) for layer in model.layers[1:]] == [keras.layers.EinsumDense] * 2
    assert_logits(model(data), want)
    not_dense = keras.Sequential([keras.Input((4, 8)), keras.layers.EinsumDense("abc,cde->abde", (None, 2, 4),
                                                                                  name="heads")])
    with pytest.raises(ValueError, match=r"layer 'heads' \(EinsumDense\) cannot be 'column' .* is not a Dense"):
        phalanx.parallelize(not_dense, 2, rules=[("heads", "column")])


def test_keras_fit_trains_a_parallelized_model_like_the_plain_one():
    x = np.random.default_rng(1).integers(0, 32, (4, SEQ)).astype("int32")
    losses = []
    for tp in (None, 2):
        model = user_transformer()
        if tp:
            phalanx.parallelize(model, tp, rules=USER_RULES)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses.append(model.fit(x, x, epochs=3, batch_size=4, verbose=0, shuffle=False).history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


def test_rules_on_weight_paths_and_a_mesh_for_tp(devices):
    """A rule may name a weight (``fc1/kernel$``): it decides the layer holding it; ``tp`` may be the
    Mesh the model will run on (its tensor axis). Same logits as the plain model."""
    from phalanx.mesh import Mesh

    model = user_transformer()
    x = np.random.default_rng(1).integers(0, 32, (2, SEQ)).astype("int32")
    want = np.asarray(model(x))
    rules = [("^embed/embeddings$", "vocab"), (r"^(q|k|v)/kernel$", "column"), ("^out/bias$", "row"),
             ("^fc1/kernel$", "column"), ("^fc2/kernel$", "row")]
    assert sorted((m.path, m.kind) for m in match(model, rules)) == sorted([
        ("embed", "vocab"), ("q", "column"), ("k", "column"), ("v", "column"), ("out", "row"),
        ("fc1", "column"), ("fc2", "row")])
    phalanx.parallelize(model, Mesh.from_devices(devices[:4], dp=2, pp=1, tp=2), rules=rules)
    assert type(model.get_layer("fc2")) is RowParallelDense and model.get_layer("fc2").tp == 2
    assert_logits(model(x), want)
    with pytest.raises(ValueError, match=r"rule 0 \('\^fc9/kernel\$' -> 'column'\) matches no layer"):
        phalanx.parallelize(user_transformer(), 2, rules=[("^fc9/kernel$", "column")])


# ---------------------------------------------------------------------------------------------
# Rule sets that would give a wrong split
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rules, tp, message", [
    ([("^nothing_here$", "column")], 2, r"rule 0 \('\^nothing_here\$' -> 'column'\) matches no layer"),
    ([("^q$", "column"), ("^q$", "row")], 2, r"rule 1 .* matches only layers that an earlier rule"),
    ([("^fc2$", "row")], 2, r"layer 'fc2' is 'row' .* no column layer comes before it"),
    ([("^q$", "column"), ("^fc2$", "row")], 2, r"layer 'fc2' is 'row' .* widths \[16\] .* input width \(32\)"),
    ([("^fc1$", "column"), ("^fc2$", "row"), ("^head$", "row")], 2, r"layer 'head' is 'row'"),
    ([("^fc1$", "column")], 3, r"layer 'fc1' \(Dense\) cannot be 'column' .* 32 output units, which tp=3 does not"),
    ([("^q$", "column"), ("^out$", "row")], 32, r"layer 'q' .* 16 output units, which tp=32 does not divide"),
    ([("^embed$", "vocab")], 5, r"layer 'embed' .* vocabulary of 32, which tp=5 does not divide"),
    ([("^embed$", "column")], 2, r"layer 'embed' \(Embedding\) cannot be 'column' .* is not a Dense"),
    ([("^q$", "vocab")], 2, r"layer 'q' \(Dense\) cannot be 'vocab' .* is not an Embedding"),
    ([("^q$", "attention")], 2, r"layer 'q' \(Dense\) cannot be 'attention' .* is not a self-attention layer"),
    ([("^ln1$", "mlp")], 2, r"layer 'ln1' .* cannot be 'mlp' .* not a gated keras-hub decoder block"),
    ([("^q$", "sideways")], 2, r"kind 'sideways' is not one of"),
    ([("^q$",)], 2, r"rule 0: \('\^q\$',\) is not a \(regex, kind\) pair"),
    ([("(", "column")], 2, r"bad regex"),
])
def test_rule_errors_name_the_layer(rules, tp, message):
    model = user_transformer()
    before = [type(layer) for layer in model.layers]
    with pytest.raises(ValueError, match=message):
        phalanx.parallelize(model, tp, rules=rules)
    assert [type(layer) for layer in model.layers] == before  # nothing changed


def test_keras_hub_rule_errors():
    llama = build("llama", num_query_heads=4, num_key_value_heads=2, hidden_dim=16)
    with pytest.raises(ValueError, match=r"layer 'llama_backbone\w*/transformer_layer_0/self_attention' "
                                         r"\(LlamaAttention\) cannot be 'attention' .* 2 key/value heads, "
                                         r"which tp=4 does not divide"):
        phalanx.parallelize(llama, 4)
    llama31 = build("llama", rope_frequency_adjustment_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_pretraining_sequence_length=16)
    with pytest.raises(ValueError, match=r"self_attention' \(LlamaAttention\) cannot be 'attention' .* Llama 3.1 "
                                         r"rotary frequency adjustment"):
        phalanx.parallelize(llama31, 2)
    gpt2 = build("gpt2")
    with pytest.raises(ValueError, match=r"layer 'gpt2_backbone\w*/transformer_layer_0' \(TransformerDecoder\) cannot "
                                         r"be 'mlp'"):
        phalanx.parallelize(gpt2, 2, rules=[(r"transformer_layer_\d+$", "mlp")])
    with pytest.raises(ValueError, match=r"no tensor-parallel preset"):
        phalanx.parallelize(user_transformer(), 2)
    with pytest.raises(ValueError, match=r"feedforward_gate_dense' is 'mlp' of block .* and 'column'"):
        phalanx.parallelize(llama, 2, rules=[(r"transformer_layer_\d+$", "mlp"), ("feedforward_gate_dense$", "column")])
    phalanx.parallelize(gpt2, 2)
    with pytest.raises(ValueError, match=r"layer 'gpt2_backbone\w*/token_embedding' is already tensor-parallel"):
        phalanx.parallelize(gpt2, 2)
    trained = build("gpt2")
    trained.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    trained.optimizer.build(trained.trainable_variables)  # as after a step of fit
    moments = {v.path: np.random.default_rng(0).normal(size=v.shape).astype("float32")
               for v in trained.trainable_variables}
    for v in trained.trainable_variables:
        trained.optimizer._momentums[trained.optimizer._get_variable_index(v)].assign(moments[v.path])
    embedding = trained.backbone.token_embedding.embeddings.path
    phalanx.parallelize(trained, 2)  # the built optimizer is rebuilt for the shards, its state carried
    assert [id(v) for v in trained.optimizer._trainable_variables] == [id(v) for v in trained.trainable_variables]
    table = trained.backbone.token_embedding  # vocabulary-parallel now: the moments are cut like the table
    shards = [trained.optimizer._momentums[trained.optimizer._get_variable_index(v)].numpy()
              for v in table.trainable_variables]
    np.testing.assert_array_equal(np.concatenate(shards, axis=0), moments[embedding])


@pytest.mark.parametrize("module", ["phalanx.models.parallelize", "phalanx.models.presets",
                                    "phalanx.models.presets.adapters"])
def test_doctests(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS).failed == 0
