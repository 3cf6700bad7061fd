"""Helpers for the multi-process tests (tests/test_cluster_train.py, tests/test_faults_cluster.py):
`phalanx launch` runs on loopback in their own process group, bounded in time, and
checks that nothing is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PHALANX = [sys.executable, "-m", "phalanx.cli"]
TINY = ["model.layers=1", "model.d_model=32", "model.heads=2", "model.ffn=64", "model.seq_len=32",
        "data.max_bytes=300000", "train.global_batch=8", "train.log_every=1", "train.eval_every=0",
        "precision.policy=float32", "train.warmup=5", "train.lr=3e-3"]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    e["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return e


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


def task_pids(stderr: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"(\w+:\d+) \(pid (\d+)\)", stderr)}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_gone(pids) -> None:
    end = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes left behind"


class Background:
    """A command running in its own process group; output to files; always killed at exit."""

    def __init__(self, cmd: list[str], logs: Path, timeout: float):
        self.out, self.err = logs.with_suffix(".out"), logs.with_suffix(".err")
        self.deadline = time.monotonic() + timeout
        self.proc = subprocess.Popen(cmd, stdout=open(self.out, "w"), stderr=open(self.err, "w"), env=env(),
                                     start_new_session=True)

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, condition, what: str) -> None:
        while not condition():
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before {what}:\n{self.stderr()[-3000:]}"
            assert time.monotonic() < self.deadline, f"timed out waiting for {what}:\n{self.stderr()[-3000:]}"
            time.sleep(0.02)

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running at its deadline:\n{self.stderr()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()
