"""Export a run's GPT or a user's Keras model: :func:`export_run` and :func:`export`.

Both write an export directory (see :mod:`phalanx.export.runtime`), load the artifact back
in its own runtime, score it beside the float model (:mod:`phalanx.export.report`), print
the table and write ``export_report.json``; both return the report as a dict.

Example (a user's model; ``phalanx.export`` is this function):
    >>> import numpy as np, keras, phalanx                                   # doctest: +SKIP
    >>> report = phalanx.export(model, "out/digits-int8", format="litert", quantize="int8",
    ...                         calibration_data=x_train, eval_data=(x_test, y_test))  # doctest: +SKIP
    >>> report["quality"]["exported"]["accuracy"]                             # doctest: +SKIP
    0.97
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from phalanx import checkpoint
from phalanx.config import ConfigError, load_config, one_device_overrides
from phalanx.data.pipeline import make_datasets
from phalanx.export import calibration, formats, report as report_lib
from phalanx.export.formats import META_FILE, MODEL_FILES, REPORT_FILE
from phalanx.export.output import check_output, io_error, make_temporary, move_into_place
from phalanx.export.quantization import copy_model, keras_quantize
from phalanx.export.runtime import load_artifact
from phalanx.fsutil import RunLock



def _sayer(quiet: bool) -> Callable[[str], None]:
    t0 = time.monotonic()

    def say(text: str) -> None:
        if not quiet:
            print(f"[phalanx.export {time.monotonic() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)
    return say


def default_output(run_dir: str | Path, fmt: str, quantize: str) -> Path:
    return Path(run_dir) / "export" / f"{fmt}-{quantize}"


# ---------------------------------------------------------------------------
# A run directory's GPT


def export_run(run_dir: str | Path, format: str = "litert", quantize: str = "none", *,  # noqa: A002
               calibration_batches: int = calibration.DEFAULT_BATCHES, output: str | Path | None = None,
               overwrite: bool = False, overrides: list[str] | tuple[str, ...] = (), eval_batches: int | None = None,
               quiet: bool = False, print_table: bool = True) -> dict:
    """Export the newest valid checkpoint of the built-in GPT's run at ``run_dir``.

    ``overrides`` (``section.key=value``) change the run's config for this export, e.g.
    ``data.source=...`` for calibration and held-out data, ``train.eval_batches=...``.
    ``output`` (default ``run_dir/export/FORMAT-QUANTIZE``) must not exist, nor be a run
    directory or inside one (but under its ``export/``); ``overwrite`` lets a previous
    export there be replaced (:mod:`phalanx.export.output`). The checkpoint is read under
    the run's lock (:class:`~phalanx.fsutil.RunLock`: not while a trainer writes it); a
    damaged newest checkpoint is skipped with a ``warning:`` line for the one before, as
    ``phalanx eval`` does. Raises :class:`ConfigError` for an unknown format or mode, an
    unsupported pair, an output it may not write, a run directory without a config or a
    valid checkpoint, and int8 without calibration data.
    """
    mode = formats.check_request(format, quantize)
    calibration.check_batches(calibration_batches)
    run_dir = Path(run_dir).expanduser()
    say = _sayer(quiet)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError("RUN_DIR", f"{str(run_dir)!r} has no config.yaml; is it a phalanx run directory "
                                     f"(made by `phalanx train`)?")
    out = check_output(output if output is not None else default_output(run_dir, format, quantize), overwrite,
                       run_dir)
    cfg = load_config(cfg_path, one_device_overrides() + [f"run.dir={run_dir}"] + list(overrides))
    if getattr(cfg.model, "experts", 0):
        raise ConfigError("model.experts", f"{cfg.model.experts}: exporting a mixture-of-experts GPT is not "
                                           f"supported yet (the export model has dense MLPs only); export a dense "
                                           f"run (model.experts=0)")
    # Keras-importing modules, deferred (not a cycle): `phalanx export --help` stays instant.
    from phalanx.export import gpt_keras
    from phalanx.models import gpt

    shapes = gpt.weight_shapes(cfg.model)
    weights: dict[str, np.ndarray] = {}

    def accept(restored) -> None:
        """Read the GPT's weights (each piece checked finite as it is read)."""
        missing = [n for n in shapes if n not in restored.tensors]
        if missing:
            raise ConfigError("RUN_DIR", f"checkpoint {restored.path} lacks {', '.join(missing[:3])}: it does not "
                                         f"hold the built-in GPT of {cfg_path} (a Keras-model run? export that "
                                         f"model with phalanx.export(model, ...))")
        weights.clear()
        for name, shape in shapes.items():
            if tuple(restored.reader.shape(name)) != tuple(shape):
                raise checkpoint.CheckpointError(restored.path / checkpoint.INDEX, f"does not fit this model: "
                                                 f"{name} has shape {list(restored.reader.shape(name))}, "
                                                 f"{cfg_path} makes it {list(shape)}")
            weights[name] = np.asarray(restored.tensors[name], np.float32)

    with _run_lock(run_dir):  # everything read from the run directory is read here
        # The newest checkpoint that verifies and reads: a damaged newer one is skipped with a warning.
        restored = checkpoint.restore_latest(run_dir / "checkpoints", warn=checkpoint.print_warning, accept=accept)
        if restored is None:
            raise ConfigError("RUN_DIR", f"{str(run_dir)!r} has no checkpoint (no checkpoints/step-*/); train it "
                                         f"first with `phalanx train` (checkpoints are written every "
                                         f"checkpoint.every steps and at the end)")
        latest = restored.path
        say(f"restored {latest}")
        run_files = _read_files(run_dir, ["config.yaml", "tokenizer"])
    float_model = gpt_keras.build(cfg.model, weights)

    datasets, data_error = None, None
    try:
        datasets = make_datasets(cfg, progress=False if quiet else None)
    except ConfigError as err:
        data_error = err
    representative = None
    if mode.needs_calibration:
        if datasets is None:
            raise ConfigError("--calibration-batches", f"int8 (full-integer) calibrates on batches of the run's "
                                                       f"training data, which cannot be read ({data_error}); "
                                                       f"point data.source=... at the data, or use --quantize "
                                                       f"int8-dynamic, which needs no calibration")
        say(f"calibration: {calibration_batches} training batches of {cfg.train.global_batch} x "
            f"{cfg.model.seq_len} tokens from the run's data pipeline")
        representative = calibration.from_run(datasets, calibration_batches)

    def make_artifact_model():
        if format in ("keras", "savedmodel") and quantize != "none":
            model = gpt_keras.build(cfg.model, weights)
            info = keras_quantize(model, quantize)
            return model, info
        if quantize == "int8":  # full-integer: a bounded attention mask (gpt_keras.INT8_MASK_VALUE)
            return gpt_keras.build(cfg.model, weights, mask_value=gpt_keras.INT8_MASK_VALUE), {}
        return float_model, {}

    meta = {"kind": "gpt", "format": format, "quantize": quantize, "mode": mode.description,
            "source": str(run_dir), "checkpoint": str(latest), "step": restored.step,
            "model": cfg.to_dict()["model"], "inputs": {"tokens": ["batch", cfg.model.seq_len], "dtype": "int32"},
            "outputs": {"logits": ["batch", cfg.model.seq_len, cfg.model.vocab], "dtype": "float32"},
            "eval_source": f"validation split of {cfg.data.source}"}

    def extra(tmp: Path) -> None:
        for rel, data in run_files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)

    def eval_batches_fn():
        n = eval_batches or cfg.train.eval_batches
        for i, batch in enumerate(datasets.val):
            if i >= n:
                break
            b = np.asarray(batch)
            yield b[:, :-1].astype(np.int32), b[:, 1:]

    notes = []
    if datasets is None:
        notes.append(f"held-out data unavailable ({data_error}); sizes only")
    total = min(eval_batches or cfg.train.eval_batches, datasets.val_batches) if datasets is not None else None
    return _export(float_model, make_artifact_model, format, mode, out, overwrite, representative, meta, extra,
                   "lm", eval_batches_fn if datasets is not None else None, total, notes, say, print_table)


def _run_lock(run_dir: Path):
    """The trainer's lock on ``run_dir`` (:class:`~phalanx.fsutil.RunLock`), so that no
    trainer writes or prunes a checkpoint while it is read; refused naming the trainer's pid
    when one runs. A run directory this process cannot write has no room for the lock file,
    and no trainer of ours can write there either: it is read as it is."""
    if not os.access(run_dir, os.W_OK):
        return contextlib.nullcontext()
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except ConfigError as err:
        raise ConfigError("RUN_DIR", f"cannot export the run while it is being trained ({err}); export once "
                                     f"the trainer has stopped") from None
    return lock  # held: entering it again keeps it, leaving releases it


def _read_files(root: Path, names: list[str]) -> dict[str, bytes]:
    """The bytes of the files ``names`` (files or folders) under ``root``, by relative path."""
    out = {}
    for name in names:
        path = root / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
        for file in found:
            try:
                out[file.relative_to(root).as_posix()] = file.read_bytes()
            except OSError as err:
                raise ConfigError("RUN_DIR", f"cannot read {str(file)!r}: {err.strerror or err}") from None
    return out


# ---------------------------------------------------------------------------
# A user's Keras model


def export(model, path: str | Path, format: str = "keras", quantize: str = "none", *,  # noqa: A002
           calibration_data=None, calibration_batches: int = calibration.DEFAULT_BATCHES,
           eval_data=None, batch_size: int = 32, kind: str = "auto", overwrite: bool = False, quiet: bool = False,
           print_table: bool = True) -> dict:
    """Export a built Keras 3 ``model`` to the directory ``path``; returns the report.

    - ``format``: ``keras`` | ``savedmodel`` | ``litert``; ``quantize``: ``none`` | ``float16``
      | ``int8-dynamic`` | ``int8`` | ``int4-weight`` (see :mod:`phalanx.export.formats` for
      which pairs exist).
    - ``calibration_data`` (needed by ``int8``): a ``tf.data.Dataset`` of input batches (or of
      ``(x, y)``), an array of inputs, or an ``(x, y)`` tuple; ``calibration_batches`` of
      ``batch_size`` rows are used.
    - ``eval_data``: ``(x, y)`` arrays or a ``tf.data.Dataset`` of ``(x, y)`` batches, scored
      with the float model and the artifact in its runtime. ``kind``: ``classifier``
      (accuracy), ``regressor`` (mse) or ``auto`` (integer or one-hot labels with a
      multi-column output make a classifier).

    ``path`` must not exist (``overwrite=True`` replaces a previous export there, nothing
    else; :mod:`phalanx.export.output`). The model passed in is not changed: Keras
    quantization works on a copy.
    """
    mode = formats.check_request(format, quantize, "format", "quantize")
    out = check_output(path, overwrite, key="path")
    import keras

    if not isinstance(model, keras.Model):
        raise ConfigError("model", f"expected a keras.Model, got {type(model).__name__}")
    if not model.built:
        raise ConfigError("model", "is not built: call it on a batch, or build it with keras.Input, before export")
    if kind not in ("auto", "classifier", "regressor"):
        raise ConfigError("kind", f"{kind!r}; use auto, classifier or regressor")
    say = _sayer(quiet)
    representative = None
    if mode.needs_calibration:
        representative = calibration.from_user(calibration_data, calibration_batches, batch_size)
        say(f"calibration: up to {calibration_batches} batches of the calibration data")

    def make_artifact_model():
        if format in ("keras", "savedmodel") and quantize != "none":
            copy = copy_model(model)
            return copy, keras_quantize(copy, quantize)
        return model, {}

    batches_fn, total, resolved_kind = None, None, kind
    if eval_data is not None:
        batches_fn, total, resolved_kind = _user_eval(model, eval_data, batch_size, kind)
    notes = [] if eval_data is not None else ["no eval_data given: sizes only (pass eval_data=(x, y) to score it)"]
    meta = {"kind": "keras", "format": format, "quantize": quantize, "mode": mode.description,
            "source": f"keras model {model.name!r}", "eval_source": "eval_data"}
    return _export(model, make_artifact_model, format, mode, out, overwrite, representative, meta, None,
                   resolved_kind, batches_fn, total, notes, say, print_table)


def _user_eval(model, eval_data, batch_size: int, kind: str):
    import tensorflow as tf

    if isinstance(eval_data, tf.data.Dataset):
        items = [(np.asarray(x), np.asarray(y)) for x, y in eval_data]
        first_y = items[0][1] if items else None

        def batches():
            yield from items
        total = len(items)
    elif isinstance(eval_data, (tuple, list)) and len(eval_data) == 2:
        x, y = np.asarray(eval_data[0]), np.asarray(eval_data[1])
        if len(x) != len(y):
            raise ConfigError("eval_data", f"x has {len(x)} rows but y has {len(y)}")
        first_y = y

        def batches():
            for s in range(0, len(x), batch_size):
                yield x[s:s + batch_size], y[s:s + batch_size]
        total = -(-len(x) // batch_size)
    else:
        raise ConfigError("eval_data", "expected (x, y) arrays or a tf.data.Dataset of (x, y) batches")
    if first_y is None:
        raise ConfigError("eval_data", "is empty")
    if kind == "auto":
        out_dim = model.outputs[0].shape[-1] if getattr(model, "outputs", None) else None
        integer = np.issubdtype(first_y.dtype, np.integer)
        one_hot = first_y.ndim >= 2 and out_dim and first_y.shape[-1] == out_dim and out_dim > 1
        kind = "classifier" if (out_dim or 0) > 1 and (integer or one_hot) else "regressor"
    return batches, total, kind


# ---------------------------------------------------------------------------
# Shared: write, reload in the runtime, score, report


def _export(float_model, make_artifact_model, fmt: str, mode, out: Path, overwrite: bool, representative,
            meta: dict, extra: Callable[[Path], None] | None, kind: str, batches_fn, total: int | None,
            notes: list[str], say: Callable[[str], None], print_table: bool) -> dict:
    """Build the export in a temporary sibling of ``out`` (checked by
    :func:`~phalanx.export.output.check_output`), score it there, and rename it into place:
    a failure leaves nothing at ``out``; an I/O error is one ConfigError naming the path."""
    tmp = make_temporary(out)
    try:
        model, info = make_artifact_model()
        if info:
            meta = {**meta, "keras_quantize": info}
            if info.get("float_params"):
                notes.append(f"{info['float_params']:,} parameters are in layers Keras's quantize leaves float "
                             f"(normalisation, position table, convolutions, biases)")
            say(f"Keras quantize({info['keras_mode']!r}): {info['quantized_layers']} layers")
        how = {"keras": "saving .keras", "savedmodel": "exporting the SavedModel",
               "litert": f"converting with the LiteRT converter ({mode.description})"}[fmt]
        say(f"{how} -> {out / MODEL_FILES[fmt]}")
        t0 = time.monotonic()
        formats.write(fmt, model, tmp / MODEL_FILES[fmt], mode.name, representative, notes)
        meta = {**meta, "export_seconds": round(time.monotonic() - t0, 2), "created": time.time()}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        if extra is not None:
            extra(tmp)

        artifact_size = formats.size_on_disk(tmp / MODEL_FILES[fmt])
        if mode.name == "none":
            float_size = artifact_size
        else:
            say(f"writing the float32 {fmt} model too, to compare sizes")
            with tempfile.TemporaryDirectory(prefix="phalanx-float-") as ftmp:
                fpath = Path(ftmp) / MODEL_FILES[fmt]
                formats.write(fmt, float_model, fpath, "none")
                float_size = formats.size_on_disk(fpath)

        quality = None
        if batches_fn is not None:
            say(f"loading {out} in its runtime and scoring it beside the float model")
            art = load_artifact(tmp)
            quality = report_lib.compare(lambda x: float_model.predict_on_batch(x), art.predict, batches_fn(), kind,
                                         progress=say, total=total)
        # sized where it is now (the hidden sibling), named where it will be
        rep = report_lib.build({**meta, "artifact": str(tmp / MODEL_FILES[fmt])}, quality, float_size,
                               artifact_size, notes)
        rep["artifact"] = str(out / MODEL_FILES[fmt])
        report_lib.write(rep, tmp / REPORT_FILE)
        move_into_place(tmp, out, overwrite)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise io_error(out, err) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if print_table:
        print(report_lib.table(rep), flush=True)
        print(f"wrote {out / MODEL_FILES[fmt]} and {out / REPORT_FILE}", flush=True)
    return rep
