"""Kill-and-resume across processes (issue 12 item 9, "fault tests"; slow).

Real `phalanx launch ... --restarts 1 -- phalanx train` runs on loopback:

* the cross-worker mesh (pp=2, one pipeline stage per worker, remote placement over
  gRPC): worker:1, which holds stage 1, is SIGKILLed after the first checkpoint; the
  cluster restarts, resumes from the last checkpoint, and every loss equals an
  uninterrupted run's (pp=2 on 2 logical CPUs of one process, which
  test_cluster_train shows equal to the cluster's), rtol 1e-5, one metrics row per step;
* parameter_server (chief + 2 workers + 1 ps): a worker is SIGKILLed after the first
  checkpoint; the cluster restarts and resumes from a checkpoint and finishes. Its steps
  are asynchronous, so only what is deterministic is asserted: exit 0, the resumed step,
  one metrics row per step 1..STEPS, the final checkpoint loads (`phalanx eval`), and
  the losses after the resume are finite and below step 1's.

* parameter_server, a dead worker noticed promptly: worker:1 SIGKILLed under a long
  ``--grace``; the launcher SIGTERMs the others, the chief saves and exits by itself
  (before, TensorFlow's ClusterCoordinator kept the finished chief waiting for the dead
  worker until the launcher's SIGKILL at the end of the grace period).

Every launch is bounded twice (the launcher's --timeout and the test's own deadline),
runs in its own process group killed in a finally block, and every test checks that
no process it started is left behind.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

from cluster_helpers import PHALANX, TINY, Background, assert_gone, checkpoint_steps, task_pids  # noqa: E402



@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("phalanx-cache"))


def overrides(cache: str, run_dir: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.cache_dir={cache}", f"run.dir={run_dir}", *extra]


def rows(run_dir: Path) -> list[dict]:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by the kill
    return out


def launch(*args: str, timeout: int, grace: int = 5) -> list[str]:
    return [*PHALANX, "launch", *args, "--restarts", "1", "--timeout", str(timeout), "--grace", str(grace), "--",
            *PHALANX, "train"]


def kill_after_first_checkpoint(run: Background, run_dir: Path, victim: str) -> tuple[int, set[int]]:
    """SIGKILL ``victim`` once a checkpoint exists; returns (newest checkpoint then, first attempt's pids)."""
    run.wait_for(lambda: checkpoint_steps(run_dir), "the first checkpoint")
    saved = checkpoint_steps(run_dir)[-1]
    pids = task_pids(run.stderr())
    os.kill(pids[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    run.wait_for(lambda: "restarting the cluster" in run.stderr(), "the restart")
    assert time.monotonic() - killed_at < 30
    return saved, set(pids.values())


def resumed_step(err: str) -> int:
    found = re.findall(r"resumed from \S+ \(step (\d+)\)", err)
    assert len(found) == 1, err[-3000:]
    return int(found[0])


MESH_STEPS = 10  # the kill comes after the first checkpoint (step 2)
PP = ["parallel.pp=2", "parallel.microbatches=4", "model.layers=2", f"train.steps={MESH_STEPS}"]


def test_mesh_across_workers_resumes_after_a_kill_with_the_uninterrupted_losses(cache, tmp_path):
    """pp=2, stage 1 on worker:1; worker:1 SIGKILLed after the first checkpoint under
    --restarts 1: the restarted cluster resumes and every loss equals the uninterrupted run's."""
    from phalanx.config import load_config
    from phalanx.train.trainer import Trainer

    # The uninterrupted run: pp=2 on 2 logical CPUs of this process (equal to the cluster's
    # pp=2 across two workers: test_cluster_train::test_pipeline_stages_on_two_workers_equal_local_pipeline).
    local_dir = tmp_path / "local"
    Trainer(load_config(None, overrides(cache, local_dir, *PP, "parallel.devices=cpu:2")), quiet=True).fit()
    expected = [r["loss"] for r in rows(local_dir)]
    assert len(expected) == MESH_STEPS

    run_dir = tmp_path / "run"
    cmd = launch("--workers", "2", timeout=150) + ["parallel.strategy=mesh",
                                                   *overrides(cache, run_dir, *PP, "checkpoint.every=2")]
    with Background(cmd, tmp_path / "launch", timeout=180) as run:
        saved, first_pids = kill_after_first_checkpoint(run, run_dir, "worker:1")
        code = run.wait()
        err = run.stderr()
    assert code == 0, err[-3000:]
    assert "layout dp=1 tp=1 pp=2" in err
    assert "worker:1 was killed by signal 9" in err
    step = resumed_step(err)
    assert saved <= step < MESH_STEPS, (saved, step)
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, MESH_STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in got], expected, rtol=1e-5)
    assert checkpoint_steps(run_dir)[-1] == MESH_STEPS
    meta = json.loads((run_dir / "checkpoints" / f"step-{MESH_STEPS:08d}" / "meta.json").read_text())
    assert meta["layout"]["engine"] == "KerasGPTEngine"  # the Keras-model engine on the remote mesh
    assert_gone(first_pids | set(task_pids(err).values()))


PS_STEPS = 30


def test_parameter_server_resumes_after_a_worker_is_killed(cache, tmp_path, capsys):
    """chief + 2 workers + 1 ps; worker:1 SIGKILLed after the first checkpoint under --restarts 1.
    Asynchronous steps: the losses are not compared with another run, only what is deterministic."""
    run_dir = tmp_path / "run"
    cmd = launch("--workers", "2", "--ps", "1", timeout=150) + [
        "parallel.strategy=parameter_server",
        *overrides(cache, run_dir, f"train.steps={PS_STEPS}", "checkpoint.every=2")]
    with Background(cmd, tmp_path / "launch", timeout=180) as run:
        saved, first_pids = kill_after_first_checkpoint(run, run_dir, "worker:1")
        code = run.wait()
        err = run.stderr()
    assert code == 0, err[-3000:]
    assert "worker:1 was killed by signal 9" in err
    assert "the chief finished with status 0" in err
    # The chief may still save on the launcher's SIGTERM after the kill: the resume is at
    # the checkpoint seen before the kill or a later one, never from scratch.
    step = resumed_step(err)
    assert saved <= step < PS_STEPS, (saved, step)
    got = rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, PS_STEPS + 1))
    losses = {r["step"]: r["loss"] for r in got}
    after = [losses[s] for s in range(step + 1, PS_STEPS + 1)]
    assert all(math.isfinite(x) for x in after), after
    assert after[-1] < losses[1] - 0.5, (losses[1], after)  # it trains on after the resume
    assert checkpoint_steps(run_dir)[-1] == PS_STEPS
    meta = json.loads((run_dir / "checkpoints" / f"step-{PS_STEPS:08d}" / "meta.json").read_text())
    assert meta["layout"]["engine"] == "GPTParameterServerEngine"
    assert_gone(first_pids | set(task_pids(err).values()))

    # The final checkpoint loads in one process (this one, no cluster).
    from phalanx.train.cli import main_eval

    assert main_eval([str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == PS_STEPS and math.isfinite(result["eval_loss"])


def test_parameter_server_chief_exits_without_waiting_for_the_grace_after_a_worker_dies(cache, tmp_path):
    """chief + 2 workers + 1 ps under --grace 120 and no restarts; worker:1 SIGKILLed after the
    first checkpoint. Every task leaves by itself (the launcher never has to SIGKILL one: the
    event order), the chief after saving a checkpoint, and well within the grace period."""
    grace = 120
    run_dir = tmp_path / "run"
    cmd = [*PHALANX, "launch", "--workers", "2", "--ps", "1", "--restarts", "0", "--timeout", "250", "--grace",
           str(grace), "--", *PHALANX, "train", "parallel.strategy=parameter_server",
           *overrides(cache, run_dir, "train.steps=100000", "checkpoint.every=2")]
    with Background(cmd, tmp_path / "launch", timeout=300) as run:
        run.wait_for(lambda: checkpoint_steps(run_dir), "the first checkpoint")
        pids = task_pids(run.stderr())
        os.kill(pids["worker:1"], signal.SIGKILL)
        killed_at = time.monotonic()
        code = run.wait()
        delay = time.monotonic() - killed_at
        err = run.stderr()
    print(f"worker death -> launcher exit: {delay:.1f} s (grace {grace} s)")
    assert code == 128 + signal.SIGKILL, err[-3000:]  # the status of the task that failed first
    assert "worker:1 was killed by signal 9" in err
    assert "killing" not in err, err[-3000:]  # no task outlived the SIGTERM: none needed the grace SIGKILL
    assert "signal received: checkpoint saved" in err  # the chief saved on the launcher's SIGTERM
    assert delay < grace / 2, delay
    assert_gone(set(pids.values()))
