"""What a compiled Keras model's sparse cross-entropy losses need of its targets.

:func:`sparse_label_rules` reads the model's built compiled loss (``model._compile_loss``,
built by :class:`~phalanx.engines.keras_model.KerasModelEngine` before any step) and the
shape of each output it is applied to: a ``SparseCategoricalCrossentropy`` (the object, the
string or the function) takes integer class ids in ``[0, units)`` of its output's class axis,
or its ``ignore_class``. :meth:`phalanx.data.keras_inputs.Batches.check_labels` then checks
the targets against them before step 1.

Example:
    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    >>> model.compile(loss="sparse_categorical_crossentropy")
    >>> _ = model.evaluate(np.zeros((2, 3)), np.zeros((2,)), verbose=0)  # builds the compiled loss
    >>> [(r.path, r.classes, r.loss) for r in sparse_label_rules(model, np.zeros((2, 3)))]
    [((), 4, 'sparse_categorical_crossentropy')]
"""

from __future__ import annotations

import keras

from phalanx.data.checks import ClassLabels, resolve


def sparse_label_rules(model, x) -> list[ClassLabels]:
    """One :class:`~phalanx.data.checks.ClassLabels` per sparse cross-entropy of ``model``'s
    compiled loss (none for a model whose ``compute_loss`` is its own), with the class count
    read from the output's shape for inputs shaped like ``x`` (None when it is not known)."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        return []
    flat = list(getattr(getattr(model, "_compile_loss", None), "_flat_losses", None) or [])
    names = list(getattr(model, "output_names", None) or []) or None
    rules, outputs = [], None
    for entry in flat:
        fn = entry.loss
        if getattr(fn, "fn", None) is not keras.losses.sparse_categorical_crossentropy:
            continue
        kwargs = getattr(fn, "_fn_kwargs", {}) or {}
        if outputs is None:
            outputs = _output_spec(model, x)
        path = tuple(entry.path or ())
        out = resolve(outputs, path, names) if outputs is not None else None
        classes = None
        shape = getattr(out, "shape", None)
        if shape is not None and len(shape):
            units = shape[kwargs.get("axis", -1)]
            classes = int(units) if units is not None else None
        loss = fn.name if type(fn).__name__ == "LossFunctionWrapper" else type(fn).__name__
        rules.append(ClassLabels(path, classes, kwargs.get("ignore_class"), loss,
                                 output=entry.name if len(flat) > 1 else None))
    return rules


def _output_spec(model, x):
    """The model's outputs as symbolic tensors (shapes only), or None if Keras cannot say."""
    try:
        inputs = keras.tree.map_structure(lambda a: keras.KerasTensor(a.shape, dtype=keras.backend.standardize_dtype(a.dtype)), x)
        return model.compute_output_spec(inputs)
    except Exception:  # noqa: BLE001 - a model that cannot trace symbolically: no class count, checks stay
        return None
