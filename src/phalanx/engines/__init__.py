"""Engines: one training step of a model on a layout.

:mod:`phalanx.engines.keras_model` trains a user's compiled Keras 3 model (its own
optimizer, loss and metrics) over the ``data`` and ``pipe`` axes of a mesh. The
built-in GPT's engines still live in :mod:`phalanx.train.engine` (tf.distribute) and
:mod:`phalanx.parallel.mesh_engine` (hand placement).
"""
