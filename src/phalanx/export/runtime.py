"""Load an exported artifact in its own runtime and run it.

An export directory holds the model file (``model.keras``, ``saved_model/`` or
``model.tflite``), ``export.json`` (format, quantization, what it came from, the GPT's
shape for a run) and ``export_report.json``; a run's export also carries the run's
``config.yaml`` and ``tokenizer/``, so ``phalanx eval`` / ``phalanx generate`` work on it
without the run directory.

- ``keras``: ``keras.saving.load_model`` (this module registers the GPT's layers), run with
  ``predict_on_batch``;
- ``savedmodel``: ``tf.saved_model.load``, endpoint ``serve``;
- ``litert``: ``ai_edge_litert.interpreter.Interpreter`` (the successor of the deprecated
  ``tf.lite.Interpreter``), its input resized to each batch's shape.

Example:
    >>> art = load_artifact("runs/demo/export/litert-int8")            # doctest: +SKIP
    >>> art.predict(np.zeros([1, 128], np.int32)).shape                 # doctest: +SKIP
    (1, 128, 256)
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from phalanx.config import ConfigError, load_config, one_device_overrides
from phalanx.data.pipeline import make_datasets
from phalanx.data.tokenize import load_run_tokenizer
from phalanx.export.formats import FORMATS, META_FILE, MODEL_FILES, size_on_disk


def is_artifact(path: str | Path) -> bool:
    """Whether ``path`` is an export directory (holds ``export.json``) or a bare model file."""
    path = Path(path)
    return (path / META_FILE).is_file() or (path.is_file() and path.suffix in (".keras", ".tflite"))


def litert_interpreter_class():
    """The ``ai-edge-litert`` Interpreter class, or a clear error if it is missing."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise ConfigError("--format", "litert artifacts run in the ai-edge-litert interpreter, which is not "
                                      "installed: pip install ai-edge-litert") from None
    return Interpreter


class Artifact:
    """An exported model in its runtime: ``predict(x) -> np.ndarray`` (float32)."""

    def __init__(self, path: str | Path, fmt: str, meta: dict | None = None, threads: int | None = None):
        self.dir = Path(path)
        self.format = fmt
        self.meta = meta or {}
        self.quantize = self.meta.get("quantize", "none")
        self.model_path = self.dir / MODEL_FILES[fmt] if self.dir.is_dir() else self.dir
        self._threads = threads or os.cpu_count() or 1
        self._load()

    @property
    def size_bytes(self) -> int:
        return size_on_disk(self.model_path)

    def _load(self) -> None:
        if self.format == "keras":
            import keras

            import phalanx.export.gpt_keras  # noqa: F401  (registers the GPT's layers)
            self._model = keras.saving.load_model(str(self.model_path), compile=False)
        elif self.format == "savedmodel":
            import tensorflow as tf
            self._model = tf.saved_model.load(str(self.model_path))
            self._fn = self._model.serve
        else:
            Interpreter = litert_interpreter_class()
            self._model = Interpreter(model_path=str(self.model_path), num_threads=self._threads)
            self._inputs = self._model.get_input_details()
            self._output = self._model.get_output_details()[0]
            self._shapes = None

    def predict(self, x) -> np.ndarray:
        """Run one batch: ``x`` an array (or a list of arrays, in the model's input order)."""
        xs = [np.asarray(a) for a in (x if isinstance(x, (list, tuple)) else [x])]
        if self.format == "keras":
            out = self._model.predict_on_batch(xs if len(xs) > 1 else xs[0])
            return np.asarray(out, np.float32)
        if self.format == "savedmodel":
            import tensorflow as tf
            return np.asarray(self._fn(*[tf.constant(a) for a in xs]), np.float32)
        it = self._model
        shapes = [a.shape for a in xs]
        if shapes != self._shapes:
            for detail, a in zip(self._inputs, xs):
                it.resize_tensor_input(detail["index"], list(a.shape), strict=False)
            it.allocate_tensors()
            self._inputs = it.get_input_details()
            self._output = it.get_output_details()[0]
            self._shapes = shapes
        for detail, a in zip(self._inputs, xs):
            it.set_tensor(detail["index"], a.astype(detail["dtype"], copy=False))
        it.invoke()
        out = it.get_tensor(self._output["index"])
        scale, zero = self._output.get("quantization", (0.0, 0))
        if out.dtype != np.float32 and scale:  # an integer output: dequantize
            out = (out.astype(np.float32) - zero) * scale
        return out.astype(np.float32, copy=False)


def load_artifact(path: str | Path, threads: int | None = None) -> Artifact:
    """The artifact at ``path`` (an export directory, or a bare ``.keras`` / ``.tflite`` file
    or SavedModel directory) loaded in its runtime."""
    path = Path(path)
    meta_path = path / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        fmt = meta.get("format")
        if fmt not in FORMATS:
            raise ConfigError(str(meta_path), f"names format {fmt!r}; expected one of {', '.join(FORMATS)}")
        return Artifact(path, fmt, meta, threads)
    if path.is_file() and path.suffix == ".keras":
        return Artifact(path, "keras", {}, threads)
    if path.is_file() and path.suffix == ".tflite":
        return Artifact(path, "litert", {}, threads)
    if (path / "saved_model.pb").is_file():
        return Artifact(path, "savedmodel", {}, threads)
    raise ConfigError(str(path), "is not an exported model: expected a directory written by `phalanx export` "
                                 "(with export.json), a .keras or .tflite file, or a SavedModel directory")


# ---------------------------------------------------------------------------
# The built-in GPT's artifacts: held-out loss and sampling, for `phalanx eval` / `generate`


def lm_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean token cross-entropy (nats), computed in float64 NumPy."""
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    picked = np.take_along_axis(logits, targets[..., None].astype(np.int64), -1)[..., 0]
    return float(np.mean(logz - picked))


def _artifact_config(path: Path, overrides: list[str]):
    cfg_path = path / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(str(path), "this export has no config.yaml: it was exported from a Keras model, not a "
                                     "phalanx run; score it with phalanx.export.report instead")
    return load_config(cfg_path, one_device_overrides() + list(overrides))


def evaluate_lm_artifact(path: str | Path, overrides: list[str] = (), batches: int | None = None) -> dict:
    """Held-out loss / perplexity of a run's exported GPT, run in its own runtime, on the
    run's validation split (``train.eval_batches`` batches, as ``phalanx eval``)."""

    path = Path(path)
    art = load_artifact(path)
    cfg = _artifact_config(path, list(overrides))
    datasets = make_datasets(cfg, progress=False)
    n = batches or cfg.train.eval_batches
    losses = []
    for i, batch in enumerate(datasets.val):
        if i >= n:
            break
        b = np.asarray(batch)
        losses.append(lm_loss(art.predict(b[:, :-1].astype(np.int32)), b[:, 1:]))
    loss = float(np.mean(losses))
    return {"artifact": str(path), "format": art.format, "quantize": art.quantize, "step": art.meta.get("step"),
            "eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), "batches": len(losses)}


def generate_with_artifact(path: str | Path, prompt: str, n_tokens: int, temperature: float = 0.8,
                           top_k: int = 40, seed: int = 0) -> str:
    """Sample ``n_tokens`` continuing ``prompt`` from a run's exported GPT, with the same
    window and sampling rule as :func:`phalanx.models.generate.generate`. Returns the new text."""
    path = Path(path)
    art = load_artifact(path)
    seq_len = int(art.meta.get("model", {}).get("seq_len", 0))
    if art.meta.get("kind") != "gpt" or not seq_len:
        raise ConfigError(str(path), "is not an export of a phalanx GPT run; generate needs one")
    tokenizer = load_run_tokenizer(path / "tokenizer")
    from phalanx.models.generate import sample  # imports TensorFlow: deferred, a LiteRT artifact runs without it
    out = sample(lambda window, position: art.predict(window)[0, position], list(tokenizer.encode(prompt)),
                 n_tokens, seq_len, temperature, top_k, seed)
    return tokenizer.decode(out)


def main_eval(path: str, overrides: list[str], as_json: bool) -> int:
    """``phalanx eval EXPORT_DIR``: what ``phalanx eval RUN_DIR`` prints, for an artifact."""
    result = evaluate_lm_artifact(path, overrides)
    if as_json:
        print(json.dumps(result))
    else:
        print(f"{result['format']} {result['quantize']} (step {result['step']}): eval loss "
              f"{result['eval_loss']:.4f}, perplexity {result['perplexity']:.2f} ({result['batches']} batches)")
    return 0


def main_generate(path: str, prompt: str, n_tokens: int, temperature: float, top_k: int, seed: int) -> int:
    """``phalanx generate EXPORT_DIR``: what ``phalanx generate RUN_DIR`` prints, for an artifact."""
    sys.stdout.write(prompt + generate_with_artifact(path, prompt, n_tokens, temperature, top_k, seed) + "\n")
    return 0
