"""``phalanx train | eval | generate``.

Overrides (``section.key=value``) may stand anywhere among the flags.

Before anything is built, ``phalanx train`` checks with the planner's arithmetic that the
model fits the devices' and the host's memory (:func:`phalanx.plan.precheck.check_fits`)
and refuses with the figures when it cannot.

Examples:
    $ phalanx train                                   # the built-in demo-sized default
    $ phalanx train my.yaml parallel.dp=2 parallel.devices=cpu:2 precision.policy=mixed_bfloat16
    $ phalanx train --quiet my.yaml train.steps=10
    $ phalanx train run.dir=runs/x train.steps=200     # resume runs/x with its config.yaml, longer
    $ phalanx train my.yaml --print-config             # the resolved config as YAML, nothing run
    $ phalanx eval runs/default --json train.eval_batches=50
    $ phalanx generate runs/default --prompt "def main(" --tokens 200
"""

from __future__ import annotations

import argparse
import math
import sys

import yaml
from pathlib import Path

from phalanx import checkpoint
from phalanx.config import (Config, ConfigError, load_config, one_device_overrides, require_directory, sections_help,
                            split_config_args)
from phalanx.data.pipeline import make_datasets
from phalanx.data.tokenize import load_run_tokenizer
from phalanx.export.runtime import main_eval as eval_artifact, main_generate as generate_artifact
from phalanx.mesh import build_mesh
from phalanx.plan.precheck import check_fits
from phalanx.train.resume import resolve_train_config


# The trainer, engines, cluster strategies and generate import TensorFlow: they are imported where
# used (deferred, not a cycle), after _runtime_first has set up what TensorFlow only accepts before
# its runtime starts, and so that --help stays instant.

def main_train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="phalanx train", description="Train a model as the config says; "
                                     "resumes from the newest checkpoint in run.dir.",
                                     epilog=sections_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...], anywhere among the flags")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit "
                        "(on an existing run: its saved config.yaml with the overrides applied)")
    ns = parser.parse_intermixed_args(argv)
    path, overrides = split_config_args(ns.args)
    # A run.dir holding a checkpoint resumes with its own config.yaml; what changes is named, and a
    # change of the model or the data is refused here, before anything is written.
    cfg, resuming = resolve_train_config(path, overrides)
    if ns.print_config:
        sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if resuming and not ns.quiet:
        print(resuming, file=sys.stderr, flush=True)
    check_fits(cfg)  # before TensorFlow builds anything: a clear refusal instead of an OOM
    cluster = _runtime_first(cfg)
    from phalanx.train.trainer import Trainer
    try:
        Trainer(cfg, cluster=cluster, quiet=ns.quiet).fit()
    except KeyboardInterrupt:  # a second Ctrl-C (the first one saves and stops at the step's end)
        newest = checkpoint.latest(Path(cfg.run.dir).expanduser() / "checkpoints")
        print(f"error: interrupted: stopped at once without saving; the checkpoints are as they were (newest: "
              f"{newest or 'none'})", file=sys.stderr, flush=True)
        return 130
    return 0


def _runtime_first(cfg: Config):
    """Set up what TensorFlow only accepts before its runtime starts: the cluster's
    collectives (multi-process strategies; server tasks serve here and never return)
    or the logical CPU devices. Returns the cluster set-up, or None for one process."""
    from phalanx.cluster.strategies import needs_cluster, setup_cluster
    if needs_cluster(cfg):  # an explicit multi-process strategy, or TF_CONFIG naming several tasks
        return setup_cluster(cfg)
    build_mesh(cfg)
    return None


def _load_run(run_dir: str, overrides: list[str]) -> Config:
    path = Path(run_dir) / "config.yaml"
    require_directory("run_dir", run_dir)
    if not path.is_file():
        raise ConfigError("run.dir", f"{run_dir!r} has no config.yaml; is it a phalanx run directory?")
    # Evaluate/generate on one device whatever layout trained it (checkpoints are layout-independent).
    return load_config(path, one_device_overrides() + [f"run.dir={run_dir}"] + overrides)


def _restored_engine(cfg: Config):
    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask

    engine = build_engine(cfg, GPTTask(cfg.model, cfg.precision.policy, cfg.train.seed))

    def accept(restored) -> None:
        try:
            engine.load_state_dict(restored.tensors)
        except checkpoint.CheckpointError:
            raise  # e.g. a piece holding NaN: skipped like a damaged file
        except (KeyError, ValueError) as err:
            raise checkpoint.CheckpointError(restored.path / checkpoint.INDEX, f"does not fit this model: "
                                             f"{str(err).strip(chr(34))}") from None

    # The newest checkpoint that verifies and loads: a damaged newer one is skipped with a warning.
    restored = checkpoint.restore_latest(Path(cfg.run.dir) / "checkpoints", warn=checkpoint.print_warning,
                                         accept=accept)
    if restored is None:
        raise ConfigError("run.dir", f"{cfg.run.dir!r} has no checkpoint yet")
    return engine, restored.step


def main_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="phalanx eval", description="Loss and perplexity of the latest "
                                     "checkpoint of a run on its held-out split.")
    parser.add_argument("run_dir")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. train.eval_batches=50 "
                        "(anywhere among the flags)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_intermixed_args(argv)
    require_directory("run_dir", ns.run_dir)
    if (Path(ns.run_dir) / "export.json").is_file():  # a `phalanx export` artifact, run in its own runtime
        return eval_artifact(ns.run_dir, ns.overrides, ns.json)
    cfg = _load_run(ns.run_dir, ns.overrides)
    from phalanx.train.trainer import Trainer

    engine, step = _restored_engine(cfg)
    trainer = Trainer(cfg, datasets=make_datasets(cfg), quiet=True)
    trainer.engine = engine
    loss = trainer.evaluate()
    result = {"step": step, "eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)),
              "batches": cfg.train.eval_batches}
    if ns.json:
        import json
        print(json.dumps(result))
    else:
        print(f"step {step}: eval loss {loss:.4f}, perplexity {result['perplexity']:.2f} "
              f"({cfg.train.eval_batches} batches of {cfg.train.global_batch})")
    return 0


def main_generate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="phalanx generate", description="Sample from a run's latest checkpoint.")
    parser.add_argument("run_dir")
    parser.add_argument("overrides", nargs="*", help="section.key=value for the run's config "
                        "(anywhere among the flags)")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="how many tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (not train.seed)")
    ns = parser.parse_intermixed_args(argv)
    if ns.tokens < 1:
        raise ConfigError("--tokens", f"must be >= 1, got {ns.tokens}")
    if ns.temperature < 0:
        raise ConfigError("--temperature", f"must be >= 0, got {ns.temperature}")
    require_directory("run_dir", ns.run_dir)
    if (Path(ns.run_dir) / "export.json").is_file():  # a `phalanx export` artifact, run in its own runtime
        return generate_artifact(ns.run_dir, ns.prompt, ns.tokens, ns.temperature, ns.top_k, ns.seed)
    cfg = _load_run(ns.run_dir, ns.overrides)
    from phalanx.models.generate import generate

    tokenizer = load_run_tokenizer(Path(ns.run_dir) / "tokenizer")
    engine, _ = _restored_engine(cfg)
    ids = generate(engine.model, tokenizer.encode(ns.prompt), ns.tokens, cfg.model.seq_len,
                   temperature=ns.temperature, top_k=ns.top_k, seed=ns.seed)
    sys.stdout.write(ns.prompt + tokenizer.decode(ids) + "\n")
    return 0
