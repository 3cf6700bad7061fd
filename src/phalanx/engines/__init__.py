"""Engines: one training step of a model on a layout (the trainer drives any of them).

* :mod:`~phalanx.engines.factory`: config -> engine (``build_engine`` for ``phalanx train``,
  ``make_engine`` to apply a given mesh to a model);
* :mod:`~phalanx.engines.task`: what is trained (the built-in GPT or a Keras model and loss);
* :mod:`~phalanx.engines.strategy`: the Engine protocol and ``StrategyEngine`` (tf.distribute:
  the Trainer's Keras task on one device, MirroredStrategy or MultiWorkerMirroredStrategy, and
  the step the parameter-server engine schedules);
* :mod:`~phalanx.engines.keras_model` and :mod:`~phalanx.engines.keras_cluster`: a user's
  compiled Keras 3 model (its own optimizer, loss and metrics) over a mesh, in one process
  or across a cluster;
* :mod:`~phalanx.engines.keras_gpt`: the built-in GPT (dense or mixture-of-experts) for
  ``phalanx train`` on every layout but parameter servers, through the Keras-model engine;
* :mod:`~phalanx.engines.ps`: the parameter-server engine.
"""
