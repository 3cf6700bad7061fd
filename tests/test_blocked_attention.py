"""The blocked causal attention (``model.attention=blocked``) against a plain attention written here.

The oracle is softmax(q k^T / sqrt(hd) + causal mask) v, written independently below in float64
(NumPy for the forward, TensorFlow's own autodiff of the same few ops for the gradients), and
Keras's own ``fit`` of the plain-attention GPT for training.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import Config, ConfigError, ModelConfig, validate
from phalanx.layers import ParallelSelfAttention
from phalanx.layers import blocked_attention
from phalanx.models.transformer import gpt

from test_keras_hub import StepLosses


def plain_attention(q, k, v):
    """softmax(q k^T / sqrt(hd) + causal mask) v in float64 with TensorFlow ops (key/value head
    ``h // (H/KV)`` for query head ``h``); differentiable, for the reference gradients."""
    q, k, v = (tf.cast(x, tf.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = tf.repeat(k, groups, axis=1), tf.repeat(v, groups, axis=1)
    t = q.shape[2]
    scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(q.shape[-1])
    causal = np.tril(np.ones((t, t), bool))
    scores = tf.where(causal, scores, tf.constant(-np.inf, tf.float64))
    return tf.matmul(tf.nn.softmax(scores, axis=-1), v)


def numpy_attention(q, k, v):
    """The forward again, in NumPy (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    t = q.shape[2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]) + np.triu(np.full((t, t), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def value_and_grads(fn, q, k, v, upstream):
    q, k, v = (tf.constant(x) for x in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        o = fn(q, k, v)
        loss = tf.reduce_sum(tf.cast(o, tf.float64) * upstream)
    return [np.asarray(tf.cast(x, tf.float64)) for x in [o, *tape.gradient(loss, [q, k, v])]]


def inputs(heads, kv, t, hd=16, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, heads, t, hd))
    k, v = (rng.normal(size=(batch, kv, t, hd)) for _ in range(2))
    return q, k, v, rng.normal(size=(batch, heads, t, hd))


# (heads, kv heads, T, block): T a multiple of the block, not one, shorter than one block,
# and grouped-query heads (two query heads per key/value head)
# (every block shape is an XLA compilation: few blocks keep the test fast)
CASES = [(2, 2, 24, 8), (4, 2, 20, 8), (3, 3, 5, 8)]


@pytest.mark.parametrize("heads,kv,t,block", CASES)
def test_float32_output_and_gradients_equal_plain_attention(heads, kv, t, block):
    q, k, v, upstream = inputs(heads, kv, t)
    want = value_and_grads(plain_attention, q, k, v, upstream)
    np.testing.assert_allclose(want[0], numpy_attention(q, k, v), atol=1e-12)  # the two references agree
    got = value_and_grads(lambda *x: blocked_attention.causal_attention(*x, block_size=block),
                          *(x.astype(np.float32) for x in (q, k, v)), upstream)
    # float32 round-off: inputs ~N(0, 1), scores ~N(0, 1) summed over hd = 16 products, outputs
    # and gradients sums of at most T = 24 terms of size ~1: a few float32 ulps (6e-8) times
    # ~24 terms; 2e-5 absolute leaves ~10x margin and is far below any real error (a wrong mask
    # or a missing block moves values by ~0.1).
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("heads,kv,t,block", [(4, 2, 20, 8)])
def test_bfloat16_within_bfloat16_tolerance(heads, kv, t, block):
    q, k, v, upstream = inputs(heads, kv, t, seed=1)
    want = value_and_grads(plain_attention, q, k, v, upstream)
    bf16 = [tf.cast(x, tf.bfloat16) for x in (q, k, v)]
    got = value_and_grads(lambda *x: blocked_attention.causal_attention(*x, block_size=block), *bf16, upstream)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        # bfloat16 keeps 8 significant bits (relative step 2^-8 = 0.4%); the inputs, the
        # scores, the probabilities and every matmul result are rounded to it once, so the
        # error is a few of those steps of the values' scale (outputs ~1, gradients up to ~5):
        # 5% of the largest value. A wrong mask or block moves values by tens of percent.
        scale = np.abs(w).max()
        err = np.abs(g - w).max()
        assert err <= 0.05 * scale, f"{name}: max error {err:.4f} vs scale {scale:.3f}"
    # the statistics are float32: the blocked output in bfloat16 is as close to the float64
    # reference as the plain float32 softmax's rounded to bfloat16 once more
    plain_bf16 = tf.cast(plain_attention(*bf16), tf.bfloat16).numpy().astype(np.float64)
    assert np.abs(got[0] - want[0]).max() <= 3 * np.abs(plain_bf16 - want[0]).max() + 1e-3


def test_bad_arguments_are_refused():
    q = tf.zeros([1, 4, 8, 4])
    with pytest.raises(ValueError, match="KV dividing"):
        blocked_attention.causal_attention(q, tf.zeros([1, 3, 8, 4]), tf.zeros([1, 3, 8, 4]))
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        blocked_attention.causal_attention(q, q, q, block_size=0)
    with pytest.raises(ValueError, match="attention_core='fused' is not valid; choose one of: plain, blocked"):
        ParallelSelfAttention(num_heads=2, head_dim=4, attention_core="fused")
    with pytest.raises(ValueError, match="does not drop attention probabilities"):
        ParallelSelfAttention(num_heads=2, head_dim=4, attention_core="blocked", dropout=0.1)
    with pytest.raises(ValueError, match="causal attention only"):
        ParallelSelfAttention(num_heads=2, head_dim=4, attention_core="blocked", causal=False)
    layer = ParallelSelfAttention(num_heads=2, head_dim=4, attention_core="blocked")
    x = tf.zeros([1, 8, 8])
    layer(x)  # causal, no mask, known length: the blocked core runs
    with pytest.raises(ValueError, match="takes no attention_mask or padding_mask"):
        layer(x, padding_mask=tf.ones([1, 8], tf.bool))  # refused, never the plain core in its place
    with pytest.raises(ValueError, match="needs the sequence length"):
        tf.function(layer).get_concrete_function(tf.TensorSpec([1, None, 8]))
    with pytest.raises(ConfigError, match="model.attention: 'flash' is not valid"):
        validate(Config().replace(model={"attention": "flash"}))


# -- the GPT trained with it ----------------------------------------------------------------

CFG = dict(layers=2, d_model=32, heads=4, ffn=64, vocab=256, seq_len=20)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 positions, so the GPT's 20 are cut into 8 + 8 + 4 (one short block), and a
    count of the blocked core's calls (it must be the one running)."""
    monkeypatch.setattr(blocked_attention, "BLOCK_SIZE", 8)
    calls = []
    real = blocked_attention.causal_attention
    monkeypatch.setattr(blocked_attention, "causal_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def compiled_gpt(attention: str):
    model = gpt(ModelConfig(**CFG, attention=attention), seed=0)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tokens():
    data = np.random.default_rng(0).integers(0, CFG["vocab"], size=(12, CFG["seq_len"] + 1)).astype("int32")
    return data[:, :-1], data[:, 1:]


def test_gpt_trained_with_blocked_attention_equals_plain(small_blocks, tmp_path):
    """Keras's own fit of the plain-attention GPT is the oracle; the blocked GPT trained by
    Keras's fit and by phalanx.fit with parallel.recompute=selective (the blocked core run
    again in the backward) give its losses and weights."""
    x, y = tokens()
    reference, ref_steps = compiled_gpt("plain"), StepLosses()
    reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[ref_steps])
    assert not small_blocks
    runs = {"keras fit": compiled_gpt("blocked"), "phalanx.fit recompute=selective": compiled_gpt("blocked")}
    for what, model in runs.items():
        steps = StepLosses()
        if what == "keras fit":
            model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[steps])
        else:
            phalanx.fit(model, x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[steps],
                        overrides=["parallel.recompute=selective", f"run.dir={tmp_path}"])
        assert small_blocks, f"{what}: the blocked core did not run"
        small_blocks.clear()
        # SGD over 3 steps: the float32 round-off of the two cores (~1e-7 relative per op)
        # is not amplified (no Adam normalisation); the tolerances of the engine's own tests
        np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-5, err_msg=what)
        for mine, want in zip(model.weights, reference.weights):
            np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{what} {mine.path}")


def test_phalanx_train_tp2_with_blocked_attention_equals_keras_one_device_plain(small_blocks, devices):
    """The engine phalanx train builds (the Keras-model engine; tp=2: each device runs the
    blocked core on its heads) trains the losses of Keras's own one-device train_on_batch of
    the plain-attention GPT (tests/gpt_oracle.py)."""
    import gpt_oracle
    from phalanx.engines.factory import make_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.task import GPTTask
    from phalanx.mesh import Mesh

    def cfg(attention, **parallel):
        return Config().replace(model={**CFG, "attention": attention}, parallel=parallel,
                                train={"global_batch": 4, "warmup": 1, "steps": 10, "lr": 1e-3})

    rng = np.random.default_rng(2)
    data = [rng.integers(0, CFG["vocab"], size=(4, CFG["seq_len"] + 1)).astype(np.int32) for _ in range(3)]
    want = gpt_oracle.run(cfg("plain"), data)[0]
    assert not small_blocks
    blocked = cfg("blocked", tp=2)
    engine = make_engine(GPTTask(blocked.model), Mesh.from_devices(devices[:2], 1, 1, 2), blocked)
    assert isinstance(engine, KerasGPTEngine)
    got = [float(engine.train_step(b)["loss"]) for b in data]
    assert small_blocks, "the blocked core did not run"
    # AdamW steps of lr 1e-3 from the same weights: float32 round-off of the two cores moves
    # the losses by ~1e-6 relative; a wrong attention moves them by ~1e-3
    np.testing.assert_allclose(got, want, rtol=2e-5)


def test_doctests():
    import doctest

    assert doctest.testmod(blocked_attention).failed == 0
