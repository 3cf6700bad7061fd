"""The old engines' own pieces: DELETED WITH THE ENGINES (the mesh engine, the pipelined core,
its sharded parameters and ZeRO, the one-device tf.distribute engine). Nothing new goes here.

What each proves and where the one engine proves it:

* the mesh engine's gradients at tp4 (its ``gradients()``) -> tests/test_parallel.py compares
  every layout's gradient norm, loss and weights with Keras's one-device step;
* its 1F1B order (trace, graph dependencies, profiler) -> tests/test_pipeline_order.py on the
  pipeline executor the Keras-model engine runs;
* its ZeRO-1 shard bytes -> tests/test_keras_zero.py (slices of the Keras-model engine);
* a checkpoint it writes resumes on the Keras-model engine -> tests/test_parallel.py's stored
  mesh-engine checkpoint (tests/data/mesh_checkpoint);
* recomputation's peak (the row still runs on the mesh engine) -> the Keras-model engine's own
  recomputation test when the row moves (tests/test_keras_recompute.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from phalanx import checkpoint
from phalanx.checkpoint import boxes
from phalanx.config import Config
from phalanx.engines.factory import make_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines.mesh import MeshEngine
from phalanx.engines.strategy import StrategyEngine
from phalanx.engines.task import GPTTask
from phalanx.layers.sharding import Split
from phalanx.mesh import Mesh
from phalanx.parallel.params import restrict, shard_shape, split_regions
from phalanx.parallel.pipeline import check_graph_order
from phalanx.parallel.schedules import peak_in_flight
from phalanx.parallel.trace import executed_order, measured_bubble, profile_actions

# the layouts, data and Keras oracle of tests/test_parallel.py
from test_parallel import STEPS, MORE, _trained_fixture, batches, make_cfg, mesh_of, reference  # noqa: F401


@pytest.fixture(scope="module")
def mesh_trained(devices):
    """The same on the mesh engine (for its own pieces)."""
    return _trained_fixture(devices, lambda cfg, mesh: MeshEngine(cfg, mesh, GPTTask(cfg.model)))


def test_gradients_match_single_device(mesh_trained):
    engine, _, _, layers = mesh_trained("tp4")
    cfg = make_cfg(layers)
    ref = StrategyEngine(cfg, GPTTask(cfg.model))
    ref.load_state_dict(engine.state_dict())
    batch = batches(1)[0]
    want, got = ref.gradients(batch), engine.gradients(batch)
    assert set(got) == set(want)
    for n, g in got.items():
        np.testing.assert_allclose(g, want[n], rtol=1e-4, atol=1e-7, err_msg=n)


def test_1f1b_runs_in_1f1b_order(mesh_trained):
    engine, _, _, _ = mesh_trained("pp4-1f1b")
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
    engine, _, _, _ = mesh_trained("pp4-1f1b")
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
    engine, _, _, _ = mesh_trained("pp4-1f1b")
    trace = engine.traces[0]
    graph = engine._train_fn.get_concrete_function(tf.TensorSpec([8, 17], tf.int32)).graph
    broken = type(trace)(order=trace.order, scopes=trace.scopes, markers=trace.markers,
                         ops=[list(o) for o in trace.ops])
    broken.ops[0][1], broken.ops[0][2] = broken.ops[0][2], broken.ops[0][1]  # F2 claims to follow F0
    with pytest.raises(AssertionError, match="does not wait"):
        check_graph_order(graph, broken)


def test_zero1_shards_optimizer_state_over_data(mesh_trained):
    engine, _, _, _ = mesh_trained("dp2-pp4-1f1b-zero1")
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


def test_a_mesh_engine_checkpoint_resumes_on_the_keras_model_engine(mesh_trained, reference, devices, tmp_path):
    """A checkpoint the mesh engine wrote (its per-device slices by logical name) restores into
    the engine phalanx train now builds, in another layout, which continues with the
    single-device losses; and the Keras-model engine's own per-device checkpoint goes back."""
    engine, _, _, layers = mesh_trained("tp4")  # (no other test steps it)
    ref_losses, _, _ = reference(layers)
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


# -- tf.distribute's one-device / mirrored engine (its own gradients) ------------------------


def _tiny_cfg(**train):
    return Config().replace(model={"layers": 2, "d_model": 32, "heads": 4, "ffn": 64, "vocab": 256, "seq_len": 16},
                            train={"global_batch": 8, "warmup": 1, "steps": 10, **train})


def _tokens():
    return np.random.default_rng(0).integers(0, 256, [8, 17]).astype(np.int32)


def _strategy_engine(cfg, devices):
    from phalanx.cluster.strategies import local_strategy
    return StrategyEngine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed), local_strategy(devices))


@pytest.mark.parametrize("replicas, accum", [(1, 4), (2, 1), (2, 2)])
def test_strategy_engine_gradients_equal_one_device_big_batch(devices, replicas, accum):
    """One step's gradients (tf.distribute's engine: the Keras-model engine exposes no
    gradients; this bounds the round-off the training comparisons below allow for): the same
    float32 sums in another order, so equal to float32 round-off (rtol 1e-5; atol 1e-7 for sums near zero, whose terms are ~1e-2)."""
    data = _tokens()
    big = _strategy_engine(_tiny_cfg(), devices[:1]).gradients(data)
    other = _strategy_engine(_tiny_cfg(grad_accum=accum), devices[:replicas]).gradients(data)
    for name in big:
        np.testing.assert_allclose(other[name], big[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("policy, other", [("mixed_bfloat16", "float32"), ("float32", "mixed_bfloat16")])
def test_the_old_engines_refuse_a_task_built_for_another_policy(devices, policy, other):
    """(tests/test_engine_policy.py checks the engines phalanx train builds.)"""
    from phalanx.cluster.strategies import local_strategy
    from phalanx.config import ConfigError
    cfg = Config().replace(model={"layers": 1, "d_model": 16, "heads": 2, "ffn": 32, "vocab": 256, "seq_len": 8},
                           train={"global_batch": 4, "warmup": 1}, precision={"policy": policy})
    for make in (lambda: StrategyEngine(cfg, GPTTask(cfg.model, other), local_strategy(devices[:1])),
                 lambda: MeshEngine(cfg, Mesh.from_devices(devices[:1], 1, 1, 1), GPTTask(cfg.model, other))):
        with pytest.raises(ConfigError, match=f"precision.policy: {policy}, but"):
            make()


def test_the_old_engines_use_the_one_adamw_apply():
    """(tests/test_adamw.py checks the Keras-model engine's PhalanxAdamW.)"""
    import inspect

    from phalanx.engines import strategy
    from phalanx.parallel import zero

    assert "optim.apply_adamw(" in inspect.getsource(strategy.StrategyEngine._apply_one)
    assert "optim.apply_adamw(" in inspect.getsource(zero.ShardedAdamW._adam)


def test_the_mesh_engine_refuses_the_moe_gpt(devices):
    """(The mixture-of-experts GPT trains on the Keras-model engine on every layout.)"""
    from phalanx.config import ConfigError
    cfg = Config().replace(model={"layers": 2, "d_model": 32, "heads": 2, "ffn": 48, "seq_len": 16, "experts": 4,
                                  "moe_every": 2}, train={"global_batch": 4}, parallel={"pp": 2})
    with pytest.raises(ConfigError, match="model.experts"):
        MeshEngine(cfg, Mesh.from_devices(devices[:2], 1, 2, 1), GPTTask(cfg.model))


def test_strategy_engine_gradients_start_the_moe_totals_at_zero_as_a_step(devices):
    """``StrategyEngine.gradients()`` counts only its own batch in the MoE statistics totals."""
    from phalanx.cluster.strategies import local_strategy
    from phalanx.models import gpt, transformer
    cfg = Config().replace(model={"layers": 2, "d_model": 32, "heads": 2, "ffn": 32, "vocab": 256, "seq_len": 8,
                                  "experts": 4, "top_k": 2, "moe_every": 1, "aux_loss_coef": 0.5},
                           train={"global_batch": 8, "warmup": 1, "steps": 10, "lr": 1e-2, "eps": 1e-2},
                           precision={"policy": "float32"})
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, [8, 9]).astype(np.int32)
    batch[4:] %= 4
    weights = {n: (np.random.default_rng(1).standard_normal(s) * 0.3).astype(np.float32)
               for n, s in gpt.weight_shapes(cfg.model).items()}
    two = StrategyEngine(cfg, GPTTask(cfg.model, "float32", 0), local_strategy(devices[:2]))
    for name, var in two.variables.items():
        var.assign(weights[name])
    layers = [b.moe for b in transformer.blocks(two.model) if b.moe is not None]

    def totals():
        return [[np.asarray(v.numpy()).copy() for v in m.statistics_totals()] for m in layers]

    seen = []
    for _ in range(2):
        two.gradients(batch)
        seen.append(totals())
        for calls, _, assignments, _ in seen[-1]:
            assert (float(calls), float(assignments)) == (2.0, 8 * 8 * 2)
    for name, value in two.weights().items():
        np.testing.assert_array_equal(value, weights[name], err_msg=name)
    two.train_step(batch)
    for got, want in zip(totals(), seen[0]):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)


# -- the mesh engine's sharded parameters (phalanx.parallel.params) ---------------------------

@pytest.mark.parametrize("split", [Split("replicated"), Split("axis", 0), Split("axis", 1), Split("qkv")],
                         ids=["replicated", "rows", "columns", "qkv"])
def test_split_regions_are_the_shards_of_split_shard(split):
    w = np.arange(8 * 24, dtype=np.float32).reshape(8, 24)
    for tp in (1, 2, 4):
        for t, want in enumerate(split.shard(w, tp)):
            got = np.full(shard_shape(split, w.shape, tp), np.nan, np.float32)
            for local, logical in split_regions(split, w.shape, t, tp):
                got[boxes.index(local)] = w[boxes.index(logical)]
            np.testing.assert_array_equal(got, want)
            sub = ((got.shape[0] // 2, got.shape[0]), (2, got.shape[1] - 1))  # part of the shard (ZeRO)
            part = np.full(boxes.shape_of(sub), np.nan, np.float32)
            for local, logical in restrict(split_regions(split, w.shape, t, tp), sub):
                part[boxes.index(local)] = w[boxes.index(logical)]
            np.testing.assert_array_equal(part, want[boxes.index(sub)])
