"""Placement: how a model's weights and work are laid over a mesh (no training loop).

Schedules and the pipeline executor, the cost-balanced stage cut, tensor-parallel splits,
ZeRO-sharded optimizer state, recomputation, the Keras graph splitter. The engines that run a
step on these are in :mod:`phalanx.engines` (``phalanx.engines.factory.make_engine(model_or_task,
mesh, cfg)``). Attributes are imported lazily so that the schedule tools (``phalanx schedule``)
do not pay for importing TensorFlow.
"""

_LAZY = {"split_keras_model": "phalanx.parallel.keras_graph"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'phalanx.parallel' has no attribute {name!r}")
