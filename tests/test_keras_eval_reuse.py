"""phalanx.evaluate and phalanx.predict run on the engine a model already has, against Keras.

The engine phalanx.fit built (its traced steps) evaluates and predicts too, and an engine
evaluate or predict built is kept for the next call, while nothing it was built from changed
(``keras_api._kept_engine``: the same key rules as a second fit's, any number of rows). The
oracle is Keras's own one-device ``fit`` / ``evaluate`` / ``predict`` of the same model from
the same weights, call for call; builds are counted at the engine's constructor and traces
with ``tf.function``'s tracing counter (``keras_api.kept_engines``), never timed.
"""

from __future__ import annotations

import numpy as np
import pytest

import phalanx
from phalanx.train import keras_api

import test_keras_tp as tp
from test_keras_fit import LAYOUTS, Builds, assert_same_weights, build, data

EVAL_BATCH, PREDICT_BATCH = 16, 4  # other row counts than fit's 8: the kept engine takes any


def _models(layout: str):
    """(model, Keras's one-device reference from the same weights, overrides, logical weights)."""
    if layout == "tp2":
        reference, model = tp.build(1), tp.build(2)
        tp.copy_weights(tp.build(1), model)
        return model, reference, tp.LAYOUTS["tp2"], tp.data(), tp.logical
    return build("mlp", "sgd"), build("mlp", "sgd"), LAYOUTS[layout], data("mlp"), None


def _traces(engine) -> tuple[int, int, int]:
    return tuple(f.experimental_get_tracing_count() for f in (engine._train_fn, engine._test_fn, engine._predict_fn))


@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_fit_evaluate_fit_predict_equals_keras_on_one_engine(layout, tmp_path, monkeypatch):
    """fit -> evaluate -> fit -> predict -> evaluate -> predict: every figure and the weights are
    Keras's, one engine is built (the first fit's), and the second evaluate and predict trace
    nothing: they read the weights the second fit trained, not those of a stale copy."""
    model, reference, overrides, (x, y), logical = _models(layout)
    fit = dict(batch_size=tp.BATCH, epochs=1, shuffle=False, verbose=0)
    want = [reference.fit(x, y, **fit).history["loss"],
            reference.evaluate(x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True),
            reference.fit(x, y, **fit).history["loss"],
            reference.predict(x, batch_size=PREDICT_BATCH, verbose=0),
            reference.evaluate(x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True),
            reference.predict(x, batch_size=PREDICT_BATCH, verbose=0)]
    builds = Builds(monkeypatch)
    got, traces = [], []
    for call in range(6):
        if call in (0, 2):
            got.append(phalanx.fit(model, x, y, **fit, overrides=overrides + [f"run.dir={tmp_path / str(call)}"])
                       .history["loss"])
        elif call in (1, 4):
            got.append(phalanx.evaluate(model, x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True,
                                        overrides=overrides))
        else:
            got.append(phalanx.predict(model, x, batch_size=PREDICT_BATCH, verbose=0, overrides=overrides))
        kept = keras_api.kept_engines(model)
        assert list(kept) == ["fit"]
        traces.append(_traces(kept["fit"]))
    assert builds.count == 1
    # (train, test, predict) traces after each call: the second evaluate and predict add none
    assert traces == [(1, 0, 0), (1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1), (1, 1, 1)]
    for mine, ref in zip(got, want):
        if isinstance(ref, dict):
            assert sorted(mine) == sorted(ref)
            for key in ref:
                np.testing.assert_allclose(mine[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)
        else:
            np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-6)
    if logical is None:
        assert_same_weights(model, reference, rtol=1e-5, atol=1e-6)
    else:
        for mine, ref in zip(logical(model), logical(reference)):
            np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-6)


def test_evaluate_and_predict_keep_their_engine_and_refresh_its_copies(monkeypatch):
    """dp2 (replica 1 reads a copy of every weight), no fit: the first evaluate's engine serves the
    next evaluate and predict, with no new build and no new trace of the same shapes, after
    ``model.set_weights`` too: the copies follow the new weights (Keras's figures for them)."""
    model, reference = build("mlp", "sgd"), build("mlp", "sgd")
    x, y = data("mlp")
    builds = Builds(monkeypatch)
    first = phalanx.evaluate(model, x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True,
                             overrides=LAYOUTS["dp2"])
    engine = keras_api.kept_engines(model)["evaluate"]
    new = [w * 0.5 + 0.1 for w in model.get_weights()]
    model.set_weights(new)
    reference.set_weights(new)
    second = phalanx.evaluate(model, x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True,
                              overrides=LAYOUTS["dp2"])
    predicted = phalanx.predict(model, x, batch_size=EVAL_BATCH, verbose=0, overrides=LAYOUTS["dp2"])
    assert builds.count == 1 and keras_api.kept_engines(model) == {"evaluate": engine}
    assert _traces(engine) == (0, 1, 1)
    want = reference.evaluate(x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True)
    assert first["loss"] != pytest.approx(want["loss"])  # the new weights changed the figures
    for key in want:
        np.testing.assert_allclose(second[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(predicted, reference.predict(x, batch_size=EVAL_BATCH, verbose=0), rtol=1e-5,
                               atol=1e-6)


def test_predict_keeps_its_engine_until_a_fit_and_each_key_builds_anew(tmp_path, monkeypatch):
    """Predict alone keeps an inference engine (no optimizer) for the next predict; another
    layout moves the weights (a new build, and the first layout builds again after it), a
    recompile builds an engine for evaluate, and a fit drops the evaluate and predict engines."""
    model, reference = build("mlp", "sgd"), build("mlp", "sgd")
    x, y = data("mlp")
    builds = Builds(monkeypatch)
    outs = [phalanx.predict(model, x, batch_size=PREDICT_BATCH, verbose=0, overrides=LAYOUTS["dp2"])
            for _ in range(2)]
    assert builds.count == 1 and list(keras_api.kept_engines(model)) == ["predict"]
    assert keras_api.kept_engines(model)["predict"].inference_only
    for out in outs:
        np.testing.assert_allclose(out, reference.predict(x, batch_size=PREDICT_BATCH, verbose=0), rtol=1e-5,
                                   atol=1e-6)
    phalanx.predict(model, x, batch_size=PREDICT_BATCH, verbose=0, overrides=LAYOUTS["pp2"])
    phalanx.predict(model, x, batch_size=PREDICT_BATCH, verbose=0, overrides=LAYOUTS["dp2"])
    assert builds.count == 3  # pp2 moved the weights: dp2's kept engine read the old ones
    phalanx.evaluate(model, x, y, batch_size=EVAL_BATCH, verbose=0, overrides=LAYOUTS["dp2"])
    assert builds.count == 4 and sorted(keras_api.kept_engines(model)) == ["evaluate", "predict"]
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    phalanx.evaluate(model, x, y, batch_size=EVAL_BATCH, verbose=0, overrides=LAYOUTS["dp2"])
    assert builds.count == 5
    phalanx.fit(model, x, y, batch_size=8, epochs=1, verbose=0, overrides=LAYOUTS["dp2"] + [f"run.dir={tmp_path}"])
    assert builds.count == 6 and list(keras_api.kept_engines(model)) == ["fit"]
