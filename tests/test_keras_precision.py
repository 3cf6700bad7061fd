"""The precision a user's Keras model trains under on :func:`phalanx.fit`, with Keras as the oracle.

A model trains in the precision it was built in unless ``precision.policy`` is set explicitly:
built under a mixed Keras policy it runs as built (its float32 head stays float32, as in Keras's
own ``fit``) and an explicit policy that differs is an error before any work; built under float32
it stays float32 under the default ``auto`` even where the hardware has bfloat16 units (the run
says how to get mixed precision), and takes an explicit mixed policy. phalanx's own GPT follows
``auto``.
"""

import keras
import numpy as np
import pytest

import phalanx
from phalanx import precision
from phalanx.config import ConfigError, load_config


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


@pytest.fixture
def bfloat16_cpu(monkeypatch):
    """This machine as one with bfloat16 units, detected as phalanx.precision detects them (the suite's
    PHALANX_AUTO_PRECISION pin removed, the CPU flags replaced, oneDNN on)."""
    monkeypatch.delenv("PHALANX_AUTO_PRECISION", raising=False)
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert load_config(None, ["parallel.devices=cpu:2"]).precision.policy == "mixed_bfloat16"  # auto would switch


def test_the_default_keeps_a_float32_model_float32_on_a_bfloat16_machine(bfloat16_cpu, tmp_path, capsys):
    x, y = data()
    ref = build("float32").fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    model = build("float32")
    history = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=1,
                          overrides=["parallel.devices=cpu:2", "parallel.dp=2", f"run.dir={tmp_path / 'r'}"]).history
    assert [layer.compute_dtype for layer in model.layers] == ["float32", "float32"]
    # float32 throughout, so dp2 differs from one device only by the order of the batch-mean sums (~1e-7).
    np.testing.assert_allclose(history["loss"], ref["loss"], rtol=1e-5)
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if "precision.policy=mixed_bfloat16" in line]
    assert len(lines) == 1 and lines[0].startswith("precision: float32 ("), lines
    assert "CPU has avx512_bf16" in lines[0]


def test_the_builtin_gpt_follows_auto(bfloat16_cpu):
    from phalanx.train.calibrate import keras_gpt

    cfg = load_config(None, ["model.layers=1", "model.d_model=16", "model.heads=2", "model.vocab=256",
                             "model.seq_len=8", "parallel.devices=cpu:1"])
    model = keras_gpt(cfg, 1)
    assert {layer.compute_dtype for layer in model._flatten_layers(include_self=False)
            if layer.dtype_policy.name == "mixed_bfloat16"} == {"bfloat16"}
    assert model.layers[1].compute_dtype == "bfloat16"
