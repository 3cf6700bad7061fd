"""A pipeline stage's forward traced once and called for every micro-batch.

Traced inline, a step holds a copy of every stage's ops for every micro-batch: its build
(Python tracing, then TensorFlow's graph optimisation and placement at the first run) grows
with the number of micro-batches. :class:`StageCalls` traces a stage's forward once per
``key`` (the engine uses ``(replica, stage, mode)``: the same stage on the same device) as a
``tf.function`` and calls it for each micro-batch. The call is marked ``_noinline``, so the
runtime optimises and instantiates the function (and the backward TensorFlow derives from it)
once per device instead of once per copy. ``tf.gradients`` over a call gives the gradients of
the ops inside (the weights' values and the stage's inputs are the call's arguments; an
embedding's gradient stays an ``IndexedSlices``); the call and the backward call are placed on
the device in scope when the stage is called, and every op inside, having no device of its
own, runs there.

Which stages may be called (:meth:`StageCalls.usable`): the caller decides that every op of
the stage belongs on the stage's one device (no tensor or expert shard: their layers place
ops by their inputs' devices, which a function's arguments do not carry, and the backward of a
function places nothing). The first trace of a key then refuses the function (the stage runs
inline, as before) when the stage reads a table with indices that are the same for every
micro-batch (:func:`phalanx.parallel.gradients.indices_vary`): the micro-batches' gradients of
such a lookup are summed row by row, a rule read from the lookup's ops, which a call hides.

Example:
    >>> import tensorflow as tf
    >>> calls = StageCalls()
    >>> w = tf.Variable(2.0)
    >>> @tf.function(autograph=False)
    ... def step(x):
    ...     run = lambda values, state, inputs: ({"y": values[0] * inputs["x"]}, list(state), [])
    ...     outs = [calls.call("stage0", run, [tf.convert_to_tensor(w)], [], {"x": x[i]})[0]["y"] for i in range(3)]
    ...     return tf.gradients(tf.add_n(outs), [w])[0]
    >>> float(step(tf.constant([1.0, 2.0, 3.0])))
    6.0
    >>> calls.traced  # one trace for the three micro-batches
    1
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask  # masks ride on tensors; no public API

from phalanx.parallel.gradients import indices_vary

# Ops that look rows of a table up by index (their gradient is an IndexedSlices).
GATHER_OPS = frozenset({"GatherV2", "ResourceGather", "Gather"})


def _constant_lookup(graph: tf.Graph) -> bool:
    """Whether ``graph`` looks a table up with indices equal in every micro-batch."""
    return any(op.type in GATHER_OPS and not indices_vary(op.inputs[1]) for op in graph.get_operations())


class StageCalls:
    """The traced forwards of a step's stages, by key; see the module docstring.

    ``run(values, state, inputs) -> (outputs, new_state, losses)``: a stage's forward on one
    micro-batch (``values``, ``state``: lists of tensors; ``inputs``, ``outputs``: dicts of
    tensors; ``losses``: a list of tensors). Keras masks on ``outputs`` cross the call.
    """

    def __init__(self):
        self._fns: dict = {}  # key -> tf.function, or None: run inline
        self.traced = 0  # stage functions traced (one per key that is called)
        self.inline: set = set()  # keys whose function was refused: their stage runs inline
        # a traced function's name scope -> the device its ops run on (given by the caller). Its
        # ops' names, and its backward's, hold the scope: a profile's op names find their device
        # by it (phalanx.train.calibrate), since the run's partition graphs list no call's body.
        self.devices: dict[str, str] = {}

    @staticmethod
    def scope(key) -> str:
        """The name scope of ``key``'s function: ``stage_call`` and the key's parts.

        >>> StageCalls.scope((1, 0, True))
        'stage_call_1_0_True'
        """
        parts = key if isinstance(key, tuple) else (key,)
        return "_".join(["stage_call", *("".join(c if c.isalnum() else "_" for c in str(p)) for p in parts)])

    def call(self, key, run: Callable, values, state, inputs, device: str | None = None):
        """``run(values, state, inputs)`` through the key's traced function (traced on the
        first call of ``key``), or inline when the function was refused. ``device``: where the
        caller places the call (recorded in :attr:`devices`)."""
        fn = self._fns.get(key, False)
        if fn is False:
            if device is not None:
                self.devices[self.scope(key)] = device
            fn = self._fns[key] = self._trace(run, values, state, inputs, self.scope(key))
            if fn is None:
                self.inline.add(key)
        if fn is None:
            return run(values, state, inputs)
        outputs, new_state, losses, masks = fn(list(values), list(state), dict(inputs))
        for k, mask in masks.items():
            set_keras_mask(outputs[k], mask)
        return outputs, list(new_state), list(losses)

    def _trace(self, run, values, state, inputs, scope: str):
        def body(v, st, inp):
            with tf.name_scope(scope):
                outputs, new_state, losses = run(v, st, inp)
            masks = {k: get_keras_mask(t) for k, t in outputs.items()
                     if isinstance(t, tf.Tensor) and get_keras_mask(t) is not None}
            return dict(outputs), list(new_state), [tf.convert_to_tensor(x) for x in losses], masks

        fn = tf.function(body, autograph=False, experimental_attributes={"_noinline": True})
        concrete = fn.get_concrete_function(list(values), list(state), dict(inputs))
        self.traced += 1
        return None if _constant_lookup(concrete.graph) else fn
