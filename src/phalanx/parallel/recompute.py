"""Activation recomputation (``parallel.recompute``).

* ``none``: keep every activation for the backward;
* ``full``: keep only each block's input; the whole block is recomputed in the
  backward (Chen et al. 2016, "Training deep nets with sublinear memory cost");
* ``selective``: recompute only the attention core (scores, softmax, weighted sum),
  whose ``[batch, heads, seq, seq]`` tensors dominate activation memory at long
  sequence lengths for little compute (Korthikanti et al. 2022).

Any Keras model on the Keras-model engine (the built-in GPT's included) goes through :func:`recompute` (a ``tf.custom_gradient`` whose backward runs the forward
again and differentiates that copy) by way of :func:`stage_runner`:

* ``full``: a stage's forward on a micro-batch is cut into *blocks*, each run under
  :func:`recompute`. A Functional or Sequential stage is cut at Keras-op boundaries into
  ``ceil(sqrt(n))`` blocks balanced by FLOPs (``n``: the stage's ops that hold weights; a
  keras-hub transformer layer is one op), Chen et al.'s square-root rule: the forward keeps
  the blocks' inputs, the backward one block's activations at a time. A subclassed model
  (no graph to cut) is one block: with one stage and one micro-batch that saves nothing,
  with several micro-batches in flight it keeps one micro-batch's activations, not all.
* ``selective``: the attention cores of :class:`~phalanx.layers.ParallelSelfAttention`
  (keras-hub GPT-2 / Llama after :func:`phalanx.parallelize`) and of every layer with
  Keras's ``_compute_attention(query, key, value, ...)`` (``keras.layers.MultiHeadAttention``
  and its keras-hub subclasses, keras-hub's ``LlamaAttention``: GPT-2's and Llama's attention
  at tp=1) are recomputed, nothing else. A model without any such layer is refused
  (:func:`check_attention`): ``selective`` would recompute nothing.

Inside a stage call (:mod:`phalanx.parallel.stage_calls`: a stage run more than once per step,
traced once and called per micro-batch) the pieces are the same: the call's forward keeps each
piece's inputs (``full``: the blocks' inputs, not one per stage; the stage's inputs alone would
leave its backward with the whole stage's activations of a micro-batch at once, no less than
without recomputation when one micro-batch is in flight), and the call's backward re-runs the
pieces one at a time.

Same numbers: the backward recomputes the same ops on the same inputs, so the activations
it differentiates are those of the forward. Non-trainable state (BatchNormalization moving
statistics, Dropout's seed state) is an *input* of a recomputed block: its dropout masks are
drawn from the same seed state again, and the state it returns in the backward is dropped
(only the forward's is threaded on to the next micro-batch).

Example:
    >>> import tensorflow as tf
    >>> x = tf.constant(2.0)
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(x)
    ...     y = recompute(lambda v: [v * v * 3.0], [x])[0]
    >>> float(y), float(tape.gradient(y, x))
    (12.0, 12.0)
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import keras
import tensorflow as tf

from phalanx.config import RECOMPUTE, ConfigError
from phalanx.layers.attention import ParallelSelfAttention
from phalanx.parallel.keras_graph import Stage, UncuttableModelError, _blocked_cuts, _key_order, _unique, \
    split_keras_model
from phalanx.parallel.partition import partition


def check_mode(mode: str) -> None:
    if mode not in RECOMPUTE:
        raise ValueError(f"parallel.recompute={mode!r} is not valid; choose one of: {', '.join(RECOMPUTE)}")


# -- one recomputed call ---------------------------------------------------------------------


def recompute(forward: Callable, args: Sequence[tf.Tensor], again: Callable | None = None,
              device: str | None = None, differentiable: Callable[[int], bool] | None = None) -> list:
    """``forward(*args)`` (a list of tensors or None), whose activations are not kept: the
    backward runs ``again(*args)`` (default ``forward``) and differentiates that copy.

    In a graph (the engines' steps) the forward's inner tensors have no gradient op reading
    them, so the executor frees them after the forward; only ``args`` stay for the backward.
    The recomputation waits for the gradients coming in, so it runs at backward time.
    ``device``: where the recomputation runs what has no device of its own (the backward of
    ``tf.gradients`` would otherwise colocate it all with the call's outputs); each argument's
    copy stays on the argument's device. ``differentiable(i)``: whether output ``i`` carries a
    gradient (default: every floating output); others (e.g. a returned BatchNormalization
    statistic) are outputs only. Gradients flow to floating ``args`` (and to variables read
    directly, if any).

    Example:
        >>> x = tf.constant([1.0, 2.0])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = recompute(lambda t: [tf.reduce_sum(tf.sin(t) ** 2)], [x])[0]
        >>> bool(tf.reduce_all(tf.abs(tape.gradient(y, x) - tf.sin(2.0 * x)) < 1e-6))
        True
    """
    args = [tf.convert_to_tensor(a) for a in args]
    again = forward if again is None else again
    layout: list[int | None] = []  # output i -> its index among the tensors returned, None: a None output

    @tf.custom_gradient
    def run(*xs):
        outs = list(forward(*xs))
        layout[:] = [None] * len(outs)
        present = []
        for i, o in enumerate(outs):
            if o is not None:
                layout[i] = len(present)
                present.append(tf.convert_to_tensor(o))

        def grad(*dys, variables=None):
            eager = tf.executing_eagerly()
            def scope():
                return contextlib.nullcontext() if device is None or eager else _placed(device)

            tape = tf.GradientTape() if eager else contextlib.nullcontext()
            with scope(), tape:
                copies = []
                with tf.control_dependencies([d for d in dys if d is not None]):
                    for x in xs:
                        with tf.device(x.device or device):  # a shard's copy stays on the shard's device
                            copies.append(tf.identity(x))
                floating = [j for j, x in enumerate(copies) if x.dtype.is_floating]
                sources = [copies[j] for j in floating] + list(variables or [])
                if eager:
                    tape.watch(sources)
                redo = [o for o in again(*copies) if o is not None]
                targets, upstream = [], []
                for i, (o, dy) in enumerate(zip(redo, dys)):
                    o = tf.convert_to_tensor(o)
                    wanted = o.dtype.is_floating if differentiable is None else differentiable(_output_of(layout, i))
                    if dy is not None and wanted and o.dtype.is_floating:
                        targets.append(o)
                        upstream.append(dy)
            if not (targets and sources):
                grads = [None] * len(sources)
            elif eager:
                grads = tape.gradient(targets, sources, output_gradients=upstream,
                                      unconnected_gradients=tf.UnconnectedGradients.NONE)
            else:  # in a graph, each gradient op goes next to the recomputed op it differentiates
                with scope():
                    grads = tf.gradients(targets, sources, grad_ys=upstream,
                                         unconnected_gradients=tf.UnconnectedGradients.NONE)
            input_grads: list = [None] * len(xs)
            for j, g in zip(floating, grads):
                input_grads[j] = g
            if variables:
                return input_grads, list(grads[len(floating):])
            return input_grads

        return present, grad

    present = run(*args)
    present = present if isinstance(present, (list, tuple)) else [present]
    return [None if k is None else present[k] for k in layout]


def _output_of(layout: list[int | None], k: int) -> int:
    """The output index whose returned tensor is the ``k``-th non-None one."""
    return layout.index(k)


@contextlib.contextmanager
def _placed(device: str):
    """Leave the colocation ``tf.gradients`` puts a gradient function under (with the call's
    outputs), and run on ``device`` instead."""
    with tf.compat.v1.get_default_graph().colocate_with(None, ignore_existing=True), tf.device(device):
        yield


# -- full: a stage cut into recomputed blocks --------------------------------------------------


def cut_stage(stage: Stage, pieces: int | None = None) -> list[Stage]:
    """``stage`` (a :class:`~phalanx.parallel.keras_graph.Stage`) cut at op boundaries into
    ``pieces`` blocks (default ``ceil(sqrt(ops that hold weights))``) balanced by FLOPs, never
    inside a span of ops that share state (as pipeline cuts). Each block reads the stage's
    inputs or earlier blocks' outputs and hands on what later blocks or the stage's outputs
    need."""
    ops = stage.ops
    blocked = _blocked_cuts(ops)
    starts = [0] + [i for i in range(1, len(ops)) if i not in blocked]
    ends = starts[1:] + [len(ops)]
    if pieces is None:
        pieces = math.ceil(math.sqrt(max(1, sum(1 for o in ops if o.trainable))))
    pieces = max(1, min(pieces, len(starts)))
    bounds = partition([sum(o.flops for o in ops[a:b]) for a, b in zip(starts, ends)], pieces)
    ranges = [(starts[a], ends[b - 1]) for a, b in bounds]
    later_reads: list[set] = []
    for j in range(len(ranges)):
        later_reads.append({k for a, b in ranges[j + 1:] for o in ops[a:b] for k in o.ins})
    out = []
    for j, (a, b) in enumerate(ranges):
        mine = ops[a:b]
        made = {k for o in mine for k in o.outs}
        needed = {k for o in mine for k in o.ins if k not in made}
        handed = {k for k in made if k in later_reads[j] or k in stage.output_keys}
        trainable = _unique(v for o in mine for v in o.trainable)
        ids = {id(v) for v in trainable}
        out.append(Stage(index=j, trainable_variables=trainable,
                         non_trainable_variables=_unique(v for o in mine for v in o.non_trainable if id(v) not in ids),
                         input_keys=sorted(needed, key=_key_order), output_keys=sorted(handed, key=_key_order),
                         cost=float(sum(o.flops for o in mine)), ops=mine))
    return out


class _Blocks:
    """A stage's forward as recomputed blocks (see the module docstring).

    ``trainable`` / ``non_trainable``: the stage's variables, in the order of the values the
    engine passes; ``output_keys``: what the stage returns; ``split``: for a whole model, the
    :class:`~phalanx.parallel.keras_graph.KerasSplit` whose inputs and outputs it maps from
    ``{"x": ...}`` / to ``{"y": ...}``, and ``regularized`` its weights with a regularizer
    (a whole model's ``stateless_call`` returns their losses with the rest)."""

    def __init__(self, blocks: list[Stage], trainable, non_trainable, output_keys, split=None, regularized=()):
        self.blocks, self.output_keys, self.split = blocks, list(output_keys), split
        self.t_index = {id(v): i for i, v in enumerate(trainable)}
        self.n_index = {id(v): i for i, v in enumerate(non_trainable)}
        self.regularized = [(self.t_index[id(v)], v.regularizer) for v in regularized]

    def apply(self, trainable_values, non_trainable_values, inputs: dict, training, device: str):
        env = dict(inputs)
        if self.split is not None:
            env = dict(zip(self.split.input_keys, self.split.flatten_inputs(inputs["x"])))
        state = list(non_trainable_values)
        losses = []
        for block in self.blocks:
            tv = [trainable_values[self.t_index[id(v)]] for v in block.trainable_variables]
            nv = [state[self.n_index[id(v)]] for v in block.non_trainable_variables]
            xs = [env[k] for k in block.input_keys]
            n_t, n_n, n_out = len(tv), len(nv), len(block.output_keys)

            def forward(*flat, _block=block, _n_t=n_t, _n_n=n_n):
                outputs, new, added = _block.apply(list(flat[:_n_t]), list(flat[_n_t:_n_t + _n_n]),
                                                   dict(zip(_block.input_keys, flat[_n_t + _n_n:])), training,
                                                   return_losses=True)
                return [outputs[k] for k in _block.output_keys] + list(new) + [tf.convert_to_tensor(x)
                                                                              for x in added]

            # Outputs and added losses carry gradients; the returned state does not (it is the
            # next micro-batch's input, as without recomputation, where no gradient reaches it).
            result = recompute(forward, tv + nv + xs, device=device,
                               differentiable=lambda i, _o=n_out, _n=n_n: i < _o or i >= _o + _n)
            env.update(zip(block.output_keys, result[:n_out]))
            for v, value in zip(block.non_trainable_variables, result[n_out:n_out + n_n]):
                state[self.n_index[id(v)]] = value
            losses.extend(result[n_out + n_n:])
        for i, regularizer in self.regularized:
            losses.append(regularizer(trainable_values[i]))
        if self.split is not None:
            return {"y": self.split.pack_outputs([env[k] for k in self.split.output_keys])}, state, losses
        return {k: env[k] for k in self.output_keys}, state, losses


class _Plain:
    """A stage as it runs without recomputation, or with its attention cores recomputed
    (``attention_of``: the model whose attention layers are, while the stage is traced)."""

    def __init__(self, stage, attention_of=None):
        self.stage, self.attention_of = stage, attention_of

    def apply(self, trainable_values, non_trainable_values, inputs: dict, training, device: str):
        if self.attention_of is None:
            return self.stage.apply(trainable_values, non_trainable_values, inputs, training)
        with attention_cores(self.attention_of):
            return self.stage.apply(trainable_values, non_trainable_values, inputs, training)


class _Whole:
    """A stage with no graph to cut (a subclassed model): one recomputed block; its inputs and
    outputs may be nests (a dict of model inputs)."""

    def __init__(self, stage):
        self.stage = stage

    def apply(self, trainable_values, non_trainable_values, inputs: dict, training, device: str):
        keys = list(inputs)
        n_t, n_n = len(trainable_values), len(non_trainable_values)
        made: dict = {}

        def forward(*flat):
            rebuilt = tf.nest.pack_sequence_as([inputs[k] for k in keys], list(flat[n_t + n_n:]))
            outputs, new, added = self.stage.apply(list(flat[:n_t]), list(flat[n_t:n_t + n_n]),
                                                   dict(zip(keys, rebuilt)), training)
            out_flat = tf.nest.flatten(outputs)
            made.update(structure=outputs, n_out=len(out_flat))
            return out_flat + list(new) + [tf.convert_to_tensor(x) for x in added]

        flat_in = list(trainable_values) + list(non_trainable_values) + tf.nest.flatten([inputs[k] for k in keys])
        result = recompute(forward, flat_in, device=device,
                           differentiable=lambda i: i < made["n_out"] or i >= made["n_out"] + n_n)
        n_out = made["n_out"]
        return tf.nest.pack_sequence_as(made["structure"], result[:n_out]), result[n_out:n_out + n_n], \
            result[n_out + n_n:]


def stage_runner(stage, mode: str, model):
    """What runs one stage of :class:`~phalanx.engines.keras_model.KerasModelEngine` in a
    training step under ``parallel.recompute=mode``: an object whose
    ``apply(trainable_values, non_trainable_values, inputs, training, device)`` returns what
    the stage's own ``apply`` does. ``stage``: the engine's stage (a whole model, ``.model``,
    or a cut stage, ``.stage``); ``model``: the model trained."""
    check_mode(mode)
    if mode == "none":
        return _Plain(stage)
    if mode == "selective":
        check_attention(model)
        return _Plain(stage, attention_of=model)
    cut = getattr(stage, "stage", None)
    if cut is not None:  # a pipeline stage of a Functional/Sequential model
        return _Blocks(cut_stage(cut), stage.trainable_variables, stage.non_trainable_variables, cut.output_keys)
    try:
        split = split_keras_model(stage.model, 1)
    except UncuttableModelError:
        return _Whole(stage)
    regularized = [v for v in stage.trainable_variables if getattr(v, "regularizer", None) is not None]
    return _Blocks(cut_stage(split.stages[0]), stage.trainable_variables, stage.non_trainable_variables, ["y"],
                   split, regularized)


# -- selective: attention cores ------------------------------------------------------------------


def _is_attention(layer) -> bool:
    return isinstance(layer, ParallelSelfAttention) or callable(getattr(layer, "_compute_attention", None))


def check_attention(model) -> None:
    """Refuse ``parallel.recompute=selective`` for a model with no attention layer it could
    recompute (it would run as ``none``, the option silently ignored).

    Example:
        >>> import keras
        >>> mlp = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="mlp")
        >>> try:
        ...     check_attention(mlp)
        ... except ConfigError as err:
        ...     print(err.key)
        parallel.recompute
    """
    if not any(_is_attention(layer) for layer in model._flatten_layers(include_self=False)):
        raise ConfigError("parallel.recompute", f"selective: model {model.name!r} has no attention layer to "
                                                "recompute (ParallelSelfAttention, Keras's MultiHeadAttention or a "
                                                "keras-hub attention layer); use parallel.recompute=full or none")


def _recomputed_core(core: Callable) -> Callable:
    """``core(q, k, v) -> o`` of :class:`~phalanx.layers.ParallelSelfAttention`, recomputed (it
    runs inside the shard's device scope: its recomputation stays there)."""
    return lambda q, k, v: recompute(lambda *a: [core(*a)], [q, k, v])[0]


def _recomputed_attention(layer, original: Callable) -> Callable:
    """``layer._compute_attention`` (Keras's MultiHeadAttention, keras-hub's attention layers:
    ``(query, key, value, ...)`` to a tensor or a nest of tensors) recomputed: the backward runs
    it again with the layer's seed state as the forward found it, in a scope of its own, so its
    dropout mask is the forward's and the state advances once."""

    def compute(query, key, value, *args, **kwargs):  # the mask, training... as the caller passes them
        state = list(layer.non_trainable_variables)
        start = [tf.convert_to_tensor(v.value) for v in state]  # the values the forward reads
        made: dict = {}

        def forward(q, k, v):
            result = original(q, k, v, *args, **kwargs)
            made["structure"] = result
            return tf.nest.flatten(result)

        def again(q, k, v):
            with keras.StatelessScope(state_mapping=list(zip(state, start))):
                return forward(q, k, v)

        flat = recompute(forward, [query, key, value], again=again)
        return tf.nest.pack_sequence_as(made["structure"], flat)

    return compute


@contextlib.contextmanager
def attention_cores(model):
    """Within: the attention cores of ``model``'s :class:`~phalanx.layers.ParallelSelfAttention`
    layers and the ``_compute_attention`` of its other attention layers (Keras's
    :class:`keras.layers.MultiHeadAttention` and keras-hub's, e.g. GPT-2's and Llama's) are
    recomputed in the backward (the calls traced inside; nothing stays changed after)."""
    changed = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, ParallelSelfAttention):
            layer.core_wrapper = _recomputed_core
            changed.append((layer, "core_wrapper"))
        elif callable(getattr(layer, "_compute_attention", None)):  # MultiHeadAttention, keras-hub's attentions
            layer._compute_attention = _recomputed_attention(layer, layer._compute_attention)
            changed.append((layer, "_compute_attention"))
    try:
        yield
    finally:
        for layer, name in changed:
            if name == "core_wrapper":
                layer.core_wrapper = None
            else:
                del layer.__dict__[name]
