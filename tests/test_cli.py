"""The console script end to end: train, eval, generate, and errors (exit 2)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tiny_overrides, write_corpus

PHALANX = shutil.which("phalanx", path=str(Path(sys.executable).parent)) or "phalanx"


def phalanx(*args, timeout=300):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([PHALANX, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_help_lists_commands():
    proc = phalanx("--help")
    assert proc.returncode == 0
    for cmd in ("train", "eval", "generate", "data", "plan", "schedule", "launch"):
        assert cmd in proc.stdout


def test_unknown_command_exits_2():
    proc = phalanx("trian")
    assert proc.returncode == 2 and "unknown command 'trian'" in proc.stderr


def test_train_eval_generate(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    args = tiny_overrides(tmp_path, corpus, train__steps=4, train__log_every=2, train__eval_every=4)
    proc = phalanx("train", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done: step 4" in proc.stderr and "metrics.jsonl" in proc.stderr
    run_dir = tmp_path / "run"
    assert (run_dir / "checkpoints" / "step-00000004" / "meta.json").is_file()

    proc = phalanx("eval", str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == 4 and 0 < result["eval_loss"] < 10 and result["perplexity"] > 1

    proc = phalanx("generate", str(run_dir), "--prompt", "def ", "--tokens", "12", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("def ") and len(proc.stdout.encode()) >= 12


def test_eval_of_a_directory_without_run_exits_2(tmp_path):
    proc = phalanx("eval", str(tmp_path))
    assert proc.returncode == 2 and "run.dir" in proc.stderr and "config.yaml" in proc.stderr


def test_bad_override_exits_2_naming_key():
    proc = phalanx("train", "model.heads=5")
    assert proc.returncode == 2
    assert "model.heads" in proc.stderr and "does not divide model.d_model=256" in proc.stderr
