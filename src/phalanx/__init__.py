"""phalanx: data, tensor and pipeline parallel training on TensorFlow 2 and Keras 3.

Your compiled Keras model, the Keras way, on any layout:

    >>> import phalanx                                                  # doctest: +SKIP
    >>> cfg = phalanx.init("parallel.devices=cpu:2", "parallel.dp=2")   # first, before TensorFlow starts
    >>> history = phalanx.fit(model, x, y, batch_size=64, epochs=3, config=cfg)

Names are imported lazily so that ``import phalanx`` does not start TensorFlow.
"""

from __future__ import annotations

__version__ = "0.1.0"


def _require_tensorflow() -> None:
    """phalanx depends on no TensorFlow build itself: the ``cpu`` and ``gpu`` extras each
    install one (two builds in one environment overwrite each other's ``tensorflow`` module).
    Say which to install before anything fails deeper down. Finding it does not import it."""
    import importlib.util
    if importlib.util.find_spec("tensorflow") is None:
        raise ImportError("phalanx needs TensorFlow 2.21, and none is installed: pip install 'phalanx[cpu]' "
                          "(CPU build) or 'phalanx[gpu]' (CUDA build); from a clone: pip install -e '.[cpu]'")


_require_tensorflow()

_LAZY = {
    "Config": ("phalanx.config", "Config"),
    "ConfigError": ("phalanx.config", "ConfigError"),
    "load_config": ("phalanx.config", "load_config"),
    "Mesh": ("phalanx.mesh", "Mesh"),
    "build_mesh": ("phalanx.mesh", "build_mesh"),
    "Trainer": ("phalanx.train.trainer", "Trainer"),
    "fit": ("phalanx.api", "fit"),
    "init": ("phalanx.api", "init"),
    "evaluate": ("phalanx.api", "evaluate"),
    "predict": ("phalanx.api", "predict"),
    "export": ("phalanx.export.api", "export"),
    "parallelize": ("phalanx.models.parallelize", "parallelize"),
    "unparallelize": ("phalanx.models.parallelize", "unparallelize"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
