"""`phalanx train` remembers its run, and the CLI's messages: resume with the saved config.yaml
(changes named; model/data changes refused before anything is written), a finished run,
YAML syntax errors, missing directories, --print-config, nearest-key suggestions."""

import re

import numpy as np
import pytest
import yaml

from phalanx import checkpoint
from phalanx.cli import main
from phalanx.config import ConfigError, load_config
from phalanx.train.resume import resolve_train_config

from helpers import tiny_overrides, write_corpus


def saved_run(tmp_path, *overrides):
    """A run directory as `phalanx train` leaves it: config.yaml and one checkpoint."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run.dir={run_dir}", "data.source=/data/prepared", "train.steps=100", *overrides])
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    checkpoint.save(run_dir / "checkpoints", 100, {"w": np.zeros(2, np.float32)})
    return run_dir


def listing(root):
    return sorted((str(p), p.stat().st_mtime_ns) for p in root.rglob("*"))


def test_resume_reuses_the_saved_config_and_names_what_changes(tmp_path):
    run_dir = saved_run(tmp_path)
    cfg, note = resolve_train_config(None, [f"run.dir={run_dir}", "train.steps=200", "train.lr=3e-4"])
    assert cfg.data.source == "/data/prepared"  # not given again: the run's own
    assert (cfg.train.steps, cfg.train.lr) == (200, 3e-4)
    assert note == f"resuming {run_dir} (its config.yaml): train.steps 100 -> 200, train.lr 0.001 -> 0.0003"
    cfg, note = resolve_train_config(None, [f"run.dir={run_dir}"])
    assert note == f"resuming {run_dir} (its config.yaml)" and cfg.train.steps == 100


def test_resume_in_another_layout_derives_dp_again(tmp_path):
    run_dir = saved_run(tmp_path, "parallel.devices=cpu:2", "parallel.dp=2")
    cfg, note = resolve_train_config(None, [f"run.dir={run_dir}", "parallel.devices=cpu:4", "parallel.tp=2"])
    assert (cfg.parallel.dp, cfg.parallel.tp) == (2, 2)
    assert "parallel.devices cpu:2 -> cpu:4" in note and "parallel.tp 1 -> 2" in note


@pytest.mark.parametrize("override,key", [("model.layers=8", "model.layers"), ("data.source=stdlib", "data.source"),
                                          ("train.seed=3", "train.seed"), ("data.val_fraction=0.1", "data.val_fraction"),
                                          ("train.global_batch=32", "train.global_batch")])
def test_resume_refuses_a_change_of_model_or_data_before_writing(tmp_path, capsys, override, key):
    run_dir = saved_run(tmp_path)
    before = listing(run_dir)
    assert main(["train", f"run.dir={run_dir}", override, "train.steps=200"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}: {run_dir} holds a run of another model or data: {key} ")
    assert "train.steps" not in err  # only the refused keys are listed
    assert listing(run_dir) == before


def test_a_config_file_matching_the_run_resumes_quietly(tmp_path):
    run_dir = saved_run(tmp_path)
    cfg, note = resolve_train_config(str(run_dir / "config.yaml"), [])
    assert note == f"resuming {run_dir} (its config.yaml)"


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path, capsys):
    run_dir = saved_run(tmp_path)
    assert main(["train", f"run.dir={run_dir}", "train.steps=300", "--print-config"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["train"]["steps"] == 300 and out["data"]["source"] == "/data/prepared"
    assert checkpoint.latest(run_dir / "checkpoints").name == "step-00000100"
    fresh = tmp_path / "fresh"
    assert main(["train", f"run.dir={fresh}", "parallel.devices=cpu:4", "parallel.tp=2", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["parallel"]["dp"] == 2 and not fresh.exists()


def test_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  layers: 2\ntrain:\n  steps: [1, 2\n  lr: 3\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"error: {re.escape(str(bad))}:\d+: not valid YAML: ", err), err


@pytest.mark.parametrize("command", [["eval"], ["generate"], ["export", "--format", "keras"]])
def test_a_missing_run_directory_does_not_exist(tmp_path, capsys, command):
    assert main([command[0], str(tmp_path / "nope"), *command[1:]]) == 2
    assert capsys.readouterr().err == f"error: run_dir: {str(tmp_path / 'nope')!r} does not exist\n"


def test_unknown_key_suggests_the_nearest(capsys):
    with pytest.raises(ConfigError, match=r"train.step: unknown key \(did you mean train.steps\?\)"):
        load_config(None, ["train.step=5"])
    with pytest.raises(ConfigError, match=r"trian: unknown section \(did you mean train\?\)"):
        load_config(None, ["trian.steps=5"])
    assert main(["train", "parallel.tpp=2", "--print-config"]) == 2
    assert "did you mean parallel.tp?" in capsys.readouterr().err


def test_a_finished_run_says_nothing_to_do_with_its_loss(tmp_path, capsys):
    from phalanx.train.trainer import Trainer
    corpus = write_corpus(tmp_path / "corpus")
    cfg = load_config(None, tiny_overrides(tmp_path, corpus, train__steps=2))
    first = Trainer(cfg).fit()
    capsys.readouterr()
    again = Trainer(cfg).fit()
    err = capsys.readouterr().err
    assert f"nothing to do: {cfg.run.dir} is at step 2, loss {first.loss:.4f}" in err, err
    assert "done:" not in err and again.loss == pytest.approx(first.loss) and again.steps == 2


def test_prepared_data_supplies_its_tokenizer_and_vocabulary(tmp_path):
    from phalanx.data.cli import main as data_main
    from phalanx.data.pipeline import make_datasets
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "prepared"
    assert data_main(["prepare", "--input", corpus, "--output", str(out), "--tokenizer", "bpe", "--bpe-vocab", "300",
                      "--seq-len", "32", "--quiet"]) == 0
    import json
    size = json.loads((out / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    cfg = load_config(None, tiny_overrides(tmp_path, str(out)))  # no data.tokenizer, bpe_vocab or model.vocab
    assert (cfg.data.tokenizer, cfg.data.bpe_vocab, cfg.model.vocab) == ("bpe", size, size)
    assert make_datasets(cfg, progress=False).vocab_size == size  # the data's own checks agree
    # an explicit key is kept: a larger model vocabulary is fine
    assert load_config(None, [*tiny_overrides(tmp_path, str(out)), "model.vocab=512"]).model.vocab == 512


def test_a_bpe_vocabulary_mismatch_names_data_bpe_vocab(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.tokenizer=bpe", "model.vocab=512"])
    assert err.value.key == "data.bpe_vocab" and "set data.bpe_vocab=512" in str(err.value)


@pytest.mark.parametrize("keys", [
    ["parallel.devices=cpu:8", "parallel.pp=4", "parallel.schedule=interleaved", "parallel.virtual_stages=2",
     "parallel.microbatches=8", "model.layers=8"],
    ["parallel.devices=cpu:8", "parallel.tp=2"],
    ["parallel.devices=cpu:4", "parallel.tp=2", "parallel.pp=2"]])
def test_plan_and_train_derive_the_same_layout(keys, capsys):
    import json

    from phalanx.commands.plan import main as plan_main
    assert plan_main([*keys, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["layout"]
    cfg = load_config(None, keys)
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (planned["dp"], planned["tp"], planned["pp"])
    assert main(["train", *keys, "--print-config"]) == 0  # what phalanx train would run
    assert yaml.safe_load(capsys.readouterr().out)["parallel"]["dp"] == planned["dp"]
