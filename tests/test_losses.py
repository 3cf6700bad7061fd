"""TokenCrossEntropy and its fused kernels against a float64 NumPy reference written here:
the loss and its gradient, float32 and bfloat16 logits, Keras's reductions and sample weights.

Tolerances from the arithmetic: the kernels compute in float32 from the logits as given (the
reference reads the same, already rounded, logits in float64), so the loss is float32-exact to
a few units of 2^-24 relative to the log-sum-exp's size; the gradient is rounded once to the
logits' dtype: 2^-8 relative per element for bfloat16 (unit roundoff of an 8-bit significand).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from phalanx.layers.losses import TokenCrossEntropy, token_cross_entropy

U32, U16 = 2.0 ** -24, 2.0 ** -8


def reference(z: np.ndarray, y: np.ndarray):
    """Per-token loss and d(sum of upstream * loss)/dz, float64."""
    z = z.astype(np.float64)
    top = z.max(-1, keepdims=True)
    e = np.exp(z - top)
    lse = np.log(e.sum(-1)) + top[..., 0]
    target = np.take_along_axis(z, y[..., None], -1)[..., 0]
    probs = e / e.sum(-1, keepdims=True)
    onehot = np.eye(z.shape[-1])[y]
    return lse - target, probs - onehot


def logits_and_labels(dtype, seed=0, shape=(3, 7, 50)):
    rng = np.random.default_rng(seed)
    z = tf.cast(rng.standard_normal(shape) * 4, dtype)
    y = rng.integers(0, shape[-1], shape[:-1])
    return z, y


@pytest.mark.parametrize("dtype, grad_rel", [(tf.float32, 16 * U32), (tf.bfloat16, U16)])
def test_token_cross_entropy_and_gradient_match_float64(dtype, grad_rel):
    z, y = logits_and_labels(dtype)
    upstream = np.random.default_rng(1).uniform(0.5, 2.0, y.shape)
    with tf.GradientTape() as tape:
        tape.watch(z)
        loss = token_cross_entropy(z, y)
        total = tf.reduce_sum(loss * upstream)
    grad = tape.gradient(total, z)
    assert loss.dtype == tf.float32 and grad.dtype == dtype  # the gradient stays in the logits' dtype
    want_loss, want_grad = reference(np.asarray(tf.cast(z, tf.float64)), y)
    want_grad = want_grad * upstream[..., None]
    lse_size = np.abs(np.asarray(tf.cast(z, tf.float64))).max(-1) + np.log(z.shape[-1])
    np.testing.assert_array_less(np.abs(loss.numpy() - want_loss), 16 * U32 * lse_size)
    got_grad = np.asarray(tf.cast(grad, tf.float64))
    # float32 inside (a few ulps of the largest term), then one rounding to the logits' dtype
    slack = grad_rel * np.abs(want_grad) + 16 * U32 * upstream[..., None]
    np.testing.assert_array_less(np.abs(got_grad - want_grad), slack + 1e-30)


@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "none"])
def test_keras_loss_reductions_and_sample_weights(dtype, reduction):
    z, y = logits_and_labels(dtype, seed=2, shape=(4, 5, 30))
    weights = np.random.default_rng(3).uniform(0, 1, y.shape)
    got = TokenCrossEntropy(reduction=reduction)(y, z, sample_weight=weights).numpy()
    per_token = reference(np.asarray(tf.cast(z, tf.float64)), y)[0] * weights
    want = {"sum_over_batch_size": per_token.sum() / per_token.size, "sum": per_token.sum(), "none": per_token}[reduction]
    np.testing.assert_allclose(got, want, rtol=64 * U32)
    # the labels may carry a trailing axis of 1, as Keras's
    np.testing.assert_allclose(TokenCrossEntropy(reduction=reduction)(y[..., None], z, sample_weight=weights).numpy(),
                               got, rtol=1e-7)


def test_same_as_keras_sparse_categorical_crossentropy_in_float32():
    z, y = logits_and_labels(tf.float32, seed=4)
    keras_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    np.testing.assert_allclose(TokenCrossEntropy()(y, z).numpy(), keras_loss(y, z).numpy(), rtol=16 * U32)
    # and in a compiled model: the same fit as Keras's own loss
    rng = np.random.default_rng(5)
    x, labels = rng.standard_normal((16, 6)).astype("float32"), rng.integers(0, 5, 16)
    histories = []
    for loss in (keras_loss, TokenCrossEntropy()):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5)])
        model.compile(optimizer="sgd", loss=loss)
        histories.append(model.fit(x, labels, epochs=3, batch_size=8, verbose=0, shuffle=False).history["loss"])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)


def test_reads_bfloat16_logits_without_a_float32_copy():
    """The graph of the loss and its gradient holds no float32 tensor of the logits' shape."""
    z, y = logits_and_labels(tf.bfloat16, shape=(2, 3, 40))

    @tf.function
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            loss = TokenCrossEntropy()(y, z)
        return loss, tape.gradient(loss, z)

    graph = step.get_concrete_function(z).graph
    big = [op.name for op in graph.get_operations() for t in op.outputs
           if t.dtype == tf.float32 and t.shape.rank is not None and t.shape.num_elements() == 2 * 3 * 40]
    assert big == []


def test_bad_labels_and_logits_are_refused():
    z, y = logits_and_labels(tf.float32, shape=(2, 3, 10))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"labels must be in \[0, 10\)"):
        TokenCrossEntropy()(np.full(y.shape, 10), z)
    with pytest.raises(ValueError, match="y_pred must be floating-point"):
        TokenCrossEntropy()(y, tf.zeros([2, 3, 10], tf.int32))


def test_config_round_trip():
    loss = TokenCrossEntropy(reduction="sum", name="ce")
    again = keras.losses.deserialize(keras.losses.serialize(loss))
    assert type(again) is TokenCrossEntropy and again.reduction == "sum" and again.name == "ce"
