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

# Modules whose Keras layers are registered for serialization (``keras.saving.register_keras_serializable``
# with package "phalanx"): a saved ``.keras`` file naming "phalanx>..." loads once they are imported.
_SERIALIZABLES = ("phalanx.layers", "phalanx.models.transformer", "phalanx.export.gpt_keras")


def _on_keras_lookup() -> None:
    """Make ``keras.saving.load_model`` find phalanx's layers after a plain ``import phalanx``,
    without importing Keras (and TensorFlow) here: Keras's lookup of a registered name is
    wrapped so that a miss on a ``phalanx>`` name imports :data:`_SERIALIZABLES` and looks again.
    The wrapper goes in when Keras is imported (now, if it already is)."""
    import sys

    def patch(keras_module) -> None:
        try:
            from keras.src.saving import object_registration as registry
        except ImportError:  # another Keras layout: loading needs the modules imported by hand
            return
        original = registry.get_registered_object
        if getattr(original, "_phalanx", False):
            return

        def get_registered_object(name, custom_objects=None, module_objects=None):
            found = original(name, custom_objects, module_objects)
            if found is None and isinstance(name, str) and name.startswith("phalanx>"):
                import importlib
                for module in _SERIALIZABLES:
                    importlib.import_module(module)
                found = original(name, custom_objects, module_objects)
            return found

        get_registered_object._phalanx = True
        registry.get_registered_object = get_registered_object

    if "keras" in sys.modules and hasattr(sys.modules["keras"], "saving"):
        patch(sys.modules["keras"])
        return
    import importlib.abc
    import importlib.machinery

    class KerasWatch(importlib.abc.MetaPathFinder):
        """Finds nothing itself: wraps the loader of the top-level ``keras`` module so that
        ``patch`` runs right after Keras's own ``__init__``; then leaves ``sys.meta_path``."""

        def find_spec(self, fullname, path=None, target=None):
            if fullname != "keras":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            inner = spec.loader

            class Loader(importlib.abc.Loader):
                def create_module(self, spec):
                    return inner.create_module(spec)

                def exec_module(self, module):
                    inner.exec_module(module)
                    patch(module)

                def __getattr__(self, name):  # resources, is_package, ...: the real loader's
                    return getattr(inner, name)

            spec.loader = Loader()
            return spec

    if not any(type(f).__name__ == "KerasWatch" for f in sys.meta_path):  # once, even if phalanx is reloaded
        sys.meta_path.insert(0, KerasWatch())


_on_keras_lookup()

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
