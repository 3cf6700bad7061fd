"""Export formats, quantization modes, which combinations exist, and the writers.

Formats and the runtime each artifact loads in:

- ``keras``: ``model.keras``, loaded by ``keras.saving.load_model`` (import
  ``phalanx.export`` first for the built-in GPT's layers);
- ``savedmodel``: ``saved_model/``, the model and one ``tf.function`` (endpoints ``serve`` and
  ``serving_default``), loaded by ``tf.saved_model.load``;
- ``litert``: ``model.tflite``, converted by the TensorFlow Lite converter from the float
  model's SavedModel with builtin ops only, run by the ``ai-edge-litert`` interpreter.

Quantization (``--quantize``), and who does it:

| mode | keras / savedmodel | litert |
|---|---|---|
| ``none`` | float32 | float32 |
| ``float16`` | refused (Keras's ``quantize`` has no float16 mode) | float16 weights (converter) |
| ``int8-dynamic`` | Keras ``quantize("int8")``: int8 weights, activations quantized per token at run time | dynamic-range: int8 weights (converter) |
| ``int8`` | refused (Keras has no calibrated activation quantization) | full-integer: int8 weights and activations, calibrated |
| ``int4-weight`` | Keras ``quantize("int4")``: int4 weights (groups of 128), float activations | refused (the TF 2.21 converter has no int4) |

The LiteRT converter always starts from the float model: it cannot take one already
passed through Keras's ``quantize`` (ARCHITECTURE.md).

Example:
    >>> check_request("litert", "int8").name
    'int8'
    >>> check_request("keras", "int8")
    Traceback (most recent call last):
    ...
    phalanx.config.ConfigError: --quantize: int8 (full-integer, calibrated) is not available for --format keras: Keras's model.quantize has no calibrated activation quantization; use --format litert --quantize int8, or one of none, int8-dynamic, int4-weight with --format keras
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from phalanx.config import ConfigError

FORMATS = ("keras", "savedmodel", "litert")
QUANTIZE_MODES = ("none", "float16", "int8-dynamic", "int8", "int4-weight")

#: the model file (or directory) inside an export directory, by format
MODEL_FILES = {"keras": "model.keras", "savedmodel": "saved_model", "litert": "model.tflite"}
META_FILE = "export.json"
REPORT_FILE = "export_report.json"


@dataclass(frozen=True)
class Mode:
    name: str
    description: str
    needs_calibration: bool = False


MODES = {
    "none": Mode("none", "float32"),
    "float16": Mode("float16", "float16 weights"),
    "int8-dynamic": Mode("int8-dynamic", "int8 weights, activations quantized at run time"),
    "int8": Mode("int8", "full-integer int8 weights and activations, calibrated", needs_calibration=True),
    "int4-weight": Mode("int4-weight", "int4 weights, float activations"),
}

#: (format, mode) -> why it is refused; combinations absent here are supported
UNSUPPORTED = {
    ("keras", "float16"): "Keras's model.quantize has no float16 mode",
    ("savedmodel", "float16"): "Keras's model.quantize has no float16 mode",
    ("keras", "int8"): "Keras's model.quantize has no calibrated activation quantization",
    ("savedmodel", "int8"): "Keras's model.quantize has no calibrated activation quantization",
    ("litert", "int4-weight"): "the TensorFlow 2.21 LiteRT converter has no int4 weight mode",
}

#: what each format's "int8" alternative is called in the refusal messages
_INSTEAD = {
    ("keras", "float16"): "--format litert --quantize float16",
    ("savedmodel", "float16"): "--format litert --quantize float16",
    ("keras", "int8"): "--format litert --quantize int8",
    ("savedmodel", "int8"): "--format litert --quantize int8",
    ("litert", "int4-weight"): "--format keras --quantize int4-weight (or savedmodel)",
}


def supported_modes(fmt: str) -> list[str]:
    return [m for m in QUANTIZE_MODES if (fmt, m) not in UNSUPPORTED]


def check_request(fmt: str, quantize: str, format_key: str = "--format",
                  quantize_key: str = "--quantize") -> Mode:
    """Validate a (format, quantize) pair; raise :class:`ConfigError` naming the flag and
    the valid choices. Returns the :class:`Mode`."""
    if fmt not in FORMATS:
        raise ConfigError(format_key, f"{fmt!r} is not an export format; use one of {', '.join(FORMATS)}")
    if quantize not in MODES:
        raise ConfigError(quantize_key, f"{quantize!r} is not a quantization mode; use one of "
                                        f"{', '.join(QUANTIZE_MODES)}")
    if (fmt, quantize) in UNSUPPORTED:
        label = "int8 (full-integer, calibrated)" if quantize == "int8" else quantize
        raise ConfigError(quantize_key, f"{label} is not available for {format_key} {fmt}: "
                                        f"{UNSUPPORTED[fmt, quantize]}; use {_INSTEAD[fmt, quantize]}, or one of "
                                        f"{', '.join(supported_modes(fmt))} with {format_key} {fmt}")
    return MODES[quantize]


def support_table() -> str:
    """A markdown table of what is supported (for docs and ``phalanx export --help``)."""
    rows = ["| format | " + " | ".join(QUANTIZE_MODES) + " |", "|---" * (len(QUANTIZE_MODES) + 1) + "|"]
    for fmt in FORMATS:
        rows.append(f"| {fmt} | " + " | ".join("no" if (fmt, m) in UNSUPPORTED else "yes"
                                              for m in QUANTIZE_MODES) + " |")
    return "\n".join(rows)


def size_on_disk(path: str | Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------
# Writers. ``model`` is a built Keras model (already quantized by Keras for keras /
# savedmodel; the float model for litert).


def write_keras(model, path: Path) -> None:
    model.save(str(path))


def write_savedmodel(model, path: Path) -> None:
    """A SavedModel with endpoints ``serve`` and ``serving_default`` (the same function).

    Models with symbolic inputs (Functional, Sequential, the built-in GPT's export model)
    are saved as a ``tf.Module`` holding the model and one ``tf.function``: Keras's own
    ``model.export(format="tf_saved_model")`` writes every variable twice (the demo GPT:
    25.3 MiB against 13.0 MiB, measured with Keras 3.15). Other models go through Keras's
    exporter, which infers their signature.
    """
    import tensorflow as tf

    inputs = getattr(model, "inputs", None)
    if not inputs:
        _keras_savedmodel(model, path)
        return
    specs = [tf.TensorSpec(tuple(t.shape), t.dtype, name=t.name) for t in inputs]

    def serve(*xs):
        return model(list(xs) if len(xs) > 1 else xs[0], training=False)

    module = tf.Module()
    module.model = model
    module.serve = tf.function(serve, input_signature=specs)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve, "serve": module.serve})


def _keras_savedmodel(model, path: Path) -> None:
    """Keras's own SavedModel export (endpoint ``serve``, plus ``serving_default``)."""
    model.export(str(path), format="tf_saved_model", verbose=False)


def write_litert(model, path: Path, mode: str, representative=None, notes: list | None = None) -> None:
    """Convert the float Keras ``model`` with the LiteRT converter, builtin ops only (the
    ``ai-edge-litert`` interpreter has no TensorFlow ops), quantizing as ``mode`` says.

    ``representative``: a callable yielding lists of input arrays, for ``int8``. Full-integer
    first tries int8 kernels for every op; if some op has none it converts again letting
    those ops stay float, and says so in ``notes``.
    """
    import tempfile

    import tensorflow as tf

    with tempfile.TemporaryDirectory(prefix="phalanx-litert-") as tmp:
        # Through Keras's SavedModel export: the converter freezes its variables (converting
        # a concrete function of the Keras model directly leaves READ_VARIABLE ops with no
        # values, measured on TF 2.21).
        _keras_savedmodel(model, Path(tmp) / "sm")

        def converter(ops):
            c = tf.lite.TFLiteConverter.from_saved_model(str(Path(tmp) / "sm"), signature_keys=["serve"])
            c.target_spec.supported_ops = ops
            if mode == "float16":
                c.optimizations = [tf.lite.Optimize.DEFAULT]
                c.target_spec.supported_types = [tf.float16]
            elif mode == "int8-dynamic":
                c.optimizations = [tf.lite.Optimize.DEFAULT]
            elif mode == "int8":
                if representative is None:
                    raise ConfigError("--quantize", "int8 needs calibration data")
                c.optimizations = [tf.lite.Optimize.DEFAULT]
                c.representative_dataset = representative
            return c

        if mode == "int8":
            try:
                blob = converter([tf.lite.OpsSet.TFLITE_BUILTINS_INT8]).convert()
            except Exception as err:  # an op without an int8 kernel: let it stay float
                if notes is not None:
                    notes.append(f"some ops have no int8 kernel and stay float ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0][:200]})")
                blob = converter([tf.lite.OpsSet.TFLITE_BUILTINS]).convert()
        else:
            blob = converter([tf.lite.OpsSet.TFLITE_BUILTINS]).convert()
    tmp_file = path.with_name(path.name + ".tmp")
    tmp_file.write_bytes(blob)
    os.replace(tmp_file, path)


def write(fmt: str, model, path: Path, mode: str, representative=None, notes: list | None = None) -> Path:
    """Write ``model`` in ``fmt`` at ``path`` (replacing what is there)."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    if fmt == "keras":
        write_keras(model, path)
    elif fmt == "savedmodel":
        write_savedmodel(model, path)
    else:
        write_litert(model, path, mode, representative, notes)
    return path
