"""The built-in GPT's layouts against single-device training, on 8 logical CPUs (tests/conftest.py).

Every layout runs three float32 AdamW steps on a tiny GPT on the engine ``phalanx train``
builds for it (the Keras-model engine) and must reproduce the single-device StrategyEngine's
losses and final weights (separate code: tf.distribute's step on one device). The mesh engine's
own pieces (its 1F1B order, ZeRO shards, gradients, recomputation) are checked on the mesh
engine, and checkpoints move between the two. Engines are traced once and shared between
tests (tracing dominates the run time).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from phalanx.config import Config, ConfigError
from phalanx.mesh import Mesh
from phalanx import checkpoint
from phalanx.engines.factory import make_engine, make_mesh_engine, needs_mesh_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines.mesh import MeshEngine
from phalanx.parallel.partition import partition
from phalanx.parallel.pipeline import check_graph_order
from phalanx.parallel.trace import executed_order, measured_bubble, profile_actions
from phalanx.parallel.schedules import peak_in_flight
from phalanx.engines.strategy import StrategyEngine
from phalanx.engines.task import GPTTask

STEPS, MORE = 3, 2
MODEL = dict(layers=4, d_model=32, heads=4, ffn=64, vocab=256, seq_len=16)
# Adam normalises each element's gradient, so an element whose true gradient is ~0
# (a cancellation sum, e.g. the key bias) moves by float noise x lr. A wrong
# gradient moves weights by ~lr = 1e-3 per step: 5e-5 still catches every real bug.
W_RTOL, W_ATOL = 1e-4, 5e-5


def make_cfg(layers: int = 4, **parallel) -> Config:
    return Config().replace(model={**MODEL, "layers": layers},
                            train={"global_batch": 8, "warmup": 1, "steps": 10, "lr": 1e-3}, parallel=parallel)


def batches(n: int, rows: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 256, size=(rows, 17)).astype(np.int32) for _ in range(n)]


def mesh_of(devices, dp=1, pp=1, tp=1) -> Mesh:
    return Mesh.from_devices(devices[: dp * pp * tp], dp, pp, tp)


@pytest.fixture(scope="module")
def reference():
    """Single-device StrategyEngine per depth: losses of STEPS + MORE steps, weights after STEPS."""
    cache = {}

    def get(layers):
        if layers not in cache:
            cfg = make_cfg(layers)
            engine = StrategyEngine(cfg, GPTTask(cfg.model))
            data = batches(STEPS + MORE)
            losses = [float(engine.train_step(b)["loss"]) for b in data[:STEPS]]
            weights = engine.weights()
            losses += [float(engine.train_step(b)["loss"]) for b in data[STEPS:]]
            cache[layers] = (losses, weights)
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
            losses = [float(engine.train_step(b)["loss"]) for b in batches(STEPS)]
            cache[name] = (engine, losses, layers)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def trained(devices):
    """Each layout's engine, as phalanx train routes it, after STEPS steps, with its losses
    (built lazily, once)."""
    return _trained_fixture(devices, lambda cfg, mesh: make_engine(cfg.model, mesh, cfg))


@pytest.fixture(scope="module")
def mesh_trained(devices):
    """The same on the mesh engine (for its own pieces)."""
    return _trained_fixture(devices, lambda cfg, mesh: MeshEngine(cfg, mesh, GPTTask(cfg.model)))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(name, trained, reference):
    engine, losses, layers = trained(name)
    assert isinstance(engine, KerasGPTEngine)  # phalanx train's engine for every layout here
    ref_losses, ref_weights = reference(layers)
    np.testing.assert_allclose(losses, ref_losses[:STEPS], rtol=1e-4, atol=1e-5)
    weights = engine.weights()
    assert set(weights) == set(ref_weights)
    for n, w in weights.items():
        np.testing.assert_allclose(w, ref_weights[n], rtol=W_RTOL, atol=W_ATOL, err_msg=n)


def test_gradients_match_single_device(mesh_trained):
    engine, _, layers = mesh_trained("tp4")
    cfg = make_cfg(layers)
    ref = StrategyEngine(cfg, GPTTask(cfg.model))
    ref.load_state_dict(engine.state_dict())
    batch = batches(1)[0]
    want, got = ref.gradients(batch), engine.gradients(batch)
    assert set(got) == set(want)
    for n, g in got.items():
        np.testing.assert_allclose(g, want[n], rtol=1e-4, atol=1e-7, err_msg=n)


def test_1f1b_runs_in_1f1b_order(mesh_trained):
    engine, _, _ = mesh_trained("pp4-1f1b")
    trace = engine.traces[0]
    expected = [[str(a) for a in rank] for rank in engine.schedule.per_stage]
    assert trace.order == expected
    # 1F1B, not GPipe: rank r never holds more than pp - r micro-batches.
    assert peak_in_flight(engine.schedule) == [4, 3, 2, 1]
    for r, order in enumerate(trace.order):
        held = peak = 0
        for a in order:
            held += 1 if a.startswith("F") else -1
            peak = max(peak, held)
        assert peak == engine.pp - r
    assert trace.order[1] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    # The traced graph makes every action wait for its predecessor on the same rank.
    graph = engine._train_fn.get_concrete_function(tf.TensorSpec([8, 17], tf.int32)).graph
    assert check_graph_order(graph, trace) > 0


def test_1f1b_order_at_run_time_from_the_profiler(mesh_trained, tmp_path):
    """The TensorFlow executor's own record (profiler trace) shows the 1F1B order per rank."""
    engine, _, _ = mesh_trained("pp4-1f1b")
    tf.profiler.experimental.start(str(tmp_path))
    try:
        engine.train_step(batches(1)[0])
    finally:
        tf.profiler.experimental.stop()
    actions = profile_actions(str(tmp_path))
    expected = [[str(a) for a in rank] for rank in engine.schedule.per_stage]
    assert executed_order(actions, engine.pp) == expected
    assert 0.0 <= measured_bubble(actions, engine.pp) < 1.0


def test_graph_order_check_detects_a_missing_dependency(mesh_trained):
    engine, _, _ = mesh_trained("pp4-1f1b")
    trace = engine.traces[0]
    graph = engine._train_fn.get_concrete_function(tf.TensorSpec([8, 17], tf.int32)).graph
    broken = type(trace)(order=trace.order, scopes=trace.scopes, markers=trace.markers,
                         ops=[list(o) for o in trace.ops])
    broken.ops[0][1], broken.ops[0][2] = broken.ops[0][2], broken.ops[0][1]  # F2 claims to follow F0
    with pytest.raises(AssertionError, match="does not wait"):
        check_graph_order(graph, broken)


def test_zero1_shards_optimizer_state_over_data(mesh_trained):
    engine, _, _ = mesh_trained("dp2-pp4-1f1b-zero1")
    opt = engine.optimizer
    per_device = opt.state_bytes_per_device()
    assert len(per_device) == 8
    # m and v, float32: what one unsharded replica would hold on each device
    unsharded: dict[str, int] = {}
    for g in opt.groups:
        for dev in g.devices:
            unsharded[dev] = unsharded.get(dev, 0) + 2 * 4 * g.total
    assert sum(2 * 4 * g.total for g in opt.groups) == 2 * 4 * engine.num_params()
    assert sorted(per_device) == sorted(unsharded)
    for dev, nbytes in per_device.items():
        assert nbytes == unsharded[dev] // engine.dp, dev


def test_checkpoint_moves_between_layouts(trained, reference, devices):
    """state_dict at dp2-tp2-pp2 continues with the single-device losses at dp1 and at dp4."""
    engine, _, layers = trained("dp2-tp2-pp2-1f1b")
    state = engine.state_dict()
    ref_losses, ref_weights = reference(layers)
    assert int(state["optimizer/step"]) == STEPS
    for n, w in ref_weights.items():
        np.testing.assert_allclose(state[n], w, rtol=W_RTOL, atol=W_ATOL)
    more = batches(STEPS + MORE)[STEPS:]
    for dp, zero in ((1, 0), (4, 2)):  # dp4 with ZeRO-2: states split on load, grads reduce-scattered
        cfg = make_cfg(layers, dp=dp, zero=zero)
        target = MeshEngine(cfg, mesh_of(devices, dp=dp), GPTTask(cfg.model))
        target.load_state_dict(state)
        losses = [float(target.train_step(b)["loss"]) for b in more]
        np.testing.assert_allclose(losses, ref_losses[STEPS:], rtol=1e-4, atol=1e-5)
        again = target.state_dict()
        assert int(again["optimizer/step"]) == STEPS + MORE
    with pytest.raises(KeyError, match="lacks"):
        target.load_state_dict({k: v for k, v in state.items() if not k.startswith("optimizer/m/")})


def test_a_mesh_engine_checkpoint_resumes_on_the_keras_model_engine(mesh_trained, reference, devices, tmp_path):
    """A checkpoint the mesh engine wrote (its per-device slices by logical name) restores into
    the engine phalanx train now builds, in another layout, which continues with the
    single-device losses; and the Keras-model engine's own per-device checkpoint goes back."""
    engine, _, layers = mesh_trained("tp4")  # (no other test steps it)
    ref_losses, _ = reference(layers)
    saved = checkpoint.save(tmp_path / "mesh", STEPS, checkpoint.state_of(engine))
    more = batches(STEPS + MORE)[STEPS:]
    cfg = make_cfg(layers, dp=2, tp=2)
    target = make_engine(cfg.model, mesh_of(devices, dp=2, tp=2), cfg)
    assert isinstance(target, KerasGPTEngine)
    checkpoint.load_into(target, checkpoint.restore(saved))
    assert int(target.state_dict()["optimizer/step"]) == STEPS
    losses = [float(target.train_step(b)["loss"]) for b in more[:1]]
    np.testing.assert_allclose(losses, ref_losses[STEPS:STEPS + 1], rtol=1e-4, atol=1e-5)
    # its own checkpoint: one shard set per device, the tensor-parallel parts by box
    again = checkpoint.save(tmp_path / "keras", STEPS + 1, checkpoint.state_of(target))
    checkpoint.verify(again)
    back = MeshEngine(make_cfg(layers), mesh_of(devices), GPTTask(cfg.model))
    checkpoint.load_into(back, checkpoint.restore(again))
    losses.append(float(back.train_step(more[1])["loss"]))
    np.testing.assert_allclose(losses, ref_losses[STEPS:], rtol=1e-4, atol=1e-5)


@pytest.mark.memory_peak
def test_recompute_lowers_peak_memory_and_keeps_the_math(devices):
    # Long sequences, thin layers: the [batch, heads, seq, seq] attention tensors dominate.
    cfg_kw = dict(layers=6, d_model=32, heads=4, ffn=64, vocab=256, seq_len=256)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, size=(8, 257)).astype(np.int32)
    peaks, losses = {}, {}
    for mode in ("none", "full", "selective"):
        cfg = Config().replace(model=cfg_kw, train={"global_batch": 8, "warmup": 1}, parallel={"recompute": mode})
        engine = MeshEngine(cfg, mesh_of(devices), GPTTask(cfg.model))
        engine.train_step(batch)  # trace and warm up outside the measurement
        tf.config.experimental.reset_memory_stats("CPU:0")
        losses[mode] = float(engine.eval_step(batch))
        engine.train_step(batch)
        peaks[mode] = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print("recompute: allocator peaks", peaks, "full/none", peaks["full"] / peaks["none"])
    assert peaks["full"] < 0.7 * peaks["none"], peaks
    assert peaks["selective"] < peaks["none"], peaks
    np.testing.assert_allclose(losses["full"], losses["none"], rtol=1e-5)
    np.testing.assert_allclose(losses["selective"], losses["none"], rtol=1e-5)


# -- small pieces -----------------------------------------------------------------------


def test_partition_balances_cost_with_embedding_and_head():
    assert partition([1.0] * 4, 2) == [(0, 2), (2, 4)]
    assert partition([1.0] * 4, 2, last_extra=2.0) == [(0, 3), (3, 4)]
    assert partition([1.0] * 8, 4, first_extra=1.0, last_extra=1.0)[0] == (0, 1)
    with pytest.raises(ValueError, match="non-empty"):
        partition([1.0] * 3, 4)


def test_errors_name_the_key(devices):
    cfg = make_cfg(tp=1)
    with pytest.raises(ConfigError, match="parallel.tp"):
        MeshEngine(cfg, mesh_of(devices, tp=8), GPTTask(cfg.model))
    # ZeRO-2/3 and recomputation run on the Keras-model engine, as dp and pp do
    assert not needs_mesh_engine(make_cfg(recompute="full")) and not needs_mesh_engine(make_cfg(pp=2, microbatches=2))
    assert not needs_mesh_engine(make_cfg(dp=2)) and not needs_mesh_engine(make_cfg(dp=2, zero=3))
    with pytest.raises(TypeError, match="takes a GPTTask"):
        make_mesh_engine(cfg, mesh_of(devices), object())
    engine = make_engine(cfg.model, mesh_of(devices), cfg)
    assert engine.num_params() == sum(int(np.prod(w.shape)) for w in engine.weights().values())


# -- composition with accumulation and mixed precision ------------------------------------


def test_composes_with_grad_accum_and_bfloat16(devices):
    cfg = Config().replace(model={**MODEL, "layers": 2}, precision={"policy": "mixed_bfloat16"},
                           train={"global_batch": 8, "grad_accum": 2, "warmup": 1},
                           parallel={"tp": 2, "pp": 2, "microbatches": 2})
    ref = StrategyEngine(cfg, GPTTask(cfg.model, "mixed_bfloat16"))
    engine = make_engine(cfg.model, mesh_of(devices, pp=2, tp=2), cfg)
    assert isinstance(engine, KerasGPTEngine)
    for b in batches(2):
        want, got = ref.train_step(b), engine.train_step(b)
        # bfloat16 keeps 8 bits of mantissa: agreement to ~1e-2 is all that rounding allows.
        np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-2)
        np.testing.assert_allclose(float(got["grad_norm"]), float(want["grad_norm"]), rtol=5e-2)
        assert float(got["skipped"]) == 0.0
    assert float(engine.eval_step(batches(1)[0])) == pytest.approx(float(ref.eval_step(batches(1)[0])), rel=1e-2)


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
