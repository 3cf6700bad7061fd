"""Bad data is refused before it trains, with one error naming the argument, the value and where
it is: NaN/inf in x, y or sample_weight (arrays before any step, a dataset's batch before the step
that would train on it), labels that are no class id of a sparse cross-entropy, complex or text
inputs, and token ids of `phalanx train`'s prepared data outside model.vocab.

What is accepted is checked against Keras's own fit: labels that are whole floats and a sparse
loss's ignore_class train as in Keras.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import ConfigError, load_config
from phalanx.data import records
from phalanx.data.corpus import glob_files, glob_root, read_documents
from phalanx.data.pipeline import make_datasets

N, BATCH = 16, 4


def classifier(ignore_class=None):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)],
                             name="classifier")
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=ignore_class))
    return model


def two_outputs():
    keras.utils.set_random_seed(2)
    a, b = keras.Input((6,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([a, b]))
    model = keras.Model({"a": a, "b": b}, {"cls": keras.layers.Dense(4, name="cls")(h),
                                           "reg": keras.layers.Dense(1, name="reg")(h)}, name="two_outputs")
    model.compile(optimizer="sgd", loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"})
    return model


def arrays():
    rng = np.random.default_rng(4)
    return rng.normal(size=(N, 6)).astype("float32"), (np.arange(N) % 3).astype("int64")


def with_value(array, index, value):
    out = np.array(array, dtype=np.result_type(array, type(value)))
    out[index] = value
    return out


def refused(tmp_path, model, *args, match, **kwargs):
    """fit refuses, naming the problem, before any step and before the run directory exists."""
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        phalanx.fit(model, *args, batch_size=kwargs.pop("batch_size", BATCH), verbose=0,
                    overrides=[f"run.dir={run}"], **kwargs)
    assert model.optimizer.iterations.numpy() == 0
    assert not run.exists()


def test_non_finite_arrays_are_refused_naming_the_argument_and_position(tmp_path):
    x, y = arrays()
    refused(tmp_path, classifier(), with_value(x, (9, 4), np.nan), y,
            match=r"^x: nan at \[9, 4\] \(sample 9, in batch 2 of batch_size 4")
    refused(tmp_path, classifier(), x, y, sample_weight=with_value(np.ones(N), 13, np.inf),
            match=r"^sample_weight: inf at \[13\] \(sample 13, in batch 3")
    model = two_outputs()
    inputs = {"a": x, "b": with_value(x[:, :2], (5, 1), -np.inf)}
    targets = {"cls": y, "reg": x[:, :1]}
    refused(tmp_path, model, inputs, targets, match=r"^x\['b'\]: -inf at \[5, 1\]")
    refused(tmp_path, model, {"a": x, "b": x[:, :2]}, {"cls": y, "reg": with_value(x[:, :1], (0, 0), np.nan)},
            match=r"^y\['reg'\]: nan at \[0, 0\]")
    # validation data and evaluate are checked as well
    refused(tmp_path, classifier(), x, y, validation_data=(with_value(x, (1, 1), np.nan), y),
            match=r"^x: nan at \[1, 1\]")
    with pytest.raises(ValueError, match=r"^y: label 3 at \[2\]"):
        phalanx.evaluate(classifier(), x, with_value(y, 2, 3), batch_size=BATCH, verbose=0)


def test_labels_that_are_no_class_id_of_a_sparse_loss_are_refused(tmp_path):
    x, y = arrays()
    refused(tmp_path, classifier(), x, with_value(y, 6, 3),
            match=r"^y: label 3 at \[6\] \(sample 6.*outside the classes \[0, 3\) of SparseCategoricalCrossentropy")
    refused(tmp_path, classifier(), x, with_value(y, 0, -1), match=r"^y: label -1 at \[0\]")
    refused(tmp_path, classifier(), x, y.astype("float32") + 0.5,
            match=r"^y: 0.5 at \[0\] .*is not a class id: SparseCategoricalCrossentropy takes integer labels")
    refused(tmp_path, two_outputs(), {"a": x, "b": x[:, :2]}, {"cls": with_value(y, 11, 4), "reg": x[:, :1]},
            match=r"^y\['cls'\]: label 4 at \[11\].*\[0, 4\) of sparse_categorical_crossentropy on output 'cls'")


def test_whole_float_labels_and_ignore_class_train_as_in_keras(tmp_path):
    x, y = arrays()
    labels = with_value(y, 3, -1)  # ignore_class=-1: that sample adds nothing to the loss
    reference = classifier(ignore_class=-1)
    expected = reference.fit(x, labels.astype("float32"), batch_size=BATCH, epochs=1, shuffle=False,
                             verbose=0).history["loss"]
    model = classifier(ignore_class=-1)
    got = phalanx.fit(model, x, labels.astype("float32"), batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      overrides=[f"run.dir={tmp_path / 'run'}"]).history["loss"]
    np.testing.assert_allclose(got, expected, rtol=1e-5)  # the same float32 program on one device
    for mine, ref in zip(model.variables, reference.variables):
        np.testing.assert_allclose(mine.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


def test_complex_and_text_inputs_are_refused(tmp_path):
    x, y = arrays()
    refused(tmp_path, classifier(), x.astype("complex64"), y, match=r"^x: arrays of dtype complex64 hold complex")
    refused(tmp_path, classifier(), x.astype(object), y, match=r"^x: arrays of dtype object")
    dataset = tf.data.Dataset.from_tensor_slices((x.astype("complex64"), y)).batch(BATCH)
    with pytest.raises(ValueError, match=r"^x: the dataset yields complex64"):
        phalanx.fit(classifier(), dataset, verbose=0, overrides=[f"run.dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", ["x", "label"])
def test_a_dataset_batch_is_checked_before_its_step(bad, tmp_path):
    """Batch 2 of 4 is bad: batches 0 and 1 train, batch 2 never runs, no checkpoint and no epoch
    row is written, and the weights stay finite."""
    x, y = arrays()
    if bad == "x":
        x = with_value(x, (9, 0), np.nan)  # row 9 = batch 2, row 1
    else:
        y = with_value(y, 10, 7)  # row 10 = batch 2, row 2
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model, run = classifier(), tmp_path / "run"
    match = r"^x: nan at \[1, 0\] \(batch 2 of the dataset, row 1\)" if bad == "x" else \
        r"^y: label 7 at \[2\] \(batch 2 of the dataset, row 2\)"
    with pytest.raises(ValueError, match=match):
        phalanx.fit(model, dataset, epochs=2, verbose=0, overrides=[f"run.dir={run}"])
    assert model.optimizer.iterations.numpy() == 2
    assert all(np.isfinite(v.numpy()).all() for v in model.variables)
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    metrics = run / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text() == ""


def test_phalanx_train_refuses_token_ids_outside_the_vocabulary(tmp_path):
    """A prepared dataset whose shard holds an id the model has no row for (damaged, or prepared
    for another vocabulary): refused naming data.source, the shard file, the record and the id."""
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    rng = np.random.default_rng(0)
    for f in range(4):
        (corpus_dir / f"f{f}.txt").write_text("".join(rng.choice(list("abcdefgh \n"), 3000)))
    glob = str(corpus_dir / "*.txt")
    manifest = records.prepare_dataset(read_documents(glob_files(glob), glob_root(glob)), tmp_path / "data",
                                       tokenizer="bytes", seq_len=16, val_fraction=0.1, progress=False)
    cfg = load_config(None, [f"data.source={tmp_path / 'data'}", "model.seq_len=16", "train.global_batch=8"])
    make_datasets(cfg, progress=False)  # as prepared: accepted
    # The same examples stored as uint16 with one id beyond the bytes tokenizer's 256.
    raw = json.loads((tmp_path / "data" / records.MANIFEST).read_text())
    raw["dtype"] = "uint16"
    for split in records.SPLITS:
        examples = records.load_split_array(manifest, split).astype("uint16")
        if split == "train":
            examples[5, 3] = 300
        shards = raw["splits"][split]["shards"]
        for i, name in enumerate(shards):
            records.write_shard(tmp_path / "data" / name, examples[i::len(shards)])
    (tmp_path / "data" / records.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        make_datasets(cfg, progress=False)
    shard = raw["splits"]["train"]["shards"][5 % len(raw["splits"]["train"]["shards"])]
    assert err.value.key == "data.source"
    assert f"token id 300 (train example 5, position 3: record {5 // len(raw['splits']['train']['shards'])} of" in \
        str(err.value) and shard in str(err.value) and "model.vocab=256" in str(err.value)
