"""The precision a user's Keras model trains under on :func:`phalanx.fit`, with Keras as the oracle.

A model built under a mixed Keras policy runs as built (its float32 head stays float32, as in
Keras's own ``fit``); ``precision.policy=auto`` keeps it; an explicit policy that differs is an
error before any work; a model built under float32 takes the configured mixed policy.
"""

import keras
import numpy as np
import pytest

import phalanx
from phalanx.config import ConfigError


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 6)).astype("float32"), rng.integers(0, 3, 32).astype("int32")


def build(policy: str = "float32"):
    """A Dense MLP with a float32 softmax head set by hand, built under ``policy``."""
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3, dtype="float32", name="head")])
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        keras.config.set_dtype_policy("float32")
    return model


@pytest.mark.parametrize("policy", ["auto", "mixed_bfloat16"])
def test_a_model_built_under_a_mixed_policy_runs_as_built(policy, tmp_path, capsys):
    x, y = data()
    reference = build("mixed_bfloat16")
    ref = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    model = build("mixed_bfloat16")
    history = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=1,
                          overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"precision.policy={policy}",
                                     f"run.dir={tmp_path / 'r'}"]).history
    assert model.get_layer("head").compute_dtype == "float32"  # the user's float32 head kept
    assert model.layers[0].compute_dtype == "bfloat16"
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=1e-2)
    out = capsys.readouterr()
    said = out.out + out.err
    assert "precision: mixed_bfloat16 (" in said
    if policy == "auto":  # the suite pins auto to float32 (conftest): the model's own policy wins
        assert "built under mixed_bfloat16; precision.policy=auto keeps it" in said


def test_an_explicit_policy_the_model_was_not_built_under_is_refused(tmp_path):
    x, y = data()
    model = build("mixed_bfloat16")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ConfigError, match=r"precision.policy.*float32.*built under the Keras policy mixed_bfloat16"):
        phalanx.fit(model, x, y, batch_size=8, epochs=1, verbose=0,
                    overrides=["parallel.devices=cpu:1", "precision.policy=float32", f"run.dir={tmp_path / 'r'}"])
    assert not (tmp_path / "r").exists()  # refused before any work
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def test_a_float32_model_takes_the_configured_policy(tmp_path):
    x, y = data()
    model = build("float32")
    phalanx.fit(model, x, y, batch_size=8, epochs=1, verbose=0,
                overrides=["parallel.devices=cpu:1", "precision.policy=mixed_bfloat16", f"run.dir={tmp_path / 'r'}"])
    # Built under float32, the head's float32 cannot be told from the default: every layer takes the policy.
    assert [layer.compute_dtype for layer in model.layers] == ["bfloat16", "bfloat16"]
    assert all(w.dtype == "float32" for w in model.weights)
