"""keras-hub's GPT-2 and Llama under tensor parallelism, with Keras as the oracle.

A plain keras-hub causal LM (small random config, float32, no dropout) handed to
``phalanx.fit`` with ``parallel.tp=2`` is split by its family's preset
(:func:`phalanx.parallelize`: attention by heads, grouped-query heads included, the MLP
by columns then rows, the token embedding by vocabulary) and trained on tp2, tp2 x pp2
and dp2 x tp2 x pp2 (8 logical CPUs). Its per-step losses equal Keras's own one-device
``model.fit`` of the same model to rtol 1e-4, and after :func:`phalanx.unparallelize` every
weight equals Keras's. The trained model then saves, reloads with keras-hub alone and
generates.
"""

from __future__ import annotations

import keras
import keras_hub  # installed by the Makefile with the test tools (no skip: a missing install must fail)
import numpy as np
import pytest

import phalanx
from phalanx.layers.sharding import ShardedLayer, placement_of

# build: Adam epsilon 1e-4 on both sides, see its comment (the weights are compared at atol 1e-5)
from test_keras_hub import StepLosses, build, data, keras_fit_of  # noqa: F401 (keras_fit_of: a fixture)

LAYOUTS = {
    "tp2": ["parallel.devices=cpu:2", "parallel.tp=2"],
    "tp2pp2": ["parallel.devices=cpu:4", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"],
    "dp2tp2pp2": ["parallel.devices=cpu:8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                  "parallel.microbatches=2"],
}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_keras_hub_tensor_parallel_equals_keras_fit(kind, keras_fit_of, tmp_path):
    x, y = data()
    reference, ref_steps, _ = keras_fit_of(kind)
    for layout, overrides in LAYOUTS.items():
        model, steps = build(kind), StepLosses()
        phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                    overrides=overrides + [f"run.dir={tmp_path / layout}"])
        np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4, err_msg=layout)
        # The weights really were cut over the tensor devices.
        shards = [v for v in model.weights if placement_of(v) is not None]
        assert shards and {v.value.device for v in shards if placement_of(v).rank == 1} != \
            {v.value.device for v in shards if placement_of(v).rank == 0}, layout
        phalanx.unparallelize(model)
        assert not any(isinstance(layer, ShardedLayer) for layer in model._flatten_layers())
        assert len(model.weights) == len(reference.weights)
        for mine, want in zip(model.weights, reference.weights):
            np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{layout} {mine.path}")


def test_one_device_weights_load_into_tp_and_the_trained_model_writes_back(tmp_path):
    """Logits of the tp layout equal the one-device model's; trained at dp2 x tp2 x pp2, the
    model goes back to plain keras-hub layers, saves, reloads and generates."""
    x, y = data()
    plain = build("gpt2")
    plain.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # weights no fresh build has
    want = plain.predict(x, verbose=0)
    plain.save(tmp_path / "one_device.keras")
    model = keras.saving.load_model(tmp_path / "one_device.keras")  # the one-device model's own file
    phalanx.parallelize(model, 2)
    got = phalanx.predict(model, x, batch_size=8, verbose=0, overrides=LAYOUTS["tp2"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                overrides=LAYOUTS["dp2tp2pp2"] + [f"run.dir={tmp_path / 'run'}"])
    trained = phalanx.predict(model, x, batch_size=8, verbose=0, overrides=LAYOUTS["tp2"])
    phalanx.unparallelize(model)
    np.testing.assert_allclose(model.predict(x, verbose=0), trained, rtol=1e-5, atol=1e-6)
    path = tmp_path / "gpt2.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, keras_hub.models.GPT2CausalLM)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), trained, rtol=1e-5, atol=1e-6)
    prompt = {"token_ids": x["token_ids"][:2], "padding_mask": np.concatenate(
        [np.ones((2, 3), "int32"), np.zeros((2, 5), "int32")], axis=1)}
    out = loaded.generate(prompt, max_length=8, stop_token_ids=None)
    assert out["token_ids"].shape == (2, 8)
    np.testing.assert_array_equal(out["token_ids"][:, :3], prompt["token_ids"][:, :3])  # the prompt is kept
    assert out["padding_mask"][:, 3:].any()  # and continued
