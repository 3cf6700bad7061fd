"""Keras-side quantization (``keras`` and ``savedmodel`` formats) and model copies.

``int8-dynamic`` is Keras's ``model.quantize("int8")``: per-output-channel int8 weights and
per-token int8 activations computed at run time (no calibration). ``int4-weight`` is
``model.quantize("int4")`` with Keras's default :class:`keras.quantizers.Int4QuantizationConfig`:
int4 weights in groups of 128 along the input dimension, float activations. Both act on
``Dense``, ``EinsumDense``, ``Embedding`` and ``ReversibleEmbedding`` layers; other layers
(convolutions, normalisation, ...) stay float, and :func:`keras_quantize` says how many
parameters that leaves.

Example:
    >>> import keras
    >>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    >>> q = keras_quantize(copy_model(m), "int8-dynamic")
    >>> q["quantized_layers"]
    2
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from phalanx.config import ConfigError

KERAS_MODES = {"int8-dynamic": "int8", "int4-weight": "int4"}


def keras_quantize(model, mode: str) -> dict:
    """Quantize ``model`` in place with Keras; returns what changed."""
    keras_mode = KERAS_MODES[mode]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one "layer X does not support quantize" per layer that stays float
        model.quantize(keras_mode)
    quantized = [layer for layer in model._flatten_layers()
                 if getattr(layer, "quantization_mode", None) == keras_mode]
    float_params = 0
    for layer in model._flatten_layers():
        if len(list(layer._flatten_layers())) == 1 and getattr(layer, "quantization_mode", None) != keras_mode:
            float_params += sum(int(w.numpy().size) for w in layer.weights if w.dtype in ("float32", "float16"))
    if not quantized:
        raise ConfigError("--quantize", f"{mode}: Keras's model.quantize found no Dense, EinsumDense or Embedding "
                                        f"layer to quantize in this model; export with --quantize none, or use "
                                        f"--format litert (the converter quantizes convolutions too)")
    return {"keras_mode": keras_mode, "quantized_layers": len(quantized), "float_params": float_params}


def copy_model(model):
    """A copy of a built Keras model with the same weights (``quantize`` changes a model in
    place; the caller's model must stay float). Functional and Sequential models are cloned;
    others go through a ``.keras`` round trip, which needs them serialisable."""
    import keras

    try:
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        return clone
    except Exception as first:  # subclassed models: clone_model needs get_config/from_config too
        with tempfile.TemporaryDirectory(prefix="phalanx-copy-") as tmp:
            path = Path(tmp) / "copy.keras"
            try:
                model.save(str(path))
                return keras.saving.load_model(str(path), compile=False)
            except Exception as second:
                raise ConfigError("--quantize", f"cannot copy the model to quantize it ({type(first).__name__}: "
                                                f"{first}; saving it: {type(second).__name__}: {second}); make it "
                                                f"serialisable (get_config + @keras.saving."
                                                f"register_keras_serializable) or use --format litert") from None
