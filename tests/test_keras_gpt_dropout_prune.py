"""Dropout and pruning of the built-in GPT on the engine ``phalanx train`` builds for it (the
Keras-model engine, ``engines/keras_gpt.py``), on every layout.

Oracle: Keras's own one-device ``train_on_batch`` of the same Keras GPT model
(:func:`phalanx.models.transformer.gpt` at tp=1, the built-in initial weights, phalanx's AdamW
as its Keras optimizer). Its positional dropout layers then draw their masks from the rows
``0..B-1`` of the one call and the calls made so far: that is the definition every layout must
reproduce. Pruning's oracle is the whole-tensor mask rule (:func:`phalanx.prune.compute_masks`).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from helpers import assert_same_run as same_run
from phalanx import checkpoint, prune
from phalanx.config import Config
from phalanx.engines.factory import build_engine
from phalanx.engines.keras_gpt import KerasGPTEngine, PhalanxAdamW
from phalanx.engines.task import GPTTask
from phalanx.models import gpt, transformer

STEPS = 3
MODEL = dict(layers=2, d_model=32, heads=4, ffn=64, vocab=256, seq_len=16)
# float32 throughout. Losses: the same sums in another order (micro-batches, tensor shards)
# agree to ~1e-6 relative; a wrong mask moves a loss by ~1e-3. Weights: AdamW normalises each
# element's gradient, so an element whose gradient is ~0 moves by float noise x lr (up to ~3e-5
# after 3 steps at lr 1e-3), while a wrong gradient or mask moves it by ~lr = 1e-3 per step.
RTOL, W_ATOL = 1e-5, 5e-5


def make_cfg(dropout: float = 0.1, train: dict | None = None, layers: int = MODEL["layers"], **parallel) -> Config:
    devices = parallel.get("dp", 1) * parallel.get("tp", 1) * parallel.get("pp", 1)
    return Config().replace(model={**MODEL, "dropout": dropout, "layers": layers}, precision={"policy": "float32"},
                            train={"global_batch": 4, "warmup": 1, "steps": 10, "lr": 1e-3, **(train or {})},
                            parallel={"devices": f"cpu:{devices}", **parallel})


def batches(n: int = STEPS, rows: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size=(rows, MODEL["seq_len"] + 1)).astype(np.int32) for _ in range(n)]


def engine_of(cfg: Config) -> KerasGPTEngine:
    engine = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    assert isinstance(engine, KerasGPTEngine), type(engine)
    return engine


def train(engine, data=None) -> tuple[list[float], dict]:
    losses = [float(engine.train_step(b)["loss"]) for b in (data or batches())]
    return losses, engine.weights()


def assert_same_run(got, want):
    same_run(got, want, RTOL, W_ATOL)


def keras_model(cfg: Config):
    """The Keras GPT at tp=1 with the built-in initial weights, compiled as Keras would train it."""
    model = transformer.gpt(cfg.model, seed=cfg.train.seed, dropout_seed=cfg.train.seed)
    decays = {id(p.variable): gpt.decays(name) for name, parts in transformer.weight_parts(model).items()
              for p in parts}
    model.compile(optimizer=PhalanxAdamW(cfg, decays, "/device:CPU:0"),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
    model.optimizer.build(model.trainable_variables)  # (its apply takes every variable it was built for)
    return model


# -- dropout --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keras_run():
    """Keras's own train_on_batch, step by step, and its evaluation of the first batch."""
    cfg = make_cfg()
    model = keras_model(cfg)
    losses = [float(model.train_on_batch(b[:, :-1], b[:, 1:])) for b in batches()]
    first = batches(1)[0]
    evaluated = float(model.test_on_batch(first[:, :-1], first[:, 1:]))
    return (losses, transformer.gpt_weights(model)), evaluated


@pytest.fixture(scope="module")
def one_device(keras_run):
    engine = engine_of(make_cfg())
    run = train(engine)
    assert_same_run(run, keras_run[0])
    first = batches(1)[0]
    # evaluation drops nothing: the same loss twice, Keras's test_on_batch's
    np.testing.assert_allclose([float(engine.eval_step(first))] * 2, [float(engine.eval_step(first)), keras_run[1]],
                               rtol=RTOL)
    return run


def test_one_device_dropout_is_keras_train_on_batch(one_device):
    cfg = make_cfg(dropout=0.0)
    without = train(engine_of(cfg))[0]
    assert not np.allclose(one_device[0], without, rtol=1e-4)  # the masks change the losses


DROPOUT_LAYOUTS = {  # id: parallel / train keys
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "pp2-1f1b": dict(pp=2, microbatches=2, schedule="1f1b"),
    "pp2-gpipe-dp2": dict(dp=2, pp=2, microbatches=2, schedule="gpipe"),
    "grad_accum2": dict(train={"grad_accum": 2}),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "tp2-pp2-mb2-sp": dict(tp=2, pp=2, microbatches=2, sequence_parallel=True),
    "tp2-sp-recompute": dict(tp=2, sequence_parallel=True, recompute="full"),  # the same masks drawn again
}


@pytest.mark.parametrize("name", list(DROPOUT_LAYOUTS))
def test_dropout_layouts_match_one_device(name, one_device):
    keys = dict(DROPOUT_LAYOUTS[name])
    assert_same_run(train(engine_of(make_cfg(**keys))), one_device)


def test_interleaved_dropout_is_keras_train_on_batch():
    """The interleaved schedule (4 chunks: 4 blocks) against Keras's own train_on_batch directly."""
    model = keras_model(make_cfg(layers=4))
    want = ([float(model.train_on_batch(b[:, :-1], b[:, 1:])) for b in batches()], transformer.gpt_weights(model))
    cfg = make_cfg(layers=4, pp=2, microbatches=2, schedule="interleaved", virtual_stages=2)
    assert_same_run(train(engine_of(cfg)), want)


def test_a_resumed_dropout_run_draws_the_uninterrupted_masks(tmp_path, one_device):
    """Two steps at tp2, saved, restored on one device: the third step's loss and the weights
    after it are the uninterrupted one-device run's (the masks follow the steps run)."""
    data = batches()
    engine = engine_of(make_cfg(tp=2))
    for batch in data[:2]:
        engine.train_step(batch)
    path = checkpoint.save(tmp_path, 2, checkpoint.state_of(engine))
    resumed = engine_of(make_cfg())
    checkpoint.load_into(resumed, checkpoint.restore(path))
    assert_same_run(train(resumed, data[2:]), (one_device[0][2:], one_device[1]))


# -- pruning --------------------------------------------------------------------------------

PRUNE = {"target": 0.5, "start": 0, "end": 4, "every": 2}
PRUNE_LAYOUTS = {"one": {}, "dp2": dict(dp=2), "tp2-pp2": dict(tp=2, pp=2, microbatches=2),
                 "dp2-zero1": dict(dp=2, zero=1)}


def pruning(layout: str, pattern: str = "unstructured"):
    cfg = make_cfg(dropout=0.0, train={"prune": {**PRUNE, "pattern": pattern}}, **PRUNE_LAYOUTS[layout])
    engine = engine_of(cfg)
    return engine, prune.Pruner(cfg, engine)


def assert_masked_zero(engine, masks) -> None:
    """The masked weights and their AdamW moments are exactly zero."""
    state = engine.state_dict()
    for name, mask in masks.items():
        for key in (name, f"optimizer/m/{name}", f"optimizer/v/{name}"):
            assert np.all(state[key][mask == 0] == 0), key


def pruned_run(layout: str, pattern: str = "unstructured"):
    """6 steps with the masks updated before steps 0, 2 and 4 (sparsity 0, 0.4375, 0.5)."""
    engine, pruner = pruning(layout, pattern)
    losses = []
    for step, batch in enumerate(batches(6)):
        pruner.before_step(step)
        losses.append(float(engine.train_step(batch)["loss"]))
        assert_masked_zero(engine, pruner.whole_masks())
    return engine, pruner, losses


@pytest.fixture(scope="module")
def pruned_one_device():
    return pruned_run("one")


def test_first_masks_are_the_whole_tensor_rule_on_every_layout():
    """Before any step (the initial weights, the same on every layout) an update at sparsity
    0.4375 installs exactly compute_masks of the whole logical weights, on every layout."""
    want = None
    for layout in ("one", "tp2-pp2"):
        engine, pruner = pruning(layout)
        weights = engine.weights()
        assert pruner.before_step(2)
        got = pruner.whole_masks()
        if want is None:
            sparsity = prune.scheduled_sparsity(2, PRUNE["target"], PRUNE["start"], PRUNE["end"])
            want = prune.compute_masks({n: w for n, w in weights.items() if prune.prunable(n)}, sparsity,
                                       "unstructured")
        assert set(got) == set(want) and want
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{layout}: {name}")
        assert_masked_zero(engine, got)


@pytest.mark.parametrize("layout", ["dp2", "tp2-pp2", "dp2-zero1"])
def test_pruned_layouts_match_one_device(layout, pruned_one_device):
    ref_engine, ref_pruner, ref_losses = pruned_one_device
    engine, pruner, losses = pruned_run(layout)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    want = ref_pruner.whole_masks()
    got = pruner.whole_masks()
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    ref = ref_engine.weights()
    for name, w in engine.weights().items():
        np.testing.assert_allclose(w, ref[name], rtol=RTOL, atol=W_ATOL, err_msg=name)


def test_sparsity_reaches_the_target_and_pruned_weights_are_zero(pruned_one_device):
    engine, pruner, _ = pruned_one_device
    weights = engine.weights()
    for name, mask in pruner.whole_masks().items():
        assert (mask == 0).mean() == pytest.approx(PRUNE["target"], abs=1e-3), name
        assert np.all(weights[name][mask == 0] == 0), name
    assert pruner.sparsity() == pytest.approx(PRUNE["target"], abs=1e-3)
    assert not np.any(weights["embed/tokens"] == 0) and not np.any(weights["block_0/ln1/gamma"] == 0)


def test_2_4_pattern_on_tp2_pp2():
    engine, pruner = pruning("tp2-pp2", "2:4")
    for step, batch in enumerate(batches(5)):
        pruner.before_step(step)
        engine.train_step(batch)
    for name, w in engine.weights().items():
        if prune.prunable(name):
            groups = np.moveaxis(w, -2, -1).reshape(-1, 4)  # 4 consecutive along the input dimension
            assert np.all((groups == 0).sum(axis=1) == 2), name


def test_masks_survive_a_checkpoint_resume_on_another_layout(tmp_path, pruned_one_device):
    """tp2 x pp2 stopped after 3 steps (between the updates before steps 2 and 4), saved, resumed
    on one device: the masks are the saved ones, and steps 3-5 give the uninterrupted one-device
    run's losses, masks and weights."""
    ref_engine, ref_pruner, ref_losses = pruned_one_device
    data = batches(6)
    engine, pruner = pruning("tp2-pp2")
    for step in range(3):
        pruner.before_step(step)
        engine.train_step(data[step])
    saved = pruner.whole_masks()
    sets = checkpoint.state_of(engine)
    mask_slots = [slot for s in sets for slot in s.slots if slot.name.startswith(prune.MASK_PREFIX)]
    assert mask_slots and all(slot.optional for slot in mask_slots)
    path = checkpoint.save(tmp_path, 3, sets)

    resumed, pruner = pruning("one")
    checkpoint.load_into(resumed, checkpoint.restore(path))
    got = pruner.whole_masks()
    assert set(got) == set(saved) and all((m == 0).any() for m in got.values())
    for name in saved:
        np.testing.assert_array_equal(got[name], saved[name], err_msg=name)
    losses = []
    for step in range(3, 6):
        pruner.before_step(step)
        losses.append(float(resumed.train_step(data[step])["loss"]))
        assert_masked_zero(resumed, pruner.whole_masks())
    np.testing.assert_allclose(losses, ref_losses[3:], rtol=RTOL)
    want = ref_pruner.whole_masks()
    for name, mask in pruner.whole_masks().items():
        np.testing.assert_array_equal(mask, want[name], err_msg=name)
    ref = ref_engine.weights()
    for name, w in resumed.weights().items():
        np.testing.assert_allclose(w, ref[name], rtol=RTOL, atol=W_ATOL, err_msg=name)
