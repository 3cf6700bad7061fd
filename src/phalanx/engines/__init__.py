"""Engines: one training step of a model on a layout (the trainer drives any of them).

* :mod:`~phalanx.engines.factory`: config -> engine (``build_engine`` for ``phalanx train``,
  ``make_engine`` to apply a given mesh to a model);
* :mod:`~phalanx.engines.task`: what is trained (the built-in GPT or a Keras model and loss);
* :mod:`~phalanx.engines.strategy`: the Engine protocol and ``StrategyEngine`` (tf.distribute:
  one device, MirroredStrategy, MultiWorkerMirroredStrategy);
* :mod:`~phalanx.engines.pipelined`: ``PipelinedEngine``, the step core of the hand-placed
  engines (per-replica pipelines, ZeRO-sharded AdamW, sharded checkpoints); the GPT's
  :class:`~phalanx.engines.mesh.MeshEngine` is one;
* :mod:`~phalanx.engines.mesh`: ``MeshEngine``, the built-in GPT on a dp x tp x pp mesh,
  running the parallel layers' own per-shard code (:class:`~phalanx.models.transformer.ShardedGPT`);
* :mod:`~phalanx.engines.keras_model` and :mod:`~phalanx.engines.keras_cluster`: a user's
  compiled Keras 3 model (its own optimizer, loss and metrics) over a mesh, in one process
  or across a cluster;
* :mod:`~phalanx.engines.keras_gpt`: the built-in MoE GPT with expert parallelism
  (``parallel.ep > 1``) for ``phalanx train``, through the Keras-model engine;
* :mod:`~phalanx.engines.ps`: the parameter-server engine.
"""
