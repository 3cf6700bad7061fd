"""The built-in GPT's layouts against single-device training, on 8 logical CPUs (tests/conftest.py).

Every layout runs three float32 AdamW steps on a tiny GPT on the engine ``phalanx train``
builds for it (the Keras-model engine, through the factory) and must reproduce the losses,
gradient norms and final weights of Keras's own one-device ``train_on_batch`` of the same Keras
model with the same optimizer (tests/gpt_oracle.py: no phalanx engine in it). Checkpoints move
between layouts. Engines are traced once and shared between tests (tracing dominates the run
time). The pipeline executor's 1F1B order is tested on its own in tests/test_pipeline_order.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gpt_oracle
from phalanx.config import Config, ConfigError
from phalanx.mesh import Mesh
from phalanx import checkpoint
from phalanx.engines.factory import make_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.parallel.partition import partition

from helpers import ADAM_EPS

STEPS, MORE = 3, 2
MODEL = dict(layers=4, d_model=32, heads=4, ffn=64, vocab=256, seq_len=16)
# AdamW with train.eps=ADAM_EPS (1e-4; default 1e-8): Adam normalises each element's gradient, and
# with a tiny eps an element whose true gradient is ~0 (a cancellation sum, e.g. the key bias) turns
# float round-off into a step of up to lr either way, on one CPU and not on another. With eps 1e-4 a
# gradient round-off d (~1e-7) moves a step by at most ~2 x lr x d / eps = 2e-6, 6e-6 in the STEPS
# compared (derivation: tests/helpers.py ADAM_EPS), 8x inside atol 5e-5; a wrong gradient moves
# weights by ~lr = 1e-3 per step, so 5e-5 still catches every real bug.
W_RTOL, W_ATOL = 1e-4, 5e-5


def make_cfg(layers: int = 4, **parallel) -> Config:
    return Config().replace(model={**MODEL, "layers": layers},
                            train={"global_batch": 8, "warmup": 1, "steps": 10, "lr": 1e-3, "eps": ADAM_EPS}, parallel=parallel)


def batches(n: int, rows: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, size=(rows, 17)).astype(np.int32) for _ in range(n)]


def mesh_of(devices, dp=1, pp=1, tp=1) -> Mesh:
    return Mesh.from_devices(devices[: dp * pp * tp], dp, pp, tp)


@pytest.fixture(scope="module")
def reference():
    """Keras's one-device train_on_batch per depth: losses and gradient norms of STEPS + MORE
    steps, weights after STEPS."""
    cache = {}

    def get(layers):
        if layers not in cache:
            cache[layers] = gpt_oracle.run(make_cfg(layers), batches(STEPS + MORE), weights_after=STEPS)
        return cache[layers]

    return get


# Tracing dominates the run time and grows with layers x micro-batches, so each layout
# gets the fewest layers its pipeline needs (pp x virtual_stages chunks).
LAYOUTS = {  # id: (dp, tp, pp, layers, extra parallel keys)
    "dp2": (2, 1, 1, 2, {}),
    "tp2": (1, 2, 1, 2, {}),
    "tp4": (1, 4, 1, 2, {}),
    "pp2-gpipe": (1, 1, 2, 2, {"schedule": "gpipe", "microbatches": 2}),
    "pp4-1f1b": (1, 1, 4, 4, {"schedule": "1f1b", "microbatches": 4}),
    "pp4-interleaved": (1, 1, 4, 8, {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 4}),
    "dp2-tp2-pp2-1f1b": (2, 2, 2, 2, {"schedule": "1f1b", "microbatches": 2}),
    "dp2-pp4-1f1b-zero1": (2, 1, 4, 4, {"schedule": "1f1b", "microbatches": 2, "zero": 1}),
}


def _trained_fixture(devices, build):
    cache = {}

    def get(name):
        if name not in cache:
            dp, tp, pp, layers, extra = LAYOUTS[name]
            cfg = make_cfg(layers, dp=dp, tp=tp, pp=pp, **extra)
            engine = build(cfg, mesh_of(devices, dp, pp, tp))
            outs = [engine.train_step(b) for b in batches(STEPS)]
            cache[name] = (engine, [float(o["loss"]) for o in outs], [float(o["grad_norm"]) for o in outs], layers)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def trained(devices):
    """Each layout's engine, as phalanx train routes it, after STEPS steps, with its losses
    (built lazily, once)."""
    return _trained_fixture(devices, lambda cfg, mesh: make_engine(cfg.model, mesh, cfg))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(name, trained, reference):
    engine, losses, norms, layers = trained(name)
    assert isinstance(engine, KerasGPTEngine)  # phalanx train's engine for every layout here
    ref_losses, ref_norms, ref_weights = reference(layers)
    np.testing.assert_allclose(losses, ref_losses[:STEPS], rtol=1e-4, atol=1e-5)
    # the global gradient norm of each step: every gradient summed over shards, stages and
    # micro-batches in another order than the one-device step (float32 round-off, ~1e-6)
    np.testing.assert_allclose(norms, ref_norms[:STEPS], rtol=1e-4)
    weights = engine.weights()
    assert set(weights) == set(ref_weights)
    for n, w in weights.items():
        np.testing.assert_allclose(w, ref_weights[n], rtol=W_RTOL, atol=W_ATOL, err_msg=n)


def test_checkpoint_moves_between_layouts(trained, reference, devices, tmp_path):
    """The state at dp2-tp2-pp2 continues with the single-device losses at dp1 (whole tensors,
    state_dict) and at dp4 with ZeRO-1 (the per-device checkpoint: moments cut into slices on load)."""
    engine, _, _, layers = trained("dp2-tp2-pp2-1f1b")
    state = engine.state_dict()
    ref_losses, _, ref_weights = reference(layers)
    assert int(state["optimizer/step"]) == STEPS
    for n, w in ref_weights.items():
        np.testing.assert_allclose(state[n], w, rtol=W_RTOL, atol=W_ATOL)
    saved = checkpoint.save(tmp_path, STEPS, checkpoint.state_of(engine))
    more = batches(STEPS + MORE)[STEPS:]
    for dp, zero in ((1, 0), (4, 1)):
        cfg = make_cfg(layers, dp=dp, zero=zero)
        target = make_engine(cfg.model, mesh_of(devices, dp=dp), cfg)
        assert isinstance(target, KerasGPTEngine)
        if zero:
            checkpoint.load_into(target, checkpoint.restore(saved))
        else:
            target.load_state_dict(state)
        losses = [float(target.train_step(b)["loss"]) for b in more]
        np.testing.assert_allclose(losses, ref_losses[STEPS:], rtol=1e-4, atol=1e-5)
        again = target.state_dict()
        assert int(again["optimizer/step"]) == STEPS + MORE
    with pytest.raises(KeyError, match="lacks"):
        target.load_state_dict({k: v for k, v in state.items() if not k.startswith("optimizer/m/")})


#: a checkpoint the mesh engine wrote at dp2 x tp2 with ZeRO-1 (tests/data/mesh_checkpoint/README.md)
MESH_CHECKPOINT = Path(__file__).parent / "data" / "mesh_checkpoint" / "step-00000002"


@pytest.mark.parametrize("dp, tp", [(1, 1), (1, 2)])
def test_a_mesh_engine_checkpoint_resumes_on_the_engine_phalanx_train_builds(devices, dp, tp):
    """The mesh engine's per-device slices (its ZeRO-1 moment pieces included) restore into the
    engine phalanx train builds now, in another layout: every tensor as written, and the next
    step's loss is Keras's own one-device loss of the restored weights."""
    restored = checkpoint.restore(MESH_CHECKPOINT)
    assert restored.meta["engine"] == "MeshEngine" and restored.step == 2
    cfg = Config().replace(model=dict(layers=2, d_model=16, heads=2, ffn=32, vocab=256, seq_len=8),
                           train={"global_batch": 4, "warmup": 1, "steps": 10, "lr": 1e-2},
                           precision={"policy": "float32"}, parallel={"dp": dp, "tp": tp})
    target = make_engine(cfg.model, mesh_of(devices, dp=dp, tp=tp), cfg)
    assert isinstance(target, KerasGPTEngine)
    checkpoint.load_into(target, restored)
    state = target.state_dict()
    assert set(state) == set(restored.tensors)
    for name in state:
        np.testing.assert_array_equal(state[name], restored.tensors[name], err_msg=name)
    batch = np.random.default_rng(5).integers(0, 256, (4, 9)).astype(np.int32)
    oracle = gpt_oracle.KerasGPT(cfg)
    oracle.load_weights({n: restored.tensors[n] for n in oracle.weights()})
    want = oracle.eval_loss(batch)
    out = target.train_step(batch)
    np.testing.assert_allclose(float(out["loss"]), want, rtol=1e-5)
    assert int(target.state_dict()["optimizer/step"]) == 3


# -- small pieces -----------------------------------------------------------------------


def test_partition_balances_cost_with_embedding_and_head():
    assert partition([1.0] * 4, 2) == [(0, 2), (2, 4)]
    assert partition([1.0] * 4, 2, last_extra=2.0) == [(0, 3), (3, 4)]
    assert partition([1.0] * 8, 4, first_extra=1.0, last_extra=1.0)[0] == (0, 1)
    with pytest.raises(ValueError, match="non-empty"):
        partition([1.0] * 3, 4)


def test_errors_name_the_key(devices):
    cfg = make_cfg(tp=1)
    with pytest.raises(ConfigError, match="parallel.tp"):  # 4 heads do not split over 8 tensor ranks
        make_engine(cfg.model, mesh_of(devices, tp=8), cfg)
    with pytest.raises(ConfigError, match="model"):
        make_engine(make_cfg(layers=2).model, mesh_of(devices), cfg)
    engine = make_engine(cfg.model, mesh_of(devices), cfg)
    assert engine.num_params() == sum(int(np.prod(w.shape)) for w in engine.weights().values())


# -- composition with accumulation and mixed precision ------------------------------------


def test_composes_with_grad_accum_and_bfloat16(devices):
    cfg = Config().replace(model={**MODEL, "layers": 2}, precision={"policy": "mixed_bfloat16"},
                           train={"global_batch": 8, "grad_accum": 2, "warmup": 1},
                           parallel={"tp": 2, "pp": 2, "microbatches": 2})
    ref = gpt_oracle.KerasGPT(cfg, "mixed_bfloat16")  # Keras's one-device step on the whole batch
    engine = make_engine(cfg.model, mesh_of(devices, pp=2, tp=2), cfg)
    assert isinstance(engine, KerasGPTEngine)
    for b in batches(2):
        want, got = ref.train_step(b), engine.train_step(b)
        # bfloat16 keeps 8 bits of mantissa: agreement to ~1e-2 is all that rounding allows.
        np.testing.assert_allclose(float(got["loss"]), want["loss"], rtol=1e-2)
        np.testing.assert_allclose(float(got["grad_norm"]), want["grad_norm"], rtol=5e-2)
        assert float(got["skipped"]) == 0.0
    assert float(engine.eval_step(batches(1)[0])) == pytest.approx(ref.eval_loss(batches(1)[0]), rel=1e-2)


def test_float16_overflow_skips_the_step_on_every_shard(devices):
    cfg = Config().replace(model={**MODEL, "layers": 1}, train={"global_batch": 8, "warmup": 1},
                           precision={"policy": "mixed_float16", "loss_scale_init": 2.0 ** 40},
                           parallel={"tp": 2, "dp": 2})
    engine = make_engine(cfg.model, mesh_of(devices, dp=2, tp=2), cfg)
    assert isinstance(engine, KerasGPTEngine)
    before = engine.state_dict()
    out = engine.train_step(batches(1)[0])
    assert float(out["skipped"]) == 1.0 and float(out["loss_scale"]) == 2.0 ** 40
    after = engine.state_dict()
    assert float(after["loss_scale/scale"]) == 2.0 ** 39 and int(after["loss_scale/skipped"]) == 1
    assert int(after["optimizer/step"]) == 0
    for name in engine.weights():
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
        np.testing.assert_array_equal(after[f"optimizer/m/{name}"], 0.0)
