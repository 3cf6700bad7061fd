"""After ``phalanx.unparallelize`` a keras-hub model is an ordinary Keras model again, its
optimizer included, whatever was done in between (a save and a reload for a look).

keras-hub GPT-2 and Llama (tiny configs, float32, no dropout) go through: ``phalanx.fit`` at
a tensor-parallel layout, ``save`` + ``keras.saving.load_model``, ``unparallelize``, ``save``,
``phalanx.fit`` at the same layout again, ``unparallelize``, Keras's own ``model.fit``,
``evaluate``, ``save`` + reload. The oracle is Keras's one-device ``fit`` of the same model
for the same three epochs: the optimizer's step count is the same (its state carried through
every swap) and the weights and the evaluation equal Keras's to rtol 1e-4, atol 1e-5 (three
epochs of Adam at lr 1e-3 on 2-step epochs, epsilon 1e-4 on both sides: a gradient's round-off d,
the layouts' sums in another order, moves an element by at most 6 x 2 x 1e-3 x d / 1e-4 = 0.12 x d
in the six steps, 1.2e-6 for d = 1e-8, the round-off of float32 sums of ~1e-2 terms; see
tests/helpers.py ADAM_EPS).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import phalanx

from test_keras_hub import build, data
from test_keras_hub_tp import LAYOUTS


# Each family at one layout (the two layouts between them): ~20 s each on a quiet machine.
@pytest.mark.parametrize("kind, layout", [("gpt2", "tp2"), ("llama", "dp2tp2pp2")])
def test_unparallelized_model_is_a_keras_model_again(kind, layout, tmp_path):
    x, y = data()
    reference = build(kind)
    for _ in range(3):
        reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    want_eval = reference.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)

    model = build(kind)
    fit = dict(batch_size=8, epochs=1, shuffle=False, verbose=0)
    phalanx.fit(model, x, y, **fit, overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / 'a'}"])
    model.save(tmp_path / "parallel.keras")
    keras.saving.load_model(tmp_path / "parallel.keras")  # a look at the file
    phalanx.unparallelize(model)
    model.save(tmp_path / "plain.keras")
    phalanx.fit(model, x, y, **fit, overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / 'b'}"])
    assert int(model.optimizer.iterations) == 4
    phalanx.unparallelize(model)
    model.fit(x, y, **fit)  # Keras's own
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 6
    for mine, want in zip(model.weights, reference.weights, strict=True):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)
    got_eval = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
    for key in want_eval:
        np.testing.assert_allclose(got_eval[key], want_eval[key], rtol=1e-4, err_msg=key)
    # The optimizer's slots are the one-device run's (Adam's moments, matched by name).
    want_slots = {v.name: v.numpy() for v in reference.optimizer.variables}
    for v in model.optimizer.variables:
        np.testing.assert_allclose(v.numpy(), want_slots[v.name], rtol=1e-3, atol=1e-7, err_msg=v.name)
    model.save(tmp_path / "end.keras")
    loaded = keras.saving.load_model(tmp_path / "end.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-6)
    reference.save(tmp_path / "reference.keras")  # keras-hub reloads the optimizer as it does Keras's own model's
    want_loaded = keras.saving.load_model(tmp_path / "reference.keras")
    assert int(loaded.optimizer.iterations) == int(want_loaded.optimizer.iterations)
