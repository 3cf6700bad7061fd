"""Fault tests of `phalanx train` as a subprocess (issue 12, "trustworthy runs"; slow).

* kill loop: SIGKILL at 6 random points (during start-up, mid-step, mid-save) of a run
  with checkpoint.every=1; every restart resumes, and the final per-step losses equal an
  uninterrupted run's, one metrics row per step;
* a corrupted newest checkpoint: the resume warns naming the file and goes on from the
  one before; with every checkpoint damaged, exit 2 with one line and no traceback;
* disk full on a real 1 MiB tmpfs (skipped where mounting is impossible; simulated in
  test_reliability.py): exit 2 naming the path and the bytes, older checkpoints intact;
  rerunning with a lower checkpoint.keep prunes first and finishes;
* two trainers on one run.dir: the second exits 2 at once naming the first one's pid;
* Ctrl-C (SIGINT to the process group): a checkpoint at the step boundary, exit 0, and the
  resumed run's losses equal the uninterrupted run's; a second Ctrl-C (during a save made
  slow by a patched writer) stops at once with one line and exit 130, the previous
  checkpoint loadable and the resume going on from it.

Every subprocess runs in its own process group, is bounded by a timeout and killed in a
finally block.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from phalanx import checkpoint

pytestmark = pytest.mark.slow

PHALANX = [sys.executable, "-m", "phalanx.cli", "train"]
TINY = ["model.layers=1", "model.d_model=32", "model.heads=2", "model.ffn=64", "model.seq_len=32",
        "data.max_bytes=300000", "train.global_batch=8", "train.log_every=1", "train.eval_every=0",
        "precision.policy=float32", "train.warmup=5", "train.lr=3e-3"]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    e.update(TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="1")
    return e


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("phalanx-cache"))


def args(cache: str, run_dir: Path, *extra: str) -> list[str]:
    return [*PHALANX, *TINY, f"data.cache_dir={cache}", f"run.dir={run_dir}", *extra]


def run(cmd: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by the kill (the resumed run drops it)
    return out


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in metrics(run_dir)), default=0)


def start(cmd: list[str], logs: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(logs.with_suffix(".out"), "w"), stderr=open(logs.with_suffix(".err"), "w"),
                            env=env(), start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


STEPS = 40


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory) -> list[float]:
    """The per-step losses of an uninterrupted STEPS-step run. It saves no checkpoint on the
    way (only at its end): saving must not change the training either (and each save waits
    ~0.1 s on fsync)."""
    reference = tmp_path_factory.mktemp("reference") / "run"
    done = run(args(cache, reference, f"train.steps={STEPS}", "checkpoint.every=0"))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = [r["loss"] for r in metrics(reference)]
    assert len(expected) == STEPS
    return expected


def test_kill_loop_ends_with_the_uninterrupted_losses(tmp_path, cache, uninterrupted):
    # Every step saves a checkpoint (~0.1 s each); the kills stop by step steps - 2 and each attempt
    # moves 1-6 steps on, so 40 steps leave room for all six.
    steps, kills = STEPS, 6
    expected = uninterrupted

    seed = int(os.environ.get("PHALANX_KILL_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    run_dir = tmp_path / "killed"
    cmd = args(cache, run_dir, f"train.steps={steps}", "checkpoint.every=1")
    killed_at = []
    for attempt in range(kills):
        proc = start(cmd, tmp_path / f"attempt{attempt}")
        try:
            resumed = last_step(run_dir)
            if rng.random() < 0.2:  # during start-up: import, build, restore
                time.sleep(rng.uniform(0.5, 3.0))
            else:  # after a few more steps, at a random point inside a step or its checkpoint
                target = min(resumed + rng.randint(1, 6), steps - 2 * (kills - attempt))
                deadline = time.monotonic() + 120
                while last_step(run_dir) < target:
                    assert proc.poll() is None, (f"exited ({proc.returncode}) before step {target} (seed {seed}):\n"
                                                 + (tmp_path / f"attempt{attempt}.err").read_text()[-3000:])
                    assert time.monotonic() < deadline, f"no progress to step {target} (seed {seed})"
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 0.08))
            assert proc.poll() is None, f"finished before kill {attempt + 1} (seed {seed})"
            killed_at.append(last_step(run_dir))
        finally:
            kill_group(proc)
    assert len(killed_at) == kills and killed_at[-1] < steps
    final = run(cmd)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resumed from" in final.stderr
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), f"seed {seed}, kills at {killed_at}"
    np.testing.assert_allclose([r["loss"] for r in rows], expected, rtol=1e-6,
                               err_msg=f"seed {seed}, kills at steps {killed_at}")
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert checkpoint.latest_valid(run_dir / "checkpoints").name == f"step-{steps:08d}"


def test_corrupted_newest_checkpoint_resumes_from_the_previous_one(tmp_path, cache):
    run_dir = tmp_path / "run"
    first = run(args(cache, run_dir, "train.steps=4", "checkpoint.every=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir / "checkpoints" / "step-00000004" / "meta.json").write_text("{garbage")
    second = run(args(cache, run_dir, "train.steps=6", "checkpoint.every=2"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "warning: skipping damaged checkpoint step-00000004" in second.stderr
    assert "step-00000004/meta.json: truncated or overwritten" in second.stderr
    assert "resumed from" in second.stderr and "step-00000002 (step 2)" in second.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]

    for path in checkpoint.all_checkpoints(run_dir / "checkpoints"):
        shards = list(path.glob("shards/*.bin"))  # every shard set's data file
        assert shards, path
        for shard in shards:
            data = bytearray(shard.read_bytes())
            data[100] ^= 0xFF
            shard.write_bytes(bytes(data))
    third = run(args(cache, run_dir, "train.steps=8"))
    assert third.returncode == 2
    assert "Traceback" not in third.stderr
    error = [line for line in third.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and "none of its 3 checkpoints is valid" in error[0] and "checksum mismatch" in error[0]


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}); "
                    f"test_reliability.py simulates ENOSPC instead")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_is_a_clean_error_and_a_lower_keep_finishes(tmp_path, cache, tmpfs):
    run_dir = tmpfs / "run"  # ~245 KB per checkpoint of the tiny model: 1 MiB holds 3, not 5
    full = run(args(cache, run_dir, "train.steps=12", "checkpoint.every=1", "checkpoint.keep=5"))
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    [error] = [line for line in full.stderr.splitlines() if line.startswith("error: ")]
    assert str(run_dir / "checkpoints") in error and "No space left on device [ENOSPC]" in error
    assert "it needs " in error and " bytes)" in error and "previous checkpoints are intact" in error
    saved = [p.name for p in checkpoint.all_checkpoints(run_dir / "checkpoints")]
    assert saved and checkpoint.latest_valid(run_dir / "checkpoints").name == saved[-1]
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))

    again = run(args(cache, run_dir, "train.steps=12", "checkpoint.every=1", "checkpoint.keep=2"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.name for p in checkpoint.all_checkpoints(run_dir / "checkpoints")] == ["step-00000011",
                                                                                       "step-00000012"]
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, 13))


def test_a_second_trainer_on_the_same_run_dir_exits_2_naming_the_pid(tmp_path, cache):
    run_dir = tmp_path / "run"
    first = start(args(cache, run_dir, "train.steps=100000", "checkpoint.every=0"), tmp_path / "first")
    try:
        deadline = time.monotonic() + 120
        while last_step(run_dir) < 1:
            assert first.poll() is None, (tmp_path / "first.err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        second = run(args(cache, run_dir, "train.steps=10"), timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by another trainer (pid {first.pid} " in second.stderr
        assert "Traceback" not in second.stderr
        assert time.monotonic() - t0 < 60  # refused at start, not after training
        assert first.poll() is None  # the first one goes on
        os.kill(first.pid, signal.SIGTERM)  # preemption path: saves a checkpoint and exits 0
        assert first.wait(timeout=60) == 0
    finally:
        kill_group(first)
    steps = [r["step"] for r in metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved rows


def wait_for(condition, proc: subprocess.Popen, logs: Path, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"exited ({proc.returncode}) before {what}:\n" + logs.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n" + logs.read_text()[-3000:]
        time.sleep(0.01)


def test_ctrl_c_saves_at_the_step_boundary_and_the_resume_gives_the_uninterrupted_losses(
        tmp_path, cache, uninterrupted):
    run_dir = tmp_path / "run"
    cmd = args(cache, run_dir, f"train.steps={STEPS}", "checkpoint.every=0")
    proc = start(cmd, tmp_path / "first")
    err = tmp_path / "first.err"
    try:
        wait_for(lambda: last_step(run_dir) >= 3, proc, err, "step 3")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends: the whole group
        assert proc.wait(timeout=120) == 0, err.read_text()[-3000:]  # as on SIGTERM
    finally:
        kill_group(proc)
    text = err.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "SIGINT received: stopping at the end of this step with a checkpoint (Ctrl-C again stops at once" in text
    stopped = int(text.split("signal received: checkpoint saved at step ")[1].split(",")[0])
    assert f"checkpoint saved at step {stopped}, stopping (SIGINT)" in text
    assert 3 <= stopped < STEPS
    newest = checkpoint.latest_valid(run_dir / "checkpoints")
    assert newest.name == f"step-{stopped:08d}" and checkpoint.restore(newest).step == stopped
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, stopped + 1))

    resumed = run(cmd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {stopped})" in resumed.stderr and "resumed from" in resumed.stderr
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in rows], uninterrupted, rtol=1e-6)


#: `phalanx train` whose shard writer sleeps (10 min) once the file $PHALANX_TEST_SLOW_SAVE exists:
#: a save in progress that only a second Ctrl-C can end early
SLOW_SAVE = [sys.executable, "-c", """
import os, sys, time
from phalanx import checkpoint
real = checkpoint.write_shard_set
def slow(*args, **kwargs):
    if os.path.exists(os.environ["PHALANX_TEST_SLOW_SAVE"]):
        time.sleep(600)
    return real(*args, **kwargs)
checkpoint.write_shard_set = slow
from phalanx.cli import main
sys.exit(main())
""", "train"]


def test_a_second_ctrl_c_stops_at_once_and_the_previous_checkpoint_resumes(tmp_path, cache):
    run_dir = tmp_path / "run"
    marker = tmp_path / "slow-now"
    overrides = [*TINY, f"data.cache_dir={cache}", f"run.dir={run_dir}", "train.steps=1000", "checkpoint.every=2"]
    err = tmp_path / "first.err"
    proc = subprocess.Popen([*SLOW_SAVE, *overrides], stdout=open(tmp_path / "first.out", "w"), stderr=open(err, "w"),
                            env={**env(), "PHALANX_TEST_SLOW_SAVE": str(marker)}, start_new_session=True)
    try:
        wait_for(lambda: checkpoint.latest(run_dir / "checkpoints") is not None and last_step(run_dir) >= 3,
                 proc, err, "a first checkpoint")
        marker.touch()  # every save from now on hangs in its shard writer
        os.killpg(proc.pid, signal.SIGINT)
        wait_for(lambda: "SIGINT received" in err.read_text(), proc, err, "the first Ctrl-C's notice")
        wait_for(lambda: list((run_dir / "checkpoints").glob(".tmp-*")), proc, err, "a save in progress")
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)  # the save would hang 10 minutes
    finally:
        kill_group(proc)
    text = err.read_text()
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    newest = checkpoint.latest(run_dir / "checkpoints")
    [line] = [x for x in text.splitlines() if x.startswith("error: ")]
    assert line == (f"error: interrupted: stopped at once without saving; the checkpoints are as they were "
                    f"(newest: {newest})")
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the abandoned save cleaned up
    assert checkpoint.latest_valid(run_dir / "checkpoints") == newest
    saved = checkpoint.step_of(newest)
    assert saved >= 2 and checkpoint.restore(newest).tensors  # loadable

    resumed = run(args(cache, run_dir, f"train.steps={saved + 2}", "checkpoint.every=2"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {saved})" in resumed.stderr
    assert [r["step"] for r in metrics(run_dir)] == list(range(1, saved + 3))
