"""Config loading and every validation error: the message names the key, the value
and what would be valid; the CLI exits 2."""

import subprocess
import sys

import pytest

from phalanx.config import Config, ConfigError, load_config, resolve_degrees


def test_defaults_are_valid_and_overrides_apply():
    cfg = load_config(None, ["parallel.dp=2", "train.lr=3e-4", "precision.policy=mixed_bfloat16",
                             "data.source=stdlib", "model.tie_embeddings=false"])
    assert cfg.parallel.dp == 2 and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.precision.policy == "mixed_bfloat16" and cfg.model.tie_embeddings is False
    assert cfg.train.micro_batch == 16


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  layers: 3\ntrain:\n  steps: 7\n")
    cfg = load_config(path, ["train.steps=9"])
    assert cfg.model.layers == 3 and cfg.train.steps == 9


BAD = [
    (["model.layerz=2"], "model.layerz", "valid keys of 'model'"),
    (["modle.layers=2"], "modle", "valid sections"),
    (["model.layers=two"], "model.layers", "expected an integer, got 'two'"),
    (["model.layers=0"], "model.layers", "must be >= 1"),
    (["model.heads=5"], "model.heads", "does not divide model.d_model=256"),
    (["model.dropout=1.5"], "model.dropout", "[0, 1)"),
    (["model.tie_embeddings=3"], "model.tie_embeddings", "true or false"),
    (["train.global_batch=10", "parallel.dp=4"], "train.global_batch", "not divisible by parallel.dp x train.grad_accum = 4 x 1"),
    (["train.global_batch=16", "train.grad_accum=3"], "train.global_batch", "use a multiple of 3"),
    (["parallel.microbatches=3"], "parallel.microbatches", "does not divide the per-replica batch 16"),
    (["parallel.schedule=zigzag"], "parallel.schedule", "gpipe, 1f1b, interleaved"),
    (["parallel.virtual_stages=2"], "parallel.virtual_stages", "needs parallel.schedule=interleaved"),
    (["parallel.devices=tpu:4"], "parallel.devices", "auto, cpu:N or gpu:N"),
    (["parallel.strategy=horovod"], "parallel.strategy", "multi_worker"),
    (["parallel.zero=4"], "parallel.zero", "choose 0, 1, 2 or 3"),
    (["parallel.recompute=some"], "parallel.recompute", "none, full, selective"),
    (["parallel.tp=3"], "parallel.tp", "does not divide model.heads=4"),
    (["parallel.dp=-1", "parallel.tp=-1"], "parallel.tp", "at most one of parallel.dp/tp/pp may be -1"),
    (["parallel.pp=8", "model.layers=4"], "parallel.pp", "need model.layers >= 8"),
    (["parallel.pp=2", "parallel.schedule=interleaved", "parallel.microbatches=3", "train.global_batch=24"],
     "parallel.microbatches", "multiple of parallel.pp=2"),
    (["precision.policy=float16"], "precision.policy", "float32, mixed_bfloat16, mixed_float16"),
    (["train.lr=0"], "train.lr", "must be > 0"),
    (["train.steps=0"], "train.steps", "must be >= 1"),
    (["train.lr=fast"], "train.lr", "expected a number"),
    (["train.beta2=1.0"], "train.beta2", "[0, 1)"),
    (["train.clip_norm=-1"], "train.clip_norm", "0 disables clipping"),
    (["data.tokenizer=words"], "data.tokenizer", "bytes, bpe"),
    (["data.val_fraction=0"], "data.val_fraction", "(0, 1)"),
    (["model.vocab=100"], "model.vocab", "too small for the bytes tokenizer"),
    (["data.tokenizer=bpe", "data.bpe_vocab=4096", "model.vocab=1024"], "data.bpe_vocab", "set data.bpe_vocab=1024"),
    (["checkpoint.keep=0"], "checkpoint.keep", "must be >= 1"),
    (["train.steps"], "train.steps", "section.key=value"),
    (["steps=3"], "steps", "section.key=value"),
    # non-finite floats, however written, and seeds numpy/Keras cannot take (issue 12)
    (["train.lr=inf"], "train.lr", "expected a finite number, got 'inf'"),
    (["train.eps=inf"], "train.eps", "expected a finite number"),
    (["precision.loss_scale_init=inf"], "precision.loss_scale_init", "expected a finite number"),
    (["train.lr=1e309"], "train.lr", "got '1e309' (read as inf)"),
    (["train.lr=.inf"], "train.lr", "got inf"),
    (["train.min_lr_ratio=-.inf"], "train.min_lr_ratio", "got -inf"),
    (["train.lr=nan"], "train.lr", "got 'nan'"),
    (["model.dropout=.nan"], "model.dropout", "got nan"),
    (["train.peak_flops=" + "9" * 400], "train.peak_flops", "expected a finite number"),
    (["train.seed=-1"], "train.seed", "must be in [0, 2**32 - 1], got -1"),
    (["train.seed=4294967296"], "train.seed", "must be in [0, 2**32 - 1]"),
]


@pytest.mark.parametrize("overrides,key,fragment", BAD, ids=[b[1] + ":" + b[0][0][:40] for b in BAD])
def test_validation_error_names_key_and_valid_values(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == key
    assert fragment in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(scalar)


def test_non_finite_values_in_a_yaml_file_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match="train.lr: expected a finite number, got inf"):
        load_config(path)
    with pytest.raises(ConfigError, match="train.eps: expected a finite number"):  # built directly, not parsed
        Config().replace(train={"eps": float("inf")})


def test_duplicate_yaml_keys_are_refused_naming_the_key(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n  steps: 5\n  lr: 3.0e-4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "train.lr" and "given twice in" in str(info.value) and "lines 2 and 4" in str(info.value)
    path.write_text("train:\n  steps: 5\nmodel:\n  layers: 2\ntrain:\n  lr: 1.0\n")
    with pytest.raises(ConfigError, match="train: given twice .*lines 1 and 5"):
        load_config(path)
    with pytest.raises(ConfigError) as info:  # an override's value is YAML too
        load_config(None, ["train.steps={a: 1, a: 2}"])
    assert info.value.key == "train.steps.a"


def test_non_utf8_config_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"train:\n  steps: 5\n\xff\xfe\x00garbage\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == "config" and "binary.yaml" in str(info.value) and "not UTF-8" in str(info.value)


def test_resolve_degrees_fills_minus_one_and_checks_product():
    assert resolve_degrees(Config().replace(parallel={"tp": -1, "dp": 2}), 8) == (2, 1, 4)
    with pytest.raises(ConfigError, match="dp x pp x tp = 2 x 1 x 1 = 2 but 8 devices"):
        resolve_degrees(Config().replace(parallel={"dp": 2}), 8)


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(Exception):
        cfg.train.steps = 3  # type: ignore[misc]


def test_cli_exits_2_with_named_key():
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli", "train", "train.global_batch=10",
                           "parallel.dp=4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "train.global_batch" in proc.stderr and "multiple of 4" in proc.stderr
