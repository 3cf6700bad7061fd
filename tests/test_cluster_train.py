"""`phalanx train` across processes: real runs through `phalanx launch` on loopback.

Every subprocess is bounded twice (the launcher's --timeout and subprocess timeouts),
killed in a finally block if a test fails early, and every test checks that no
process it started is left behind. Tiny model, float32, one shared data cache.

* multi_worker on 2 processes (the Keras-model engine on each worker, the workers data
  parallel) equals one process with dp=2 on 2 logical CPUs, losses and final weights;
* a worker SIGKILLed under --restarts 1: the cluster restarts within 30 s, resumes
  from the last checkpoint, and the final losses equal the uninterrupted run's;
* a worker crashing mid-run without --restarts: launch exits non-zero within 30 s;
* pp=2 with one stage per worker (parallel.strategy=mesh: the chief's Keras-model engine places
  stage 1 on worker:1) equals pp=2 on 2 logical CPUs of one process;
* ZeRO-3 across 2 workers, under multi_worker (2 x dp2, resumed by a second launch) and on a mesh
  over both workers' devices (dp2), equals Keras's one-device train_on_batch (tests/gpt_oracle.py);
* SIGTERM (preemption) to one worker of two: both stop at the same step, the chief
  saves a checkpoint, everything exits 0; the same for a single process;
* parameter_server (chief + 2 workers + 1 ps): the loss falls and its checkpoint loads
  in one process (`phalanx eval`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

from cluster_helpers import PHALANX, TINY, Background, assert_gone, checkpoint_steps, env, task_pids  # noqa: E402

LAUNCH = [*PHALANX, "launch"]
# Long enough to be interrupted between polls (a step of 2 workers takes ~70 ms, the kill comes at
# step 3) and for the loss to fall by more than 1.0 (5.45 -> 2.76 at step 60).
STEPS = 60
D_MODEL = int(next(o for o in TINY if o.startswith("model.d_model=")).split("=")[1])


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("phalanx-cache"))


def overrides(cache: str, run_dir: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.cache_dir={cache}", f"run.dir={run_dir}", f"train.steps={STEPS}", *extra]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a resumed run's rows replace the first attempt's."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def last_step(run_dir: Path) -> int:
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return 0
    steps = [json.loads(line)["step"] for line in text.splitlines() if line.endswith("}")]
    return max(steps, default=0)


def launch_cmd(*args: str, timeout: int, grace: int = 5) -> list[str]:
    return [*LAUNCH, *args, "--timeout", str(timeout), "--grace", str(grace), "--"]


@pytest.fixture(scope="module")
def reference_run(cache, tmp_path_factory) -> Path:
    """The uninterrupted single-process run: dp=2 on 2 of the session's logical CPUs (in this
    process: no second TensorFlow start-up). It runs on the Keras-model engine, whose one-process
    numbers are checked against independent oracles elsewhere: tf.distribute's one-device step
    (tests/test_engine.py::test_training_matches_one_device) and Keras's own train_on_batch
    (tests/test_moe_train.py::test_dp2_tp2_ep2_trains_as_keras_own_one_device_steps)."""
    from phalanx.config import load_config
    from phalanx.train.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    cfg = load_config(None, overrides(cache, run_dir, "parallel.dp=2", "parallel.devices=cpu:2"))
    Trainer(cfg, quiet=True).fit()
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[int, float]:
    result = losses(reference_run)
    assert sorted(result) == list(range(1, STEPS + 1))
    assert result[STEPS] < result[1] - 1.0  # it trains
    return result


def assert_same_losses(got: dict[int, float], expected: dict[int, float]) -> None:
    assert sorted(got) == sorted(expected)
    steps = sorted(expected)
    np.testing.assert_allclose([got[s] for s in steps], [expected[s] for s in steps], rtol=1e-5)


def test_two_workers_equal_one_process_and_resume_after_a_kill(cache, reference, reference_run, tmp_path):
    """multi_worker on 2 processes = dp=2 in one (losses every step, weights and AdamW moments at
    the end); a SIGKILLed worker under --restarts 1: the cluster restarts within 30 s, resumes
    from the last checkpoint and ends with the uninterrupted losses. (One run tests both, to
    keep the suite short.)"""
    from phalanx import checkpoint

    run_dir = tmp_path / "run"
    cmd = launch_cmd("--workers", "2", "--restarts", "1", timeout=200) + [
        *PHALANX, "train", "parallel.strategy=multi_worker", *overrides(cache, run_dir, "checkpoint.every=2")]
    with Background(cmd, tmp_path / "launch", timeout=230) as run:
        run.wait_for(lambda: last_step(run_dir) >= 3, "step 3")
        worker1 = task_pids(run.stderr())["worker:1"]
        os.kill(worker1, signal.SIGKILL)
        killed_at = time.monotonic()
        first_pids = set(task_pids(run.stderr()).values())
        run.wait_for(lambda: "restarting the cluster" in run.stderr(), "the restart")
        assert time.monotonic() - killed_at < 30
        code = run.wait()
        err = run.stderr()
    assert code == 0, err[-3000:]
    assert "layout dp=2" in err
    # Before the kill: 2 workers with 1 device each = 1 process with 2 devices. The resumed
    # run dropped the rows past its checkpoint, so metrics.jsonl holds one row per step.
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", err)
    assert resumed and int(resumed.group(1)) >= 2, err[-3000:]
    rows = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, STEPS + 1))
    first = {s: loss for s, loss in losses(run_dir).items() if s <= int(resumed.group(1))}
    assert_same_losses(first, {s: reference[s] for s in first})
    # After the restart: the steps from the checkpoint on are those of the uninterrupted run.
    assert_same_losses(losses(run_dir), reference)
    assert checkpoint_steps(run_dir)[-1] == STEPS
    assert_gone(first_pids | set(task_pids(err).values()))
    # Both runs on the Keras-model engine: the workers' run is 2 workers x 1 replica.
    final = checkpoint.step_dir(run_dir / "checkpoints", STEPS)
    assert json.loads((final / "meta.json").read_text())["layout"]["engine"] == "KerasGPTEngine"
    mine, ref = checkpoint.restore(final).tensors, checkpoint.restore(
        checkpoint.step_dir(reference_run / "checkpoints", STEPS)).tensors
    assert sorted(mine) == sorted(ref) and int(mine["optimizer/step"]) == STEPS
    for name in ref:
        if name.startswith("loss_scale/") or name == "optimizer/step":
            continue
        # Each replica's gradient is the same computation in both runs; only where the two replicas'
        # sum is formed differs (a collective across processes vs an add on one device), which is
        # float32 round-off. 60 AdamW steps can amplify round-off in an element whose gradient is
        # itself near zero to a fraction of lr (3e-3): hence the relative bound on each tensor as a
        # whole (as the MoE cluster test), with the losses above equal to 1e-5 every step.
        # The key bias is left out: softmax ignores it, so its gradient is round-off alone, which
        # AdamW scales to lr-sized steps in either run (as tests/test_moe_cluster.py).
        keep = np.r_[0:D_MODEL, 2 * D_MODEL:3 * D_MODEL] if name.endswith("attn/qkv/bias") else slice(None)
        a, b = mine[name][keep], ref[name][keep]
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-7, name


def test_builtin_gpt_zero3_across_two_workers_equals_keras_and_resumes(cache, tmp_path):
    """`phalanx train parallel.strategy=multi_worker parallel.zero=3` on 2 workers x dp2: every
    weight and AdamW moment cut into 4 slices over the 4 replicas of the 2 workers. 3 steps, a
    checkpoint (the slices all-gathered on both workers, written by the chief), then a second launch
    resumes it to step 6 (each worker cuts its slices from the restored state). Against the
    one-device oracle, Keras's own train_on_batch of the same Keras model (tests/gpt_oracle.py)
    on the same global batches: the losses and gradient norms of every step, and the final weights."""
    import gpt_oracle
    from phalanx import checkpoint
    from phalanx.config import load_config
    from phalanx.data import pipeline

    run_dir = tmp_path / "run"
    layout = ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.zero=3", "checkpoint.every=3"]
    for steps in (3, 6):
        cmd = launch_cmd("--workers", "2", timeout=150) + [
            *PHALANX, "train", "parallel.strategy=multi_worker", *overrides(cache, run_dir, *layout,
                                                                            f"train.steps={steps}")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env())
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr and "layout dp=4" in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    cfg = load_config(None, overrides(cache, tmp_path / "oracle", "train.steps=6"))
    batches = pipeline.make_datasets(cfg, progress=False).train_iterator(0)
    oracle_losses, oracle_norms, weights = gpt_oracle.run(cfg, [next(batches) for _ in range(6)])
    # The same computation up to float32 summation order (4 replicas' gradients summed across 2
    # processes vs one device's tape): ~1e-6 relative in a loss or a norm over 6 steps.
    np.testing.assert_allclose([r["loss"] for r in rows], oracle_losses, rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], oracle_norms, rtol=1e-4)
    mine = checkpoint.restore(checkpoint.step_dir(run_dir / "checkpoints", 6)).tensors
    assert int(mine["optimizer/step"]) == 6
    for name, ref in weights.items():
        # AdamW can turn round-off in an element whose gradient is near zero into an lr-sized step
        # (lr 3e-3 here): a relative bound on each tensor as a whole, the key bias left out (softmax
        # ignores it: its gradient is round-off alone), as in the test above.
        keep = np.r_[0:D_MODEL, 2 * D_MODEL:3 * D_MODEL] if name.endswith("attn/qkv/bias") else slice(None)
        a, b = mine[name][keep], ref[keep]
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-7, name


def test_builtin_gpt_zero3_on_a_mesh_across_two_workers_equals_keras(cache, tmp_path):
    """`phalanx train parallel.strategy=mesh parallel.dp=2 parallel.zero=3` on 2 workers: one mesh
    over both workers' devices, driven by the chief, each data replica (and its slices) on its own
    worker. The losses and gradient norms of Keras's train_on_batch on one device (tests/gpt_oracle.py)."""
    import gpt_oracle
    from phalanx.config import load_config
    from phalanx.data import pipeline

    run_dir = tmp_path / "run"
    cmd = launch_cmd("--workers", "2", timeout=150) + [
        *PHALANX, "train", "parallel.strategy=mesh", *overrides(cache, run_dir, "parallel.dp=2", "parallel.zero=3",
                                                                "train.steps=4")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "layout dp=2 " in proc.stderr and "zero=3" in proc.stderr and "workers=2 (mesh)" in proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = load_config(None, overrides(cache, tmp_path / "oracle", "train.steps=4"))
    batches = pipeline.make_datasets(cfg, progress=False).train_iterator(0)
    oracle_losses, oracle_norms, _ = gpt_oracle.run(cfg, [next(batches) for _ in range(4)])
    # float32 summation order alone (2 replicas' gradients summed vs one tape)
    np.testing.assert_allclose([r["loss"] for r in rows], oracle_losses, rtol=1e-5)
    np.testing.assert_allclose([r["grad_norm"] for r in rows], oracle_norms, rtol=1e-4)


def test_crashing_worker_makes_launch_fail_fast(cache, tmp_path):
    run_dir = tmp_path / "run"
    cmd = launch_cmd("--workers", "2", timeout=120, grace=5) + [
        *PHALANX, "train", "parallel.strategy=multi_worker", *overrides(cache, run_dir, "train.steps=100000")]
    with Background(cmd, tmp_path / "launch", timeout=150) as run:
        # Once the loop has started (the chief printed the model line), worker:1 dies: worker:0 is then
        # in the first step's collectives, where only SIGKILL (after --grace) ends it.
        run.wait_for(lambda: "[worker:0] model:" in run.stderr(), "the training loop")
        os.kill(task_pids(run.stderr())["worker:1"], signal.SIGKILL)
        crashed_at = time.monotonic()
        code = run.wait()
        elapsed = time.monotonic() - crashed_at
        err = run.stderr()
    assert code != 0 and elapsed < 30, (code, elapsed, err[-3000:])
    assert "worker:1 was killed by signal 9" in err
    assert_gone(task_pids(err).values())


def test_sigterm_stops_all_workers_at_one_step_with_a_checkpoint(cache, tmp_path):
    run_dir = tmp_path / "run"
    cmd = launch_cmd("--workers", "2", timeout=150) + [
        *PHALANX, "train", "parallel.strategy=multi_worker", *overrides(cache, run_dir, "train.steps=100000")]
    with Background(cmd, tmp_path / "launch", timeout=180) as run:
        run.wait_for(lambda: last_step(run_dir) >= 3, "step 3")
        os.kill(task_pids(run.stderr())["worker:1"], signal.SIGTERM)  # the notice reaches one worker only
        code = run.wait()
        err = run.stderr()
    assert code == 0, err[-3000:]
    stopped = re.search(r"\[worker:0\] signal received: checkpoint saved at step (\d+), stopping", err)
    assert stopped, err[-3000:]
    step = int(stopped.group(1))
    assert checkpoint_steps(run_dir)[-1] == step == last_step(run_dir)
    assert "all workers finished with status 0" in err
    assert_gone(task_pids(err).values())


def test_sigterm_single_process_saves_and_returns(cache, tmp_path):
    """One process (in this one): SIGTERM -> checkpoint at the next step, normal return."""
    import threading

    from phalanx.config import load_config
    from phalanx.train.trainer import Trainer

    run_dir = tmp_path / "run"
    cfg = load_config(None, overrides(cache, run_dir, "train.steps=100000"))
    done, late = threading.Event(), []

    def preempt():
        deadline = time.monotonic() + 120
        while not done.is_set() and last_step(run_dir) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        if not done.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    # A safety net: a signal arriving after fit() restored the handlers must not end pytest.
    previous = signal.signal(signal.SIGTERM, lambda *a: late.append(a))
    watcher = threading.Thread(target=preempt, daemon=True)
    try:
        watcher.start()
        summary = Trainer(cfg, quiet=True).fit()
    finally:
        done.set()
        watcher.join(5)
        signal.signal(signal.SIGTERM, previous)
    assert summary.stopped_early and not late
    assert 3 <= summary.steps < 100000
    assert checkpoint_steps(run_dir)[-1] == summary.steps == last_step(run_dir)


def test_parameter_server_trains_and_its_checkpoint_loads(cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    steps = 30
    cmd = launch_cmd("--workers", "2", "--ps", "1", timeout=150) + [
        *PHALANX, "train", "parallel.strategy=parameter_server",
        *overrides(cache, run_dir, f"train.steps={steps}", "train.log_every=5", f"train.eval_every={steps}")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the chief finished with status 0" in out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(5, steps + 1, 5))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5, rows  # it trains (asynchronously: not bit-exact)
    meta = json.loads((run_dir / "checkpoints" / f"step-{steps:08d}" / "meta.json").read_text())
    assert meta["layout"]["engine"] == "GPTParameterServerEngine"
    assert_gone(task_pids(out.stderr).values())

    # One process (this one), no cluster: the chief's checkpoint loads and evaluates to the chief's own eval loss.
    from phalanx.train.cli import main_eval

    assert main_eval([str(run_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == steps
    np.testing.assert_allclose(result["eval_loss"], rows[-1]["eval_loss"], rtol=1e-4)


# What `phalanx train` does first (train/cli.py): set up the cluster, then train with it.
TRAIN_IN_CLUSTER = ("import sys; from phalanx.config import load_config; "
                    "from phalanx.cluster.strategies import setup_cluster; cfg = load_config(None, sys.argv[1:]); "
                    "setup = setup_cluster(cfg); from phalanx.train.trainer import Trainer; "
                    "t = Trainer(cfg, cluster=setup); t.fit(); "
                    "print('TASKS', sorted({v.value.device.split('/device')[0] for v in t.engine.model.variables}))")


def test_pipeline_stages_on_two_workers_equal_local_pipeline(cache, tmp_path):
    """pp=2 with stage 0 on worker:0 and stage 1 on worker:1 (remote placement over gRPC)
    gives the losses of pp=2 on 2 logical CPUs of one process."""
    from phalanx.config import load_config
    from phalanx.train.trainer import Trainer

    pp = ["parallel.pp=2", "parallel.microbatches=4", "model.layers=2", "train.steps=6"]
    local_dir = tmp_path / "local"
    Trainer(load_config(None, overrides(cache, local_dir, *pp, "parallel.devices=cpu:2")), quiet=True).fit()
    expected = losses(local_dir)

    run_dir = tmp_path / "run"
    cmd = launch_cmd("--workers", "2", timeout=120) + [sys.executable, "-c", TRAIN_IN_CLUSTER,
                                                       *overrides(cache, run_dir, *pp)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "layout dp=1 tp=1 pp=2" in out.stderr
    assert "[worker:1] [phalanx.cluster] the chief at" in out.stdout  # worker:1 served, then left
    meta = json.loads((run_dir / "checkpoints" / "step-00000006" / "meta.json").read_text())
    assert meta["layout"]["engine"] == "KerasGPTEngine"  # the Keras-model engine drives the remote stages
    # the model's variables live on both tasks: stage 1 on worker:1, placed from the chief
    assert "[worker:0] TASKS ['/job:worker/replica:0/task:0', '/job:worker/replica:0/task:1']" in out.stdout, \
        out.stdout[-2000:]
    assert_same_losses(losses(run_dir), expected)
    assert_gone(task_pids(out.stderr).values())
