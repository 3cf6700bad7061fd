"""``parallel.recompute`` for any Keras model on the Keras-model engine, Keras as the oracle.

``full`` re-runs each block of a stage (a Functional/Sequential stage cut into about
``sqrt(n)`` blocks) in the backward; ``selective`` re-runs the attention cores only
(:class:`keras.layers.MultiHeadAttention`, keras-hub GPT-2's attention at tp=1, and
:class:`phalanx.layers.ParallelSelfAttention`, GPT-2's after the tp preset). The backward
recomputes the same ops on the same inputs (the weights, the crossing activations and the
seed state of dropout), so the losses and weights equal Keras's own one-device ``fit`` to
round-off: SGD (no amplification of round-off by Adam's normalisation) is compared at rtol 1e-5
as in the tests of the engine without recomputation. The memory tests measure the allocator's
peak during a step on one logical device with and without recomputation.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import load_config
from phalanx.engines.keras_model import KerasModelEngine
from phalanx.mesh import Mesh

from test_keras_hub import StepLosses, build, data, keras_fit_of  # noqa: F401 (keras_fit_of: a fixture)


def mlp(depth: int = 6, width: int = 32, inputs: int = 16):
    """A deep MLP with the state recomputation must not apply twice: Dropout's seed state and
    BatchNormalization's moving statistics."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    model = keras.Sequential([keras.Input((inputs,)), *layers[:depth // 2], keras.layers.Dropout(0.3),
                              keras.layers.BatchNormalization(), *layers[depth // 2:], keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    return model


def xy(rows: int = 32, inputs: int = 16):
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, inputs)).astype("float32"), rng.normal(size=(rows, 4)).astype("float32")


def assert_same(model, reference, steps, ref_steps, what):
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-5, err_msg=what)
    for mine, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{what} {mine.path}")


def cnn():
    """Two convolutions with BatchNormalization between them, then a Dense head."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def cnn_xy():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 8, 8, 3)).astype("float32"), rng.normal(size=(32, 4)).astype("float32")


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("layout", [[], ["parallel.devices=cpu:2", "parallel.pp=2"]], ids=["one_device", "pp2"])
def test_full_recompute_equals_keras_fit(kind, layout, tmp_path):
    """The MLP (Dropout and BatchNormalization between its Dense layers) and the CNN
    (BatchNormalization after each convolution): each stage's blocks re-run in the backward,
    dropout masks drawn and BatchNorm statistics updated once (one micro-batch: Keras's own
    step, no ghost batches): the losses, weights and moving statistics of Keras's fit."""
    build, (x, y) = {"mlp": (mlp, xy()), "cnn": (cnn, cnn_xy())}[kind]
    reference, ref_steps = build(), StepLosses()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[ref_steps])
    model, steps = build(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=layout + ["parallel.recompute=full", f"run.dir={tmp_path}"])
    assert_same(model, reference, steps, ref_steps, f"{kind} full {layout}")


# Layouts where a replica runs each stage more than once: the stages run as stage calls (traced
# once, called per micro-batch), the recomputed pieces inside each call. The number of chunks
# a batch is cut into, for the ghost-batch oracle of the BatchNormalization models.
CALL_LAYOUTS = {
    "pp2m4": (["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=4"], 4),
    "accum2": (["train.grad_accum=2"], 2),
}


def assert_called(model, what):
    """The last phalanx.fit of ``model`` ran every stage as a stage call (none refused, none inline)."""
    calls = model.__dict__["_phalanx_fit_engine"][1].stage_calls
    assert calls is not None and calls.traced >= 1 and not calls.inline, what


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("layout", sorted(CALL_LAYOUTS))
def test_full_recompute_inside_stage_calls_equals_keras_fit(kind, layout, tmp_path):
    """Several micro-batches per stage: each stage is a traced call whose backward re-runs its
    blocks. The oracle is Keras's fit of the batch cut into the same chunks in order (each
    normalised by its own BatchNormalization statistics, which move once per chunk, and drawing
    its own dropout mask: helpers.ghost_batches); the losses and weights to round-off as above."""
    from helpers import ghost_batches

    build, (x, y) = {"mlp": (mlp, xy()), "cnn": (cnn, cnn_xy())}[kind]
    overrides, chunks = CALL_LAYOUTS[layout]
    reference, ref_steps = build(), StepLosses()
    ghost = ghost_batches(reference, chunks)
    ghost.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    ghost.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[ref_steps])
    model, steps = build(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[steps],
                overrides=overrides + ["parallel.recompute=full", f"run.dir={tmp_path}"])
    assert_called(model, f"{kind} {layout}")
    assert_same(model, reference, steps, ref_steps, f"{kind} full {layout}")


def test_selective_recompute_of_a_model_without_attention_is_refused(tmp_path):
    """``selective`` recomputes attention cores only: on a model with none it would run as
    ``none``, so it is refused, naming the key, before anything is written."""
    from phalanx.config import ConfigError

    for build, (x, y) in ((mlp, xy()), (cnn, cnn_xy())):
        model = build()
        with pytest.raises(ConfigError, match=r"parallel.recompute: selective: model .* has no attention layer"):
            phalanx.fit(model, x, y, batch_size=8, epochs=1, verbose=0,
                        overrides=["parallel.recompute=selective", f"run.dir={tmp_path / model.name}"])
        assert not (tmp_path / model.name).exists()


class Subclassed(keras.Model):
    """No graph to cut: recomputed as one block."""

    def __init__(self):
        super().__init__()
        self.hidden = [keras.layers.Dense(32, activation="relu") for _ in range(3)]
        self.drop, self.out = keras.layers.Dropout(0.3), keras.layers.Dense(4)

    def call(self, x, training=False):
        for layer in self.hidden:
            x = layer(x)
        return self.out(self.drop(x, training=training))


def test_full_recompute_of_a_subclassed_model_equals_keras_fit(tmp_path):
    x, y = xy()

    def build():
        keras.utils.set_random_seed(0)
        model = Subclassed()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    reference, ref_steps = build(), StepLosses()
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[ref_steps])
    model, steps = build(), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["parallel.recompute=full", f"run.dir={tmp_path}"])
    assert_same(model, reference, steps, ref_steps, "subclassed")


def recomputed_calls(model, mode: str, batch, layout=("/device:CPU:0",), tp: int = 1) -> int:
    """How many ops with a custom gradient (a recomputed call is one) the traced training step holds."""
    engine = KerasModelEngine(model, load_config(None, [f"parallel.recompute={mode}", f"parallel.tp={tp}"]),
                              Mesh.from_devices(list(layout), 1, 1, tp), batch)
    graph = engine._train_fn.get_concrete_function(*[tf.nest.map_structure(tf.constant, t) if t is not None
                                                     else None for t in batch]).graph
    return sum(1 for op in graph.get_operations() if "_gradient_op_type" in op.node_def.attr)


def test_selective_recomputes_each_shard_core_of_parallel_self_attention():
    """Two ParallelSelfAttention layers cut tp=2: four attention cores, each one recomputed
    call; nothing else is."""
    from phalanx.layers import ParallelSelfAttention

    def model():
        keras.utils.set_random_seed(0)
        x = inputs = keras.Input((8, 16))
        for _ in range(2):
            x = x + ParallelSelfAttention(num_heads=2, head_dim=8, tp=2, dropout=0.1)(x)
        m = keras.Model(inputs, x)
        m.compile(optimizer="sgd", loss="mse")
        return m

    rng = np.random.default_rng(0)
    batch = (rng.normal(size=(4, 8, 16)).astype("float32"), rng.normal(size=(4, 8, 16)).astype("float32"), None)
    devices = ("/device:CPU:0", "/device:CPU:1")
    # (the layers' own ops hold custom gradients too: counted the same in both)
    none = recomputed_calls(model(), "none", batch, devices, tp=2)
    assert recomputed_calls(model(), "selective", batch, devices, tp=2) - none == 4


def gpt2(dropout: float):
    """A small keras-hub GPT-2 causal LM compiled with SGD."""
    keras.utils.set_random_seed(1)
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=16, dropout=dropout)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_of_keras_hub_gpt2_with_dropout_equals_keras_fit(mode, tmp_path):
    """One device: GPT-2's attention is Keras's MultiHeadAttention with attention dropout, whose
    masks the recomputation must draw again from the same seed state."""
    x, y = data()
    reference, ref_steps = gpt2(0.1), StepLosses()
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[ref_steps])
    model, steps = gpt2(0.1), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[steps],
                overrides=[f"parallel.recompute={mode}", f"run.dir={tmp_path}"])
    assert_same(model, reference, steps, ref_steps, mode)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_of_keras_hub_llama_equals_keras_fit(mode, keras_fit_of, tmp_path):
    """Llama at tp=1, one device: ``full`` cuts the opened backbone into blocks of its decoder
    layers, ``selective`` recomputes Llama's own attention layer (its _compute_attention: one
    recomputed call per block in the traced step). Keras's numbers (Adam over 2 steps, epsilon
    1e-4 on both sides: the bound of the keras-hub tests, test_keras_hub.build)."""
    x, y = data()
    if mode == "selective":
        assert recomputed_calls(build("llama"), "selective", (x, y, None)) - \
            recomputed_calls(build("llama"), "none", (x, y, None)) == 2
    else:  # the blocks of the cut stage: more than one recomputed call, each a custom gradient
        assert recomputed_calls(build("llama"), "full", (x, y, None)) - \
            recomputed_calls(build("llama"), "none", (x, y, None)) >= 2
    reference, ref_steps, _ = keras_fit_of("llama", epochs=1)
    model, steps = build("llama"), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[steps],
                overrides=[f"parallel.recompute={mode}", f"run.dir={tmp_path}"])
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4)
    for mine, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=mine.path)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_of_tensor_parallel_gpt2_equals_keras_fit(mode, keras_fit_of, tmp_path):
    """tp2 x pp2 with two micro-batches: the preset's ParallelSelfAttention (selective: its
    per-shard cores) and the blocks of each pipeline stage (full), as Keras's one-device fit."""
    x, y = data()
    reference, ref_steps, _ = keras_fit_of("gpt2", epochs=1)
    model, steps = build("gpt2"), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[steps],
                overrides=["parallel.devices=cpu:4", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2",
                           f"parallel.recompute={mode}", f"run.dir={tmp_path}"])
    # Adam (epsilon 1e-4 on both sides: test_keras_hub.build), one epoch of 2 steps, and the tp layout's
    # reordered sums: the bound of the tp tests
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4, err_msg=mode)
    phalanx.unparallelize(model)
    for mine, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"{mode} {mine.path}")


@pytest.mark.parametrize("kind,layout,mode", [
    ("gpt2", "pp2m4", "selective"), ("llama", "accum2", "full"),
    pytest.param("gpt2", "pp2m4", "full", marks=pytest.mark.slow),
    pytest.param("llama", "accum2", "selective", marks=pytest.mark.slow)])
def test_recompute_of_keras_hub_inside_stage_calls_equals_keras_fit(kind, layout, mode, tmp_path):
    """GPT-2 cut into 2 stages with 4 micro-batches, Llama with 2 accumulation steps: each stage
    a traced call, whose backward re-runs the blocks (full) or the attention cores (selective)
    inside it. No BatchNormalization or dropout: Keras's fit of the whole batch is the oracle
    (Adam, epsilon 1e-4, at the bounds of test_keras_hub)."""
    x, y = data()
    reference, ref_steps = build(kind), StepLosses()
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[ref_steps])
    model, steps = build(kind), StepLosses()
    phalanx.fit(model, x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[steps],
                overrides=CALL_LAYOUTS[layout][0] + [f"parallel.recompute={mode}", f"run.dir={tmp_path}"])
    assert_called(model, f"{kind} {layout} {mode}")
    np.testing.assert_allclose(steps.losses, ref_steps.losses, rtol=1e-4, err_msg=mode)
    for mine, want in zip(model.weights, reference.weights):
        np.testing.assert_allclose(mine.numpy(), want.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"{mode} {mine.path}")


# -- measured memory ----------------------------------------------------------------------------------


def step_peak(model, mode: str, batch, accum: int = 1) -> float:
    """Bytes the allocator's peak rose above what was allocated before one training step (the
    least of three steps, after the step was built), on one logical device. ``accum > 1``: the
    batch in that many accumulation steps, the stage then a traced call (checked)."""
    engine = KerasModelEngine(model, load_config(None, [f"parallel.recompute={mode}", f"train.grad_accum={accum}"]),
                              Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), batch)
    assert (engine.stage_calls is not None) == (accum > 1)
    batch = tuple(None if t is None else tf.nest.map_structure(tf.constant, t) for t in batch)
    engine.train_step(batch)
    if accum > 1:
        assert engine.stage_calls.traced == 1 and not engine.stage_calls.inline
    peaks = []
    for _ in range(3):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        float(engine.train_step(batch)["loss"])
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return float(min(peaks))


@pytest.mark.memory_peak
@pytest.mark.parametrize("accum", [1, 2], ids=["inline", "called"])
def test_full_recompute_lowers_the_activation_peak_of_a_deep_mlp(accum):
    """32 Dense layers on 2048 rows (a micro-batch): each keeps a 2 MiB activation for the
    backward without recomputation (~64 MiB); with it the forward keeps ~6 block inputs and the
    backward one block's activations (measured ~26 MiB against ~68 MiB). With two accumulation
    steps the stage is a traced call whose backward re-runs its blocks, one at a time: measured
    41 MiB against 84 MiB (the call's backward holds the stage's gradients at once, beside the
    carried sums)."""
    rng = np.random.default_rng(0)
    rows = 2048 * accum
    batch = (rng.normal(size=(rows, 256)).astype("float32"), rng.normal(size=(rows, 1)).astype("float32"), None)

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((256,))] + [keras.layers.Dense(256, activation="relu") for _ in range(32)]
                             + [keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return m

    none, full = step_peak(model(), "none", batch, accum), step_peak(model(), "full", batch, accum)
    assert full < 0.7 * none, f"recompute=full step peak {full / 2**20:.1f} MiB vs none {none / 2**20:.1f} MiB " \
                              f"(ratio {full / none:.2f}, bound 0.7)"


@pytest.mark.memory_peak
@pytest.mark.parametrize("accum", [1, 2], ids=["inline", "called"])
def test_selective_recompute_lowers_the_attention_peak(accum):
    """Four MultiHeadAttention blocks (4 heads, 256 tokens, attention dropout, 8 rows a
    micro-batch): each keeps its [8, 4, 256, 256] probabilities, dropout mask and dropped
    probabilities (8 MiB each) without recomputation; selective keeps the cores' inputs only.
    With two accumulation steps the stage is a traced call, the cores recomputed in its
    backward: measured 53 MiB against 100 MiB. (The call must not keep the attention scores
    that the recomputed core returns beside its output: their gradient is a zeros_like, which
    reads only their shape; kept, they gave 89 MiB.)"""
    rng = np.random.default_rng(0)
    rows = 8 * accum
    batch = (rng.normal(size=(rows, 256, 32)).astype("float32"), rng.normal(size=(rows, 256, 32)).astype("float32"),
             None)

    def model():
        keras.utils.set_random_seed(0)
        x = inputs = keras.Input((256, 32))
        for _ in range(4):
            x = x + keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, dropout=0.1)(x, x)
        m = keras.Model(inputs, x)
        m.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return m

    none, selective = step_peak(model(), "none", batch, accum), step_peak(model(), "selective", batch, accum)
    assert selective < 0.7 * none, f"recompute=selective step peak {selective / 2**20:.1f} MiB vs none " \
                                   f"{none / 2**20:.1f} MiB (ratio {selective / none:.2f}, bound 0.7)"


def test_the_docstring_examples_run():
    import doctest

    from phalanx.parallel import recompute

    assert doctest.testmod(recompute).failed == 0


@pytest.mark.memory_peak
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_selective_recompute_lowers_the_peak_of_keras_hub_attention(kind):
    """keras-hub's own attention layers (GPT-2's, a MultiHeadAttention; Llama's LlamaAttention
    with grouped-query heads): 8 blocks, 4 heads, 256 tokens, 8 rows, width 32. Without
    recomputation each block keeps its [8, 4, 256, 256] probabilities (8 MiB) and more for the
    backward; selective keeps the cores' inputs (width-32 tensors, ~0.25 MiB each) and the
    [8, 256, 256] attention masks keras-hub builds outside the core (2 MiB each), while the part
    both share (one core's backward, the logits: ~40 MiB) stays: measured ratios ~0.65 (GPT-2) and
    ~0.4 (Llama); kept probabilities would give ~1. Bound 0.75."""
    import keras_hub

    keras.utils.set_random_seed(0)
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=8, num_heads=4, hidden_dim=32,
                                                 intermediate_dim=64, max_sequence_length=256, dropout=0.0)
        lm = keras_hub.models.GPT2CausalLM
    else:
        backbone = keras_hub.models.LlamaBackbone(vocabulary_size=64, num_layers=8, num_query_heads=4,
                                                  num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
        lm = keras_hub.models.LlamaCausalLM
    weights = backbone.get_weights()

    def model():
        m = lm(backbone=backbone, preprocessor=None)
        backbone.set_weights(weights)
        m.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    tokens = np.random.default_rng(0).integers(0, 64, (8, 257)).astype("int32")
    batch = ({"token_ids": tokens[:, :-1], "padding_mask": np.ones((8, 256), "int32")}, tokens[:, 1:], None)
    none, selective = step_peak(model(), "none", batch), step_peak(model(), "selective", batch)
    print(f"{kind} step peak: selective {selective / 2**20:.1f} MiB, none {none / 2**20:.1f} MiB")
    assert selective < 0.75 * none, f"{kind} recompute=selective step peak {selective / 2**20:.1f} MiB vs none " \
                                    f"{none / 2**20:.1f} MiB (ratio {selective / none:.2f}, bound 0.75)"
