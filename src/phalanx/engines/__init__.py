"""Engines: one training step of a model on a layout (the trainer drives any of them).

* :mod:`~phalanx.engines.factory`: config -> engine (``build_engine`` for ``phalanx train``,
  ``make_engine`` to apply a given mesh to a model);
* :mod:`~phalanx.engines.task`: what ``phalanx train`` trains (the built-in GPT) and its precision;
* :mod:`~phalanx.engines.joined`: a logical tensor held by several variables;
* :mod:`~phalanx.engines.keras_model` and :mod:`~phalanx.engines.keras_cluster`: a user's
  compiled Keras 3 model (its own optimizer, loss and metrics) over a mesh, in one process
  or across a cluster;
* :mod:`~phalanx.engines.keras_gpt`: the built-in GPT (dense or mixture-of-experts) for
  ``phalanx train`` on every layout but parameter servers, through the Keras-model engine;
* :mod:`~phalanx.engines.ps` and :mod:`~phalanx.engines.ps_gpt`: the parameter-server engine
  (any Keras model; the built-in GPT for ``phalanx train``).
"""
