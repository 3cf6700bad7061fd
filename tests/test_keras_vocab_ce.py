"""The vocabulary-parallel cross-entropy of ``phalanx.fit`` (Keras-model engine), with Keras as the oracle.

A keras-hub causal LM cut ``tp`` ways by its preset has a vocabulary-parallel output head (GPT-2:
tied to the token embedding; Llama: untied). Compiled with one
``SparseCategoricalCrossentropy(from_logits=True)`` and no metric, the engine computes the loss
from the head's shard logits: per-step losses and trained weights equal Keras's own one-device
``model.fit``, and the executed train step holds no tensor of the full vocabulary width on any
device. A loss or metric that needs the joined logits runs on them, and the engine says so.
"""

from __future__ import annotations

import keras
import keras_hub  # installed by the Makefile with the test tools (no skip: a missing install must fail)
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import load_config
from phalanx.engines.keras_model import KerasModelEngine, _as_tensors
from phalanx.mesh import Mesh
from phalanx.train.calibrate import run_with_metadata

from test_keras_hub import StepLosses, data
from test_keras_hub_tp import LAYOUTS

VOCAB = 64


def build(kind: str, metrics=(), **loss_kwargs):
    """test_keras_hub's models without metrics: ``weighted_metrics=[]`` (keras-hub's task compiles
    itself with accuracy when made, and Keras's compile keeps those metrics when given None)."""
    keras.utils.set_random_seed(1)
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                                                 intermediate_dim=32, max_sequence_length=16, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                                                  num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    loss = loss_kwargs.pop("loss", None) or keras.losses.SparseCategoricalCrossentropy(from_logits=True, **loss_kwargs)
    # Adam epsilon 1e-4 on both sides (Keras's default 1e-7): 2 steps at lr 1e-3 move an element by
    # at most 2 x 2 x 1e-3 x 1e-7 / 1e-4 = 4e-6 for gradient round-off of 1e-7, inside atol 1e-5
    # (derivation: tests/helpers.py ADAM_EPS).
    model.compile(optimizer=keras.optimizers.Adam(1e-3, epsilon=1e-4), loss=loss, weighted_metrics=list(metrics))
    return model


def padding_weights(x) -> np.ndarray:
    return x["padding_mask"].astype("float32")  # per-token sample weights: the padded tokens weigh 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_vocab_parallel_loss_equals_keras_fit(kind, tmp_path, capsys):
    """Tied (GPT-2) and untied (Llama) heads at tp2 and dp2 x tp2 x pp2, with per-token sample
    weights: the per-step losses and the weights after 2 steps are Keras's."""
    x, y = data()
    sw = padding_weights(x)
    reference, ref_steps = build(kind), StepLosses()
    reference.fit(x, y, sample_weight=sw, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[ref_steps])
    for layout in ("tp2", "dp2tp2pp2"):
        model, steps = build(kind), StepLosses()
        phalanx.fit(model, x, y, sample_weight=sw, batch_size=8, epochs=1, shuffle=False, verbose=1,
                    callbacks=[steps], overrides=LAYOUTS[layout] + [f"run.dir={tmp_path / layout}"])
        assert "loss: vocabulary-parallel cross-entropy on the tp=2 shard logits" in capsys.readouterr().err
        np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4, err_msg=layout)
        phalanx.unparallelize(model)
        assert len(model.weights) == len(reference.weights)
        for mine, want in zip(model.weights, reference.weights):
            np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"{layout} {mine.path}")


def _engine(model, devices, layout: str, batch):
    phalanx.parallelize(model, 2)
    cfg = load_config(None, LAYOUTS[layout])
    p = cfg.parallel
    return KerasModelEngine(model, cfg, Mesh.from_devices(devices[:p.dp * p.pp * p.tp], p.dp, p.pp, p.tp), batch)


def _vocab_wide_tensors(engine, batch) -> tuple[dict, dict]:
    """Run one train step with run metadata; return ``(full, shard)``: device -> names of the
    executed ops whose output is a float tensor ``[..., VOCAB]`` (full logits or their
    gradient), and of those ``[..., VOCAB / tp]`` (the shard logits).

    The partition graphs (what each device ran, after pruning and Grappler) name the ops; their
    static shapes come from the traced step's graph."""
    _, meta = run_with_metadata(lambda: engine.train_step(batch)["loss"].numpy())
    graph = engine._train_fn.get_concrete_function(*_as_tensors(batch)).graph
    shapes = {op.name: [(t.shape, t.dtype) for t in op.outputs] for op in graph.get_operations()}
    full: dict[str, list] = {}
    shard: dict[str, list] = {}
    for fn in meta.function_graphs:
        for part in fn.partition_graphs:
            for node in part.node:
                for shape, dtype in shapes.get(node.name, []):
                    if not dtype.is_floating or shape.rank is None or shape.rank < 2:
                        continue
                    if shape[-1] == VOCAB:
                        full.setdefault(node.device, []).append(node.name)
                    elif shape[-1] == VOCAB // engine.mesh.tp:
                        shard.setdefault(node.device, []).append(node.name)
    return full, shard


@pytest.mark.parametrize("kind, layout", [("gpt2", "tp2"), ("llama", "tp2"),
                                          pytest.param("gpt2", "dp2tp2pp2", marks=pytest.mark.slow)])
def test_the_full_logits_are_never_on_one_device(kind, layout, devices):
    """No op of the executed train step outputs [..., vocab] on any device. The check finds the
    joined logits when the loss reads them (the concat and Keras's
    SparseSoftmaxCrossEntropyWithLogits on the rank 0 device: the next test, and the engine
    before this path)."""
    x, y = data()
    batch = (x, y, None)
    engine = _engine(build(kind), devices, layout, batch)
    assert engine.vocab_loss
    full, shard = _vocab_wide_tensors(engine, batch)
    assert not full, {d: names[:5] for d, names in full.items()}
    # The check sees the logits: the tensor devices of the last stage ran [..., vocab/2] ops.
    last = {engine.mesh.device(d, engine.pp - 1, r).split("device:")[-1] for d in range(engine.dp) for r in range(2)}
    assert last <= {d.split("device:")[-1] for d in shard}, (last, sorted(shard))


def test_a_compiled_metric_joins_the_logits(devices):
    """Accuracy reads y_pred: the logits are joined (what the check above would catch), the
    engine's note says why, and the loss is Keras's."""
    x, y = data()
    batch = (x, y, None)
    engine = _engine(build("gpt2", metrics=["accuracy"]), devices, "tp2", batch)
    assert not engine.vocab_loss and "compiled metrics read the full logits" in engine.loss_note
    full, _ = _vocab_wide_tensors(engine, batch)
    assert full


LOSSES = {
    "sum": dict(reduction="sum"),
    "mean_with_sample_weight": dict(reduction="mean_with_sample_weight"),
    "ignore_class": dict(ignore_class=5),
    "none_weights": dict(),
}


@pytest.mark.parametrize("case", sorted(LOSSES))
def test_reductions_sample_weights_and_ignore_class_are_keras(case, devices):
    """The loss of an evaluation step (test_step) on tp2 x pp2 equals Keras's compiled loss on
    the one-device model's joined logits, for each reduction, ignore_class and sample weights."""
    x, y = data()
    y = y.copy()
    y[:, ::2] = 5  # ignore_class=5 drops these tokens
    sw = None if case == "none_weights" else padding_weights(x) * np.linspace(0.5, 1.5, 8, dtype="float32")
    reference = build("llama", **LOSSES[case])
    model = build("llama", **LOSSES[case])
    engine = _engine(model, devices, "tp2pp2", (x, y, sw))
    assert engine.vocab_loss
    got = float(engine.test_step((x, y, sw))["loss"])  # one replica, two micro-batches: their mean
    halves = [float(reference.compute_loss({k: v[i:i + 8] for k, v in x.items()}, y[i:i + 8],
                                           reference({k: v[i:i + 8] for k, v in x.items()}),
                                           sample_weight=None if sw is None else sw[i:i + 8]))
              for i in (0, 8)]
    np.testing.assert_allclose(got, np.mean(halves), rtol=1e-5)
    if case == "none_weights":  # equal micro-batches: the mean of theirs is the whole batch's
        np.testing.assert_allclose(got, float(reference.compute_loss(x, y, reference(x))), rtol=1e-5)


def test_a_label_outside_the_vocabulary_is_refused_as_keras_refuses_it(devices):
    x, y = data()
    y = y.copy()
    y[3, 2] = VOCAB
    reference = build("gpt2")
    with pytest.raises(tf.errors.InvalidArgumentError):  # Keras on a CPU
        reference.compute_loss(x, y, reference(x))
    engine = _engine(build("gpt2"), devices, "tp2", (x, y, None))
    assert engine.vocab_loss
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"y: labels must be in \[0, {VOCAB}\)"):
        engine.test_step((x, y, None))


@pytest.mark.slow
def test_what_the_vocab_parallel_loss_cannot_honour_joins_the_logits(devices, tmp_path, capsys):
    """from_logits=False (probabilities), the string loss (from_logits=False too), a loss
    function of the user's: the joined logits, said in one line; fit's losses still equal Keras's."""
    sce = keras.losses.SparseCategoricalCrossentropy
    x, y = data()
    def own(y_true, y_pred):
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)

    for loss, reason in ((sce(from_logits=False), "from_logits=False"),
                         ("sparse_categorical_crossentropy", "from_logits=False"),
                         (own, "is not SparseCategoricalCrossentropy")):
        engine = _engine(build("gpt2", loss=loss), devices, "tp2", (x, y, None))
        assert not engine.vocab_loss and reason in engine.loss_note, engine.loss_note
        assert engine.loss_note.startswith("loss: the tp=2 shard logits are joined on one device"), engine.loss_note

    reference, ref_steps = build("gpt2", loss=sce(from_logits=False)), StepLosses()
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[ref_steps])
    model, steps = build("gpt2", loss=sce(from_logits=False)), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=1, callbacks=[steps],
                overrides=LAYOUTS["tp2"] + [f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert "loss: the tp=2 shard logits are joined on one device for the compiled loss" in err, err
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
