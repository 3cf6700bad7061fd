"""keras-hub's LLMs are user models like any other: GPT-2 and Llama (small random
configs, float32, no dropout) through phalanx.fit on dp2, pp2 and dp2 x pp2 give the
per-step losses and final weights of Keras's own one-device ``fit``.

They take a dict of ``token_ids`` and ``padding_mask`` (the mask read by every block, so
it reaches each stage as a model input), nest their backbone inside the task model (the
cut falls inside it) and tie or untie the token embedding with the output head (a tied
weight is read by the first and last stages: a mirror on the last, gradients summed).
"""

from __future__ import annotations

import numpy as np
import pytest

import keras
import keras_hub  # installed by the Makefile with the test tools (no skip: a missing install must fail)

import phalanx

from helpers import ADAM_EPS

LAYOUTS = {
    "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"],
    "pp2": ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"],
    "dp2pp2": ["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"],
}


def build(kind: str):
    keras.utils.set_random_seed(1)
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
                                                 intermediate_dim=32, max_sequence_length=16, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=4,
                                                  num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    # Adam epsilon 1e-4 (Keras's default 1e-7) in the reference and the runs under test alike: the
    # weights after 4 steps at lr 1e-3 are compared at atol 1e-5, and gradient round-off of 1e-7 (the
    # layouts' sums in another order, another CPU's kernels; GPT-2's key bias, which softmax ignores,
    # has nothing else) moves an element by at most 4 x 2 x 1e-3 x 1e-7 / 1e-4 = 8e-6 (derivation:
    # tests/helpers.py ADAM_EPS). With 1e-7 such an element could move by up to 2 x lr a step.
    model.compile(optimizer=keras.optimizers.Adam(1e-3, epsilon=ADAM_EPS),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), weighted_metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (16, 9)).astype("int32")
    mask = np.ones((16, 8), "int32")
    mask[::3, 6:] = 0  # some padded rows
    return {"token_ids": tokens[:, :-1], "padding_mask": mask}, tokens[:, 1:]


class StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


@pytest.fixture(scope="session")
def keras_fit_of():
    """``keras_fit_of(kind, epochs)``: Keras's own one-device ``fit`` of ``build(kind)`` on
    ``data()`` (batch 8, no shuffle): the trained model, its StepLosses and its history. The
    oracle is the same for every layout, so it is trained once per worker and shared (read only:
    a test compares against its weights and optimizer state, never trains it). Other modules
    import this fixture by name."""
    runs = {}

    def fit(kind: str, epochs: int = 2):
        if (kind, epochs) not in runs:
            x, y = data()
            reference, steps = build(kind), StepLosses()
            history = reference.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
                                    callbacks=[steps]).history
            runs[kind, epochs] = reference, steps, history
        return runs[kind, epochs]

    return fit


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_keras_hub_causal_lm_equals_keras_fit(kind, keras_fit_of, tmp_path):
    x, y = data()
    reference, ref_steps, ref = keras_fit_of(kind)
    for layout, overrides in LAYOUTS.items():
        model, steps = build(kind), StepLosses()
        history = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                              overrides=overrides + [f"run.dir={tmp_path / layout}"]).history
        np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4, err_msg=layout)
        np.testing.assert_allclose(history["accuracy"], ref["accuracy"], rtol=1e-4, err_msg=layout)
        for mine, want in zip(model.weights, reference.weights):
            np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"{layout} {mine.path}")
