"""The tensor-parallel layers against independent oracles: Keras's own Dense / Embedding /
sparse cross-entropy, and NumPy references written here (attention with GQA, causal and
padding masks and RoPE as per-head loops; plain and gated MLPs). Outputs and gradients at
tp=2 and tp=4 in float32; ops placed on their shard's device; .keras files that load
across layouts; errors naming the layer."""

import numpy as np
import pytest
import keras
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

from phalanx.layers import (ColumnParallelDense, ParallelMLP, ParallelSelfAttention, RowParallelDense,
                            VocabParallelEmbedding, vocab_parallel_cross_entropy)
from phalanx.layers.attention import rotary
from phalanx.layers.sharding import placement_of

RTOL, ATOL = 1e-5, 1e-6
rng = np.random.default_rng(0)


def normal(*shape, scale=1.0):
    return (rng.normal(size=shape) * scale).astype("float32")


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def logical_grads(layer, grads):
    """Per-shard gradients (in ``layer.trainable_weights`` order) joined into logical ones."""
    by_var = {id(v): tf.convert_to_tensor(g) for v, g in zip(layer.trainable_weights, grads)}
    out = {}
    for name, (variables, axis, _) in layer._logical.items():
        parts = [by_var[id(v)].numpy() for v in variables]
        out[name] = parts[0] if axis is None else np.concatenate(parts, axis=axis)
    return out


def grads_of(layer, fn):
    """``fn()``'s value and its gradients over ``layer``'s logical weights."""
    with tf.GradientTape() as tape:
        y = fn()
        loss = tf.reduce_sum(y * _weights_like(y))
    return y.numpy(), logical_grads(layer, tape.gradient(loss, layer.trainable_weights))


def _weights_like(y):
    # A fixed, non-uniform cotangent so every output element matters to the gradient.
    return tf.constant(np.linspace(-1.0, 1.0, int(np.prod(y.shape))).reshape(y.shape), y.dtype)


# -- Dense ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", [ColumnParallelDense, RowParallelDense])
def test_dense_matches_keras_dense(kind, tp):
    x = normal(3, 5, 8)
    dense = keras.layers.Dense(12, activation="gelu", bias_initializer="glorot_uniform")
    dense.build((None, 5, 8))
    layer = kind(12, tp=tp, activation="gelu")
    layer.build((None, 5, 8))
    assert [placement_of(v).rank for v in layer.kernel] == list(range(tp))
    layer.set_logical_weights(dict(zip(["kernel", "bias"], dense.get_weights())))  # Dense -> logical
    y, g = grads_of(layer, lambda: layer(x))
    y_ref, g_ref = grads_of_dense(dense, x)
    close(y, y_ref)
    for name in ("kernel", "bias"):
        close(g[name], g_ref[name])
    back = keras.layers.Dense(12)
    back.build((None, 8))
    back.set_weights(list(layer.logical_weights().values()))  # logical -> Dense
    for a, b in zip(back.get_weights(), dense.get_weights()):
        np.testing.assert_array_equal(a, b)


def grads_of_dense(dense, x):
    with tf.GradientTape() as tape:
        y = dense(x)
        loss = tf.reduce_sum(y * _weights_like(y))
    g = tape.gradient(loss, [dense.kernel, dense.bias])
    return y.numpy(), {"kernel": g[0].numpy(), "bias": g[1].numpy()}


def test_row_takes_column_shards_without_the_concat():
    x = normal(2, 5, 8)
    col, row = ColumnParallelDense(16, tp=2, activation="relu"), RowParallelDense(8, tp=2)
    row(col(x))  # built eagerly
    weights = col.trainable_weights + row.trainable_weights

    def step(x, boundary):
        with tf.GradientTape() as tape:
            h = col(x)
            h = tf.identity(h) if boundary else h  # a pipeline boundary hands the tensor on this way
            tape.watch(h)
            y = row(h)
            loss = tf.reduce_sum(y * _weights_like(y))
        return y, tape.gradient(loss, weights + [h])

    fused, at_boundary = (tf.function(lambda x, b=b: step(x, b)) for b in (False, True))
    graph = fused.get_concrete_function(tf.TensorSpec([2, 5, 8])).graph
    # The row layer's matmuls read the column's shard outputs: nothing slices the concat.
    assert not [op for op in graph.get_operations() if op.type == "StridedSlice"]
    assert [op for op in at_boundary.get_concrete_function(tf.TensorSpec([2, 5, 8])).graph.get_operations()
            if op.type == "StridedSlice"]
    wc, wr = col.logical_weights(), row.logical_weights()
    kc, bc, kr, br = (tf.constant(v) for v in (wc["kernel"], wc["bias"], wr["kernel"], wr["bias"]))
    with tf.GradientTape() as tape:
        tape.watch([kc, bc, kr, br])
        h = tf.nn.relu(x @ kc + bc)
        tape.watch(h)
        y_ref = h @ kr + br
        loss = tf.reduce_sum(y_ref * _weights_like(y_ref))
    ref = tape.gradient(loss, [kc, bc, kr, br, h])
    for y, grads in (fused(x), at_boundary(x)):
        close(y, y_ref)
        close(np.concatenate(grads[0:2], 1), ref[0])  # column kernel shards: cut on dim 1
        close(np.concatenate(grads[2:4], 0), ref[1])
        close(np.concatenate(grads[4:6], 0), ref[2])  # row kernel shards: cut on dim 0
        close(grads[6], ref[3])
    assert fused(x)[1][7] is None  # fused: no gradient for the concat itself (input_slices)
    close(at_boundary(x)[1][7], ref[4])
    soft = ColumnParallelDense(6, tp=2, activation="softmax")  # not element-wise: applied after the concat
    close(np.sum(soft(x), axis=-1), np.ones((2, 5)))
    # A concat that no column layer made is sliced as usual.
    g = tf.function(lambda a, b: row(tf.concat([a, b], axis=-1)))
    close(g(x, x), row(np.concatenate([x, x], -1)))
    assert [op for op in g.get_concrete_function(x, x).graph.get_operations() if op.type == "StridedSlice"]


# -- Embedding and cross-entropy ------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_embedding_matches_keras_embedding(tp):
    ids = np.array([[0, 3, 15, 8], [7, 7, 12, 1]])
    ref = keras.layers.Embedding(16, 6, embeddings_initializer="glorot_uniform")
    ref.build(ids.shape)
    emb = VocabParallelEmbedding(16, 6, tp=tp)
    emb.build()
    emb.set_logical_weights({"embeddings": ref.get_weights()[0]})
    y, g = grads_of(emb, lambda: emb(ids))
    with tf.GradientTape() as tape:
        y_ref = ref(ids)
        loss = tf.reduce_sum(y_ref * _weights_like(y_ref))
    close(y, y_ref)
    close(g["embeddings"], tf.convert_to_tensor(tape.gradient(loss, ref.embeddings)))
    h = normal(2, 4, 6)
    logits, g = grads_of(emb, lambda: emb(h, reverse=True))
    table = ref.get_weights()[0]
    close(logits, h @ table.T)
    w = _weights_like(tf.constant(logits)).numpy().reshape(-1, 16)
    close(g["embeddings"], w.T @ h.reshape(-1, 6))  # d/dtable of sum(w * h @ table^T)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_keras(tp):
    h, labels = normal(2, 5, 6, scale=3.0), rng.integers(0, 16, size=(2, 5))
    weight = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], "float32")
    emb = VocabParallelEmbedding(16, 6, tp=tp, embeddings_initializer="glorot_uniform")
    emb.build()
    table = tf.constant(emb.logical_weights()["embeddings"])
    hidden = tf.constant(h)
    for reduction in ("sum_over_batch_size", "mean_with_sample_weight", "none"):
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(hidden)
            loss = vocab_parallel_cross_entropy(hidden, emb, labels, sample_weight=weight, reduction=reduction)
            ref_table = tf.identity(table)
            tape.watch(ref_table)
            ref = loss_fn(labels, hidden @ tf.transpose(ref_table), sample_weight=weight)
        close(loss, ref)
        close(tape.gradient(loss, hidden), tape.gradient(ref, hidden))
        g = logical_grads(emb, tape.gradient(loss, emb.trainable_weights))
        close(g["embeddings"], tape.gradient(ref, ref_table))
    # The shards given as tensors, no weights: the mean token loss.
    shards = [tf.convert_to_tensor(v) for v in emb.embeddings]
    close(vocab_parallel_cross_entropy(h, shards, labels),
          np.mean(keras.losses.sparse_categorical_crossentropy(labels, h @ table.numpy().T, from_logits=True)))


# -- Attention ---------------------------------------------------------------------------


def attention_reference(xp, x, w, heads, kv_heads, pad, wavelength=None, scaling=1.0):
    """Causal grouped-query self-attention as per-head loops; ``xp`` is NumPy (outputs) or
    TensorFlow's NumPy (gradients). RoPE rotates each pair (i, i + hd/2) by
    ``position * wavelength**(-2i/hd) / scaling``."""
    b, t, d = x.shape
    hd = w["query"].shape[-1]
    allowed = np.tril(np.ones((t, t), bool))[None] & (np.asarray(pad)[:, None, :] > 0)  # [B, T(q), T(k)]

    def rope(v):  # v [B, T, hd]
        if wavelength is None:
            return v
        angle = np.arange(t)[:, None] * wavelength ** (-np.arange(0, hd, 2) / hd) / scaling
        dtype = "float64" if xp is np else "float32"
        cos, sin = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
        v1, v2 = v[..., : hd // 2], v[..., hd // 2:]
        return xp.concatenate([v1 * cos - v2 * sin, v2 * cos + v1 * sin], axis=-1)

    out = 0.0
    for h in range(heads):
        g = h // (heads // kv_heads)  # the key/value head this query head reads
        q = rope(xp.matmul(x, w["query"][:, h, :]) + w["query_bias"][h])
        k = rope(xp.matmul(x, w["key"][:, g, :]) + w["key_bias"][g])
        v = xp.matmul(x, w["value"][:, g, :]) + w["value_bias"][g]
        scores = xp.matmul(q, xp.transpose(k, [0, 2, 1])) / np.sqrt(hd)
        scores = xp.where(allowed, scores, -1e30)
        e = xp.exp(scores - xp.max(scores, axis=-1, keepdims=True))
        probs = e / xp.sum(e, axis=-1, keepdims=True)
        out = out + xp.matmul(xp.matmul(probs, v), w["output"][h])
    return out + w["output_bias"]


@pytest.mark.parametrize("tp,heads,kv_heads,wavelength", [(2, 8, 4, 10000), (4, 8, 4, 100), (2, 4, 4, None)])
def test_attention_matches_reference(tp, heads, kv_heads, wavelength):
    x = normal(2, 6, 8)
    pad = np.array([[1, 1, 1, 1, 0, 0], [1] * 6])
    attn = ParallelSelfAttention(heads, 4, num_kv_heads=kv_heads, tp=tp, rope_max_wavelength=wavelength,
                                 rope_scaling_factor=2.0, bias_initializer="glorot_uniform")
    attn.build(x.shape)
    assert len(attn.trainable_weights) == 7 * tp + 1
    w = attn.logical_weights()
    y, g = grads_of(attn, lambda: attn(x, padding_mask=pad))
    close(y, attention_reference(np, x.astype("float64"), {k: v.astype("float64") for k, v in w.items()},
                                 heads, kv_heads, pad, wavelength, 2.0))
    tw = {k: tf.constant(v) for k, v in w.items()}
    with tf.GradientTape() as tape:
        tape.watch(list(tw.values()))
        ref = attention_reference(tnp, tf.constant(x), tw, heads, kv_heads, pad, wavelength, 2.0)
        loss = tf.reduce_sum(ref * _weights_like(ref))
    ref_g = tape.gradient(loss, tw)
    for name in w:
        close(g[name], ref_g[name])
    # The same mask as [B, T, T] attention_mask.
    full = np.broadcast_to(pad[:, None, :], (2, 6, 6))
    close(attn(x, attention_mask=full), y)


def test_attention_weights_load_from_keras_multi_head_attention_and_rope_matches_keras_hub():
    x = normal(2, 5, 8)
    mha = keras.layers.MultiHeadAttention(num_heads=4, key_dim=2, bias_initializer="glorot_uniform")
    y_ref = mha(x, x, use_causal_mask=True)
    attn = ParallelSelfAttention(4, 2, tp=2)
    attn.build(x.shape)
    attn.set_logical_weights(dict(zip(attn.logical_weights(), mha.get_weights())))
    close(attn(x), y_ref)
    from keras_hub.layers import RotaryEmbedding  # the convention the keras-hub models use

    q = normal(2, 5, 3, 6)
    close(rotary(tf.constant(q), 500, 2.0), RotaryEmbedding(max_wavelength=500, scaling_factor=2.0)(q))


def test_attention_dropout_uses_the_layer_seed():
    x = normal(2, 4, 8)
    attn = ParallelSelfAttention(4, 2, tp=2, dropout=0.5, seed=3)
    eval_out = attn(x)
    a, b = attn(x, training=True), attn(x, training=True)
    assert not np.allclose(a, eval_out) and not np.allclose(a, b)
    close(attn(x, training=False), eval_out)
    assert tf.function(lambda x: attn(x, training=True))(x).shape == x.shape  # seeds drawn in a graph too


# -- MLP --------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("gated", [False, True])
def test_mlp_matches_reference(tp, gated):
    x = normal(2, 3, 6)
    mlp = ParallelMLP(8, tp=tp, activation="silu" if gated else "relu", gated=gated,
                      bias_initializer="glorot_uniform")
    mlp.build(x.shape)
    w = mlp.logical_weights()
    assert list(w) == (["up", "up_bias", "gate", "gate_bias", "down", "down_bias"] if gated
                       else ["up", "up_bias", "down", "down_bias"])

    def reference(xp, x, w):
        up = xp.matmul(x, w["up"]) + w["up_bias"]
        if gated:
            gate = xp.matmul(x, w["gate"]) + w["gate_bias"]
            hidden = gate / (1 + xp.exp(-gate)) * up
        else:
            hidden = xp.maximum(up, 0.0)
        return xp.matmul(hidden, w["down"]) + w["down_bias"]

    y, g = grads_of(mlp, lambda: mlp(x))
    close(y, reference(np, x, w))
    tw = {k: tf.constant(v) for k, v in w.items()}
    with tf.GradientTape() as tape:
        tape.watch(list(tw.values()))
        ref = reference(tnp, tf.constant(x), tw)
        loss = tf.reduce_sum(ref * _weights_like(ref))
    ref_g = tape.gradient(loss, tw)
    for name in w:
        close(g[name], ref_g[name])


# -- Placement ----------------------------------------------------------------------------


def _placed_graph(layer_or_model, devices, args, kwargs=None):
    """Shard r's variables on ``devices[r]``; a tf.function that reads each on its device
    and calls statelessly, as the engine does. Returns (graph, outputs)."""
    from phalanx.engines.keras_model import place_variable

    for v in layer_or_model.weights:
        p = placement_of(v)
        if p is not None:
            place_variable(v, devices[p.rank])

    @tf.function
    def step(*args):
        values = []
        for i, v in enumerate(layer_or_model.trainable_variables):
            p = placement_of(v)
            with tf.device(v.value.device):
                values.append(tf.identity(v.value, name=f"shard_{p.rank}_" if p else "whole_"))
        return layer_or_model.stateless_call(values, [], *args, **(kwargs or {}))[0]

    concrete = step.get_concrete_function(*[tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in args])
    return concrete.graph, concrete(*args)


def _shard_ranks(op):
    """The ranks of the shard values ``op`` depends on."""
    seen, stack, ranks = set(), [op], set()
    while stack:
        o = stack.pop()
        if o.name in seen:
            continue
        seen.add(o.name)
        if o.type == "Identity" and o.name.startswith("shard_"):
            ranks.add(int(o.name.split("_")[1]))
        stack.extend(i.op for i in o.inputs)
    return ranks


def _same_device(a, b):
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (a.device_type, a.device_index) == (b.device_type, b.device_index)


def _assert_matmuls_on_their_shard(graph, devices, tp):
    matmuls = [op for op in graph.get_operations() if op.type in ("MatMul", "BatchMatMulV2", "BatchMatMulV3")]
    assert matmuls
    used = set()
    for op in matmuls:
        ranks = _shard_ranks(op)
        assert len(ranks) == 1, (op.name, ranks)  # each matmul reads one shard's weights
        rank = ranks.pop()
        assert _same_device(op.device, devices[rank]), (op.name, op.device, rank)
        used.add(rank)
    assert used == set(range(tp))


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_ops_run_on_their_shard_device(tp):
    devices = [f"/device:CPU:{r}" for r in range(tp)]
    x = normal(2, 4, 8)
    ids = np.array([[1, 5, 9, 14], [0, 2, 3, 15]], "int32")
    cases = [
        (ColumnParallelDense(8, tp=tp), (x,), {}),
        (RowParallelDense(8, tp=tp), (x,), {}),
        (ParallelMLP(8, tp=tp, gated=True), (x,), {}),
        (ParallelSelfAttention(8, 2, num_kv_heads=4, tp=tp, rope_max_wavelength=10000), (x,),
         {"padding_mask": np.ones((2, 4), "float32")}),
        (VocabParallelEmbedding(16, 8, tp=tp), (ids,), {}),
        (VocabParallelEmbedding(16, 8, tp=tp), (x,), {"reverse": True}),
    ]
    for layer, args, kwargs in cases:
        layer.build(args[0].shape)
        expected = layer(*args, **kwargs)
        graph, out = _placed_graph(layer, devices, args, kwargs)
        close(out, expected)
        # The shards are combined (the sum, or the column concat) on shard 0's device.
        combine = "ConcatV2" if isinstance(layer, ColumnParallelDense) or kwargs.get("reverse") else "AddN"
        combined = [op for op in graph.get_operations() if op.type == combine]
        assert combined and all(_same_device(op.device, devices[0]) for op in combined), combine
        if not isinstance(layer, VocabParallelEmbedding) or kwargs:
            _assert_matmuls_on_their_shard(graph, devices, tp)
        else:  # the lookups: each shard's gather on its device
            gathers = [op for op in graph.get_operations() if op.type == "GatherV2"]
            assert sorted(_shard_ranks(op).pop() for op in gathers) == list(range(tp))
            for op in gathers:
                assert _same_device(op.device, devices[_shard_ranks(op).pop()]), (op.name, op.device)


def test_placement_survives_mixed_precision_inside_a_model():
    # Inside a model Keras autocasts variables; the shard values must keep their devices.
    devices = ["/device:CPU:2", "/device:CPU:3"]
    inp = keras.Input((4, 8))
    out = ParallelMLP(8, tp=2, dtype="mixed_bfloat16")(inp)
    model = keras.Model(inp, out)
    graph, y = _placed_graph(model, devices, (normal(2, 4, 8),))
    assert y.dtype == tf.bfloat16
    _assert_matmuls_on_their_shard(graph, devices, 2)


def test_cross_entropy_shards_on_their_devices():
    devices = ["/device:CPU:1", "/device:CPU:2"]
    emb = VocabParallelEmbedding(16, 8, tp=2)
    emb.build()
    from phalanx.engines.keras_model import place_variable

    for v in emb.embeddings:
        place_variable(v, devices[placement_of(v).rank])

    @tf.function
    def loss(h, labels):
        shards = []
        for r, v in enumerate(emb.embeddings):
            with tf.device(v.value.device):
                shards.append(tf.identity(v.value, name=f"shard_{r}_"))
        return vocab_parallel_cross_entropy(h, shards, labels)

    h, labels = normal(2, 3, 8), np.array([[0, 9, 15], [3, 8, 7]])
    concrete = loss.get_concrete_function(tf.TensorSpec([2, 3, 8]), tf.TensorSpec([2, 3], tf.int64))
    _assert_matmuls_on_their_shard(concrete.graph, devices, 2)
    close(concrete(h, labels), vocab_parallel_cross_entropy(h, emb, labels))


# -- Saving and errors --------------------------------------------------------------------


def _model(tp):
    ids = keras.Input((6,), dtype="int32")
    emb = VocabParallelEmbedding(32, 8, tp=tp, name="embed")
    h = emb(ids)
    h = h + ParallelSelfAttention(4, 2, num_kv_heads=2, tp=tp, rope_max_wavelength=10000, name="attn")(h)
    h = h + ParallelMLP(16, tp=tp, gated=True, activation="silu", name="mlp")(h)
    h = RowParallelDense(8, tp=tp, name="row")(ColumnParallelDense(16, tp=tp, activation="gelu", name="col")(h))
    return keras.Model(ids, emb(h, reverse=True))


def test_keras_file_round_trip_across_layouts(tmp_path):
    ids = rng.integers(0, 32, size=(2, 6)).astype("int32")
    model = _model(tp=2)
    expected = model(ids)
    path = str(tmp_path / "model.keras")
    model.save(path)
    close(keras.saving.load_model(path)(ids), expected)  # tp=2 file -> tp=2 model
    one = _model(tp=1)
    one.load_weights(path)  # the file holds logical weights: it loads into tp=1
    assert not [v for v in one.weights if placement_of(v)]
    close(one(ids), expected)
    four = _model(tp=2)  # and a tp=1 file into tp=2
    one.save(str(tmp_path / "one.keras"))
    four.load_weights(str(tmp_path / "one.keras"))
    close(four(ids), expected)


def test_indivisible_shapes_are_errors_naming_the_layer():
    with pytest.raises(ValueError, match="'c'.*units 6 is not divisible by tp=4"):
        ColumnParallelDense(6, tp=4, name="c")
    with pytest.raises(ValueError, match="'r'.*'kernel'.*not divisible by 4"):
        RowParallelDense(4, tp=4, name="r").build((None, 6))
    with pytest.raises(ValueError, match="'e'.*vocab 10 is not divisible by tp=4"):
        VocabParallelEmbedding(10, 4, tp=4, name="e")
    with pytest.raises(ValueError, match="'m'.*hidden_dim 6 is not divisible by tp=4"):
        ParallelMLP(6, tp=4, name="m")
    with pytest.raises(ValueError, match="'a'.*num_kv_heads=3 does not divide num_heads=4"):
        ParallelSelfAttention(4, 2, num_kv_heads=3, name="a")
    with pytest.raises(ValueError, match="'a'.*tp=4 does not divide num_kv_heads=2"):
        ParallelSelfAttention(8, 2, num_kv_heads=2, tp=4, name="a")
