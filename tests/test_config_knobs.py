"""Every config key either changes the run or is refused, on every layout `phalanx train` runs.

The test walks every field of the Config tree (``dataclasses.fields``) and, for each layout of
``LAYOUTS`` (one device, dp, tp, pp, ep, multi_worker), sets the field away from its default and
asks the checks that run before anything is written (``load_config``'s validation and the
engine's ``refuse_before_build``). Refused: the error must name that key. Accepted: the change
must show, without training, in what the run would compute — the planner's estimate of the
step (``plan``: memory and layout), the learning-rate schedule (``schedule``) or one AdamW step
on fixed gradients (``adamw``) — or the field lists the test that shows its effect in a run
(a reason in ``ELSEWHERE``). A new config field fails ``test_every_field_is_listed`` until it is
given a value and a way to show it.

Also here: the refusals come before the run directory is touched, ``model.seq_len`` too long for
memory names ``model.seq_len``, and a damaged newest checkpoint is never called intact.
"""

from __future__ import annotations

import dataclasses
import errno
import os

import numpy as np
import pytest
import tensorflow as tf

from phalanx import checkpoint
from phalanx.config import Config, ConfigError, default_of, key_of, load_config
from phalanx.core.optim import apply_adamw, clip_factor, learning_rate
from phalanx.engines.factory import refuse_before_build
from phalanx.engines.task import GPTTask
from phalanx.plan.precheck import check_fits, estimate_per_device

from helpers import tiny_overrides, write_corpus

LAYOUTS = {
    "one": [],
    "dp": ["parallel.dp=2", "parallel.devices=cpu:2"],
    "tp": ["parallel.tp=2", "parallel.devices=cpu:2"],
    "pp": ["parallel.pp=2", "parallel.microbatches=2", "parallel.devices=cpu:2"],
    "ep": ["parallel.dp=2", "parallel.ep=2", "model.experts=4", "parallel.devices=cpu:2"],
    "multi_worker": ["parallel.strategy=multi_worker"],
}

# A value away from the default for every key (one that is valid by itself).
CHANGED = {
    "model.layers": 2, "model.d_model": 128, "model.heads": 8, "model.ffn": 512, "model.vocab": 512,
    "model.seq_len": 64, "model.dropout": 0.1, "model.tie_embeddings": False, "model.experts": 8,
    "model.top_k": 1, "model.moe_every": 2, "model.capacity_factor": 1.5, "model.aux_loss_coef": 0.1,
    "model.attention": "blocked",
    "parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.microbatches": 4, "parallel.schedule": "gpipe",
    "parallel.virtual_stages": 2, "parallel.devices": "cpu:4", "parallel.strategy": "mesh", "parallel.zero": 1,
    "parallel.recompute": "full", "parallel.ep": 2, "parallel.sequence_parallel": True,
    "precision.policy": "mixed_bfloat16", "precision.loss_scale_init": 1024.0,
    "precision.loss_scale_growth_interval": 10,
    "train.global_batch": 32, "train.grad_accum": 2, "train.steps": 100, "train.lr": 3e-4, "train.min_lr_ratio": 0.5,
    "train.warmup": 10, "train.clip_norm": 0.1, "train.weight_decay": 0.0, "train.beta1": 0.8, "train.beta2": 0.999,
    "train.eps": 1e-6, "train.seed": 7, "train.eval_every": 10, "train.eval_batches": 2, "train.log_every": 1,
    "train.peak_flops": 1e12, "train.prune.target": 0.5, "train.prune.start": 10, "train.prune.end": 500,
    "train.prune.pattern": "2:4", "train.prune.every": 10,
    "data.source": "corpus/*.txt", "data.tokenizer": "bpe", "data.bpe_vocab": 300, "data.val_fraction": 0.1,
    "data.cache_dir": "/tmp/cache", "data.max_bytes": 100000,
    "run.dir": "runs/other", "checkpoint.every": 10, "checkpoint.keep": 1, "checkpoint.async": True,
}
# Other keys a changed key needs to be valid at all (not to have an effect).
ALONG = {"data.tokenizer": ["data.bpe_vocab=300", "model.vocab=512"], "data.bpe_vocab": ["data.tokenizer=bpe",
         "model.vocab=512"], "train.prune.pattern": ["train.prune.target=0.5"],
         "parallel.virtual_stages": ["parallel.schedule=interleaved"]}

# How an accepted key shows without a run.
PLAN = {"model.layers", "model.d_model", "model.heads", "model.ffn", "model.vocab", "model.seq_len",
        "parallel.virtual_stages", "model.experts", "model.top_k", "model.moe_every", "parallel.microbatches",
        "parallel.recompute", "parallel.zero", "precision.policy", "train.global_batch", "train.grad_accum",
        "parallel.schedule"}
SCHEDULE = {"train.lr", "train.min_lr_ratio", "train.warmup", "train.steps"}
ADAMW = {"train.clip_norm", "train.weight_decay", "train.beta1", "train.beta2", "train.eps"}
# Keys whose effect a run shows, and the test that shows it.
ELSEWHERE = {
    "model.attention": "tests/test_blocked_attention.py: the blocked core runs in training and gives the plain "
                       "core's numbers (the planner does not model its smaller attention memory: it errs safe)",
    "model.dropout": "tests/test_keras_gpt_dropout_prune.py: dropout masks on every layout against Keras's "
                     "one-device train_on_batch",
    "model.tie_embeddings": "tests/test_weight_names.py, tests/test_transformer_gpt.py: an untied head has its own "
                            "weight (on a pipeline it replaces the last stage's mirror of the embedding: the same "
                            "bytes, so the plan of the fullest device may not change)",
    "parallel.sequence_parallel": "tests/test_sequence_parallel.py, tests/test_keras_tp.py: sequence chunks per "
                                  "tensor rank (the planner does not model them)",
    "model.capacity_factor": "tests/test_moe.py: tokens past an expert's capacity dropped, as the reference",
    "model.aux_loss_coef": "tests/test_moe.py: the load-balancing loss's coefficient in the logged loss",
    "parallel.dp": "a layout key: tests/test_parallel.py trains each layout against one device",
    "parallel.tp": "a layout key: tests/test_parallel.py", "parallel.pp": "a layout key: tests/test_parallel.py",
    "parallel.ep": "a layout key: tests/test_moe_train.py", "parallel.devices": "a layout key: tests/test_parallel.py",
    "parallel.strategy": "a layout key: tests/test_cluster_strategies.py, tests/test_reliability.py",
    "precision.loss_scale_init": "tests/test_engine.py: the float16 loss scale starts there",
    "precision.loss_scale_growth_interval": "tests/test_engine.py: the loss scale's growth",
    "train.seed": "tests/test_data_pipeline.py: another seed, other batches (and other initial weights)",
    "train.eval_every": "tests/test_reliability.py: evaluation follows train.eval_every",
    "train.eval_batches": "batches per evaluation, and the default of phalanx eval / export "
                          "(tests/test_export.py), also with train.eval_every=0",
    "train.log_every": "tests/test_trainer.py: one printed line per log_every steps",
    "train.peak_flops": "tests/test_reliability.py: MFU against the given peak",
    "train.prune.target": "tests/test_prune.py", "train.prune.start": "tests/test_prune.py",
    "train.prune.end": "tests/test_prune.py", "train.prune.pattern": "tests/test_prune.py",
    "train.prune.every": "tests/test_prune.py",
    "data.source": "tests/test_data_pipeline.py", "data.tokenizer": "tests/test_data_pipeline.py (bpe source)",
    "data.bpe_vocab": "tests/test_data_pipeline.py (bpe source)",
    "data.val_fraction": "tests/test_data_pipeline.py", "data.cache_dir": "tests/test_data_pipeline.py",
    "data.max_bytes": "tests/test_data_pipeline.py (stdlib with max_bytes)",
    "run.dir": "where everything is written", "checkpoint.every": "tests/test_reliability.py",
    "checkpoint.keep": "tests/test_reliability.py (pruned before a save)",
    "checkpoint.async": "tests/test_trainer.py (background saves)",
}


def all_keys(cls=Config, prefix="") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        default = default_of(prefix + key_of(f))
        if dataclasses.is_dataclass(default):
            keys += all_keys(type(default), prefix + key_of(f) + ".")
        else:
            keys.append(prefix + key_of(f))
    return keys


def test_every_field_is_listed():
    keys = all_keys()
    assert sorted(CHANGED) == sorted(keys), "give a new config field a value in CHANGED and a way to show it"
    for key in keys:
        assert CHANGED[key] != default_of(key)
        ways = [key in PLAN, key in SCHEDULE, key in ADAMW, key in ELSEWHERE]
        assert sum(ways) == 1, key


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def plan(cfg: Config):
    mem, count, dp, pp, tp = estimate_per_device(cfg)
    return (dataclasses.astuple(mem), count, dp, pp, tp)


def schedule(cfg: Config) -> np.ndarray:
    t = cfg.train
    return np.array([float(learning_rate(s, t)) for s in (0, t.warmup // 2, t.warmup, (t.warmup + t.steps) // 2,
                                                            t.steps, 5, 50, 250)])


def adamw(cfg: Config) -> np.ndarray:
    """Two AdamW steps on fixed gradients (one small beside eps, one clipped by 0.1 but not by 1)."""
    var, m, v = (tf.Variable(x, dtype=tf.float32) for x in ([1.0, -2.0], [0.0, 0.0], [0.0, 0.0]))
    for step, grad in ((1, [1e-7, 0.5]), (2, [3e-7, -0.25])):
        grad = tf.constant(grad)
        factor = clip_factor(tf.linalg.global_norm([grad]), cfg.train.clip_norm)
        apply_adamw(var, m, v, grad, step=step, lr=0.1, factor=factor, finite=True, cfg=cfg.train, decay=True)
    return var.numpy()


OBSERVE = {**{k: plan for k in PLAN}, **{k: schedule for k in SCHEDULE}, **{k: adamw for k in ADAMW}}


def checked(overrides: list[str]) -> Config:
    """The configuration through every check that runs before the run directory is touched."""
    cfg = load_config(None, overrides)
    refuse_before_build(cfg, GPTTask(cfg.model))
    return cfg


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_key_changes_the_run_or_is_refused(layout):
    base = LAYOUTS[layout]
    reference = checked(base)
    accepted, refused = [], []
    for key, value in CHANGED.items():
        setting = f"{key}={_text(value)}"
        if any(item.startswith(key + "=") for item in base):  # the layout sets it: another layout shows it
            continue
        along = ALONG.get(key, [])
        try:
            cfg = checked(base + along + [setting])
        except ConfigError as err:
            named = {key} | {item.split("=")[0] for item in along}  # or a key it needs, refused by itself
            assert err.key in named or key in str(err), f"{layout}: {setting} refused without naming it: {err}"
            refused.append(key)
            continue
        accepted.append(key)
        if key in OBSERVE:
            before = OBSERVE[key](checked(base + ALONG.get(key, [])) if ALONG.get(key) else reference)
            after = OBSERVE[key](cfg)
            assert not np.array_equal(np.asarray(before, dtype=object), np.asarray(after, dtype=object)), \
                f"{layout}: {setting} is accepted but changes nothing the step computes"
        else:
            assert ELSEWHERE[key]
    assert accepted and refused


# The keys a configuration ignores, each refused naming it and the key that would make it matter.
IGNORED = [
    (["parallel.schedule=interleaved"], "parallel.schedule", "parallel.pp > 1"),
    (["parallel.schedule=gpipe"], "parallel.schedule", "parallel.pp > 1"),
    (["model.top_k=1"], "model.top_k", "model.experts >= 2"),
    (["model.capacity_factor=1.25"], "model.capacity_factor", "model.experts >= 2"),
    (["model.moe_every=2"], "model.moe_every", "model.experts >= 2"),
    (["model.aux_loss_coef=0.1"], "model.aux_loss_coef", "model.experts >= 2"),
    (["data.bpe_vocab=8192"], "data.bpe_vocab", "data.tokenizer=bpe"),
    (["precision.policy=float32", "precision.loss_scale_init=1024"], "precision.loss_scale_init",
     "precision.policy=mixed_float16"),
    (["precision.policy=mixed_bfloat16", "precision.loss_scale_growth_interval=10"],
     "precision.loss_scale_growth_interval", "precision.policy=mixed_float16"),
    (["train.prune.pattern=2:4"], "train.prune.pattern", "train.prune.target > 0"),
    (["train.prune.every=10"], "train.prune.every", "train.prune.target > 0"),
    (["parallel.microbatches=2"], "parallel.microbatches", "parallel.pp > 1"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "parallel.tp > 1"),
]


@pytest.mark.parametrize("overrides,key,needs", IGNORED, ids=[i[1] + "=" + i[0][-1].split("=")[1] for i in IGNORED])
def test_an_ignored_key_is_refused_naming_what_would_make_it_matter(overrides, key, needs):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key and needs in str(err.value)
    load_config(None, [f"{key}={default_of(key) if not isinstance(default_of(key), bool) else 'false'}"])  # defaults


def test_engine_refusals_come_before_the_run_directory_is_touched(tmp_path):
    """ZeRO with one replica and loss scaling under precision.policy=auto (never float16 for the
    GPT): refused before the lock file exists."""
    from phalanx.train.trainer import Trainer
    corpus = write_corpus(tmp_path / "corpus", files=1, lines=50)
    for extra, key in ((["parallel.zero=1"], "parallel.zero"),
                       (["precision.loss_scale_init=1024"], "precision.loss_scale_init")):
        cfg = load_config(None, tiny_overrides(tmp_path, corpus, "run") + extra)
        with pytest.raises(ConfigError) as err:
            Trainer(cfg, quiet=True).fit()
        assert err.value.key == key
        assert not (tmp_path / "run").exists()


def test_a_sequence_too_long_for_memory_names_model_seq_len():
    with pytest.raises(ConfigError) as err:
        check_fits(load_config(None, ["model.seq_len=1000000000"]), host_memory_bytes=2**34)
    assert err.value.key == "model.seq_len" and "shorten model.seq_len" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a batch that one sequence per micro-batch would fit
        check_fits(load_config(None, ["train.global_batch=4096", "model.seq_len=1024"]), host_memory_bytes=2**34)
    assert err.value.key == "train.global_batch"


def test_a_damaged_newest_checkpoint_is_never_called_intact(tmp_path, monkeypatch):
    """A read-only checkpoints folder (the damaged newest cannot be moved aside): one line that
    names the newest valid checkpoint, not the damaged one, and does not ask to free space."""
    from phalanx.train.trainer import Trainer
    corpus = write_corpus(tmp_path / "corpus", files=1, lines=60)
    overrides = tiny_overrides(tmp_path, corpus, "run", train__steps=2, checkpoint__every=1)
    Trainer(load_config(None, overrides), quiet=True).fit()
    ckpts = tmp_path / "run" / "checkpoints"
    newest = checkpoint.latest(ckpts)
    damaged = next(p for p in newest.rglob("*") if p.is_file() and p.stat().st_size > 100)
    damaged.write_bytes(damaged.read_bytes()[:-7])
    rename = os.rename

    def read_only(src, dst, *args, **kwargs):
        if str(src).startswith(str(ckpts)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))
        return rename(src, dst, *args, **kwargs)
    monkeypatch.setattr(os, "rename", read_only)
    with pytest.raises(ConfigError) as err:
        Trainer(load_config(None, overrides[:-2] + ["train.steps=3", "checkpoint.every=1"]), quiet=True).fit()
    message = str(err.value)
    assert "EROFS" in message and "newest valid checkpoint is step-00000001" in message, message
    assert newest.name not in message.split(";", 1)[1] and "free space" not in message
