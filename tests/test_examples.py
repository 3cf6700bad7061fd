"""The recipes in examples/ run, on one device and on parallel layouts (issue 9, item 7).

Each recipe runs as a user runs it: a new process (``python examples/<recipe>.py``), so
TensorFlow starts with the devices the recipe's ``phalanx.init`` asks for (conftest's 8
logical devices are not inherited). The quick tests trim the data (``--max-samples``)
and train one epoch, and check the exit status and the final held-out line; the slow
ones train with the defaults and check the held-out figure each recipe states.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ACCURACY = re.compile(r"held-out accuracy: (\d\.\d+) \(loss (\d+\.\d+)")
LM_LOSS = re.compile(r"held-out loss: (\d+\.\d+) nats/byte, perplexity (\d+\.\d+)")
QUICK = ["--epochs", "1", "--max-samples", "128", "--verbose", "0"]
QUICK_LM = ["--epochs", "1", "--max-samples", "64", "--train-bytes", "20000", "--generate", "8", "--verbose", "0"]


def run_recipe(name: str, tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return subprocess.run([sys.executable, str(EXAMPLES / name), "--run-dir", str(tmp_path / "run"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def held_out_accuracy(done: subprocess.CompletedProcess) -> float:
    assert done.returncode == 0, done.stderr[-3000:]
    match = ACCURACY.search(done.stdout)
    assert match, done.stdout[-2000:]
    accuracy, loss = float(match.group(1)), float(match.group(2))
    assert 0.0 <= accuracy <= 1.0 and loss == loss  # not NaN
    return accuracy


def held_out_loss(done: subprocess.CompletedProcess) -> float:
    assert done.returncode == 0, done.stderr[-3000:]
    match = LM_LOSS.search(done.stdout)
    assert match, done.stdout[-2000:]
    loss = float(match.group(1))
    assert 0.0 < loss < 10.0
    return loss


# -- quick: a few steps on one device and on a parallel layout ------------------------------------

DIGITS_QUICK = [
    ("digits_mlp.py", "one"), ("digits_mlp.py", "dp2"),
    ("digits_cnn.py", "one"), ("digits_cnn.py", "pp2"),
    ("digits_lstm.py", "one"), ("digits_lstm.py", "dp2"),
]


@pytest.mark.parametrize("recipe,layout", DIGITS_QUICK, ids=[f"{r[:-3]}-{l}" for r, l in DIGITS_QUICK])
def test_digits_recipe_runs(tmp_path, recipe, layout):
    done = run_recipe(recipe, tmp_path, "--layout", layout, *QUICK)
    held_out_accuracy(done)
    assert f"layout {layout}" in done.stdout
    assert (tmp_path / "run" / "metrics.jsonl").is_file()  # the run dir the recipe was given


@pytest.mark.parametrize("layout", ["one", "pp2"])
def test_transformer_recipe_runs(tmp_path, layout):
    done = run_recipe("stdlib_transformer.py", tmp_path, "--layout", layout, *QUICK_LM)
    held_out_loss(done)
    assert "sample (prompt | continuation):" in done.stdout


def test_unknown_layout_is_a_clear_error(tmp_path):
    done = run_recipe("digits_mlp.py", tmp_path, "--layout", "pp3")
    assert done.returncode == 2
    assert "unknown layout 'pp3'" in done.stderr and "dp2pp2 = parallel.devices=cpu:4" in done.stderr


def test_batch_size_must_split_over_every_layout(tmp_path):
    done = run_recipe("digits_cnn.py", tmp_path, "--batch-size", "30")
    assert done.returncode == 2 and "not a multiple of 4" in done.stderr


# -- slow: the other layouts, and the stated held-out figures with the defaults ---------------------

# Each digits recipe's stated figure is checked on one layout, with the defaults (below).
STATED_RUNS = [("digits_mlp.py", "one"), ("digits_cnn.py", "dp2"), ("digits_lstm.py", "pp2")]
# Every other layout, on trimmed data: a layout that a quick test or a stated run trains is not run again.
DIGITS_SLOW = [(r, layout) for r in ("digits_mlp.py", "digits_cnn.py", "digits_lstm.py")
               for layout in ("dp2pp2", "pp2", "dp2") if (r, layout) not in DIGITS_QUICK + STATED_RUNS]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,layout", DIGITS_SLOW, ids=[f"{r[:-3]}-{l}" for r, l in DIGITS_SLOW])
def test_digits_recipe_runs_on_other_layouts(tmp_path, recipe, layout):
    held_out_accuracy(run_recipe(recipe, tmp_path, "--layout", layout, *QUICK))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "dp2pp2"])
def test_transformer_recipe_runs_on_other_layouts(tmp_path, layout):
    held_out_loss(run_recipe("stdlib_transformer.py", tmp_path, "--layout", layout, *QUICK_LM))


STATED = {"digits_mlp.py": 0.95, "digits_cnn.py": 0.95, "digits_lstm.py": 0.90}  # as the docstrings state


@pytest.mark.slow
@pytest.mark.parametrize("recipe,layout", STATED_RUNS, ids=[f"{r[:-3]}-{l}" for r, l in STATED_RUNS])
def test_digits_recipe_reaches_its_stated_accuracy(tmp_path, recipe, layout):
    """The default run reaches the figure the recipe states. The recipes pass --run-dir to phalanx:
    the one-device run, rerun into the same run dir, resumes, trains nothing and reports the
    same held-out figure (checked here rather than after a run of its own: one training run less)."""
    assert f">= {STATED[recipe]:.2f}" in (EXAMPLES / recipe).read_text()
    accuracy = held_out_accuracy(run_recipe(recipe, tmp_path, "--layout", layout, "--verbose", "0", timeout=600))
    assert accuracy >= STATED[recipe], (recipe, layout, accuracy)
    if layout == "one":
        again = run_recipe(recipe, tmp_path, "--layout", layout, "--verbose", "2")
        assert held_out_accuracy(again) == accuracy
        assert "nothing to do" in again.stderr


@pytest.mark.slow
def test_transformer_recipe_reaches_its_stated_loss(tmp_path):
    """The default run reaches the held-out loss its docstring states. On one device (~75 s on 2
    cores; pp2 ~90 s): the recipe's figure is the same on every layout (examples/README.md), the
    pp2 cut of this model is run above, and a long pp2 run is the LSTM's stated run. The sample
    at the end (160 single-sequence calls) is skipped: the quick runs print theirs."""
    assert "held-out loss <= 1.65 nats per byte" in (EXAMPLES / "stdlib_transformer.py").read_text()
    loss = held_out_loss(run_recipe("stdlib_transformer.py", tmp_path, "--layout", "one", "--generate", "0",
                                    "--verbose", "0", timeout=900))
    assert loss <= 1.65, loss
