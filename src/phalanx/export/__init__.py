"""After training: a run's GPT or a user's Keras model as a small servable artifact.

``phalanx export RUN_DIR --format keras|savedmodel|litert --quantize none|float16|
int8-dynamic|int8|int4-weight`` and :func:`phalanx.export` write an export directory,
load it back in its own runtime, and report its size, held-out quality and speed beside
the float model (``export_report.json``). Which (format, quantize) pairs exist and why:
:mod:`phalanx.export.formats`.

Modules: ``formats`` (modes, the support matrix, writers), ``quantization`` (Keras's
``quantize``), ``calibration`` (int8 representative data), ``gpt_keras`` (the built-in GPT
as stock Keras layers), ``runtime`` (load and run an artifact), ``report``, ``api``, ``cli``.

Names are imported lazily, so importing this package does not start TensorFlow; a ``.keras``
export loads with ``import phalanx`` then ``keras.saving.load_model`` (``phalanx`` registers its
layers when Keras first looks one up).
"""

from __future__ import annotations

_LAZY = {
    "export": ("phalanx.export.api", "export"),
    "export_run": ("phalanx.export.api", "export_run"),
    "load_artifact": ("phalanx.export.runtime", "load_artifact"),
    "is_artifact": ("phalanx.export.runtime", "is_artifact"),
    "FORMATS": ("phalanx.export.formats", "FORMATS"),
    "QUANTIZE_MODES": ("phalanx.export.formats", "QUANTIZE_MODES"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'phalanx.export' has no attribute {name!r}")


# `phalanx.export` is both this package and the function `phalanx.export(model, path, ...)`:
# once any submodule is imported, Python binds the package to the attribute `phalanx.export`,
# so the package itself must be callable.
import sys as _sys  # noqa: E402
import types as _types  # noqa: E402


class _CallableModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        """``phalanx.export(model, path, format=..., quantize=..., ...)``: see :func:`phalanx.export.api.export`."""
        from phalanx.export.api import export
        return export(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
