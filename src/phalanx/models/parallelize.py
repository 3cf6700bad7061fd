"""Tensor parallelism for a Keras model you already have: a rule table, applied in place.

Keras 3's ``LayoutMap`` idea on TensorFlow. A rule table is an ordered list of
``(regex, kind)`` pairs. Each layer of the model has a *path*: the names from the model
down to it, joined by ``/`` (the model's own name left out), e.g.
``gpt2_backbone/transformer_layer_0/self_attention``; each of a layer's own weights has the
layer's path and its name, e.g. ``.../self_attention/query/kernel``. Walking the model from
the top, the first rule whose regex ``re.search``-es a layer's path, or the path of one of
its own weights, decides the layer's kind:

=============  ==================================================================================
``column``     a Dense (or Dense-like EinsumDense) -> ``ColumnParallelDense`` (output units cut)
``row``        a Dense -> ``RowParallelDense`` (input cut; needs a ``column`` layer before it)
``vocab``      an Embedding / ``ReversibleEmbedding`` -> vocabulary-parallel (``reverse=True`` too)
``attention``  a self-attention layer (keras ``MultiHeadAttention``, keras-hub GPT-2 / Llama /
               Mistral attention) -> split by heads, grouped-query included
``mlp``        a keras-hub gated decoder block (Llama, Mistral): its FFN Dense layers -> one
               ``ParallelMLP`` (the walk still goes into the block, so its attention can match)
``replicated`` left whole, and nothing under it is converted
=============  ==================================================================================

Layers no rule matches are left whole (replicated) and the walk goes into them. A matched
layer (other than ``mlp``) is replaced by its tensor-parallel version, and the walk does
not go into it. :func:`parallelize` swaps the layers **in place** (the model object stays
the same: Keras's layer tracking, a Functional graph's nodes and every attribute that held
the old layer now hold the new one), copies the current weights in, and returns the model.
:func:`unparallelize` puts plain layers back, rebuilt from their configs, with the current
weights. :func:`preset_for` gives the table of a keras-hub model
(:mod:`phalanx.models.presets`); ``rules=None`` uses it.

Every rule is checked before anything changes; a rule set that would give a wrong split
raises ``ValueError`` naming the layer (or rule): a regex that matches no layer, a kind
that does not fit the layer (``attention`` on a Dense, ``column`` on an Embedding, ...), a
dimension ``tp`` does not divide, a ``row`` layer with no ``column`` layer of its input
width before it (in the same block or graph), a layer already tensor-parallel.

Example:
    >>> import keras, numpy as np
    >>> x = keras.Input((8,))
    >>> y = keras.layers.Dense(4, name="fc2")(keras.layers.Dense(16, activation="relu", name="fc1")(x))
    >>> model = keras.Model(x, y)
    >>> data = np.random.default_rng(0).normal(size=(2, 8)).astype("float32")
    >>> before = model(data)
    >>> _ = parallelize(model, 2, rules=[("fc1", "column"), ("fc2", "row")])
    >>> [type(layer).__name__ for layer in model.layers[1:]]
    ['ColumnParallelDense', 'RowParallelDense']
    >>> bool(np.allclose(model(data), before, atol=1e-6))
    True
    >>> _ = unparallelize(model)
    >>> [type(layer).__name__ for layer in model.layers[1:]]
    ['Dense', 'Dense']
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from phalanx.layers.sharding import ShardedLayer
from phalanx.mesh import Mesh
from phalanx.models.presets import preset_for as _preset_for
from phalanx.models.presets.adapters import (CONVERSIONS, can_make_plain, dense_dims, is_converted, mlp_dense_layers,
                                             mlp_to_plain, to_mlp, to_plain)

KINDS = ("column", "row", "vocab", "attention", "mlp", "replicated")


@dataclass(frozen=True)
class Match:
    """One layer a rule decided: its path, the layer, the layer that holds it, the kind and
    the index of the rule."""

    path: str
    layer: object
    parent: object
    kind: str
    rule: int


# ---------------------------------------------------------------------------------------------
# Rules and the walk
# ---------------------------------------------------------------------------------------------

def _compile(rules) -> list[tuple[re.Pattern, str, str]]:
    if isinstance(rules, dict):
        rules = list(rules.items())
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"rule {i}: {rule!r} is not a (regex, kind) pair")
        pattern, kind = rule
        if kind not in KINDS:
            raise ValueError(f"rule {i} ({pattern!r} -> {kind!r}): kind {kind!r} is not one of {KINDS}")
        try:
            out.append((re.compile(pattern), kind, pattern))
        except re.error as err:
            raise ValueError(f"rule {i} ({pattern!r} -> {kind!r}): bad regex: {err}") from None
    return out


def _children(layer) -> list:
    if not hasattr(layer, "_flatten_layers"):
        return []
    return list(layer._flatten_layers(include_self=False, recursive=False))


def layer_paths(model) -> list[tuple[str, object, object]]:
    """``(path, layer, parent)`` of every layer under ``model``, top-down, each layer once
    (a layer used in two places, like keras-hub's token embedding in the backbone and the
    task model, under the first path met)."""
    seen, out = {id(model)}, []

    def walk(layer, prefix):
        for child in _children(layer):
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}/{child.name}" if prefix else child.name
            out.append((path, child, layer))
            walk(child, path)

    walk(model, "")
    return out


def _weight_paths(layer, path: str) -> list[str]:
    """The paths of ``layer``'s own weights (not its sub-layers'): ``<layer path>/<name>``."""
    own = list(getattr(layer, "_trainable_variables", [])) + list(getattr(layer, "_non_trainable_variables", []))
    return [f"{path}/{v.name}" for v in own]


def _decides(regex: re.Pattern, layer, path: str) -> bool:
    return bool(regex.search(path)) or any(regex.search(w) for w in _weight_paths(layer, path))


def match(model, rules) -> list[Match]:
    """The layers ``rules`` decide, top-down, without changing anything (a dry run of
    :func:`parallelize`'s matching; no checks).

    Example (a rule on a weight path decides the layer that holds the weight):
        >>> import keras
        >>> x = keras.Input((8,))
        >>> model = keras.Model(x, keras.layers.Dense(4, name="fc2")(keras.layers.Dense(16, name="fc1")(x)))
        >>> [(m.path, m.kind) for m in match(model, [("fc1/kernel$", "column"), ("fc2", "row")])]
        [('fc1', 'column'), ('fc2', 'row')]
    """
    compiled = _compile(rules)
    seen, out = {id(model)}, []

    def walk(layer, prefix):
        for child in _children(layer):
            if id(child) in seen:
                continue
            seen.add(id(child))
            path = f"{prefix}/{child.name}" if prefix else child.name
            hit = next((i for i, (regex, _, _) in enumerate(compiled) if _decides(regex, child, path)), None)
            if hit is not None:
                kind = compiled[hit][1]
                out.append(Match(path, child, layer, kind, hit))
                if kind != "mlp":
                    continue
            walk(child, path)

    walk(model, "")
    return out


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

def _check(model, tp: int, compiled, matches: list[Match]) -> None:

    # Every rule decides at least one layer.
    used = {m.rule for m in matches}
    layers = layer_paths(model)
    paths = [p for p, _, _ in layers]
    for i, (regex, kind, pattern) in enumerate(compiled):
        if i in used:
            continue
        shadowed = [p for p, layer, _ in layers if _decides(regex, layer, p)]
        if shadowed:
            raise ValueError(f"rule {i} ({pattern!r} -> {kind!r}) matches only layers that an earlier rule or a "
                             f"converted outer layer already decides, e.g. {shadowed[0]!r}")
        examples = ", ".join(repr(p) for p in paths[:6])
        raise ValueError(f"rule {i} ({pattern!r} -> {kind!r}) matches no layer of model {model.name!r} "
                         f"(layer paths look like {examples}, ...)")
    # Each kind fits its layer, dimensions divide.
    for m in matches:
        if m.kind == "replicated":
            continue
        if isinstance(m.layer, ShardedLayer) or is_converted(m.layer):
            raise ValueError(f"layer {m.path!r} is already tensor-parallel ({type(m.layer).__name__}); "
                             f"unparallelize the model first")
        if not getattr(m.layer, "built", False):
            raise ValueError(f"layer {m.path!r} is not built: build or call the model once before parallelize")
        problem = CONVERSIONS[m.kind].problems(m.layer, tp)
        if problem:
            raise ValueError(f"layer {m.path!r} ({type(m.layer).__name__}) cannot be {m.kind!r} "
                             f"(rule {m.rule}: {compiled[m.rule][2]!r}): it {problem}")
    # An mlp block owns its FFN Dense layers: no other rule may take them.

    owned = {id(d): m for m in matches if m.kind == "mlp" for d in mlp_dense_layers(m.layer)}
    for m in matches:
        if id(m.layer) in owned and m.kind != "replicated":
            block = owned[id(m.layer)]
            raise ValueError(f"layer {m.path!r} is 'mlp' of block {block.path!r} (rule {block.rule}) and "
                             f"{m.kind!r} (rule {m.rule}): a layer takes one kind")
    # A row layer needs a column layer of its input width before it, in the same block or graph.
    by_parent: dict[int, list[Match]] = {}
    for m in matches:
        if m.kind in ("column", "row"):
            by_parent.setdefault(id(m.parent), []).append(m)
    for group in by_parent.values():
        widths: set[int] = set()
        for m in group:
            n_in, units = dense_dims(m.layer)
            if m.kind == "column":
                widths.add(units)
                continue
            if n_in not in widths:
                before = (f"the column layers since the last row layer have widths {sorted(widths)}" if widths
                          else "no column layer comes before it")
                raise ValueError(f"layer {m.path!r} is 'row' (rule {m.rule}: {compiled[m.rule][2]!r}) but {before} "
                                 f"in {getattr(m.parent, 'name', '?')!r}: a row layer takes the cut output of a "
                                 f"column layer of its input width ({n_in})")
            widths = set()


# ---------------------------------------------------------------------------------------------
# The optimizer's state across a swap
# ---------------------------------------------------------------------------------------------

def _logical_groups(model) -> dict[int, tuple[list, int | None]]:
    """Variable id -> (its logical weight's shard variables, cut axis), for sharded weights."""
    out = {}
    for _, layer, _ in layer_paths(model):
        if isinstance(layer, ShardedLayer):
            for variables, axis, _ in layer._logical.values():
                for v in variables:
                    out[id(v)] = (list(variables), axis if len(variables) > 1 else None)
    return out


def _join(values, axis):
    import numpy as np

    return values[0] if axis is None else np.concatenate(values, axis=axis)


def _trainable_logical(model) -> list[tuple[list, int | None]]:
    """The trainable weights as logical weights: (variables in shard order, cut axis)."""
    groups, seen, out = _logical_groups(model), set(), []
    for v in model.trainable_variables:
        if id(v) in seen:
            continue
        members, axis = groups.get(id(v), ([v], None))
        seen.update(id(m) for m in members)
        out.append((members, axis))
    return out


def _slots_of(optimizer, variables) -> dict[int, dict[str, object]]:
    """id(variable) -> {slot suffix: slot variable}: Keras names a slot
    ``<the variable's path, '/' -> '_'>_<suffix>`` (the longest matching prefix wins)."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", v) for v in variables), key=lambda item: -len(item[0]))
    out: dict[int, dict[str, object]] = {}
    for slot in optimizer.variables:
        owner = next((v for prefix, v in prefixes if slot.name.startswith(prefix)), None)
        if owner is not None and tuple(slot.shape) == tuple(owner.shape):
            out.setdefault(id(owner), {})[slot.name[len(owner.path.replace("/", "_")) + 1:]] = slot
    return out


def _capture_optimizer(model):
    """The state a built optimizer keeps per trainable weight, as logical values, before the
    layers holding the weights are swapped: ``(optimizer, [(weight value, {suffix: slot
    value})])``, or None for an optimizer not built yet (it builds on the new weights)."""
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's slots are its inner's
    if inner is None or not getattr(inner, "built", False):
        return None
    slots = _slots_of(inner, model.trainable_variables)
    records = []
    for members, axis in _trainable_logical(model):
        value = _join([m.numpy() for m in members], axis)
        suffixes = set().union(*[set(slots.get(id(m), {})) for m in members])
        state = {}
        for suffix in suffixes:
            parts = [slots.get(id(m), {}).get(suffix) for m in members]
            if all(part is not None for part in parts):
                state[suffix] = _join([part.numpy() for part in parts], axis)
        records.append((value, state))
    return inner, records


def _acknowledge_list_edit(value) -> None:
    """A TensorFlow-tracked list edited in place other than by appending holds what it should:
    say so (TensorFlow refuses to checkpoint such a list otherwise)."""
    try:
        from tensorflow.python.trackable.data_structures import ListWrapper
    except ImportError:  # pragma: no cover - another TensorFlow layout
        return
    if isinstance(value, ListWrapper):
        value._non_append_mutation = False
        value._external_modification = False
        value._last_wrapped_list_snapshot = list(value._storage)


def _restore_optimizer(model, captured) -> None:
    """Rebuild the optimizer ``_capture_optimizer`` read, in place (the same object, its
    step count and other own variables kept), for the model's new weights, and give each
    new weight the slots of the old weight it was copied from. A swap copies values exactly,
    so the old weight is the one of equal shape and value (equal ones in model order)."""
    import numpy as np

    if captured is None:
        return
    inner, records = captured
    old_slots = {id(s) for d in _slots_of(inner, inner._trainable_variables).values() for s in d.values()}
    kept = [v for v in inner._variables if id(v) not in old_slots]
    inner._variables[:] = kept  # in place: Keras's tracker appends new variables to this very list
    _acknowledge_list_edit(inner._variables)
    inner._trainable_variables_indices = {}
    inner.built = False
    inner.build(model.trainable_variables)
    slots = _slots_of(inner, model.trainable_variables)
    unused = list(range(len(records)))
    for members, axis in _trainable_logical(model):
        value = _join([m.numpy() for m in members], axis)
        k = next((k for k in unused if records[k][0].shape == value.shape and np.array_equal(records[k][0], value)),
                 None)
        if k is None:
            raise ValueError(f"weight {members[0].path!r}: no weight of the model before the swap holds its value, "
                             f"so its optimizer state cannot be carried over; re-compile with a fresh optimizer")
        unused.remove(k)
        for suffix, saved in records[k][1].items():
            parts = [slots.get(id(m), {}).get(suffix) for m in members]
            if any(part is None for part in parts):
                continue
            pieces = [saved] if axis is None else np.split(saved, len(members), axis=axis)
            for part, piece in zip(parts, pieces):
                part.assign(piece)


# ---------------------------------------------------------------------------------------------
# Swapping a layer everywhere it is referenced
# ---------------------------------------------------------------------------------------------

def _all_layers(root) -> list:
    return [root] + [layer for _, layer, _ in layer_paths(root)]


def _set_attribute(layer, name: str, value) -> None:
    tracker = getattr(layer, "_tracker", None)
    locked = bool(tracker is not None and tracker.locked)
    if locked:
        tracker.unlock()
    try:
        setattr(layer, name, value)
    finally:
        if locked:
            tracker.lock()


def _replace_in_graph(function, old, new) -> None:
    from keras.src.ops.function import make_node_key

    for ops in [function._operations, *function._operations_by_depth.values()]:
        for i, op in enumerate(ops):
            if op is old:
                ops[i] = new
    prefix = f"{id(old)}_ib-"
    function._nodes = {(make_node_key(new, int(key[len(prefix):])) if key.startswith(prefix) else key)
                       for key in function._nodes}


def _move_nodes(old, new) -> None:
    from keras.src.ops.node import KerasHistory

    if not getattr(old, "_inbound_nodes", None):
        return
    for index, node in enumerate(old._inbound_nodes):
        node.operation = new
        for t, tensor in enumerate(node.outputs):
            history = getattr(tensor, "_keras_history", None)
            if history is not None and history.operation is old:
                tensor._keras_history = KerasHistory(new, index, t)
    new._inbound_nodes = list(old._inbound_nodes)
    new._outbound_nodes = list(old._outbound_nodes)
    old._inbound_nodes, old._outbound_nodes = [], []


def _fix_tf_tracking(layer, old, new) -> None:
    """TensorFlow's checkpoint tracking of ``layer`` (Keras layers are TF trackables on this
    backend): dependencies named after attributes that held ``old`` now name ``new`` (or
    are dropped), and list wrappers we edited acknowledge the edit (TensorFlow refuses to
    checkpoint a tracked list changed other than by appending; the list holds what the
    model now has, which is what a checkpoint must save)."""
    names = getattr(layer, "_self_unconditional_dependency_names", None)
    deps = getattr(layer, "_self_unconditional_checkpoint_dependencies", None)
    if names is not None and deps is not None:
        for name, ref in list(names.items()):
            if ref is old:
                if new is None:
                    del names[name]
                else:
                    names[name] = new
        for i in reversed(range(len(deps))):
            if deps[i].ref is old:
                if new is None:
                    del deps[i]
                else:
                    deps[i] = type(deps[i])(name=deps[i].name, ref=new)
    try:
        from tensorflow.python.trackable.data_structures import ListWrapper
    except ImportError:  # pragma: no cover - another TensorFlow layout
        return
    for value in list(vars(layer).values()):
        if not isinstance(value, ListWrapper):
            continue
        snapshot = value._last_wrapped_list_snapshot or []
        if any(v is new for v in value._storage) or any(v is old for v in snapshot):
            _acknowledge_list_edit(value)


def replace_layer(root, old, new, after=()) -> None:
    """Swap layer ``old`` for ``new`` everywhere under ``root`` (``root`` included): Keras's
    layer trackers (so weights follow), attributes, lists, dicts and tuples of attributes,
    and Functional graphs (operations, nodes, tensor histories). ``new=None`` removes
    ``old`` from the trackers only (the caller deletes its attributes). Layers in ``after``
    are tracked right after ``new``, in order."""
    from keras.src.ops.function import Function

    for layer in _all_layers(root):
        if layer is old:
            continue
        tracker = getattr(layer, "_tracker", None)
        if tracker is not None and tracker.is_in_store("layers", old):
            if new is None:
                tracker.untrack(old)
            else:
                tracker.replace_tracked_value("layers", old, new)
                store = tracker.config["layers"][1]
                at = next(i for i, v in enumerate(store) if v is new)
                for j, extra in enumerate(after):
                    store.insert(at + 1 + j, extra)
                    tracker.stored_ids["layers"].add(id(extra))
        if new is None:
            _fix_tf_tracking(layer, old, None)
            continue
        if isinstance(layer, Function):
            _replace_in_graph(layer, old, new)
        for name, value in list(vars(layer).items()):
            if name == "_layers" or name.startswith("_phalanx"):
                continue
            if value is old:
                _set_attribute(layer, name, new)
            elif isinstance(value, list):
                for i, v in enumerate(list(value)):
                    if v is old:
                        value[i] = new
            elif isinstance(value, dict):
                for k, v in list(value.items()):
                    if v is old:
                        value[k] = new
            elif isinstance(value, tuple) and not hasattr(value, "_fields") and any(v is old for v in value):
                _set_attribute(layer, name, type(value)(new if v is old else v for v in value))
        _fix_tf_tracking(layer, old, new)
    if new is not None:
        _move_nodes(old, new)


def _after_swaps(model) -> None:
    """Forget what Keras compiled for the old layers: the traced train/test/predict functions,
    and the compile-time ``trainable`` record keyed by layer objects (it would keep the old
    layers alive and make ``fit`` warn that trainability changed)."""
    for layer in _all_layers(model):
        for attr in ("train_function", "test_function", "predict_function"):
            if getattr(layer, attr, None) is not None:
                setattr(layer, attr, None)
        state = layer.__dict__.get("_compiled_trainable_state")
        if state is not None:
            _set_attribute(layer, "_compiled_trainable_state",
                           {child: state.get(child, child.trainable) for child in layer._flatten_layers()})
            _sync_dependency(layer, "_compiled_trainable_state", state)


def _sync_dependency(layer, name: str, old) -> None:
    """Point TensorFlow's checkpoint dependency ``name`` of ``layer`` at the attribute's
    current value, if it still names ``old`` (Keras stores some attributes in wrappers
    TensorFlow does not re-track on assignment)."""
    names = getattr(layer, "_self_unconditional_dependency_names", None)
    deps = getattr(layer, "_self_unconditional_checkpoint_dependencies", None)
    if names is None or deps is None or name not in names or names[name] is not old:
        return
    import tensorflow as tf

    value = layer.__dict__.get(name)
    for i in reversed(range(len(deps))):
        if deps[i].name != name:
            continue
        if isinstance(value, tf.__internal__.tracking.Trackable):
            deps[i] = type(deps[i])(name=name, ref=value)
        else:
            del deps[i]
    if isinstance(value, tf.__internal__.tracking.Trackable):
        names[name] = value
    else:
        del names[name]


# ---------------------------------------------------------------------------------------------
# The API
# ---------------------------------------------------------------------------------------------

def preset_for(model, tp: int | None = None):
    """The rule table of ``model``'s keras-hub family (GPT-2, Llama, Mistral; a task model
    such as ``GPT2CausalLM`` goes by its backbone), or None for any other model. With ``tp``,
    the table :func:`parallelize` uses with ``rules=None``: the token embedding stays
    replicated when ``tp`` does not divide the vocabulary."""

    return _preset_for(model, tp)


def parallelize(model, tp, rules=None):
    """Swap ``model``'s layers for tensor-parallel ones with ``tp`` shards, in place, as
    ``rules`` say (an ordered list of ``(regex on the layer or weight path, kind)``; None: the
    preset of the model's keras-hub family, see :func:`preset_for`). ``tp``: the shard count,
    or a :class:`phalanx.mesh.Mesh` (its ``tensor`` axis size). The current weights are copied
    in (as logical values: the model computes the same function). Returns ``model``.

    Raises ``ValueError`` naming the layer or rule when the rules would give a wrong split
    (see the module docstring); nothing has changed then. A built optimizer (a model trained
    before) is rebuilt for the new weights in place, its state carried over: each shard's
    slots are the slices of the weight's slots, the step count stays. ``tp=1`` also converts (to
    one-shard layers), so a model trains the same code path at every ``tp``.
    """
    if isinstance(tp, Mesh):  # its tensor axis
        tp = tp.tp
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp: {tp!r} is not a positive integer or a phalanx Mesh")
    if rules is None:
        rules = preset_for(model, tp)
        if rules is None:
            raise ValueError(f"model {model.name!r} ({type(model).__name__}) has no tensor-parallel preset (presets: "
                             f"keras-hub GPT2Backbone, LlamaBackbone, MistralBackbone and their task models): "
                             f"pass rules=[(regex, kind), ...]")
    compiled = _compile(rules)
    matches = match(model, rules)
    _check(model, tp, compiled, matches)
    captured = _capture_optimizer(model)

    for m in matches:
        if m.kind == "replicated":
            continue
        if m.kind == "mlp":
            to_mlp(m.layer, tp, lambda old, new, after=(): replace_layer(model, old, new, after))
            continue
        replace_layer(model, m.layer, CONVERSIONS[m.kind].convert(m.layer, tp))
    _after_swaps(model)
    _restore_optimizer(model, captured)
    return model


def unparallelize(model):
    """Put plain layers back where :func:`parallelize` put tensor-parallel ones, in place:
    each rebuilt from the config of the layer it replaced (never a kept copy) and holding
    the current (trained) weights. The model then saves, and reloads with Keras (and
    keras-hub) alone, and generates; its optimizer is rebuilt for the plain weights in place,
    with its state (step count, each weight's slots joined from its shards'), so Keras's
    ``fit``, ``evaluate`` and ``save`` go on from it. Tensor-parallel layers that :func:`parallelize` did not
    make (a model built from phalanx's layers, or loaded from a file) become their plain
    Keras twin when they have one (Dense, Embedding, ReversibleEmbedding,
    MultiHeadAttention) and stay otherwise. Returns ``model``."""

    captured = _capture_optimizer(model)
    for _, layer, _ in layer_paths(model):
        if getattr(layer, "_phalanx_mlp", None) is not None:
            mlp_to_plain(layer, lambda old, new, after=(): replace_layer(model, old, new, after))
    for _, layer, _ in layer_paths(model):
        if can_make_plain(layer):
            replace_layer(model, layer, to_plain(layer))
    _after_swaps(model)
    _restore_optimizer(model, captured)
    return model


def is_parallelized(model) -> bool:
    """Whether any layer under ``model`` is tensor-parallel (holds weights cut into shards)."""

    return any(isinstance(layer, ShardedLayer) for _, layer, _ in layer_paths(model))


__all__ = ["KINDS", "Match", "parallelize", "unparallelize", "preset_for", "match", "layer_paths", "replace_layer",
           "is_parallelized"]
