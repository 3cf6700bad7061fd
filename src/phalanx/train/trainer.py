"""The training loop: parse -> build -> train -> close.

:class:`Trainer` builds the engine that trains the built-in GPT as the config says
(:func:`phalanx.engines.factory.build_engine`), the input pipeline, resumes from the newest checkpoint in
``<run.dir>/checkpoints``, then runs ``train.steps`` steps with logging, periodic
evaluation and checkpoints. SIGTERM (preemption) or SIGINT (Ctrl-C) saves a
checkpoint at the next step boundary and returns normally (``Summary.stopped_early``;
``phalanx train`` exits 0); a second SIGINT raises KeyboardInterrupt at once, the
checkpoints already written left as they were
(:class:`phalanx.cluster.preemption.StopSignals`).

Example (a 3-step run on the embedded corpus):
    >>> from phalanx.config import load_config
    >>> cfg = load_config(None, ["model.layers=1", "model.d_model=32", "model.heads=2",
    ...     "model.ffn=64", "model.seq_len=16", "train.steps=3", "train.global_batch=4",
    ...     "data.max_bytes=200000", "run.dir=/tmp/phalanx-doctest"])  # doctest: +SKIP
    >>> summary = Trainer(cfg, quiet=True).fit()                      # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from phalanx import checkpoint, precision, prune
from phalanx.cluster.preemption import StopSignals, stop_agreement
from phalanx.config import Config, ConfigError, describe_layout
from phalanx.data import pipeline
from phalanx.data.tokenize import save_tokenizer
from phalanx.engines.factory import build_engine, refuse_before_build, require_gpt_task
from phalanx.engines.task import GPTTask
from phalanx.fsutil import RunLock
from phalanx.train.metrics import RunPeak, mfu_text
from phalanx.train.moe_stats import MoEStats
from phalanx.train.progress import RunOutput, plot_loss, read_metrics


@dataclass
class Summary:
    steps: int
    loss: float
    eval_loss: float | None
    tokens_per_s: float
    mfu: float | None  # None: unavailable (phalanx.train.metrics.RunPeak)
    wall_s: float
    skipped_steps: int
    run_dir: Path
    checkpoint: Path | None
    stopped_early: bool = False

    def line(self) -> str:
        ev = f" (eval {self.eval_loss:.4f})" if self.eval_loss is not None else ""
        stop = " [stopped by signal, checkpoint saved]" if self.stopped_early else ""
        return (f"done: step {self.steps}, loss {self.loss:.4f}{ev}, {self.tokens_per_s:,.0f} tokens/s, "
                f"{mfu_text(self.mfu)}, {self.wall_s:.0f}s, {self.skipped_steps} skipped steps{stop}\n"
                f"outputs: {self.run_dir}/metrics.jsonl, {self.run_dir}/loss.png, {self.run_dir}/tb/, "
                f"{self.checkpoint or 'no checkpoint'}")


def device_count(engine) -> int:
    """Devices that run ``engine``'s steps (the MFU denominator counts each one's peak):
    ``engine.n_devices`` if it says, else its mesh's size, else its strategy's replicas."""
    n = getattr(engine, "n_devices", None)
    if n:
        return int(n)
    mesh = getattr(engine, "mesh", None)
    if mesh is not None:
        return len(mesh.devices)
    strategy = getattr(engine, "strategy", None)
    if strategy is not None:
        return int(strategy.num_replicas_in_sync)
    return 1


class Trainer:
    """Trains the built-in GPT (``task``: its :class:`~phalanx.engines.task.GPTTask`, by default
    built from ``cfg``) as ``cfg`` says. A Keras model trains through :func:`phalanx.fit`
    instead (any other ``task`` is a TypeError saying so).

    ``datasets`` (optional) overrides the built-in input pipeline: an object with
    ``.train`` (an infinite tf.data.Dataset of global batches) and ``.val``.
    """

    def __init__(self, cfg: Config, task=None, datasets=None, *, cluster=None,
                 interactive: bool | None = None, quiet: bool = False):
        self.cfg, self.cluster = cfg, cluster
        self.run_dir = Path(cfg.run.dir).expanduser()
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.interactive, self.quiet = interactive, quiet
        if task is None:
            task = GPTTask(cfg.model, _keras_policy(cfg), cfg.train.seed)
        require_gpt_task(task)
        self.task = task
        self._datasets = datasets
        self.is_chief = cluster is None or cluster.is_chief
        self._saver = checkpoint.AsyncSaver() if cfg.checkpoint.async_ else None

    # -- building ---------------------------------------------------------------

    def _check_run_dir(self) -> None:
        saved = self.run_dir / "config.yaml"
        if saved.is_file() and checkpoint.latest(self.ckpt_dir) is not None:
            old = yaml.safe_load(saved.read_text()) or {}
            if old.get("model") != dataclasses.asdict(self.cfg.model):
                raise ConfigError("run.dir", f"{str(self.run_dir)!r} holds checkpoints of a different model "
                                  f"({old.get('model')}); use a new run.dir or the same model.* keys")

    def build(self) -> None:
        import keras
        keras.utils.set_random_seed(self.cfg.train.seed)
        self._check_run_dir()
        if self._datasets is None:
            # every process reads the whole global batch (a multi_worker engine takes its own rows)
            self._datasets = pipeline.make_datasets(self.cfg)
        self.engine = build_engine(self.cfg, self.task, self.cluster)
        self.pruner = prune.Pruner(self.cfg, self.engine) if prune.enabled(self.cfg) else None
        if self.is_chief:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
            tokenizer = getattr(self._datasets, "tokenizer", None)
            if tokenizer is not None:
                save_tokenizer(tokenizer, self.run_dir / "tokenizer")

    # -- checkpoints --------------------------------------------------------------

    def _restore(self):
        """Load the newest valid checkpoint (if any); return (step, train iterator positioned after it).

        A newer checkpoint that is damaged, or that fails while it is loaded (a piece
        holding NaN or inf, a tensor that does not fit though the recorded config agrees, an
        unreadable data position), is skipped with a warning and moved to
        ``checkpoints/damaged/``; a checkpoint of another model, or whose data position
        belongs to other data, is refused with a ConfigError naming the key.
        """
        builtin_data = isinstance(self._datasets, pipeline.Datasets)
        found = {}

        def accept(restored) -> None:
            self._check_model(restored)  # another model: a ConfigError by key, no fallback
            path = restored.path
            try:
                # Every device reads only the boxes of each tensor it holds (any layout wrote them).
                checkpoint.load_into(self.engine, restored)
            except checkpoint.CheckpointError:
                raise
            except (KeyError, ValueError) as err:
                index = checkpoint.INDEX if restored.meta.get("format") == 3 else checkpoint.TENSORS
                raise checkpoint.CheckpointError(path / index, f"does not fit this model: "
                                                 f"{str(err).strip(chr(34))}; use the run's own model.* keys or a "
                                                 f"new run.dir") from None
            if builtin_data and (path / "data").is_dir():
                try:
                    found["iterator"] = pipeline.restore_iterator(self._datasets, path / "data")
                except ConfigError:
                    raise  # other data (batch, seed, dataset): by key, no fallback
                except FileNotFoundError:
                    raise checkpoint.CheckpointError(path / checkpoint.DATA_POSITION, "missing, though the data/ "
                                                     "folder is there (removed, with its manifest entry?)") from None
                except (OSError, ValueError, KeyError, TypeError) as err:
                    raise checkpoint.CheckpointError(path / checkpoint.DATA_POSITION, f"unreadable data position "
                                                     f"({type(err).__name__}: {err})") from None
            elif builtin_data:
                found["iterator"] = self._datasets.train_iterator(restored.step)
            else:  # a user's dataset: no position to restore, skip what was consumed
                found["iterator"] = iter(self._datasets.train.skip(restored.step))

        restored = checkpoint.resume_latest(self.ckpt_dir, warn=self._warn, accept=accept,
                                            move_damaged=self.is_chief)
        if restored is None:
            return 0, (self._datasets.train_iterator(0) if builtin_data else iter(self._datasets.train))
        self._say(f"resumed from {restored.path} (step {restored.step})")
        return restored.step, found["iterator"]

    def _check_model(self, restored) -> None:
        """Refuse a checkpoint written for another model shape (even with no config.yaml
        beside it), naming the first differing key."""
        saved = (restored.meta.get("config") or {}).get("model")
        if not isinstance(saved, dict):
            return  # no config recorded (e.g. written by hand): the shapes are checked on load
        now = dataclasses.asdict(self.cfg.model)
        for key, value in now.items():
            if key in saved and saved[key] != value:
                raise ConfigError(f"model.{key}", f"the checkpoint {restored.path} was written with model.{key}="
                                                  f"{saved[key]!r}, this run has {value!r}; resume with the same "
                                                  f"model.* keys or use a new run.dir")

    def _save(self, step: int, iterator) -> Path | None:
        prepare = getattr(self.engine, "before_checkpoint", None)
        if prepare is not None:  # every worker (under ZeRO across workers: the slices all-gathered)
            prepare()
        if not self.is_chief:
            return None
        writers = {}
        if isinstance(iterator, pipeline.TrainIterator):
            writers["data"] = lambda d: pipeline.save_iterator(iterator, d)
        meta = {"config": self.cfg.to_dict(), "layout": _layout(self.cfg, self.engine)}
        # Every device's shard set, by logical name and box; written one slot at a time per thread.
        state = checkpoint.state_of(self.engine)  # pruning masks (prune/mask/*) are engine slots too
        if self._saver is not None:  # checkpoint.async: snapshot now, write in the background
            return self._saver.save(self.ckpt_dir, step, state, meta=meta, writers=writers,
                                    keep=self.cfg.checkpoint.keep)
        return checkpoint.save(self.ckpt_dir, step, state, meta=meta, writers=writers,
                               keep=self.cfg.checkpoint.keep)

    # -- the loop -------------------------------------------------------------------

    def evaluate(self) -> float:
        """Mean loss over up to ``train.eval_batches`` held-out batches."""
        losses = []
        for i, batch in enumerate(self._datasets.val):
            if i >= self.cfg.train.eval_batches:
                break
            losses.append(float(self.engine.eval_step(batch)))
        if not losses:
            raise ConfigError("data.val_fraction", "the held-out split has no full batch; raise "
                              "data.val_fraction or lower train.global_batch")
        return float(np.mean(losses))

    def fit(self) -> Summary:
        """Build, resume, train ``train.steps`` steps; returns the :class:`Summary`.

        The chief holds :class:`phalanx.fsutil.RunLock` on ``run.dir`` throughout: a
        second trainer on the same directory fails at once with a ConfigError naming
        this one's pid.
        """
        refuse_before_build(self.cfg, self.task, self.cluster)  # before the lock file: nothing written yet
        with RunLock(self.run_dir) if self.is_chief else contextlib.nullcontext():
            try:
                try:
                    summary = self._fit()
                except BaseException:
                    self._wait_for_saves(raising=False)  # let a background save finish; the first error wins
                    raise
                self._wait_for_saves()
                return summary
            except OSError as err:
                # Checkpoint writes raise CheckpointError themselves; this catches the run's other
                # files (metrics.jsonl, config.yaml, loss.png) on a full or read-only disk.
                if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
                    raise
                # only a checkpoint that verifies is called intact (the newest may be a damaged one)
                newest = checkpoint.latest_valid(self.ckpt_dir, warn=lambda text: None)
                kept = f"the newest valid checkpoint is {newest.name}" if newest else "no valid checkpoint is there"
                fix = "free space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "make it writable"
                raise ConfigError("run.dir", f"cannot write {err.filename or self.run_dir}: {err.strerror} "
                                             f"[{errno.errorcode.get(err.errno, err.errno)}]; {kept}; {fix} "
                                             f"or use another run.dir") from None

    def _wait_for_saves(self, raising: bool = True) -> None:
        """Wait for a background save (``checkpoint.async``) and raise its error, naming the path."""
        if self._saver is None:
            return
        try:
            self._saver.wait()
        except checkpoint.CheckpointError as err:
            if raising:
                raise
            self._warn(str(err))

    def _fit(self) -> Summary:
        t_start = time.monotonic()
        self.build()
        cfg, t = self.cfg, self.cfg.train
        start, iterator = self._restore()
        tokens_per_step = t.global_batch * self.task.tokens_per_example()
        flops_per_step = self.task.flops_per_example() * t.global_batch
        # the run's peak; MFU above 100% measures it again, then is unavailable rather than wrong
        run_peak = RunPeak(cfg, device_count(self.engine), say=self._say) if flops_per_step else None
        if start >= t.steps:  # a finished run: nothing to train, nothing to rewrite
            return self._nothing_to_do(start, t_start)
        self._say(f"model: {self.engine.num_params():,} parameters; layout {self.layout_line()}; "
                  f"global batch {t.global_batch} x {self.task.tokens_per_example()} tokens")
        self._say(precision.describe(cfg))
        last = {"loss": float("nan")}
        eval_loss, rate, util, stopped = None, 0.0, 0.0, False
        # The first step of this process traces and compiles the step functions: it is timed on its
        # own ("building the step") and left out of the first window's throughput and the ETA.
        window_losses, window_start, window_steps = [], time.monotonic(), 0
        building = True
        saved_path = None
        step = start
        # cluster: under multi_worker all workers must stop at the same step (one tiny all-reduce of the
        # SIGTERM flag per step, phalanx.cluster.preemption); one process just reads its own flag.
        agree_stop = stop_agreement(self.cluster)
        with RunOutput(self.run_dir, t.steps, start, self.interactive, self.quiet,
                       write=self.is_chief) as out, \
                StopSignals(announce=True) as stop:
            if run_peak is not None:
                run_peak.say = out.message
            while step < t.steps:
                batch = next(iterator)
                if self.pruner is not None:
                    self.pruner.before_step(step)  # recomputes the masks at the schedule's steps
                result = self.engine.train_step(batch)
                step += 1
                window_losses.append(result["loss"])
                if building:
                    float(result["loss"])  # waits for the step to finish
                    build_s = time.monotonic() - window_start
                    out.built(step, build_s)
                    window_start, building = time.monotonic(), False
                else:
                    window_steps += 1
                stopping = agree_stop(stop.set)  # cluster: every worker calls it once per step
                evaluating = bool(t.eval_every) and (step % t.eval_every == 0 or step == t.steps)
                # An evaluation or a stop closes the logging window too, so every evaluation is in
                # metrics.jsonl (one row per step) whatever train.log_every is.
                if step % t.log_every == 0 or step == t.steps or evaluating or stopping:
                    losses = [float(x) for x in window_losses]  # syncs the device
                    # a parameter-server step whose worker died before its results were read has none
                    # (its update was applied: phalanx.engines.ps.StepResult): the mean is over the others
                    losses = [v for v, x in zip(losses, window_losses) if not getattr(x, "lost", False)] or [np.nan]
                    elapsed = time.monotonic() - window_start
                    only_build = not window_steps
                    if only_build:  # the window holds only the building step: time that one
                        elapsed, window_steps = build_s, 1
                    rate = tokens_per_step * window_steps / elapsed
                    util = run_peak.mfu(flops_per_step, elapsed / window_steps) if run_peak else 0.0
                    row = {"step": step, "loss": float(np.mean(losses)), "lr": float(result["lr"]),
                           "tokens_per_s": rate, "mfu": util, "step_time_s": elapsed / window_steps,
                           "grad_norm": float(result["grad_norm"]), "loss_scale": float(result["loss_scale"]),
                           "skipped": float(result["skipped"])}
                    if only_build:
                        row["build_s"] = build_s
                    if self.cfg.model.experts and hasattr(self.engine, "model"):  # MoE totals of the whole step
                        row.update(MoEStats(self.engine.model).read())
                    if self.pruner is not None:  # measured: exact zeros among the pruned weights
                        row["sparsity"] = self.pruner.sparsity()
                    if evaluating:
                        eval_loss = self.evaluate()
                        row["eval_loss"] = eval_loss
                    last = row
                    if self.is_chief:
                        out.log(row)
                    window_losses, window_start, window_steps = [], time.monotonic(), 0
                if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == t.steps or stopping:
                    saved_path = self._save(step, iterator) or saved_path
                if stopping:
                    stopped = True
                    why = f" ({stop.signal})" if stop.signal else " (by another worker)"
                    out.message(f"signal received: checkpoint saved at step {step}, stopping{why}")
                    break
        skipped = _skipped_steps(self.engine) if self.is_chief else 0
        if self.is_chief:
            plot_loss(self.run_dir)
        summary = Summary(steps=step, loss=last["loss"], eval_loss=eval_loss, tokens_per_s=rate, mfu=util,
                          wall_s=time.monotonic() - t_start, skipped_steps=skipped, run_dir=self.run_dir,
                          checkpoint=saved_path or checkpoint.latest(self.ckpt_dir), stopped_early=stopped)
        self._say(summary.line())
        return summary

    def layout_line(self) -> str:
        """The run's whole layout as the engine resolved it (:func:`phalanx.config.describe_layout`)."""
        e = self.engine
        workers = 1 if self.cluster is None else max(1, int(self.cluster.info.num_workers))
        return describe_layout(self.cfg, dp=getattr(e, "dp", None), tp=getattr(e, "tp", None),
                               pp=getattr(e, "pp", None), workers=workers,
                               strategy=None if self.cluster is None else self.cluster.name)

    def _nothing_to_do(self, step: int, t_start: float) -> Summary:
        """The checkpoint is at or past ``train.steps``: say so with the run's last logged loss."""
        rows = [r for r in read_metrics(self.run_dir) if r.get("step", 0) <= step]
        loss = float(rows[-1]["loss"]) if rows else float("nan")
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        self._say(f"nothing to do: {self.run_dir} is at step {step}, loss {loss:.4f} (train.steps={self.cfg.train.steps});"
                  f" raise train.steps to train further")
        return Summary(steps=step, loss=loss, eval_loss=evals[-1] if evals else None, tokens_per_s=0.0, mfu=0.0,
                       wall_s=time.monotonic() - t_start, skipped_steps=0, run_dir=self.run_dir,
                       checkpoint=checkpoint.latest(self.ckpt_dir))

    def _say(self, text: str) -> None:
        if not self.quiet and self.is_chief:
            print(text, file=sys.stderr, flush=True)

    def _warn(self, text: str) -> None:
        """A warning the user must see (a skipped checkpoint), even with quiet=True."""
        if self.is_chief:
            checkpoint.print_warning(text)


def _skipped_steps(engine) -> int:
    """Steps skipped on non-finite gradients (the loss scale's counter, read alone: the state
    of the whole model is never gathered for it)."""
    if hasattr(engine, "join"):  # parameter servers: steps may still be scheduled
        engine.join()
    scale = getattr(engine, "loss_scale", None)
    if scale is not None and hasattr(scale, "skipped"):
        return int(scale.skipped.numpy())
    return int(engine.state_dict().get("loss_scale/skipped", 0))


def _keras_policy(cfg: Config) -> str:
    return cfg.precision.policy


def _layout(cfg: Config, engine) -> dict:
    p = cfg.parallel
    return {"dp": engine.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "schedule": p.schedule,
            "engine": type(engine).__name__}
