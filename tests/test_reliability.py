"""Issue 12, "trustworthy runs" (the fast part; multi-process fault tests: test_faults.py).

* verified checkpoints: a manifest of sha256 per file; a damaged newest checkpoint
  (truncated, bit-flipped or missing shard file, garbage meta.json or index, an index
  piece outside its file or a slice missing, missing or garbage data position, a
  step that disagrees with its directory) is skipped with a warning naming the file
  for the newest valid one; none valid is a clear error; non-finite tensors are
  never written; format-1 checkpoints load with a warning;
* disk full: a one-line CheckpointError naming the path and the bytes, previous
  checkpoints intact, no temporary dir; old checkpoints pruned *before* writing
  (simulated ENOSPC, and a real tiny tmpfs where mounting works);
* one trainer per run.dir (RunLock), a stale lock after SIGKILL taken over;
* exactly one metrics row per step after a resume;
* the trainer: resume past a corrupted newest checkpoint equals an uninterrupted run,
  another model's checkpoint without config.yaml is refused by key, a NaN state is
  never saved, evaluation follows train.eval_every, MFU counts the devices (dp2, tp2);
* no silent no-ops: parallel.zero/recompute/microbatches/devices refused per strategy.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from phalanx import checkpoint
from phalanx.checkpoint import CheckpointError, CheckpointWarning
from phalanx.config import Config, ConfigError, load_config
from phalanx.fsutil import LOCK_FILE, RunLock

from helpers import tiny_overrides, write_corpus


def state(seed: int = 0, n: int = 1000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"block_0/w": rng.standard_normal(n).astype(np.float32), "optimizer/step": np.int64(seed)}


def write_position(step: int):
    def write(directory: Path) -> None:
        (directory / "data_iterator.json").write_text(json.dumps({"step": step, "seed": 0}))
    return write


def save_steps(root: Path, steps=(1, 2, 3), keep=None) -> None:
    for s in steps:
        checkpoint.save(root, s, state(s), meta={"config": {}}, writers={"data": write_position(s)}, keep=keep)


# ---------------------------------------------------------------------------
# Verified checkpoints


def test_manifest_has_a_sha256_per_file_and_is_written_last(tmp_path):
    save_steps(tmp_path, (4,))
    path = tmp_path / "step-00000004"
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["data/data_iterator.json", "index.json", "meta.json", "shards/tensors.bin"]
    for rel, entry in manifest["files"].items():
        assert entry["sha256"] == checkpoint.sha256_file(path / rel)
        assert entry["bytes"] == (path / rel).stat().st_size
    assert json.loads((path / "meta.json").read_text())["format"] == checkpoint.FORMAT_VERSION == 3


#: the data file of a checkpoint of whole tensors (one shard set, "tensors")
DATA = "shards/tensors.bin"


def _edit_index(path: Path, change) -> None:
    """Change the first tensor's entry of index.json (and sign it in the manifest)."""
    index = json.loads((path / "index.json").read_text())
    change(index["tensors"]["block_0/w"])
    _rewrite_signed(path, "index.json", json.dumps(index))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _rewrite_signed(path: Path, rel: str, text: str) -> None:
    """Change a file *and* its manifest entry: what only the content checks can catch."""
    (path / rel).write_text(text)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][rel] = {"bytes": (path / rel).stat().st_size, "sha256": checkpoint.sha256_file(path / rel)}
    (path / "manifest.json").write_text(json.dumps(manifest))


DAMAGE = {
    "truncated tensors": (lambda p: _truncate(p / DATA), "tensors.bin", "truncated or overwritten"),
    "bit-flipped tensors": (lambda p: _flip_byte(p / DATA), "tensors.bin", "checksum mismatch"),
    "missing shard file": (lambda p: (p / DATA).unlink(), "tensors.bin", "missing (listed in manifest.json)"),
    "garbage index, manifest updated": (lambda p: _rewrite_signed(p, "index.json", "{not json"), "index.json",
                                        "not valid JSON"),
    "index piece past its file's end": (lambda p: _edit_index(p, lambda e: e["pieces"][0].update(offset=10**6)),
                                        "index.json", "runs past its end"),
    "index piece in an unlisted file": (lambda p: _edit_index(p, lambda e: e["pieces"][0].update(file="x.bin")),
                                        "index.json", "a file the manifest does not list"),
    "index missing a slice": (lambda p: _edit_index(p, lambda e: e["pieces"][0].update(box=[[0, 10]])),
                              "index.json", "pieces cover 10 of its 1000 elements"),
    "garbage meta.json": (lambda p: (p / "meta.json").write_text("{not json"), "meta.json", "bytes"),
    "garbage meta.json, manifest updated": (lambda p: _rewrite_signed(p, "meta.json", "{not json"), "meta.json",
                                            "not valid JSON"),
    "missing data position": (lambda p: (p / "data" / "data_iterator.json").unlink(), "data_iterator.json",
                              "missing (listed in manifest.json)"),
    "garbage data position": (lambda p: _rewrite_signed(p, "data/data_iterator.json", "\x00\x01"),
                              "data_iterator.json", "not valid JSON"),
    "data position of another step": (lambda p: _rewrite_signed(p, "data/data_iterator.json", '{"step": 7}'),
                                      "data_iterator.json", "puts the data at step 7, but the checkpoint is step 3"),
    "meta step differs from the directory": (
        lambda p: _rewrite_signed(p, "meta.json", json.dumps({"format": 3, "step": 1})), "meta.json",
        "says step 1, but its directory step-00000003 is step 3"),
    "missing manifest": (lambda p: (p / "manifest.json").unlink(), "manifest.json", "missing; a format-3 checkpoint"),
    "garbage manifest": (lambda p: (p / "manifest.json").write_text("[]"), "manifest.json", "not a JSON object but a list"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_is_skipped_with_a_warning_naming_the_file(tmp_path, kind):
    save_steps(tmp_path)
    damage, file_name, fragment = DAMAGE[kind]
    newest = tmp_path / "step-00000003"
    damage(newest)
    with pytest.raises(CheckpointError) as info:
        checkpoint.restore(newest)
    assert file_name in str(info.value) and fragment in str(info.value)
    with pytest.warns(CheckpointWarning) as caught:
        assert checkpoint.latest_valid(tmp_path).name == "step-00000002"
    assert any("step-00000003" in str(w.message) and file_name in str(w.message) for w in caught)
    heard = []
    restored = checkpoint.restore_latest(tmp_path, warn=heard.append)
    assert restored.step == 2 and restored.tensors["optimizer/step"] == 2
    assert len(heard) == 1 and fragment in heard[0]


def test_no_valid_checkpoint_is_a_clear_error_and_none_is_none(tmp_path):
    assert checkpoint.restore_latest(tmp_path / "nothing") is None
    save_steps(tmp_path, (1, 2))
    for path in checkpoint.all_checkpoints(tmp_path):
        _flip_byte(path / DATA)
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="none of its 2 checkpoints is valid"):
        checkpoint.restore_latest(tmp_path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_state_is_never_written(tmp_path, bad):
    save_steps(tmp_path, (1,))
    tensors = state(2)
    tensors["optimizer/m/block_0/w"] = np.ones(4, np.float32)
    tensors["optimizer/m/block_0/w"][1] = bad
    with pytest.raises(CheckpointError, match=r"refusing to save step 2: non-finite values in optimizer/m/block_0/w"):
        checkpoint.save(tmp_path, 2, tensors, keep=1)
    assert [p.name for p in checkpoint.all_checkpoints(tmp_path)] == ["step-00000001"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_non_finite_weights_in_an_old_checkpoint_are_skipped(tmp_path):
    save_steps(tmp_path, (1,))
    legacy = tmp_path / "step-00000002"  # format 1 (no manifest) holding a NaN: the unverified path
    legacy.mkdir()
    np.savez(legacy / "tensors.npz", **{"w": np.array([np.nan], np.float32)})
    (legacy / "meta.json").write_text(json.dumps({"format": 1, "step": 2}))
    heard = []
    assert checkpoint.restore_latest(tmp_path, warn=heard.append).step == 1
    assert "non-finite values in w (1 NaN" in heard[-1]


def test_format_1_checkpoint_loads_unverified_with_a_warning(tmp_path):
    legacy = tmp_path / "step-00000005"
    legacy.mkdir()
    np.savez(legacy / "tensors.npz", **{"block_0%2Fw": np.ones(2, np.float32)})
    (legacy / "meta.json").write_text(json.dumps({"format": 1, "step": 5}))
    with pytest.warns(CheckpointWarning, match="no manifest.json .format 1"):
        restored = checkpoint.restore(legacy)
    assert restored.step == 5 and restored.tensors["block_0/w"].tolist() == [1.0, 1.0]
    _truncate(legacy / "tensors.npz")  # even unverified, a broken zip is named, not a raw BadZipFile
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="tensors.npz: not a readable .npz"):
        checkpoint.restore(legacy)


# ---------------------------------------------------------------------------
# Disk full and other I/O errors


def test_disk_full_during_save_is_one_clean_error(tmp_path, monkeypatch):
    save_steps(tmp_path, (1, 2))
    before = {p.name: checkpoint.sha256_file(p / DATA) for p in checkpoint.all_checkpoints(tmp_path)}

    def full(directory, shard, values=None):
        path = directory / "shards" / f"{shard.name}.bin"
        path.write_bytes(b"x" * 100)  # a partial file, as a real ENOSPC leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(checkpoint, "write_shard_set", full)
    with pytest.raises(CheckpointError) as info:
        save_steps(tmp_path, (3,))
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message and "ENOSPC" in message
    needed = checkpoint.estimate_bytes(state(3))
    assert f"needs {checkpoint._human(needed)} ({needed:,} bytes)" in message
    assert "previous checkpoints are intact (newest step-00000002)" in message
    assert not list(tmp_path.glob(".tmp-*"))
    assert {p.name: checkpoint.sha256_file(p / DATA) for p in checkpoint.all_checkpoints(tmp_path)} == before


def test_other_io_errors_name_the_path(tmp_path, monkeypatch):
    def denied(directory, shard, values=None):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(directory))
    monkeypatch.setattr(checkpoint, "write_shard_set", denied)
    with pytest.raises(CheckpointError, match=r"Permission denied \[EACCES\].*check the file system"):
        save_steps(tmp_path, (1,))


def test_old_checkpoints_are_pruned_before_the_new_one_is_written(tmp_path, monkeypatch):
    save_steps(tmp_path, (1, 2, 3, 4))
    seen = []
    real = checkpoint.write_shard_set

    def spy(directory, shard, values=None):
        seen.append([p.name for p in checkpoint.all_checkpoints(tmp_path)])
        return real(directory, shard, values)
    monkeypatch.setattr(checkpoint, "write_shard_set", spy)
    save_steps(tmp_path, (5,), keep=2)
    assert seen == [["step-00000004"]]  # keep - 1 old ones while writing
    assert [p.name for p in checkpoint.all_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    save_steps(tmp_path, (6,), keep=1)  # keep=1 never deletes the only old checkpoint first
    assert seen[-1] == ["step-00000005"]
    assert [p.name for p in checkpoint.all_checkpoints(tmp_path)] == ["step-00000006"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root and mount rights; skipped where mounting is impossible)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_on_a_tiny_tmpfs_then_lowering_keep_frees_the_space(tiny_tmpfs):
    root = tiny_tmpfs / "checkpoints"
    big = lambda s: {"w": np.full(80_000, s, np.float32)}  # 320 KB: 3 fit in 1 MiB, not 4
    for s in (1, 2, 3):
        checkpoint.save(root, s, big(s), keep=4)
    with pytest.raises(CheckpointError, match=r"No space left on device \[ENOSPC\].*needs 3\d\d\.\d KiB"):
        checkpoint.save(root, 4, big(4), keep=4)
    assert [p.name for p in checkpoint.all_checkpoints(root)] == ["step-00000001", "step-00000002", "step-00000003"]
    assert not list(root.glob(".tmp-*"))
    assert checkpoint.latest_valid(root).name == "step-00000003"
    checkpoint.save(root, 4, big(4), keep=3)  # the rerun with a lower keep prunes first, then fits
    checkpoint.save(root, 5, big(5), keep=3)
    assert [p.name for p in checkpoint.all_checkpoints(root)] == ["step-00000003", "step-00000004", "step-00000005"]
    assert checkpoint.restore(checkpoint.latest_valid(root)).tensors["w"][0] == 5


# ---------------------------------------------------------------------------
# One trainer per run directory


def test_second_lock_on_a_run_dir_fails_naming_the_pid(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(ConfigError) as info:
            RunLock(tmp_path / "run").acquire()
        assert info.value.key == "run.dir" and f"pid {os.getpid()}" in str(info.value)
    with RunLock(tmp_path / "run") as again:  # released on exit
        assert again.holder_pid() == os.getpid()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from phalanx.fsutil import RunLock\n"
                               f"RunLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            RunLock(tmp_path).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        assert f"pid {holder.pid}" in (tmp_path / LOCK_FILE).read_text()  # the dead holder's record stays...
        with RunLock(tmp_path) as lock:  # ...but its lock died with it
            assert lock.holder_pid() == os.getpid()
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------------------
# Metrics rows


def test_resume_drops_metrics_rows_past_the_resumed_step(tmp_path):
    from phalanx.train.progress import RunOutput, read_metrics

    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')
    with RunOutput(tmp_path, total_steps=6, start_step=2, interactive=False, quiet=True, tensorboard=False) as out:
        for s in (3, 4):
            out.log({"step": s, "loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert [r["loss"] for r in read_metrics(tmp_path)][2:] == [0.5, 0.5]


# ---------------------------------------------------------------------------
# The trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def train(tmp_path, corpus, name, **extra):
    from phalanx.train.trainer import Trainer
    cfg = load_config(None, tiny_overrides(tmp_path, corpus, name, **extra))
    return Trainer(cfg, quiet=True).fit(), Path(cfg.run.dir)


def rows(run_dir: Path) -> list[dict]:
    from phalanx.train.progress import read_metrics
    return read_metrics(run_dir)


def test_resume_past_a_corrupted_newest_checkpoint_equals_an_uninterrupted_run(tmp_path, corpus, capsys):
    _, full = train(tmp_path, corpus, "full", train__steps=6, checkpoint__every=2)
    _, run_dir = train(tmp_path, corpus, "hurt", train__steps=4, checkpoint__every=2)
    (shard,) = (run_dir / "checkpoints" / "step-00000004" / "shards").glob("*.bin")  # one device: one shard set
    _flip_byte(shard)
    capsys.readouterr()
    summary, _ = train(tmp_path, corpus, "hurt", train__steps=6, checkpoint__every=2)
    err = capsys.readouterr().err
    assert "warning: skipping damaged checkpoint step-00000004" in err and f"{shard.name}: checksum mismatch" in err
    assert summary.steps == 6
    got = rows(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # steps 3, 4 re-run, their old rows dropped
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in rows(full)], rtol=1e-6)
    assert [p.name[:13] for p in (run_dir / "checkpoints" / "damaged").iterdir()] == ["step-00000004"]


def test_resume_after_a_kill_between_log_and_checkpoint_keeps_one_row_per_step(tmp_path, corpus):
    _, run_dir = train(tmp_path, corpus, "r", train__steps=4, checkpoint__every=2)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")  # killed after logging 3, 4, before saving 4
    train(tmp_path, corpus, "r", train__steps=5, checkpoint__every=2)
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5]


def test_another_model_without_config_yaml_is_refused_by_key(tmp_path, corpus):
    _, run_dir = train(tmp_path, corpus, "m", train__steps=2)
    (run_dir / "config.yaml").unlink()
    with pytest.raises(ConfigError) as info:
        train(tmp_path, corpus, "m", train__steps=4, model__d_model=64)
    assert info.value.key == "model.d_model" and "written with model.d_model=32, this run has 64" in str(info.value)


def test_a_checkpoint_of_other_shapes_without_any_config_is_a_clear_error(tmp_path, corpus):
    checkpoint.save(tmp_path / "x" / "checkpoints", 3, {"embed/tokens": np.zeros((3, 3), np.float32)})
    with pytest.raises(CheckpointError, match=r"index.json: does not fit this model: checkpoint lacks"):
        train(tmp_path, corpus, "x", train__steps=4)


def test_a_non_finite_state_is_not_saved_and_the_last_good_checkpoint_stays(tmp_path, corpus, monkeypatch):
    from phalanx.engines.keras_gpt import KerasGPTEngine  # phalanx train's engine for this run

    real = KerasGPTEngine.checkpoint_slots

    def poisoned(self):  # the checkpoint reads each variable's part through its slot's fetch()
        sets = real(self)
        if int(self.optimizer.step.numpy()) >= 2:
            for slot in (x for s in sets for x in s.slots if x.name == "block_0/attn/qkv/kernel"):
                slot.fetch = lambda fetch=slot.fetch: np.asarray(fetch()) * np.nan
        return sets
    monkeypatch.setattr(KerasGPTEngine, "checkpoint_slots", poisoned)
    with pytest.raises(CheckpointError, match=r"refusing to save step 2: non-finite values in "
                                              r"block_0/attn/qkv/kernel \(3072 NaN"):
        train(tmp_path, corpus, "nan", train__steps=3, checkpoint__every=1)
    ckpts = tmp_path / "nan" / "checkpoints"
    assert checkpoint.latest_valid(ckpts).name == "step-00000001"
    assert not list(ckpts.glob(".tmp-*"))


def test_a_second_trainer_on_a_run_dir_fails_before_writing(tmp_path, corpus):
    with RunLock(tmp_path / "busy"):
        with pytest.raises(ConfigError, match=f"in use by another trainer \\(pid {os.getpid()} "):
            train(tmp_path, corpus, "busy", train__steps=2)
    assert not (tmp_path / "busy" / "metrics.jsonl").exists()


def test_evaluation_follows_eval_every_whatever_log_every_is(tmp_path, corpus):
    summary, run_dir = train(tmp_path, corpus, "ev", train__steps=6, train__log_every=4, train__eval_every=3)
    got = rows(run_dir)
    assert [r["step"] for r in got] == [3, 4, 6]
    assert [r["step"] for r in got if "eval_loss" in r] == [3, 6]
    assert summary.eval_loss == got[-1]["eval_loss"]


@pytest.mark.parametrize("layout,devices", [(["parallel.dp=2"], 2), (["parallel.tp=2"], 2), ([], 1)])
def test_mfu_counts_every_device(tmp_path, corpus, layout, devices):
    from phalanx.engines.task import GPTTask

    extra = {o.split("=")[0].replace(".", "__"): o.split("=")[1] for o in layout}
    peak = 1e12
    _, run_dir = train(tmp_path, corpus, "mfu", train__steps=2, train__peak_flops=peak,
                       parallel__devices=f"cpu:{devices}", **extra)
    cfg = load_config(None, tiny_overrides(tmp_path, corpus, "mfu"))
    flops_per_step = GPTTask(cfg.model).flops_per_example() * cfg.train.global_batch
    for r in rows(run_dir):
        assert r["mfu"] == pytest.approx(flops_per_step / r["step_time_s"] / (devices * peak), rel=1e-9)


# ---------------------------------------------------------------------------
# No silent no-ops


def cluster(workers: int, ps: int = 0):
    from phalanx.cluster.tf_config import ClusterInfo
    jobs = {"worker": tuple(f"localhost:{1000 + i}" for i in range(workers))}
    if ps:
        jobs.update(chief=("localhost:999",), ps=tuple(f"localhost:{2000 + i}" for i in range(ps)))
    return ClusterInfo(cluster=jobs, task_type="chief" if ps else "worker", task_index=0)


UNHONOURED = [({"zero": 1}, "parallel.zero"), ({"zero": 2}, "parallel.zero"),
              ({"recompute": "full"}, "parallel.recompute"), ({"recompute": "selective"}, "parallel.recompute"),
              ({"microbatches": 2}, "parallel.microbatches"), ({"devices": "cpu:2"}, "parallel.devices")]


@pytest.mark.parametrize("strategy", ["parameter_server", "auto"])
@pytest.mark.parametrize("parallel,key", UNHONOURED, ids=[f"{k}={list(p.values())[0]}" for p, k in UNHONOURED])
def test_values_a_parameter_server_cluster_cannot_honour_are_refused(strategy, parallel, key):
    """Parameter servers run a whole step on one worker (auto picks them when TF_CONFIG has ps tasks)."""
    from phalanx.cluster.strategies import resolve_strategy_name

    info = cluster(2, ps=1)
    with pytest.raises(ConfigError) as err:  # micro-batches without a pipeline: refused as the config is read
        resolve_strategy_name(Config().replace(parallel={"strategy": strategy, **parallel}), info)
    ignored = key == "parallel.microbatches" and "is ignored unless parallel.pp > 1" in str(err.value)
    assert err.value.key == key and ("is not honoured by parallel.strategy=" in str(err.value) or ignored)
    assert ("parallel.strategy=mesh" in str(err.value)) or key == "parallel.devices" or ignored
    assert resolve_strategy_name(Config().replace(parallel={"strategy": strategy}), info) == "parameter_server"


@pytest.mark.parametrize("strategy", ["multi_worker", "auto"])
def test_the_builtin_gpts_multi_worker_run_takes_zero_and_each_workers_layout(strategy):
    """phalanx train's multi_worker run is each worker's own layout on the Keras-model engine:
    its devices, micro-batches and ZeRO (sliced over every worker's replicas) are honoured there."""
    from phalanx.cluster.strategies import resolve_strategy_name

    for zero in (1, 2, 3):
        assert resolve_strategy_name(Config().replace(parallel={"strategy": strategy, "zero": zero}),
                                     cluster(2)) == "multi_worker"
    assert resolve_strategy_name(Config().replace(parallel={"strategy": strategy, "devices": "cpu:2", "pp": 2,
                                                            "microbatches": 2}), cluster(2)) == "multi_worker" \
        or strategy == "auto"  # (auto with pp > 1 picks the mesh across workers)


@pytest.mark.parametrize("parallel", [{"dp": 2, "zero": 1}, {"dp": 2, "zero": 3}, {"recompute": "full"},
                                      {"recompute": "selective"}, {"dp": 2, "tp": 2, "devices": "cpu:4"},
                                      {"zero": 1}, {"microbatches": 2}],
                         ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_explicit_mirrored_is_the_default_one_process_run(parallel):
    """In one process parallel.strategy=mirrored is what auto is: the same engine on the same
    layout, so it accepts and refuses the same values, with the same messages."""
    from phalanx.engines.factory import refuse_before_build
    from phalanx.engines.task import GPTTask

    def outcome(strategy):
        try:
            cfg = Config().replace(parallel={"strategy": strategy, **parallel},
                                   model={"layers": 1, "d_model": 32, "heads": 2, "seq_len": 8})
            refuse_before_build(cfg, GPTTask(cfg.model))
        except ConfigError as err:
            return err.key, str(err).replace(f"strategy={strategy}", "strategy=?")
        return None

    assert outcome("mirrored") == outcome("auto")


def test_pipeline_microbatches_without_a_pipeline_are_refused():
    from phalanx.engines.task import GPTTask
    from phalanx.engines.factory import build_engine

    model = {"layers": 1, "d_model": 32, "heads": 2, "seq_len": 8}
    with pytest.raises(ConfigError, match="parallel.microbatches: 2 is ignored unless parallel.pp > 1.*grad_accum"):
        Config().replace(parallel={"microbatches": 2}, model=model)  # refused as the config is read
    cfg = Config().replace(parallel={"microbatches": 2, "pp": -1, "devices": "cpu:1"}, model=model)
    with pytest.raises(ConfigError, match="parallel.microbatches: 2 splits a pipeline's batch.*train.grad_accum=2"):
        build_engine(cfg, GPTTask(cfg.model))  # parallel.pp=-1 filled with one device: at build


def test_disk_full_outside_the_checkpoint_is_a_clean_error(tmp_path, corpus, monkeypatch):
    from phalanx.train import progress

    def full(run_dir, step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(run_dir) / "metrics.jsonl"))
    monkeypatch.setattr(progress, "drop_rows_after", full)
    with pytest.raises(ConfigError) as info:
        train(tmp_path, corpus, "full", train__steps=2)
    assert info.value.key == "run.dir" and "metrics.jsonl: No space left on device [ENOSPC]" in str(info.value)
