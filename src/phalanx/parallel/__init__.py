"""Parallelism applied from outside the model: schedules, tensor/pipeline/data parallel engines.

``phalanx.parallel.make_engine(model_or_task, mesh, cfg)`` returns an Engine (see
:mod:`phalanx.parallel.apply`). Attributes are imported lazily so that the schedule
tools (``phalanx schedule``) do not pay for importing TensorFlow.
"""

_LAZY = {"make_engine": "phalanx.parallel.apply", "make_mesh_engine": "phalanx.parallel.apply",
         "needs_mesh_engine": "phalanx.parallel.apply", "MeshEngine": "phalanx.parallel.mesh_engine",
         "split_keras_model": "phalanx.parallel.keras_graph"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phalanx.parallel' has no attribute {name!r}")
