"""The numerics every engine and the planner share, below the models and the placement code.

:mod:`~phalanx.core.optim` (the one AdamW apply and the learning-rate schedule),
:mod:`~phalanx.core.loss_scale` (dynamic loss scaling for float16),
:mod:`~phalanx.core.costs` (the one parameter and FLOP model: MFU, the pipeline
partitioner and the planner count the same FLOPs), :mod:`~phalanx.core.batch` (cutting a
nest of batch tensors into micro-batches). These modules import only
:mod:`phalanx.config` (tests/test_import_direction.py).
"""
