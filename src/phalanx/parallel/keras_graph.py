"""Cut a Keras 3 model (Sequential or Functional) into pipeline stages run statelessly.

The model's graph is flattened into a list of *ops*, one per call of a Keras operation
(a node), in a topological order (depth-first from the outputs, which follows the order
the model was written in). Nested Functional/Sequential models are inlined, so a cut
may fall inside them. The list is cut into ``stages`` contiguous ranges balanced by
estimated forward FLOPs (or parameter counts) with :func:`phalanx.parallel.partition.partition`.

Keys. Every tensor that flows between ops has a string key: ``"in:<i>"`` is the i-th
flat model input, ``"t:<n>"`` the n-th tensor produced by an op (numbered in op
order). A stage reads model inputs directly (``"in:*"`` keys are never handed from
stage to stage) and hands on, per :meth:`KerasSplit.crossing`, every ``"t:*"`` tensor
that a later stage reads -- several when a residual branch spans the cut -- plus every
model output it produced, so all outputs reach the last stage.

Stateless execution. :meth:`Stage.apply` calls the stage's layers in op order, each
through its own ``Layer.__call__`` with the arguments recorded in its node (as
``Functional.call`` does), inside ``keras.StatelessScope(state_mapping=...)``: every
variable read sees the value given, every ``assign`` (BatchNormalization statistics,
Dropout's seed generator) is recorded in the scope instead of touching the variable,
and the updated non-trainable values are read back from the scope. ``training`` is given
to a layer whose ``call`` declares it (and to layers with sublayers, which hand it on
through Keras's call context), never to Flatten, Conv2D, Reshape or raw ops.

Cuts never separate the calls of a layer called several times, nor ops reading one
variable; after balancing, each cut slides over neighbouring parameter-free ops to
where the fewest elements cross it. Not carried: activity-regularizer losses (dropped,
as in any ``StatelessScope`` that does not collect them) and the implicit Keras mask
riding on a model output produced by an early stage.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8),
    ...                           keras.layers.Dense(8), keras.layers.Dense(2)])
    >>> split = split_keras_model(model, stages=2)
    >>> [len(s.ops) for s in split.stages], split.crossing(0)
    ([1, 2], ['t:0'])
    >>> x = keras.ops.ones((3, 4))
    >>> bool(keras.ops.all(split.run(x) == model(x)))
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
from keras import tree
from keras.src.models.functional import Functional, unpack_singleton

from phalanx.parallel.partition import partition

BALANCES = ("flops", "params")
# Cost of an op without matmul-like weights (activations, adds, norms, pooling...): tiny
# next to any matmul but non-zero, so that chains of such ops are still spread out.
EPSILON = 1.0


class UncuttableModelError(ValueError):
    """The model cannot be cut into the requested number of pipeline stages."""


@dataclass
class _Op:
    """One call of one Keras operation (a node of the inlined graph)."""

    op: Any = field(repr=False)    # the keras Operation / Layer that is called
    node: Any = field(repr=False)  # its Node: recorded call arguments, symbolic in/out tensors
    ins: list = field(default_factory=list)    # keys aligned with node.input_tensors
    outs: list = field(default_factory=list)   # keys aligned with node.outputs
    training: bool = False                     # offer `training=` to op.__call__
    trainable: list = field(default_factory=list, repr=False)      # variables this call reads
    non_trainable: list = field(default_factory=list, repr=False)
    flops: float = 0.0

    def run(self, env: dict, training: bool) -> None:
        args, kwargs = self.node.arguments.fill_in(
            {id(t): env[k] for t, k in zip(self.node.input_tensors, self.ins)})
        if self.training:  # overrides a recorded training=..., as Functional.call does
            kwargs = {**kwargs, "training": training}
        for k, y in zip(self.outs, tree.flatten(self.op(*args, **kwargs))):
            env[k] = y


def _key_order(key: str) -> tuple[bool, int]:
    kind, n = key.split(":")
    return kind != "in", int(n)


def _unique(variables) -> list:
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


@dataclass
class Stage:
    """A contiguous range of ops; see the module docstring for keys and execution."""

    index: int
    trainable_variables: list
    non_trainable_variables: list
    input_keys: list[str]
    output_keys: list[str]
    cost: float                     # estimated forward FLOPs per example
    ops: list = field(default_factory=list, repr=False)

    @property
    def op_names(self) -> list[str]:
        return [o.op.name for o in self.ops]

    def apply(self, trainable_values, non_trainable_values, inputs: dict, training: bool,
              return_losses: bool = False):
        """Run the stage on the given variable values without assigning any variable.

        Returns ``(outputs by key, new non-trainable values aligned with
        non_trainable_variables)``, and with ``return_losses`` also the losses its layers
        added during the call (``add_loss``: activity regularisers, a mixture-of-experts
        router's balancing loss...). Weight regularisation is not among them: it depends on
        the weights only, not on the call."""
        if len(trainable_values) != len(self.trainable_variables) or \
                len(non_trainable_values) != len(self.non_trainable_variables):
            raise ValueError(f"stage {self.index} takes {len(self.trainable_variables)} trainable and "
                             f"{len(self.non_trainable_variables)} non-trainable values, got "
                             f"{len(trainable_values)} and {len(non_trainable_values)}")
        missing = [k for k in self.input_keys if k not in inputs]
        if missing:
            raise KeyError(f"stage {self.index} needs inputs {missing}")
        env = {k: inputs[k] for k in self.input_keys}
        mapping = list(zip(self.trainable_variables, trainable_values)) + \
            list(zip(self.non_trainable_variables, non_trainable_values))
        with keras.StatelessScope(state_mapping=mapping, collect_losses=return_losses) as scope:
            for o in self.ops:
                o.run(env, training)
        outputs = {k: env[k] for k in self.output_keys}
        state = [scope.get_current_value(v) for v in self.non_trainable_variables]
        return (outputs, state, list(scope.losses)) if return_losses else (outputs, state)


@dataclass
class KerasSplit:
    """The stages of a model and how data flows between them."""

    stages: list[Stage]
    input_keys: list[str]
    output_keys: list[str]
    graph: Any = field(default=None, repr=False)                      # the model's Functional
    producer: dict = field(default_factory=dict, repr=False)          # key -> stage producing it
    last_use: dict = field(default_factory=dict, repr=False)          # key -> last stage reading it

    def crossing(self, s: int) -> list[str]:
        """``"t:*"`` keys handed from stage s to stage s+1 (including pass-through outputs)."""
        outputs = set(self.output_keys)
        return sorted((k for k, p in self.producer.items()
                       if p <= s and (self.last_use.get(k, -1) > s or k in outputs)), key=_key_order)

    def flatten_inputs(self, x) -> list:
        # Keras's own standardisation: dict by input name, list, or a single tensor; casts
        # to the inputs' dtypes and fixes a trailing unit axis exactly as model(x) does.
        return list(self.graph._standardize_inputs(x))

    def pack_outputs(self, flat):
        return unpack_singleton(tree.pack_sequence_as(self.graph._outputs_struct, list(flat)))

    def run(self, x, training: bool = False):
        """All stages in order on the variables' current values (read, never assigned)."""
        env = dict(zip(self.input_keys, self.flatten_inputs(x)))
        for st in self.stages:
            out, _ = st.apply(st.trainable_variables, st.non_trainable_variables, env, training)
            env.update(out)
        return self.pack_outputs([env[k] for k in self.output_keys])


# ----------------------------------------------------------------------------- graph


def _graph_of(model):
    """The Functional graph of a Sequential or Functional model, or a clear error."""
    if isinstance(model, keras.Sequential):
        if model._functional is None:
            raise UncuttableModelError(
                f"Sequential model {model.name!r} is not built, so it has no graph of layers yet: call it "
                f"on a batch of data first, or start it with keras.Input(shape=...)")
        return model._functional
    if isinstance(model, Functional):
        return model
    raise UncuttableModelError(
        f"{type(model).__name__} is a subclassed model (or not a keras.Model): it has no graph of layers "
        f"to cut into pipeline stages. Build it with the Functional or Sequential API, or train it "
        f"with parallel.pp=1 (data parallelism works for any model)")


def _topo_nodes(inputs, outputs) -> list:
    """Nodes between inputs and outputs, depth-first post-order from the outputs
    (iterative: deep models would exceed Python's recursion limit)."""
    stop = {id(t) for t in inputs}
    done, order = set(), []
    stack = [(t, False) for t in reversed(outputs)]
    while stack:
        t, expanded = stack.pop()
        op, index, _ = t._keras_history
        node = op._inbound_nodes[index]
        if id(t) in stop or node.is_input or id(node) in done:
            continue
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((t, True))
        stack.extend((x, False) for x in reversed(node.input_tensors))
    return order


def _inlinable(op, node):
    """The Functional graph of a nested model called plainly on tensors, else None."""
    if isinstance(op, keras.Sequential):
        inner, plain_call = op._functional, type(op).call is keras.Sequential.call
    elif isinstance(op, Functional):
        inner, plain_call = op, type(op).call is Functional.call
    else:
        return None
    args, kwargs = node.arguments.args, node.arguments.kwargs
    # keras-hub's tasks call their backbone with mask={"token_ids": None, ...}: all None.
    if inner is None or not plain_call or len(args) != 1 or \
            any(x is not None for k, v in kwargs.items() if k != "training" for x in tree.flatten(v)):
        return None
    outer = tree.flatten(args[0])
    if isinstance(args[0], dict) != isinstance(inner._inputs_struct, dict) or len(outer) != len(inner.inputs):
        return None
    if isinstance(args[0], dict) and sorted(args[0]) != sorted(inner._inputs_struct):
        return None
    # Functional.call would cast dtypes and squeeze/expand ranks: inline only when it does not.
    for a, b in zip(outer, inner.inputs):
        if not isinstance(a, keras.KerasTensor) or a.dtype != b.dtype or len(a.shape) != len(b.shape):
            return None
    return inner


def _variables(op, node) -> tuple[list, list]:
    trainable = list(op.trainable_variables) if isinstance(op, keras.layers.Layer) else []
    non_trainable = list(op.non_trainable_variables) if isinstance(op, keras.layers.Layer) else []
    # A variable passed straight into a raw op (e.g. keras.ops.matmul(x, layer.kernel)).
    for a in node.arguments._flat_arguments:
        if isinstance(a, keras.Variable):
            (trainable if a.trainable else non_trainable).append(a)
    return _unique(trainable), _unique(non_trainable)


def _takes_training(op) -> bool:
    # Declared in call(): pass it. Not declared but the layer has sublayers: Layer.__call__
    # drops it from call() yet hands it to the sublayers through the call context, as
    # under the model's own call. Otherwise (Flatten, Conv2D, raw ops...): never pass it.
    if not isinstance(op, keras.layers.Layer):
        return False
    return bool(op._call_has_context_arg.get("training", False) or op._layers)


class _Builder:
    def __init__(self):
        self.ops: list[_Op] = []
        self.n = 0

    def add_graph(self, graph, in_keys: list[str]) -> list[str]:
        """Append the ops of ``graph`` reading ``in_keys``; return its output keys."""
        keys = {id(t): k for t, k in zip(graph.inputs, in_keys)}
        for node in _topo_nodes(graph.inputs, graph.outputs):
            ins = [keys[id(t)] for t in node.input_tensors]
            inner = _inlinable(node.operation, node)
            if inner is not None:
                outer = {id(t): k for t, k in zip(node.input_tensors, ins)}
                outs = self.add_graph(inner, [outer[id(t)] for t in tree.flatten(node.arguments.args[0])])
            else:
                outs = [f"t:{self.n + i}" for i in range(len(node.outputs))]
                self.n += len(outs)
                tv, ntv = _variables(node.operation, node)
                self.ops.append(_Op(node.operation, node, ins, outs, _takes_training(node.operation),
                                    tv, ntv, _flops(node.operation, node)))
            keys.update((id(t), k) for t, k in zip(node.outputs, outs))
        return [keys[id(t)] for t in graph.outputs]


# ----------------------------------------------------------------------------- costs


def _dims(shape) -> float:
    return float(np.prod([d or 1 for d in shape]))  # unknown dims count as 1


def _weights_flops(layer, out_shape) -> float:
    """2 x kernel size x output positions for every weight of rank >= 2 (exact for Dense,
    Conv*D, depthwise/separable conv): positions = output elements / output channels."""
    channels_first = getattr(layer, "data_format", None) == "channels_first" and len(out_shape) > 2
    channels = (out_shape[1] if channels_first else out_shape[-1]) if len(out_shape) > 1 else 1
    positions = _dims(out_shape[1:]) / float(channels or 1)
    return sum(2.0 * _dims(w.shape) * positions for w in layer.weights if len(w.shape) >= 2)


def _flops(op, node) -> float:
    """Estimated forward FLOPs per example of one call (batch dimension excluded).

    Dense/Conv: 2 x kernel size x output positions. EinsumDense: 2 x output elements x
    contracted kernel dims. MultiHeadAttention: its four projections plus 2 x Tq x Tv x
    heads x (key_dim + value_dim) for scores and weighted sum. RNN/LSTM/GRU: time steps x
    2 x (kernel + recurrent kernel sizes), gates' elementwise work ignored. A nested
    model: the sum over its graph. Embedding (a gather) and parameter-free ops: EPSILON."""
    L = keras.layers
    out = node.outputs[0].shape if node.outputs else (None,)
    try:
        if isinstance(op, L.MultiHeadAttention):
            args, kwargs = node.arguments.args, node.arguments.kwargs
            query = kwargs.get("query", args[0] if args else None)
            value = kwargs.get("value", args[1] if len(args) > 1 else query)
            tq, tv = _dims(query.shape[1:-1]), _dims(value.shape[1:-1])
            proj = sum(2.0 * _dims(d.kernel.shape) * t for d, t in (
                (op._query_dense, tq), (op._key_dense, tv), (op._value_dense, tv), (op._output_dense, tq)))
            return proj + 2.0 * tq * tv * op.num_heads * (op.key_dim + op.value_dim)
        if isinstance(op, (L.RNN, L.Bidirectional)):
            steps = _dims(node.input_tensors[0].shape[1:2])
            return steps * 2.0 * sum(_dims(w.shape) for w in op.weights if len(w.shape) >= 2)
        if isinstance(op, L.Embedding):
            return EPSILON
        if isinstance(op, L.EinsumDense):
            lhs, rhs = op.equation.replace("...", "").split("->")
            kernel = lhs.split(",")[1]
            contracted = [d for c, d in zip(kernel, op.kernel.shape) if c not in rhs]
            return 2.0 * _dims(out[1:]) * _dims(contracted)
        graph = op._functional if isinstance(op, keras.Sequential) else op
        if isinstance(graph, Functional):  # a nested model that could not be inlined
            return sum(_flops(n.operation, n) for n in _topo_nodes(graph.inputs, graph.outputs))
        if isinstance(op, keras.layers.Layer):
            return _weights_flops(op, out) + EPSILON
    except (AttributeError, IndexError, ValueError, TypeError):
        pass  # an unusual layer: fall back to the generic estimate
    return (_weights_flops(op, out) if isinstance(op, keras.layers.Layer) else 0.0) + EPSILON


# ----------------------------------------------------------------------------- split


def _blocked_cuts(ops: list[_Op]) -> dict[int, set[str]]:
    """Cut positions i (between ops i-1 and i) that must not be used, with the reason:
    inside the span of the ops that share *state* (a non-trainable variable, e.g. a
    BatchNormalization called twice): its updates must be threaded through one stage.
    Trainable weights may be shared across stages (tied embeddings): each stage lists
    them, and the engine keeps a mirror on every stage but the first and sums the
    gradients. Keras masks need no rule: a symbolic call records the mask it passes
    (e.g. LSTM(mask=...)) as a node argument, so a mask is an ordinary tensor of the
    graph and is handed over like one."""
    spans: dict[int, tuple[str, list[int]]] = {}
    for i, o in enumerate(ops):
        for v in o.non_trainable:
            spans.setdefault(id(v), (f"variable {v.path!r} (state read by several layers)", []))[1].append(i)
    blocked: dict[int, set[str]] = {}
    for why, where in spans.values():
        for i in range(min(where) + 1, max(where) + 1):
            blocked.setdefault(i, set()).add(why)
    return blocked


def _slide_cuts(cuts: list[int], ops: list[_Op], output_keys: list[str], blocked) -> list[int]:
    """Move each cut over neighbouring parameter-free ops (cost EPSILON) to where the
    fewest tensor elements cross it: e.g. a mask derived from a model input is then
    computed by the stage that uses it (reading the input) instead of being handed on,
    and a pooling op runs before the hand-over. Changes stage costs by epsilons only."""
    n = len(ops)
    made = {k: (i, t) for i, o in enumerate(ops) for k, t in zip(o.outs, o.node.outputs)}
    last = {k: i for i, o in enumerate(ops) for k in o.ins}
    last.update((k, n) for k in output_keys)
    size = [0.0] * (n + 1)  # size[i]: elements per example crossing a cut before op i
    for k, (p, t) in made.items():
        for i in range(p + 1, last.get(k, p) + 1):
            size[i] += _dims(t.shape[1:])
    free = [not o.trainable and not o.non_trainable and o.flops == EPSILON for o in ops]
    cuts = list(cuts)
    for j, c in enumerate(cuts):
        lo, hi = (cuts[j - 1] if j else 0) + 1, (cuts[j + 1] if j + 1 < len(cuts) else n) - 1
        best, i = c, c
        while i - 1 >= lo and free[i - 1]:  # op i-1 would move to the later stage
            i -= 1
            best = i if i not in blocked and size[i] < size[best] else best
        i = c
        while i + 1 <= hi and free[i]:  # op i would move to the earlier stage
            i += 1
            best = i if i not in blocked and size[i] < size[best] else best
        cuts[j] = best
    return cuts


def split_keras_model(model, stages: int, balance: str = "flops") -> KerasSplit:
    """Cut ``model`` into ``stages`` pipeline stages balanced by ``balance`` (flops or params)."""
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r} is not valid; choose one of {', '.join(BALANCES)}")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    graph = _graph_of(model)
    input_keys = [f"in:{i}" for i in range(len(graph.inputs))]
    builder = _Builder()
    output_keys = builder.add_graph(graph, input_keys)
    ops = builder.ops

    seen: set[int] = set()
    costs = []
    for o in ops:
        if balance == "params":  # count a shared variable once, where it is first read
            new = [v for v in o.trainable + o.non_trainable if id(v) not in seen]
            costs.append(sum(_dims(v.shape) for v in new) + EPSILON)
            seen.update(id(v) for v in o.trainable + o.non_trainable)
        else:
            costs.append(o.flops)

    # Units: maximal op ranges with no allowed cut inside; partition() groups whole units.
    blocked = _blocked_cuts(ops)
    starts = [0] + [i for i in range(1, len(ops)) if i not in blocked]
    ends = starts[1:] + [len(ops)]
    if stages > len(starts):
        if len(starts) < len(ops):
            why = sorted(set().union(*blocked.values()))
            raise UncuttableModelError(
                f"model {model.name!r} can be cut into at most {len(starts)} stages, not {stages}: its "
                f"{len(ops)} ops cannot be separated around {'; '.join(why)}. Use at most {len(starts)} "
                f"pipeline stages (parallel.pp x virtual_stages)")
        raise UncuttableModelError(
            f"model {model.name!r} has only {len(ops)} ops, so it can be cut into at most {len(ops)} "
            f"pipeline stages, not {stages}; use parallel.pp x virtual_stages <= {len(ops)}")
    bounds = partition([sum(costs[a:b]) for a, b in zip(starts, ends)], stages)
    cuts = _slide_cuts([starts[a] for a, _ in bounds[1:]], ops, output_keys, blocked)
    ranges = list(zip([0] + cuts, cuts + [len(ops)]))

    producer = {k: s for s, (a, b) in enumerate(ranges) for o in ops[a:b] for k in o.outs}
    last_use: dict[str, int] = {}
    for s, (a, b) in enumerate(ranges):
        for o in ops[a:b]:
            last_use.update((k, s) for k in o.ins)
    outputs = set(output_keys)
    result = []
    for s, (a, b) in enumerate(ranges):
        mine = ops[a:b]
        made = {k for o in mine for k in o.outs}
        needed = {k for o in mine for k in o.ins if k not in made}
        handed = {k for k in made if last_use.get(k, -1) > s or k in outputs}
        trainable = _unique(v for o in mine for v in o.trainable)
        ids = {id(v) for v in trainable}
        result.append(Stage(
            index=s, trainable_variables=trainable,
            non_trainable_variables=_unique(v for o in mine for v in o.non_trainable if id(v) not in ids),
            input_keys=sorted(needed, key=_key_order), output_keys=sorted(handed, key=_key_order),
            cost=float(sum(o.flops for o in mine)), ops=mine))
    return KerasSplit(result, input_keys, output_keys, graph, producer, last_use)
