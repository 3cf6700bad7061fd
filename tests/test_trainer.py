"""The training loop end to end: outputs, resume equals an uninterrupted run, eval,
a golden-loss debug run (a user's Keras model: tests/test_keras_fit.py)."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from phalanx import checkpoint
from phalanx.config import ConfigError, load_config
from phalanx.train.progress import read_metrics
from phalanx.train.trainer import Trainer

from helpers import tiny_overrides, write_corpus

GOLDEN = Path(__file__).parent / "golden" / "debug_3step.json"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def run(tmp_path, corpus, name="run", **extra):
    cfg = load_config(None, tiny_overrides(tmp_path, corpus, name, **extra))
    return Trainer(cfg, quiet=True).fit(), cfg


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def test_run_writes_all_outputs_and_loss_falls(tmp_path, corpus):
    summary, cfg = run(tmp_path, corpus, train__steps=30, train__lr=3e-3, train__eval_every=15,
                       train__log_every=5, checkpoint__every=10, checkpoint__keep=2)
    run_dir = Path(cfg.run.dir)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [5, 10, 15, 20, 25, 30]
    for key in ("step", "loss", "lr", "tokens_per_s", "mfu", "step_time_s"):
        assert key in rows[0]
    assert "eval_loss" in rows[2] and "eval_loss" in rows[-1]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    kept = [p.name for p in checkpoint.all_checkpoints(run_dir / "checkpoints")]
    assert kept == ["step-00000020", "step-00000030"]
    assert summary.steps == 30 and summary.eval_loss is not None and summary.tokens_per_s > 0
    # the built-in GPT trains on the Keras-model engine
    meta = json.loads((run_dir / "checkpoints" / "step-00000030" / "meta.json").read_text())
    assert meta["layout"]["engine"] == "KerasGPTEngine"


def test_resume_gives_the_uninterrupted_losses(tmp_path, corpus):
    full, cfg_full = run(tmp_path, corpus, "full", train__steps=6, checkpoint__every=3)
    # The same run, stopped after step 3: keep only its first checkpoint and log lines.
    part = tmp_path / "part"
    shutil.copytree(cfg_full.run.dir, part)
    shutil.rmtree(part / "checkpoints" / "step-00000006")
    metrics = (part / "metrics.jsonl").read_text().splitlines()[:3]
    (part / "metrics.jsonl").write_text("\n".join(metrics) + "\n")
    resumed, _ = run(tmp_path, corpus, "part", train__steps=6, checkpoint__every=3)
    assert resumed.steps == 6
    np.testing.assert_allclose([l for _, l in losses(part)], [l for _, l in losses(cfg_full.run.dir)], rtol=1e-6)
    a = checkpoint.restore(Path(cfg_full.run.dir) / "checkpoints" / "step-00000006").tensors
    b = checkpoint.restore(part / "checkpoints" / "step-00000006").tensors
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-8, err_msg=k)


def test_resume_refuses_a_different_model(tmp_path, corpus):
    run(tmp_path, corpus, "r", train__steps=2)
    with pytest.raises(ConfigError, match="run.dir"):
        run(tmp_path, corpus, "r", train__steps=4, model__d_model=64)


def test_save_is_atomic_when_killed_mid_write(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    checkpoint.save(root, 1, {"w": np.ones(2, np.float32)})

    def crash(path):
        raise KeyboardInterrupt("killed")
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(root, 2, {"w": np.zeros(2, np.float32)}, writers={"data": crash})
    assert checkpoint.latest(root).name == "step-00000001"
    assert not list(root.glob(".tmp-*"))
    assert checkpoint.restore(checkpoint.latest(root)).tensors["w"].tolist() == [1.0, 1.0]


def test_golden_losses_of_a_3_step_debug_run(tmp_path, corpus):
    _, cfg = run(tmp_path, corpus, "golden", train__steps=3)
    got = [l for _, l in losses(cfg.run.dir)]
    if os.environ.get("PHALANX_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": got}, indent=1) + "\n")
    expected = json.loads(GOLDEN.read_text())["losses"]
    np.testing.assert_allclose(got, expected, rtol=1e-4)


