"""Sparsity during training (train.prune.*, phalanx.prune): masks on every layout,
the schedule, N:M, checkpoints and resume, export, and the errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import numpy_peaks, tiny_overrides, write_corpus
from phalanx import prune
from phalanx.config import ConfigError, load_config
from phalanx.engines.task import GPTTask

TINY = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=64", "model.seq_len=16",
        "train.global_batch=8", "train.warmup=1", "train.lr=1e-2"]
LAYOUTS = {  # name -> parallel overrides
    "one": [],
    "dp2": ["parallel.dp=2", "parallel.devices=cpu:2"],
    "tp2": ["parallel.tp=2", "parallel.devices=cpu:2"],
    "pp2": ["parallel.pp=2", "parallel.microbatches=2", "parallel.devices=cpu:2"],
    "dp2-zero1": ["parallel.dp=2", "parallel.zero=1", "parallel.devices=cpu:2"],
}


def _batches(n, rows=8, seq=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(rows, seq + 1)).astype(np.int32) for _ in range(n)]


def _train_layout(layout: str, pattern: str = "unstructured", steps: int = 6):
    """Steps of a directly built engine with a Pruner (start 0, end 4, every 2); after every
    step, checks that masked weights and their moments are exactly zero."""
    from phalanx.engines.factory import build_engine
    target = 0.5
    cfg = load_config(None, TINY + LAYOUTS[layout] + [f"train.prune.target={target}", "train.prune.start=0",
                                                       "train.prune.end=4", "train.prune.every=2",
                                                       f"train.prune.pattern={pattern}"])
    engine = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    pruner = prune.Pruner(cfg, engine)
    losses = []
    for step, batch in enumerate(_batches(steps)):
        pruner.before_step(step)
        losses.append(float(engine.train_step(batch)["loss"]))
        state = engine.state_dict()
        masks = pruner.whole_masks()
        assert masks and set(masks) == {n for n in state if prune.prunable(n)
                                        and not n.startswith(("optimizer/", prune.MASK_PREFIX))}
        for name, mask in masks.items():
            off = mask == 0
            for key in (name, f"optimizer/m/{name}", f"optimizer/v/{name}"):
                assert np.all(state[key][off] == 0), (layout, step, key)
    return cfg, engine, pruner, losses


@pytest.fixture(scope="module")
def one_device_losses():
    return {p: _train_layout("one", p)[3] for p in ("unstructured", "2:4")}


@pytest.mark.parametrize("layout", ["one", "dp2", "tp2", "pp2", "dp2-zero1"])
def test_masks_keep_their_zeros_on_every_layout(layout, one_device_losses):
    cfg, engine, pruner, losses = _train_layout(layout)
    weights = engine.weights()
    # after the last mask update (step 4) the sparsity is the target, per tensor
    for name, mask in pruner.whole_masks().items():
        assert (weights[name] == 0).mean() == pytest.approx(0.5, abs=1e-3), name
    assert not np.any(weights["embed/tokens"] == 0) and not np.any(weights["block_0/ln1/gamma"] == 0)
    # the same run on one device (masks, moments and all): the losses agree
    np.testing.assert_allclose(losses, one_device_losses["unstructured"], rtol=2e-4)


@pytest.mark.parametrize("layout", ["one", "tp2"])
def test_2_4_means_exactly_2_of_every_4_are_zero(layout, one_device_losses):
    cfg, engine, pruner, losses = _train_layout(layout, "2:4")
    for name, w in engine.weights().items():
        if not prune.prunable(name):
            continue
        groups = np.moveaxis(w, -2, -1).reshape(-1, 4)  # 4 consecutive along the input dimension
        assert np.all((groups == 0).sum(axis=1) == 2), name
    np.testing.assert_allclose(losses, one_device_losses["2:4"], rtol=2e-4)


def test_mask_functions():
    w = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
    m = prune.unstructured_mask(w, 0.25)
    assert (m == 0).sum() == 12 and np.abs(w[m == 0]).max() <= np.abs(w[m == 1]).min()
    nm = prune.nm_mask(w, 2, 4)
    for col in range(6):
        for g in range(2):
            block = np.abs(w[4 * g:4 * g + 4, col])
            kept = nm[4 * g:4 * g + 4, col] == 1
            assert kept.sum() == 2 and block[kept].min() >= block[~kept].max()
    assert prune.prunable("block_0/mlp/fc/kernel") and prune.prunable("block_1/moe/w_in")
    for name in ("embed/tokens", "embed/positions", "block_0/mlp/fc/bias", "final_ln/gamma", "block_0/moe/router"):
        assert not prune.prunable(name)


def _tiny_run(tmp_path, corpus, run, steps, **extra):
    from phalanx.train.trainer import Trainer
    cfg = load_config(None, tiny_overrides(tmp_path, corpus, run, train__steps=steps, train__prune__target=0.5,
                                           train__prune__start=2, train__prune__end=6, train__prune__every=2,
                                           checkpoint__every=5, **extra))
    return Trainer(cfg, quiet=True).fit(), cfg


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prune_run")
    corpus = write_corpus(tmp / "corpus", files=2, lines=200)
    summary, cfg = _tiny_run(tmp, corpus, "full", 8)
    return tmp, corpus, summary, cfg


def test_sparsity_follows_the_cubic_schedule(pruned_run):
    tmp, corpus, summary, cfg = pruned_run
    rows = {r["step"]: r for r in _rows(summary.run_dir) if "sparsity" in r}
    assert sorted(rows) == list(range(1, 9))
    start, end, every, target = 2, 6, 2, 0.5
    for step, row in rows.items():
        # masks are recomputed before the steps that follow 2, 4 and 6 completed steps
        last_update = max([u for u in range(start, end + 1, every) if u <= step - 1], default=None)
        want = 0.0 if last_update is None else target * (1 - (1 - (last_update - start) / (end - start)) ** 3)
        assert row["sparsity"] == pytest.approx(want, abs=2e-3), (step, row["sparsity"], want)
    assert rows[8]["sparsity"] == pytest.approx(0.5, abs=1e-3)


def test_resume_keeps_the_masks_and_equals_an_uninterrupted_run(pruned_run):
    import shutil
    from phalanx import checkpoint
    tmp, corpus, full, cfg = pruned_run
    # The same run stopped after step 5 (between the mask updates before steps 5 and 7):
    # keep only its step-5 checkpoint and log lines, then resume it to step 8.
    part = tmp / "resumed"
    shutil.copytree(full.run_dir, part)
    shutil.rmtree(part / "checkpoints" / "step-00000008")
    rows = (part / "metrics.jsonl").read_text().splitlines()[:5]
    (part / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    saved = checkpoint.restore(part / "checkpoints" / "step-00000005").tensors
    masks = {k: v for k, v in saved.items() if k.startswith(prune.MASK_PREFIX)}
    assert masks and all((v == 0).any() for v in masks.values())
    resumed, _ = _tiny_run(tmp, corpus, "resumed", 8)
    assert resumed.steps == 8
    a = checkpoint.restore(full.run_dir / "checkpoints" / "step-00000008").tensors
    b = checkpoint.restore(part / "checkpoints" / "step-00000008").tensors
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=1e-6, atol=1e-8, err_msg=key)
        if key.startswith(prune.MASK_PREFIX):  # the masked weights are exactly zero after resuming too
            assert np.all(b[key[len(prune.MASK_PREFIX):]][b[key] == 0] == 0)
    np.testing.assert_allclose([r["loss"] for r in _rows(part)], [r["loss"] for r in _rows(full.run_dir)],
                               rtol=1e-6)
    # step 6 runs on the checkpoint's masks (the next update is before step 7): reinstalled, they
    # keep the weights of row 6 exactly as sparse as in the uninterrupted run
    assert [r["sparsity"] for r in _rows(part)] == [r["sparsity"] for r in _rows(full.run_dir)]


def test_export_of_a_pruned_run_keeps_the_zeros(pruned_run, tmp_path):
    from phalanx import checkpoint
    from phalanx.export.api import export_run
    from phalanx.export.runtime import load_artifact
    tmp, corpus, summary, cfg = pruned_run
    out = tmp_path / "k"
    report = export_run(summary.run_dir, "keras", "none", output=out, eval_batches=1, quiet=True, print_table=False)
    masks = {k[len(prune.MASK_PREFIX):]: v for k, v in
             checkpoint.restore_latest(summary.checkpoint.parent).tensors.items() if k.startswith(prune.MASK_PREFIX)}
    model = load_artifact(out)._model
    zeros = sum(int((np.asarray(w) == 0).sum()) for w in model.get_weights())
    assert zeros >= sum(int((m == 0).sum()) for m in masks.values())
    sizes = report["size_bytes"]
    assert sizes["exported_compressed"] < 0.8 * sizes["exported"], sizes
    assert report["sparsity"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("override,key", [
    ("train.prune.target=1.0", "train.prune.target"),
    ("train.prune.target=-0.1", "train.prune.target"),
    ("train.prune.every=0", "train.prune.every"),
    ("train.prune.end=0", "train.prune.end"),
    ("train.prune.start=-1", "train.prune.start"),
    ("train.prune.pattern=4:2", "train.prune.pattern"),
    ("train.prune.pattern=dense", "train.prune.pattern"),
    ("train.prune.colour=red", "train.prune.colour"),
    ("train.prune=0.5", "train.prune"),
])
def test_bad_keys_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert err.value.key == key


def test_n_m_errors_name_the_weight_and_the_target():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.prune.target=0.3", "train.prune.pattern=2:4"])
    assert err.value.key == "train.prune.target" and "0.5" in str(err.value)
    with pytest.raises(ConfigError) as err:  # ffn 36: mlp/proj's input dim is not a multiple of 8
        load_config(None, ["model.ffn=36", "train.prune.target=0.75", "train.prune.pattern=2:8"])
    assert err.value.key == "train.prune.pattern" and "mlp/proj/kernel" in str(err.value)


def test_nested_keys_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 10\n  prune:\n    target: 0.5\n    pattern: 2:4\n")
    cfg = load_config(path, ["train.prune.every=3"])
    assert (cfg.train.prune.target, cfg.train.prune.pattern, cfg.train.prune.every) == (0.5, "2:4", 3)
    assert cfg.train.steps == 10 and cfg.replace(train={"prune": {"end": 50}}).train.prune.pattern == "2:4"
    assert load_config(None, []).train.prune.target == 0  # off by default


@pytest.mark.parametrize("layout", [[], ["parallel.dp=2", "parallel.ep=2", "parallel.devices=cpu:2"]])
def test_moe_experts_are_pruned_2_4_too(layout):
    """Whole experts, and with expert parallelism each replica's expert shard."""
    from phalanx.engines.factory import build_engine
    cfg = load_config(None, TINY + ["model.experts=2", "train.prune.target=0.5", "train.prune.pattern=2:4",
                                    "train.prune.start=0", "train.prune.end=1", "train.prune.every=1", *layout])
    engine = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    pruner = prune.Pruner(cfg, engine)
    for step, batch in enumerate(_batches(2)):
        pruner.before_step(step)
        engine.train_step(batch)
    weights = engine.weights()
    assert {"block_0/moe/w_in", "block_0/moe/w_out"} <= set(pruner.whole_masks())
    assert "block_0/moe/router" not in pruner.whole_masks()
    for name in ("block_0/moe/w_in", "block_0/moe/w_out"):
        groups = np.moveaxis(weights[name], -2, -1).reshape(-1, 4)
        assert np.all((groups == 0).sum(axis=1) == 2), name


# ---------------------------------------------------------------------------
# Shard by shard (phalanx.prune.shards): the masks of the whole-tensor rule, on every layout


def test_kth_smallest_is_exact_across_parts():
    from phalanx.prune.select import kth_smallest
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 50, 5000).astype(np.uint64)  # many ties
    parts = lambda: iter(np.array_split(keys, 7))  # noqa: E731
    ordered = np.sort(keys)
    for k in (0, 1, 999, 2500, 4999):
        assert kth_smallest(parts, k, bits=32) == ordered[k]
    with pytest.raises(IndexError):
        kth_smallest(parts, 5000, bits=32)


def _tp_engine(devices, tp, overrides):
    """The engine phalanx train builds for the built-in GPT at ``tp`` (the Keras-model engine)."""
    from phalanx.engines.factory import make_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.mesh import Mesh
    cfg = load_config(None, TINY + [f"parallel.tp={tp}", *overrides])
    engine = make_engine(GPTTask(cfg.model, "float32", 0), Mesh.from_devices(devices[:tp], 1, 1, tp), cfg)
    assert type(engine) is KerasGPTEngine, type(engine)
    return cfg, engine


@pytest.mark.parametrize("pattern", ["unstructured", "2:4"])
def test_shard_masks_equal_the_whole_tensor_masks_at_tp1_and_tp2(devices, pattern):
    """Weights rounded to a coarse grid (many exact ties at the threshold, so the tie rule by
    logical index matters), pruned at tp1 and tp2 on the engine phalanx train builds: the same masks, equal to
    the whole-tensor reference functions (stable argsort) on the same weights."""
    overrides = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=4", "train.prune.every=2",
                 f"train.prune.pattern={pattern}"]
    rng = np.random.default_rng(7)
    state = None
    got = {}
    for tp in (1, 2):
        cfg, engine = _tp_engine(devices, tp, overrides)
        if state is None:
            state = {k: (np.round(rng.normal(size=v.shape) * 4) / 4).astype(v.dtype) if prune.prunable(k)
                     and not k.startswith(("optimizer/", prune.MASK_PREFIX)) else v
                     for k, v in engine.state_dict().items()}
        engine.load_state_dict(state)
        pruner = prune.Pruner(cfg, engine)
        assert pruner.before_step(2)  # sparsity 0.4375 of the cubic ramp
        got[tp] = pruner.whole_masks()
    sparsity = prune.scheduled_sparsity(2, 0.5, 0, 4)
    weights = {k: v for k, v in state.items() if k in got[1]}
    want = prune.compute_masks(weights, sparsity, pattern)
    assert set(got[1]) == set(got[2]) == set(want) and want
    for name in want:
        np.testing.assert_array_equal(got[1][name], want[name], err_msg=name)
        np.testing.assert_array_equal(got[2][name], want[name], err_msg=name)
    if pattern == "unstructured":  # the grid made ties at the threshold: the index rule was exercised
        name = "block_0/mlp/fc/kernel"
        tau = np.sort(np.abs(weights[name]).ravel())[int(round(sparsity * weights[name].size)) - 1]
        on_tau = np.abs(weights[name]) == tau
        assert 0 < (want[name][on_tau] == 0).sum() < on_tau.sum()


#: NumPy bytes one chunk's keys and histogram temporaries may take (phalanx.prune.shards.CHUNK elements)
CHUNK_TEMPORARIES = 2 * 2**20


def assert_updated(updated: bool) -> None:
    assert updated, "not a mask update step"


@pytest.mark.memory_peak
def test_a_prune_step_holds_a_shard_not_the_model(devices):
    """Peak host NumPy memory (tracemalloc) of one mask update at tp1 and tp4 on phalanx train's engine,
    with the MLP kernels the largest weights: tp4's peak is about a quarter of tp1's."""
    model = ["model.layers=2", "model.d_model=256", "model.heads=4", "model.ffn=8192", "model.vocab=256"]
    overrides = [*model, "train.prune.target=0.5", "train.prune.start=0", "train.prune.end=4", "train.prune.every=2"]
    peaks = {}
    for tp in (1, 4):
        cfg, engine = _tp_engine(devices, tp, overrides)
        pruner = prune.Pruner(cfg, engine)
        # the least transient (peak less what stays allocated) of two calls: installing a mask assigns a
        # NumPy array to a tf.Variable, which may keep its buffer as storage by the heap's history
        # (helpers.numpy_peaks), counting the variable's own state as the step's
        peaks[tp] = min(peak - held for peak, held in numpy_peaks(lambda: pruner.before_step(2), runs=2))
    largest = 4 * 256 * 8192  # bytes of one MLP kernel, the largest weight
    prunable_bytes = 4 * 2 * (256 * 768 + 256 * 256 + 2 * 256 * 8192)
    print("prune step peak NumPy bytes:", peaks, "tp4/tp1:", peaks[4] / peaks[1], "largest weight:", largest,
          "all pruned weights:", prunable_bytes)
    # one weight at a time (that weight and its mask, plus a chunk's temporaries), never all of them
    assert peaks[1] < 2.5 * largest < 0.6 * prunable_bytes, peaks
    assert peaks[4] < 0.25 * peaks[1] + CHUNK_TEMPORARIES, peaks  # a quarter: a shard and its mask


def test_tp_masks_travel_in_the_device_shard_sets(devices, tmp_path):
    """The engine phalanx train builds writes its masks per device (no whole-mask 'extra' set); a tp2
    checkpoint's masks load into tp1 equal; a dense checkpoint (no masks) loads into a pruning
    engine with every weight kept."""
    from phalanx import checkpoint
    overrides = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=4", "train.prune.every=2"]
    cfg, tp2 = _tp_engine(devices, 2, overrides)
    pruner = prune.Pruner(cfg, tp2)
    pruner.before_step(2)
    sets = checkpoint.state_of(tp2)
    assert all(s.name.startswith("dp0-") for s in sets)
    mask_sets = {s.name for s in sets for slot in s.slots if slot.name.startswith(prune.MASK_PREFIX)}
    assert mask_sets == {"dp0-pp0-tp0", "dp0-pp0-tp1"}
    path = checkpoint.save(tmp_path / "pruned", 3, sets)
    cfg1, tp1 = _tp_engine(devices, 1, overrides)
    checkpoint.load_into(tp1, checkpoint.restore(path))
    got, want = prune.Pruner(cfg1, tp1).whole_masks(), pruner.whole_masks()
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # a dense checkpoint (written without pruning) into a pruning engine: masks stay all ones
    _, dense = _tp_engine(devices, 2, [])
    path = checkpoint.save(tmp_path / "dense", 1, checkpoint.state_of(dense))
    _, fresh = _tp_engine(devices, 2, overrides)
    checkpoint.load_into(fresh, checkpoint.restore(path))
    assert all((m == 1).all() for m in prune.Pruner(cfg, fresh).whole_masks().values())


def _built_engine(layout: str, prune_on: bool = True):
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    overrides = ["train.prune.target=0.5", "train.prune.start=0", "train.prune.end=4", "train.prune.every=2"]
    cfg = load_config(None, TINY + LAYOUTS[layout] + (overrides if prune_on else []))
    engine = build_engine(cfg, GPTTask(cfg.model, "float32", cfg.train.seed))
    assert type(engine) is KerasGPTEngine, type(engine)  # phalanx train's engine, pruning or not
    return cfg, engine


@pytest.mark.parametrize("layout", ["one", "dp2"])
def test_built_engine_masks_survive_save_and_resume(layout, tmp_path):
    """The engine phalanx train builds writes its masks as optional slots beside the weights'
    (no 'extra' set), one part at a time; stopped after 3 steps (between the mask updates before steps
    2 and 4), saved, and resumed in a new engine, its masks are the saved ones, and steps 3 to
    5 give the losses, masks and state of the uninterrupted run (start 0, end 4, every 2)."""
    from phalanx import checkpoint
    batches = _batches(6)
    _, _, full_pruner, full_losses = _train_layout(layout)
    cfg, engine = _built_engine(layout)
    pruner = prune.Pruner(cfg, engine)
    for step in range(3):
        pruner.before_step(step)
        engine.train_step(batches[step])
    saved_masks = pruner.whole_masks()
    assert saved_masks and all((m == 0).any() for m in saved_masks.values())
    sets = checkpoint.state_of(engine)
    mask_slots = [slot for s in sets for slot in s.slots if slot.name.startswith(prune.MASK_PREFIX)]
    assert {slot.name for slot in mask_slots} == {prune.MASK_PREFIX + n for n in saved_masks}
    assert all(slot.optional for slot in mask_slots) and not any(s.name.startswith("extra") for s in sets)
    path = checkpoint.save(tmp_path, 3, sets)
    assert {prune.MASK_PREFIX + n for n in saved_masks} <= set(checkpoint.restore(path).tensors)

    cfg, resumed = _built_engine(layout)
    checkpoint.load_into(resumed, checkpoint.restore(path))
    pruner = prune.Pruner(cfg, resumed)
    got = pruner.whole_masks()
    assert set(got) == set(saved_masks)
    for name in saved_masks:
        np.testing.assert_array_equal(got[name], saved_masks[name], err_msg=name)
    losses = []
    for step in range(3, 6):
        pruner.before_step(step)
        losses.append(float(resumed.train_step(batches[step])["loss"]))
    np.testing.assert_allclose(losses, full_losses[3:], rtol=1e-6)
    want = full_pruner.whole_masks()
    for name, mask in pruner.whole_masks().items():
        np.testing.assert_array_equal(mask, want[name], err_msg=name)
    full_state = full_pruner.engine.state_dict()
    for key, value in resumed.state_dict().items():
        np.testing.assert_allclose(value, full_state[key], rtol=1e-6, atol=1e-8, err_msg=key)


def test_a_dense_checkpoint_resumes_into_a_pruning_engine(tmp_path):
    """A checkpoint written without pruning (no prune/mask/* tensors) loads into a pruning
    engine: every mask stays all ones and the weights are the checkpoint's; the
    first mask update then prunes them to the schedule."""
    from phalanx import checkpoint
    _, dense = _built_engine("one", prune_on=False)
    dense.train_step(_batches(1)[0])
    path = checkpoint.save(tmp_path, 1, checkpoint.state_of(dense))
    assert not any(n.startswith(prune.MASK_PREFIX) for n in checkpoint.restore(path).tensors)
    cfg, fresh = _built_engine("one")
    checkpoint.load_into(fresh, checkpoint.restore(path))
    pruner = prune.Pruner(cfg, fresh)
    masks = pruner.whole_masks()
    assert masks and all((m == 1).all() for m in masks.values())
    want = dense.state_dict()
    for key, value in fresh.state_dict().items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)
    assert pruner.sparsity() == 0.0
    assert pruner.before_step(2) and pruner.sparsity() == pytest.approx(prune.scheduled_sparsity(2, 0.5, 0, 4),
                                                                        abs=1e-3)


@pytest.mark.parametrize("rows", [(0, 8, 12), (0, 6, 12), (0, 5, 9, 12)])
def test_shard_masks_of_any_row_split_equal_the_whole_tensor_rule(rows):
    """Hand-made shards of a [12, 6] weight (rows split on and off the 4-row N:M groups, so
    both the per-shard and the joining path run), with ties: unstructured and 2:4 masks equal
    the whole-tensor functions."""
    from phalanx.prune.shards import WeightShard, shard_masks
    w = (np.round(np.random.default_rng(3).normal(size=(12, 6)) * 2) / 2).astype(np.float32)
    shards = [WeightShard("w", w.shape, [(((0, b - a), (0, 6)), ((a, b), (0, 6)))],
                          fetch=lambda a=a, b=b: w[a:b].copy(), install=None)
              for a, b in zip(rows[:-1], rows[1:])]
    for nm, want in ((None, prune.unstructured_mask(w, 0.4)), ((2, 4), prune.nm_mask(w, 2, 4))):
        got = np.full(w.shape, -1.0, np.float32)
        for shard, mask in shard_masks(shards, 0.4 if nm is None else 0.5, nm, prune.nm_mask):
            (_, logical), = shard.regions
            got[logical[0][0]:logical[0][1]] = mask
        np.testing.assert_array_equal(got, want, err_msg=str(nm))
