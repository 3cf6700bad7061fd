"""Pipeline-split a Keras 3 model whose layers form a chain, and train it on the mesh.

"Put the first half of my model on device 0 and the rest on device 1": a
``keras.Sequential`` model, or a Functional model with one input and one output, is
cut at *cut points* — tensors that every path from the input to the output passes
through (inside a piece, branches such as residual connections are fine). The pieces
between consecutive cut points are the units; :func:`split_model` groups consecutive
units into ``stages`` balanced by parameter count or by estimated FLOPs, and
:class:`KerasPipelineEngine` runs the stages over the ``pipe`` axis with any schedule,
replicated over ``data`` (ZeRO optional), with the same step as
:class:`phalanx.train.engine.StrategyEngine`.

Each piece is called with ``stateless_call`` on the engine's own variables, which
live on the stage's device; the user's model is only read.

Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(8),
    ...                           keras.layers.Dense(2)])
    >>> split = split_model(model, stages=2)
    >>> [len(s) for s in split.stages]
    [1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from phalanx.config import Config, ConfigError
from phalanx.mesh import Mesh
from phalanx.parallel.base import PipelinedEngine
from phalanx.parallel.params import ShardedParams
from phalanx.parallel.pipeline import partition
from phalanx.parallel.tensor import Split


class UncuttableModelError(ValueError):
    """The model cannot be cut into the requested number of pipeline stages."""


@dataclass
class ModelSplit:
    """``stages[s]``: the pieces (a Keras layer or a sub-model) of stage s, in order."""

    stages: list[list[Any]]
    costs: list[float]


def chain_pieces(model) -> list[Any]:
    """The model as a chain of callables: its layers (Sequential) or the Functional
    sub-models between consecutive cut points."""
    import keras

    if isinstance(model, keras.Sequential):
        return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if not isinstance(model, keras.Model) or not hasattr(model, "operations") or not hasattr(model, "inputs"):
        raise UncuttableModelError(
            f"{type(model).__name__} is not a keras.Sequential or Functional model; a subclassed model has no "
            f"graph of layers to cut. Rebuild it as Sequential or with the Functional API")
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        raise UncuttableModelError(f"model {model.name!r} has {len(model.inputs)} inputs and "
                                   f"{len(model.outputs)} outputs; only single-input, single-output chains can be cut")
    ops = [op for op in model.operations if not isinstance(op, keras.layers.InputLayer)]
    # Only this model's call of each layer counts (sub-models add nodes to shared layers).
    own = getattr(model, "_nodes", None)
    nodes = {}
    for op in ops:
        # Keras keys a model's nodes as "<id(layer)>_ib-<index of the call>".
        mine = [n for i, n in enumerate(op._inbound_nodes) if own is None or f"{id(op)}_ib-{i}" in own]
        if len(mine) != 1:
            raise UncuttableModelError(f"layer {op.name!r} is called {len(mine)} times; a shared "
                                       f"layer would live on several stages at once")
        nodes[id(op)] = mine[0]
    # tensor id -> index of the last operation that reads it
    last_use: dict[int, int] = {}
    for i, op in enumerate(ops):
        for t in nodes[id(op)].input_tensors:
            last_use[id(t)] = i
    out_id = id(model.outputs[0])
    cuts = [model.inputs[0]]
    live = {id(model.inputs[0]): model.inputs[0]}
    for i, op in enumerate(ops):
        for t in nodes[id(op)].output_tensors:
            live[id(t)] = t
        live = {k: t for k, t in live.items() if last_use.get(k, -1) > i or k == out_id}
        if len(live) == 1 and i < len(ops) - 1:
            (t,) = live.values()
            if t is not cuts[-1]:
                cuts.append(t)
    cuts.append(model.outputs[0])
    return [keras.Model(a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def piece_cost(piece, by: str) -> float:
    """Parameters of a piece, or its forward FLOPs per example estimated as 2 x kernel
    size x output positions for every kernel (exact for Dense and convolutions)."""
    if by == "params":
        return float(sum(np.prod(v.shape) for v in piece.trainable_variables))
    if by != "flops":
        raise ValueError(f"balance={by!r} is not valid; choose params or flops")
    layers = getattr(piece, "layers", None) or [piece]
    total = 0.0
    for layer in layers:
        for v in layer.trainable_variables:
            if len(v.shape) < 2:
                continue
            out = getattr(layer, "output", None)
            positions = float(np.prod(out.shape[1:-1])) if out is not None and len(out.shape) > 2 else 1.0
            total += 2.0 * float(np.prod(v.shape)) * positions
    return total + 1.0  # a parameter-free piece still costs something


def split_model(model, stages: int, balance: str = "params") -> ModelSplit:
    """Cut ``model`` into ``stages`` consecutive groups of pieces, balanced by ``balance``."""
    pieces = chain_pieces(model)
    if stages > len(pieces):
        raise UncuttableModelError(
            f"model {model.name!r} has only {len(pieces)} cut-able pieces (layers between single-tensor cut "
            f"points) but {stages} pipeline stages were asked for; use parallel.pp x virtual_stages <= {len(pieces)}")
    costs = [piece_cost(p, balance) for p in pieces]
    bounds = partition(costs, stages)
    return ModelSplit([pieces[a:b] for a, b in bounds], [sum(costs[a:b]) for a, b in bounds])


class KerasPipelineEngine(PipelinedEngine):
    """Train a :class:`~phalanx.train.task.KerasTask` split over ``pipe`` (and replicated over ``data``).

    ``balance``: ``params`` or ``flops``. Batches are ``(x, y)``; the loss is the task's
    Keras loss, averaged over micro-batches exactly as over the whole batch.
    """

    def __init__(self, cfg: Config, mesh: Mesh, task, balance: str = "params"):
        if mesh.tp != 1:
            raise ConfigError("parallel.tp", f"{mesh.tp}: tensor parallelism is implemented for the built-in GPT "
                                             f"only; a Keras model can be split over pipe and data (tp=1)")
        self._init_schedule(cfg, mesh)
        self.task = task
        self.model = task.build()
        if self.model.non_trainable_variables:
            raise UncuttableModelError(
                f"model {self.model.name!r} has non-trainable state (e.g. BatchNormalization statistics: "
                f"{self.model.non_trainable_variables[0].path}); micro-batched pipelines would change it, so "
                f"such models are not supported")
        self.split = split_model(self.model, self.chunks, balance)
        names = {id(v): path for path, v in
                 ((v.path, v) for v in self.model.trainable_variables)}
        # piece variables -> logical names, in each piece's own trainable_variables order
        self.piece_names = [[[names[id(v)] for v in piece.trainable_variables] for piece in stage]
                            for stage in self.split.stages]
        stage_of = {n: s for s, stage in enumerate(self.piece_names) for piece in stage for n in piece}
        initial = {v.path: np.asarray(v.numpy()) for v in self.model.trainable_variables}
        params = ShardedParams(initial, {n: Split("replicated") for n in initial}, 1, self.dp,
                               lambda n, t, d: [self.stage_devices(d, stage_of[n])[0]])
        self.stage_keys = [[((n, 0), 0) for piece in stage for n in piece] for stage in self.piece_names]
        self._setup(params, task.decays)

    def forward(self, replica: int, stage: int, x, micro, training: bool = True):
        inputs, targets = micro
        h = inputs if stage == 0 else x
        device = self.stage_devices(replica, stage)[0]
        with tf.device(device):
            for piece, names in zip(self.split.stages[stage], self.piece_names[stage]):
                values = [self.params.shards[(n, 0)].copies[replica][0] for n in names]
                h, _ = piece.stateless_call([tf.convert_to_tensor(v) for v in values], [], h, training=training)
            if stage == self.chunks - 1:
                return tf.reduce_mean(tf.cast(self.task.loss_fn(targets, h), tf.float32))
        return h

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        return self._train_fn(tf.nest.map_structure(tf.convert_to_tensor, tuple(batch)))

    def eval_step(self, batch) -> tf.Tensor:
        return self._eval_fn(tf.nest.map_structure(tf.convert_to_tensor, tuple(batch)))
