"""The fused GPT kernels (gpt_ops: LayerNorm, bias + GELU, causal softmax, cross-entropy)
against the same math written as plain TensorFlow ops and differentiated by the tape:
float32 to ~1e-6, bfloat16 inputs to bfloat16 rounding."""

import math

import numpy as np
import pytest
import tensorflow as tf

from phalanx.models import gpt_ops


def ref_layer_norm(x, g, b):
    x = tf.cast(x, tf.float64)
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + gpt_ops.LAYER_NORM_EPS) * tf.cast(g, tf.float64) + tf.cast(b, tf.float64)


def ref_gelu(x, bias):
    return tf.nn.gelu(tf.cast(x, tf.float64) + tf.cast(bias, tf.float64), approximate=True)


def ref_softmax(scores, scale):
    s = tf.cast(scores, tf.float64) * scale
    t = s.shape[-1]
    causal = tf.linalg.band_part(tf.ones([t, t], tf.float64), -1, 0)
    return tf.nn.softmax(s + (causal - 1.0) * 1e9, axis=-1)


def ref_cross_entropy(logits, targets):
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=tf.cast(logits, tf.float64))


def value_and_grads(fn, args, upstream):
    """fn(*args) and d<fn(*args), upstream>/d(float args), all as float64 NumPy."""
    args = [tf.convert_to_tensor(a) for a in args]
    with tf.GradientTape() as tape:
        for a in args:
            if a.dtype.is_floating:
                tape.watch(a)
        y = fn(*args)
        total = tf.reduce_sum(tf.cast(y, tf.float64) * upstream)
    floats = [a for a in args if a.dtype.is_floating]
    grads = tape.gradient(total, floats)
    return [np.asarray(tf.cast(y, tf.float64))] + [np.asarray(tf.cast(g, tf.float64)) for g in grads]


def assert_close(got, want, rtol, what):
    for i, (g, w) in enumerate(zip(got, want)):
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
        assert err < rtol, f"{what}: output {i} differs by {err:.2e} (relative, norm) > {rtol}"


CASES = {
    "layer_norm": (gpt_ops.layer_norm, ref_layer_norm,
                   lambda rng, dt: [tf.cast(rng.standard_normal([3, 5, 48]) * 3 + 1, dt),
                                    tf.constant(rng.standard_normal(48), tf.float32),
                                    tf.constant(rng.standard_normal(48), tf.float32)]),
    "gelu": (gpt_ops.gelu, ref_gelu,
             lambda rng, dt: [tf.cast(rng.standard_normal([4, 7, 40]) * 2, dt),
                              tf.constant(rng.standard_normal(40) * 0.5, tf.float32)]),
    "causal_softmax": (gpt_ops.causal_softmax, lambda s: ref_softmax(s, 1.0),
                       lambda rng, dt: [tf.cast(rng.standard_normal([2, 3, 16, 16]) * 8, dt)]),
    "cross_entropy": (gpt_ops.token_cross_entropy, ref_cross_entropy,
                      lambda rng, dt: [tf.cast(rng.standard_normal([2, 9, 50]) * 3, dt),
                                       tf.constant(rng.integers(0, 50, [2, 9]), tf.int32)]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype, rtol", [(tf.float32, 2e-6), (tf.bfloat16, 1.5e-2)])
def test_fused_kernel_matches_plain_ops(name, dtype, rtol):
    fused, ref, make = CASES[name]
    rng = np.random.default_rng(0)
    args = make(rng, dtype)
    # the reference sees the same (rounded) inputs, in float64
    ref_args = [tf.cast(a, tf.float64) if a.dtype.is_floating else a for a in args]
    out_shape = ref(*ref_args).shape
    upstream = tf.constant(rng.standard_normal(out_shape))
    got = value_and_grads(fused, args, upstream)
    want = value_and_grads(ref, ref_args, upstream)
    assert got[0].shape == want[0].shape
    assert_close(got, want, rtol, f"{name} {dtype.name}")


@pytest.mark.parametrize("name", list(CASES))
def test_fused_kernels_keep_the_compute_dtype(name):
    fused, _, make = CASES[name]
    args = make(np.random.default_rng(1), tf.bfloat16)
    out = fused(*args)
    # activations stay bfloat16; the loss is float32
    assert out.dtype == (tf.float32 if name == "cross_entropy" else tf.bfloat16)


def test_causal_mask():
    for dtype in (tf.float32, tf.bfloat16):
        s = tf.cast(tf.random.normal([1, 1, 6, 6]) * 4, dtype)
        p = tf.cast(gpt_ops.causal_softmax(s), tf.float32).numpy()[0, 0]
        assert np.all(np.triu(p, 1) == 0)  # no query sees a later key
        np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-2)
        np.testing.assert_allclose(p[1, :2], tf.nn.softmax(tf.cast(s, tf.float32)[0, 0, 1, :2]).numpy(), rtol=1e-2)


def test_attention_matches_plain_ops():
    rng = np.random.default_rng(3)
    q, k, v = (tf.constant(rng.standard_normal([2, 3, 16, 16]).astype(np.float32)) for _ in range(3))

    def ref(q, k, v):
        return tf.matmul(ref_softmax(tf.matmul(q, k, transpose_b=True), 0.25), v)

    upstream = tf.constant(rng.standard_normal([2, 3, 16, 16]))
    got = value_and_grads(gpt_ops.causal_attention, [q, k, v], upstream)
    want = value_and_grads(ref, [tf.cast(a, tf.float64) for a in (q, k, v)], upstream)
    assert_close(got, want, 2e-6, "attention")


def test_gpt_step_in_a_distributed_graph_on_logical_devices(devices):
    """The fused kernels run inside the traced step of the engine phalanx train builds for two
    data replicas on two logical CPUs, in bfloat16."""
    from phalanx.config import Config
    from phalanx.engines.factory import make_engine
    from phalanx.engines.task import GPTTask
    from phalanx.mesh import Mesh

    cfg = Config().replace(model={"layers": 1, "d_model": 32, "heads": 4, "ffn": 64, "vocab": 256, "seq_len": 8},
                           train={"global_batch": 4}, precision={"policy": "mixed_bfloat16"}, parallel={"dp": 2})
    engine = make_engine(GPTTask(cfg.model, "mixed_bfloat16"), Mesh.from_devices(devices[:2], 2, 1, 1), cfg)
    assert engine.dp == 2
    batch = np.random.default_rng(0).integers(0, 256, [4, 9]).astype(np.int32)
    first = float(engine.train_step(batch)["loss"])
    assert abs(first - math.log(256)) < 0.1
    for _ in range(5):
        last = float(engine.train_step(batch)["loss"])
    assert last < first


def ref_add_layer_norm(x, y, bias, g, b):
    s = tf.cast(x, tf.float64) + tf.cast(y, tf.float64) + tf.cast(bias, tf.float64)
    return tf.stack([s, ref_layer_norm(s, g, b)])


@pytest.mark.parametrize("dtype, rtol", [(tf.float32, 2e-6), (tf.bfloat16, 1.5e-2)])
def test_add_layer_norm_matches_plain_ops(dtype, rtol):
    """The residual add + bias + LayerNorm kernel (both outputs, all five gradients) against the
    float64 sum and LayerNorm; bfloat16: the sum is rounded once to bfloat16 (2^-8 relative)
    before the LayerNorm, and the gradients once."""
    rng = np.random.default_rng(7)
    args = [tf.cast(rng.standard_normal([3, 5, 48]) * 2 + 1, dtype), tf.cast(rng.standard_normal([3, 5, 48]), dtype),
            tf.constant(rng.standard_normal(48), tf.float32), tf.constant(rng.standard_normal(48), tf.float32),
            tf.constant(rng.standard_normal(48), tf.float32)]
    upstream = tf.constant(rng.standard_normal([2, 3, 5, 48]))
    got = value_and_grads(lambda *a: tf.stack(gpt_ops.add_layer_norm(*a)), args, upstream)
    want = value_and_grads(ref_add_layer_norm, [tf.cast(a, tf.float64) for a in args], upstream)
    assert_close(got, want, rtol, f"add_layer_norm {dtype.name}")
    s, out = gpt_ops.add_layer_norm(*args)
    assert s.dtype == out.dtype == dtype
