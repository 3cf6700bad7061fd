"""Pipeline parallelism: the executor of a schedule table.

:func:`run_schedule` runs a :class:`~phalanx.parallel.schedules.Schedule` inside one
``tf.function``: every forward action opens its own ``GradientTape`` on the stage's
input and weights; every backward action calls ``tape.gradient(...,
output_gradients=<gradient from the next stage>)``. Each action's ops are created
under ``tf.control_dependencies`` on the previous action of the same rank, so the
TensorFlow executor must follow the table's order per rank (without them it would run
any order the data allows, e.g. all forwards first). The order in which actions were
chained is recorded in a :class:`PipelineTrace`, and :func:`check_graph_order` proves
from the traced graph that every op of an action waits for the previous action
(what the executor then ran, from a profiler trace: :mod:`phalanx.parallel.trace`).
Stages are cut by :func:`phalanx.parallel.partition.partition`.

Example:
    >>> schedule_for(Config().replace(parallel={"pp": 2, "microbatches": 2}), 2).name
    '1f1b'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import tensorflow as tf

from phalanx.config import Config, ConfigError
from phalanx.parallel.gradients import SparseGradient, join_gradients
from phalanx.parallel.schedules import Schedule, build_schedule, iter_actions


@dataclass
class PipelineTrace:
    """What the executor chained, per rank, in order: action names and their graph scopes."""

    order: list[list[str]] = field(default_factory=list)
    scopes: list[list[str]] = field(default_factory=list)
    markers: list[list[list[str]]] = field(default_factory=list)
    ops: list[list[list[str]]] = field(default_factory=list)  # names of the ops each action created


# forward(stage, microbatch, x_in) -> activation (or, on the last stage, the float32 loss).
# An activation may be one tensor or a list of tensors (several tensors cross a cut when a
# skip branch or a mask spans it); stage s+1 receives exactly what stage s returned.
StageForward = Callable[[int, int, "tf.Tensor | list[tf.Tensor] | None"], "tf.Tensor | list[tf.Tensor]"]


def _flat(value) -> list[tf.Tensor]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _differentiable(tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    # Integer or boolean tensors crossing a cut (token ids, masks) carry no gradient.
    return [t for t in tensors if t.dtype.is_floating]


def schedule_for(cfg: Config, pp: int) -> Schedule:
    """The schedule table ``cfg.parallel`` asks for on ``pp`` pipeline ranks (virtual
    stages only for ``interleaved``); an impossible one is a ConfigError on the key."""
    p = cfg.parallel
    try:
        return build_schedule(p.schedule, pp, p.microbatches, p.virtual_stages if p.schedule == "interleaved" else 1)
    except ValueError as err:
        raise ConfigError("parallel.schedule", str(err)) from None


def accumulate_gradient(total, grad, keep_sparse: bool = False, origin=None):
    """``total + grad`` in float32. With ``keep_sparse``, sparse gradients (an embedding's
    ``IndexedSlices``) are joined as one device's tape over the whole batch gives them, not
    densified (:func:`phalanx.parallel.gradients.join_gradients`: rows of lookups by the
    batch's ids kept, lookups with the same indices in every micro-batch summed per row);
    Keras's optimizers treat that differently from the dense sum (Adam squares each row)."""
    if keep_sparse:
        return join_gradients(total, grad, origin)
    grad = tf.cast(tf.convert_to_tensor(grad), tf.float32)  # gather grads are IndexedSlices
    if total is None:
        return grad
    return tf.convert_to_tensor(total) + grad


def run_schedule(schedule: Schedule, forward: StageForward, params: Sequence[Sequence[tf.Variable]],
                 loss_weight: tf.Tensor, trace: PipelineTrace | None = None, prefix: str = "pipe",
                 keep_sparse: bool = False, initial: Sequence[Sequence[tf.Tensor | None]] | None = None,
                 sources: Callable[[int, int], Sequence[tf.Tensor]] | None = None):
    """Run one pipeline step; return ``(grads, loss_sum)``.

    ``params[s]``: the variables stage ``s`` reads. ``grads[s][j]`` is the gradient of
    ``sum over micro-batches of loss_i x loss_weight`` w.r.t. ``params[s][j]``;
    ``loss_sum`` is the sum of the (unweighted) micro-batch losses. Activations handed
    between stages may be single tensors or lists; only their floating-point members
    are differentiated. ``keep_sparse``: see :func:`accumulate_gradient` (a sparse
    gradient is then a :class:`~phalanx.parallel.gradients.SparseGradient`, its lookups keyed
    by stage; :func:`~phalanx.parallel.gradients.finish` makes it the optimizer's); a weight
    that received no gradient is then ``None`` instead of zeros. ``initial`` (shaped like
    ``grads``, e.g. the previous accumulation step's): sums the micro-batches' gradients
    start from, so gradient accumulation keeps one running sum per weight; each rank's first
    action then waits for the sums of the stages it runs, so a rank starts this step once it
    has ended the previous one (otherwise nothing orders two steps: the executor ran the next
    step's forwards beside the last one's, every step's activations in flight at once).
    ``sources(stage, microbatch)`` (called after that forward ran): what its backward
    differentiates in place of ``params[stage]``, aligned with it, e.g. the values that forward
    read (in a graph; a tape differentiates ``params``). Differentiating a variable finds every read of it in the graph, and the graph walk of
    each backward then spans every micro-batch's forward: a step's build grew with the square of
    its micro-batches.

    Each backward adds its weight gradients into the running sums at once (the rank's next
    action waits for the additions), so a rank holds one gradient set, not one per
    micro-batch; the sums are taken in micro-batch order of the rank's table.
    """
    if schedule.split_backward:
        raise ValueError(f"schedule {schedule.name!r} splits the backward into B and W; the executor runs "
                         f"gpipe, 1f1b and interleaved")
    last_stage = schedule.num_stages - 1
    outputs, saved, grad_out = {}, {}, {}
    acc: list[list[tf.Tensor | None]] = ([list(row) for row in initial] if initial is not None
                                         else [[None] * len(p) for p in params])
    losses = []
    previous: dict[int, list[tf.Tensor]] = {}
    if initial is not None:
        for rank in range(schedule.pp):
            stages = {schedule.model_stage(rank, a) for a in schedule.per_stage[rank]}
            previous[rank] = [t for st in sorted(stages) for g in acc[st] if g is not None
                              for t in (g.tensors() if isinstance(g, SparseGradient) else [g])]
    if trace is not None:
        trace.order = [[] for _ in range(schedule.pp)]
        trace.scopes = [[] for _ in range(schedule.pp)]
        trace.markers = [[] for _ in range(schedule.pp)]
        trace.ops = [[] for _ in range(schedule.pp)]
    graph = tf.compat.v1.get_default_graph()
    for rank, action in iter_actions(schedule):
        first_op = len(graph.get_operations()) if trace is not None else 0
        stage, mb = schedule.model_stage(rank, action), action.microbatch
        scope = f"{prefix}_r{rank}_{action}"
        with tf.control_dependencies(previous.get(rank, [])), tf.name_scope(scope) as full_scope:
            if action.kind == "F":
                x_in = outputs.pop((stage - 1, mb)) if stage > 0 else None
                watched = _differentiable(_flat(x_in))
                with tf.GradientTape() as tape:
                    for t in watched:
                        tape.watch(t)
                    out = forward(stage, mb, x_in)
                    if stage == last_stage:
                        targets = [out * tf.cast(loss_weight, out.dtype)]
                    else:
                        targets = _differentiable(_flat(out))
                if stage == last_stage:
                    losses.append(out)
                else:
                    outputs[(stage, mb)] = out
                saved[(stage, mb)] = (tape, watched, targets)
                marker = targets or _flat(out)
            else:
                tape, watched, targets = saved.pop((stage, mb))
                own = params[stage] if sources is None or tf.executing_eagerly() else sources(stage, mb)
                differentiated = list(own) + watched
                upstream = grad_out.pop((stage, mb)) if stage < last_stage else None
                if targets and not tf.executing_eagerly():
                    # tf.gradients (not the tape) puts each gradient op on the device of the
                    # forward op it differentiates: a stage's backward runs on the stage's
                    # devices, not all on the step's default device. It sees the whole graph,
                    # so the stage's inputs are stop_gradients: a path between two of them
                    # (a skip tensor computed from another) belongs to the previous stage.
                    grads = tf.gradients(targets, differentiated, grad_ys=upstream, stop_gradients=watched,
                                         unconnected_gradients=tf.UnconnectedGradients.NONE)
                elif targets:
                    grads = tape.gradient(targets, differentiated, output_gradients=upstream,
                                          unconnected_gradients=tf.UnconnectedGradients.NONE)
                else:  # nothing differentiable leaves this stage: its weights get no gradient
                    grads = [None] * len(differentiated)
                n = len(params[stage])
                if watched:
                    grad_out[(stage - 1, mb)] = [tf.zeros_like(x) if g is None else g
                                                 for x, g in zip(watched, grads[n:])]
                summed = []
                for j, (var, g) in enumerate(zip(params[stage], grads[:n])):
                    if g is None:  # a weight this stage lists but does not use (e.g. a tied copy)
                        continue
                    with tf.device(var.device):
                        acc[stage][j] = accumulate_gradient(acc[stage][j], g, keep_sparse, origin=stage)
                    summed.extend(acc[stage][j].tensors() if isinstance(acc[stage][j], SparseGradient)
                                  else [acc[stage][j]])
                # The running sums are part of the marker: the rank's next action waits for them,
                # so each micro-batch's gradient is added (and freed) before the next action
                # starts. An addition that drives a control edge is also one Grappler's
                # arithmetic optimizer leaves alone; without the edge it rewrote the chain into
                # one AddN at the end of the step, which kept every micro-batch's gradient alive.
                marker = summed + [g for g in grads[n:] if g is not None] or targets or _flat(upstream)
        previous[rank] = marker
        if trace is not None:
            trace.order[rank].append(str(action))
            trace.scopes[rank].append(full_scope)
            trace.markers[rank].append([t.op.name for t in marker])
            # Gradient ops are named after the forward op ("gradient_tape/<F scope>/..."),
            # not after the B scope, so an action's ops are recorded by creation order.
            trace.ops[rank].append([op.name for op in graph.get_operations()[first_op:]])
    # keep_sparse callers sum contributions themselves and are told None = no gradient.
    grads = [[g if g is not None or keep_sparse else tf.zeros_like(v) for g, v in zip(row, p)]
             for row, p in zip(acc, params)]
    return grads, tf.add_n(losses)


def check_graph_order(graph: tf.Graph, trace: PipelineTrace) -> int:
    """Verify in a traced graph that each action waits for the previous one on its rank.

    For every rank and every pair of consecutive actions ``(a, b)``, each *root* op of
    ``b`` (an op ``b`` created none of whose data inputs ``b`` created) must have every
    marker op of ``a`` (its outputs) as a control or data input. Then no op of ``b`` can
    start before ``a``'s results exist. Returns the number of root ops checked; raises
    ``AssertionError`` naming the first violation.
    """
    by_name = {op.name: op for op in graph.get_operations()}
    checked = 0
    for rank, per_action in enumerate(trace.ops):
        for k in range(1, len(per_action)):
            names, markers = set(per_action[k]), set(trace.markers[rank][k - 1])
            if not names:
                raise AssertionError(f"rank {rank}: no ops recorded for action {trace.order[rank][k]}")
            for name in per_action[k]:
                op = by_name.get(name)
                if op is None:
                    raise AssertionError(f"op {name} of {trace.order[rank][k]} is not in the graph")
                if any(i.op.name in names for i in op.inputs):
                    continue
                before = {c.name for c in op.control_inputs} | {i.op.name for i in op.inputs}
                if not markers <= before:
                    raise AssertionError(
                        f"rank {rank}: op {op.name} of {trace.order[rank][k]} does not wait for "
                        f"{trace.order[rank][k - 1]} (missing {sorted(markers - before)[:3]})")
                checked += 1
    return checked
