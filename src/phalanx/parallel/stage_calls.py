"""A pipeline stage's forward traced once and called for every micro-batch.

Traced inline, a step holds a copy of every stage's ops for every micro-batch: its build
(Python tracing, then TensorFlow's graph optimisation and placement at the first run) grows
with the number of micro-batches. :class:`StageCalls` traces a stage's forward once per
``key`` (the engine uses ``(replica, stage, mode)``: the same stage on the same devices) as a
``tf.function`` and calls it for each micro-batch. The call is marked ``_noinline``, so the
runtime optimises and instantiates the function (and the backward TensorFlow derives from it)
once instead of once per copy. ``tf.gradients`` over a call gives the gradients of the ops
inside (the weights' values and the stage's inputs are the call's arguments; an embedding's
gradient stays an ``IndexedSlices``).

Placement: the call and its backward call are placed on the device in scope when the stage is
called (the stage's tensor rank 0), and so is every op inside that names no device. A tensor
shard's layer places its ops on the device of its weight's value
(:func:`phalanx.layers.sharding.on_device_of`); a function's arguments name no device, so each
weight value enters the function through an identity on the device the caller's value was made
on, and the shard's ops inside run on their rank as they would inline. TensorFlow builds a
function's backward with no devices at all (it would run whole on the call's device); here it
is built when the stage is traced, each gradient op on the device of the op it differentiates
(as ``tf.gradients`` does outside a function). A multi-device call runs its ops on their
devices and exchanges tensors between them inside the call, at the same points as inline.

A tensor-parallel head's shard logits: the loss reads them from the head's join (a tagged
concat, :func:`~phalanx.layers.tensor_parallel.vocab_logit_shards`), which a call's output does
not carry; a call returns such an output as its pieces and the caller joins them again, each
piece through an identity on the rank it was made on (the loss then reads each on its rank).

The step that makes the calls (the glue: weight reads, the calls and their backward calls,
gradient sums, the update) runs under :func:`glue_options`: only Grappler's pruner on its own
graph, while each call keeps the options it was made with.

What a call keeps for its backward: TensorFlow makes every forward tensor its backward reads
an extra output of the forward call, held by the caller until the backward call. Its backward
is traced with every gradient op of every input, a ``Mul``'s with respect to a constant scale
too, whose reads inline are pruned before anything runs; :func:`dead_captures` finds those
and the backward reads zeros there instead (a 4-layer d_model 256 GPT stage kept 43.0 MiB per
micro-batch beyond its inputs, 37.0 MiB without them: each block's attention scores before
the softmax and a projection's bias sum), and so do tensors a ``ZerosLike`` reads, the zero
gradient of an output nothing differentiates (TensorFlow makes it with ``zeros_like``, which
reads only the shape; inline the graph optimiser folds it): a recomputed attention core returns
its probabilities beside its output, and the call kept them, 8 MiB a block in
tests/test_keras_recompute.py. Recomputation (:mod:`phalanx.parallel.recompute`) runs inside a
call as inline: a recomputed piece's forward is in the call's forward, which keeps only the
piece's inputs; its re-run and gradients are in the call's backward. What a call still holds beyond the inline step: its
backward returns every gradient of the stage at once while the saved tensors are held (inline,
each is freed once read, each gradient summed as made): one float32 copy of the stage's
weights, which the planner counts (:mod:`phalanx.plan.keras_memory`).

Which stages may be called: the caller decides (the engine: no expert shards, whose layers
place ops by their inputs' devices). The first trace of a key then
refuses the function (the stage runs inline, as before) when the stage reads a table with
indices that are the same for every micro-batch
(:func:`phalanx.parallel.gradients.indices_vary`): the micro-batches' gradients of such a
lookup are summed row by row, a rule read from the lookup's ops, which a call hides.

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

import contextlib
from typing import Callable

import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask  # masks ride on tensors; no public API
from tensorflow.python.eager import context  # a call's Grappler options: no public API
from tensorflow.python.ops import gradients_util  # a function's backward built with devices: no public API

from phalanx.layers.tensor_parallel import joined_shards, rejoin_shards
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
        # the call options in force when the calls were planned (Grappler on): a stage call is
        # made with them, also inside a step run under glue_options()
        self._options = context.context().function_call_options
        # (key, devices) -> {output key: (mark, the pieces' devices)}: outputs that were a tensor
        # shards' tagged join, returned as the pieces and joined again by the caller
        self._joined: dict = {}
        self._fns: dict = {}  # (key, the weight values' devices) -> tf.function, or None: run inline
        self.traced = 0  # stage functions traced (one per key that is called)
        self.inline: set = set()  # keys whose function was refused: their stage runs inline
        # a traced function's name scope -> the device its ops run on (given by the caller). Its
        # ops' names, and its backward's, hold the scope: a profile's op names find their device
        # by it (phalanx.train.calibrate), since the run's partition graphs list no call's body.
        self.devices: dict[str, str] = {}
        # the name of each op inside a traced function or its backward that names a device of
        # its own (a tensor shard's, on its rank) -> that device; the others run on their scope's
        self.op_devices: dict[str, str] = {}

    @staticmethod
    def scope(key) -> str:
        """The name scope of ``key``'s function: ``stage_call`` and the key's parts.

        >>> StageCalls.scope((1, 0, True))
        'stage_call_1_0_True'
        """
        parts = key if isinstance(key, tuple) else (key,)
        return "_".join(["stage_call", *("".join(c if c.isalnum() else "_" for c in str(p)) for p in parts)])

    def call(self, key, run: Callable, values, state, inputs, device: str | None = None, backward: bool = True):
        """``run(values, state, inputs)`` through the key's traced function (traced on the
        first call of ``key``), or inline when the function was refused. ``device``: where the
        caller places the call (recorded in :attr:`devices`). ``backward``: the call will be
        differentiated (its backward, placed, is built with the trace); a key's first call decides."""
        devices = _devices(values)
        fn = self._fns.get((key, devices), False)
        if fn is False:
            if device is not None:
                self.devices[self.scope(key)] = device
            fn = self._fns[(key, devices)] = self._trace(run, values, state, inputs, devices, backward,
                                                         self.scope(key), self._joined.setdefault((key, devices), {}))
            if fn is None:
                self.inline.add(key)
        if fn is None:
            return run(values, state, inputs)
        with _call_options(self._options):
            outputs, new_state, losses, masks = fn(list(values), list(state), dict(inputs))
        for k, (mark, devices_k) in self._joined[(key, devices)].items():
            outputs[k] = rejoin_shards(mark, outputs[k], devices_k)
        for k, mask in masks.items():
            set_keras_mask(outputs[k], mask)
        return outputs, list(new_state), list(losses)

    def _trace(self, run, values, state, inputs, devices, backward: bool, scope: str, joined: dict):
        def body(v, st, inp):
            with tf.name_scope(scope):
                v = _placed(v, devices)
                outputs, new_state, losses = run(v, st, inp)
            masks = {k: get_keras_mask(t) for k, t in outputs.items()
                     if isinstance(t, tf.Tensor) and get_keras_mask(t) is not None}
            outputs = dict(outputs)
            for k, t in outputs.items():  # a tensor-parallel head's shard logits: the loss reads them
                found = joined_shards(t)
                if found is not None:
                    mark, outputs[k] = found
                    joined[k] = (mark, [p.device for p in outputs[k]])
            return outputs, list(new_state), [tf.convert_to_tensor(x) for x in losses], masks

        fn = tf.function(body, autograph=False, experimental_attributes={"_noinline": True})
        with _call_options(self._options):  # the fused kernels' calls inside too
            concrete = fn.get_concrete_function(list(values), list(state), dict(inputs))
        self.traced += 1
        if _constant_lookup(concrete.graph):
            return None
        graphs = [concrete.graph]
        if backward:
            _place_backward(concrete)
            graphs.append(concrete._delayed_rewrite_functions.forward_backward()[1].graph)
        self.op_devices.update(_named_devices(graphs))
        return fn


@contextlib.contextmanager
def _call_options(options):
    """Function calls made in this context (in a graph: the call ops created) carry ``options``."""
    ctx = context.context()
    saved = ctx.function_call_options
    ctx.function_call_options = options
    try:
        yield
    finally:
        ctx.function_call_options = saved


def glue_options():
    """A context in which a step that calls stage functions runs with only Grappler's pruner
    for its own graph (the glue: weight reads, the calls, their backward calls, gradient sums,
    the update), while each stage call keeps the options it was made with
    (:class:`StageCalls`), so Grappler still optimises the stage functions, where it pays.

    On the glue, Grappler's passes cost about half of the first run (8 layers tp2 x pp2 with 8
    micro-batches: 25 s -> 13 s with the meta-optimizer off) and find little: its ops are reads,
    additions and calls (benchmarks/results/build_2026-11-28.md).

    >>> f = tf.function(lambda x: x + 1.0)
    >>> with glue_options():
    ...     float(f(tf.constant(1.0)))
    2.0
    """
    saved = context.context().function_call_options
    config = tf.compat.v1.ConfigProto.FromString(saved.config_proto_serialized)
    # only the pruner: ops nothing reads (a head's joined logits when the loss reads its shards,
    # gradients no one asked for) must still not run
    config.graph_options.rewrite_options.optimizers[:] = ["pruning"]
    return _call_options(context.FunctionCallOptions(executor_type=saved.executor_type, config_proto=config))


def _named_devices(graphs) -> dict[str, str]:
    """Op name -> device, for the ops of ``graphs`` that name a device; a gradient op that names
    none but is colocated with an op that does (``colocate_gradients_with_ops``) gets that one."""
    named = {op.name: op.device for g in graphs for op in g.get_operations() if op.device}
    for g in graphs:
        for op in g.get_operations():
            if not op.device:
                for group in op.colocation_groups():
                    device = named.get(group.decode()[len("loc:@"):])
                    if device:
                        named[op.name] = device
                        break
    return named


def _devices(values) -> tuple:
    """The device each of the weight values ``values`` was made on ('' where none is named)."""
    return tuple(getattr(t, "device", "") or "" for t in values)


def _placed(values, devices) -> list:
    """The weight values inside the function (arguments, which name no device), each through
    an identity on the device its caller's value was made on: a tensor shard's layer places its
    ops by its weight's device, and finds it inside the function as it would inline."""
    out = []
    for t, device in zip(values, devices):
        if device:
            with tf.device(device):
                t = tf.identity(t)
        out.append(t)
    return out


def _place_backward(concrete) -> None:
    """Build the function's backward now, each gradient op on the device of the op it
    differentiates (TensorFlow builds a function's backward with no devices: it would all run
    on the call's device), reading only the forward tensors its gradients need
    (:func:`dead_captures`)."""
    helper = gradients_util._GradientsHelper
    dead = dead_captures(concrete)
    hooked: list = []  # the backward graph while its capture is hooked

    def build(*args, **kwargs):
        graph = tf.compat.v1.get_default_graph()  # the backward's graph, being traced
        if graph in hooked:  # a recomputed piece's own gradients, inside the backward
            return helper(*args, **kwargs)
        zeros: dict = {}

        def capture(tensor, name=None, shape=None):
            if tensor.ref() not in dead:
                return type(graph).capture(graph, tensor, name, shape)
            if tensor.ref() not in zeros:  # read by dead ops only: never computed, never held
                zeros[tensor.ref()] = tf.zeros(tensor.shape, tensor.dtype)
            return zeros[tensor.ref()]

        graph.capture = capture
        hooked.append(graph)
        try:
            return helper(*args, **dict(kwargs, colocate_gradients_with_ops=True))
        finally:
            hooked.remove(graph)
            del graph.capture

    try:
        gradients_util._GradientsHelper = build
        concrete._delayed_rewrite_functions.forward_backward()
    finally:
        gradients_util._GradientsHelper = helper


def dead_captures(concrete) -> set:
    """The forward tensors (as ``Tensor.ref()``) that TensorFlow's backward of ``concrete``
    would take from the forward only for ops none of its gradients needs.

    A gradient function makes every input's gradient (a ``Mul``'s with respect to a constant
    scale too); tracing the backward captures every forward tensor those ops read, and each
    capture becomes an extra output of the forward call, held until the backward call. Inline,
    the graph optimiser prunes those ops before anything runs, and the tensors only they read
    are freed after the forward (e.g. a block's attention scores before the softmax). The
    backward is traced once in a scratch graph to find them; each is then read as zeros of its
    shape by the (pruned) ops that wanted it.

    >>> f = tf.function(lambda x: tf.sin(x) * 2.0)  # d/dx reads cos(x); only d/d(2.0) reads sin(x)
    >>> c = f.get_concrete_function(tf.TensorSpec([], tf.float32))
    >>> [r.deref().op.type for r in dead_captures(c)]
    ['Sin']
    """
    from tensorflow.python.eager import backprop_util
    from tensorflow.python.framework import func_graph as func_graph_module

    graph = concrete.graph
    count = concrete._delayed_rewrite_functions._num_inference_outputs
    outputs = [o for o in graph.outputs[:count] if backprop_util.IsTrainable(o)]
    with graph.as_default():
        scratch = func_graph_module.FuncGraph("stage_call_backward_scratch")
        with scratch.as_default():
            upstream = [tf.compat.v1.placeholder(o.dtype, o.shape) for o in outputs]
            grads = gradients_util._GradientsHelper(outputs, graph.inputs, grad_ys=upstream, src_graph=graph)
    live, stack = set(), []
    for g in grads:
        if g is not None:
            stack.extend(t.op for t in tf.nest.flatten(g, expand_composites=True))
    while stack:
        op = stack.pop()
        if op.name not in live:
            live.add(op.name)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)

    def unread(internal) -> bool:  # no live op reads the value (a ZerosLike reads its shape only)
        return internal.op.name not in live or all(op.type == "ZerosLike" for op in internal.consumers()
                                                   if op.name in live)

    return {external.ref() for external, internal in scratch.captures
            if unread(internal) and external.shape.is_fully_defined()
            and external.dtype not in (tf.resource, tf.variant)}
