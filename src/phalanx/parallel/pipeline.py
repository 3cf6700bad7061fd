"""Pipeline parallelism: cost-balanced partition and the executor of a schedule table.

:func:`partition` cuts a chain of layers into ``pp x virtual_stages`` contiguous
chunks minimising the most expensive chunk, with the embedding counted on the first
chunk and the head on the last (Lingvo's cost-balanced partitioner idea).

:func:`run_schedule` runs a :class:`~phalanx.parallel.schedules.Schedule` inside one
``tf.function``: every forward action opens its own ``GradientTape`` on the stage's
input and weights; every backward action calls ``tape.gradient(...,
output_gradients=<gradient from the next stage>)``. Each action's ops are created
under ``tf.control_dependencies`` on the previous action of the same rank, so the
TensorFlow executor must follow the table's order per rank (without them it would run
any order the data allows, e.g. all forwards first). The order in which actions were
chained is recorded in a :class:`PipelineTrace`, and :func:`check_graph_order` proves
from the traced graph that every op of an action waits for the previous action.

Example:
    >>> partition([1.0, 1.0, 1.0, 1.0], chunks=2, first_extra=0.0, last_extra=2.0)
    [(0, 3), (3, 4)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import tensorflow as tf

from phalanx.parallel.schedules import Schedule, iter_actions


def partition(costs: Sequence[float], chunks: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, one per chunk, each non-empty.

    Minimises the largest chunk cost, where chunk 0 also pays ``first_extra`` (the
    embedding) and the last chunk ``last_extra`` (the head and loss); ties prefer
    earlier cuts. Exact dynamic programme, O(chunks x layers^2).
    """
    n = len(costs)
    if chunks < 1 or chunks > n:
        raise ValueError(f"cannot cut {n} layers into {chunks} non-empty pipeline chunks; "
                         f"need 1 <= pp x virtual_stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(k: int, a: int, b: int) -> float:
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == chunks - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[k][b]: minimal max cost covering layers [0, b) with chunks 0..k
    best = [[inf] * (n + 1) for _ in range(chunks)]
    cut = [[0] * (n + 1) for _ in range(chunks)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, 0, b)
    for k in range(1, chunks):
        for b in range(k + 1, n + 1):
            for a in range(k, b):
                value = max(best[k - 1][a], cost(k, a, b))
                if value < best[k][b] - 1e-12:
                    best[k][b], cut[k][b] = value, a
    bounds, b = [], n
    for k in range(chunks - 1, 0, -1):
        a = cut[k][b]
        bounds.append((a, b))
        b = a
    bounds.append((0, b))
    return bounds[::-1]


@dataclass
class PipelineTrace:
    """What the executor chained, per rank, in order: action names and their graph scopes."""

    order: list[list[str]] = field(default_factory=list)
    scopes: list[list[str]] = field(default_factory=list)
    markers: list[list[list[str]]] = field(default_factory=list)


# forward(stage, microbatch, x_in) -> activation (or, on the last stage, the float32 loss)
StageForward = Callable[[int, int, "tf.Tensor | None"], tf.Tensor]


def run_schedule(schedule: Schedule, forward: StageForward, params: Sequence[Sequence[tf.Variable]],
                 loss_weight: tf.Tensor, trace: PipelineTrace | None = None, prefix: str = "pipe"):
    """Run one pipeline step; return ``(grads, loss_sum)``.

    ``params[s]``: the variables stage ``s`` reads. ``grads[s][j]`` is the gradient of
    ``sum over micro-batches of loss_i x loss_weight`` w.r.t. ``params[s][j]``;
    ``loss_sum`` is the sum of the (unweighted) micro-batch losses.
    """
    if schedule.split_backward:
        raise ValueError(f"schedule {schedule.name!r} splits the backward into B and W; the executor runs "
                         f"gpipe, 1f1b and interleaved")
    last_stage = schedule.num_stages - 1
    outputs, saved, grad_out = {}, {}, {}
    acc: list[list[tf.Tensor | None]] = [[None] * len(p) for p in params]
    losses = []
    previous: dict[int, list[tf.Tensor]] = {}
    if trace is not None:
        trace.order = [[] for _ in range(schedule.pp)]
        trace.scopes = [[] for _ in range(schedule.pp)]
        trace.markers = [[] for _ in range(schedule.pp)]
    for rank, action in iter_actions(schedule):
        stage, mb = schedule.model_stage(rank, action), action.microbatch
        scope = f"{prefix}_r{rank}_{action}"
        with tf.control_dependencies(previous.get(rank, [])), tf.name_scope(scope) as full_scope:
            if action.kind == "F":
                x_in = outputs.pop((stage - 1, mb)) if stage > 0 else None
                with tf.GradientTape() as tape:
                    if x_in is not None:
                        tape.watch(x_in)
                    out = forward(stage, mb, x_in)
                    target = out * tf.cast(loss_weight, out.dtype) if stage == last_stage else out
                if stage == last_stage:
                    losses.append(out)
                else:
                    outputs[(stage, mb)] = out
                saved[(stage, mb)] = (tape, x_in, target)
                marker = [target]
            else:
                tape, x_in, target = saved.pop((stage, mb))
                sources = list(params[stage]) + ([x_in] if x_in is not None else [])
                upstream = grad_out.pop((stage, mb)) if stage < last_stage else None
                grads = tape.gradient(target, sources, output_gradients=upstream,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                if x_in is not None:
                    grad_out[(stage - 1, mb)] = grads[-1]
                for j, (var, g) in enumerate(zip(params[stage], grads)):
                    with tf.device(var.device):
                        g = tf.cast(tf.convert_to_tensor(g), tf.float32)  # gather grads are IndexedSlices
                        acc[stage][j] = g if acc[stage][j] is None else acc[stage][j] + g
                marker = [g for g in grads]
        previous[rank] = marker
        if trace is not None:
            trace.order[rank].append(str(action))
            trace.scopes[rank].append(full_scope)
            trace.markers[rank].append([t.op.name for t in marker])
    grads = [[g if g is not None else tf.zeros_like(v) for g, v in zip(row, p)] for row, p in zip(acc, params)]
    return grads, tf.add_n(losses)


def check_graph_order(graph: tf.Graph, trace: PipelineTrace) -> int:
    """Verify in a traced graph that each action waits for the previous one on its rank.

    For every rank and every pair of consecutive actions ``(a, b)``, each *root* op of
    ``b`` (an op of ``b``'s scope none of whose data inputs come from ``b``'s scope)
    must have every marker op of ``a`` as a control input or a data input. Then no op
    of ``b`` can start before ``a``'s results exist. Returns the number of edges
    checked; raises ``AssertionError`` naming the first violation.
    """
    ops_by_scope: dict[str, list] = {}
    for op in graph.get_operations():
        for scopes in trace.scopes:
            for s in scopes:
                if op.name.startswith(s):
                    ops_by_scope.setdefault(s, []).append(op)
    checked = 0
    for rank, scopes in enumerate(trace.scopes):
        for k in range(1, len(scopes)):
            scope, markers = scopes[k], set(trace.markers[rank][k - 1])
            ops = ops_by_scope.get(scope, [])
            if not ops:
                raise AssertionError(f"rank {rank}: no ops found for action {trace.order[rank][k]} ({scope})")
            for op in ops:
                if any(i.op.name.startswith(scope) for i in op.inputs):
                    continue
                before = {c.name for c in op.control_inputs} | {i.op.name for i in op.inputs}
                if not markers <= before:
                    raise AssertionError(
                        f"rank {rank}: op {op.name} of {trace.order[rank][k]} does not wait for "
                        f"{trace.order[rank][k - 1]} (missing {sorted(markers - before)[:3]})")
                checked += 1
    return checked
