"""The pipeline executor (:func:`phalanx.parallel.pipeline.run_schedule`, the one the
Keras-model engine runs every pipeline step with) on a 4-stage toy model over 4 logical CPUs:

* its gradients and loss equal a plain unpipelined GradientTape of the same model;
* 1F1B, not GPipe: the traced actions follow the schedule table per rank and every action's
  ops wait for the previous action's (control dependencies in the graph), a broken record is
  caught, and the executor's own record (a profiler trace) shows the same order at run time;
* accumulation steps carry one gradient sum, and a rank starts a step once it ended the last.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from phalanx.parallel.pipeline import PipelineTrace, check_graph_order, run_schedule
from phalanx.parallel.schedules import build_schedule, peak_in_flight
from phalanx.parallel.trace import executed_order, measured_bubble, profile_actions

PP, MB, ROWS, WIDTH = 4, 4, 8, 16


@pytest.fixture(scope="module")
def toy(devices):
    """A 4-stage tanh MLP (one weight per stage on its own device), its 1F1B step traced once."""
    rng = np.random.default_rng(0)
    weights = []
    for s in range(PP):
        with tf.device(devices[s]):
            weights.append(tf.Variable(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 4, name=f"w{s}"))
    x = tf.constant(rng.standard_normal((ROWS, WIDTH)).astype(np.float32))
    schedule = build_schedule("1f1b", PP, MB)
    trace = PipelineTrace()
    rows = ROWS // MB

    def forward(stage, mb, h):
        with tf.device(devices[stage]):
            h = x[mb * rows:(mb + 1) * rows] if stage == 0 else h
            out = tf.tanh(h @ weights[stage])
            return tf.reduce_mean(tf.square(out)) if stage == PP - 1 else out

    @tf.function(autograph=False)
    def step():
        grads, loss_sum = run_schedule(schedule, forward, [[w] for w in weights], tf.constant(1.0 / MB),
                                       trace=trace, prefix="dp0_acc0")
        return [g[0] for g in grads], loss_sum

    graph = step.get_concrete_function().graph
    return schedule, trace, step, graph, weights, x


def test_gradients_equal_the_unpipelined_tape(toy):
    _, _, step, _, weights, x = toy
    with tf.GradientTape() as tape:  # the plain reference: the mean of the micro-batches' losses
        losses = []
        for mb in range(MB):
            h = x[mb * 2:(mb + 1) * 2]
            for w in weights:
                h = tf.tanh(h @ w)
            losses.append(tf.reduce_mean(tf.square(h)))
        want_loss = tf.add_n(losses)
        loss = want_loss / MB
    want = tape.gradient(loss, weights)
    grads, loss_sum = step()
    np.testing.assert_allclose(float(loss_sum), float(want_loss), rtol=1e-6)
    for g, w in zip(grads, want):  # float32, sums of 4 micro-batches in another order
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)


def test_1f1b_runs_in_1f1b_order(toy):
    schedule, trace, _, graph, _, _ = toy
    assert trace.order == [[str(a) for a in rank] for rank in schedule.per_stage]
    # 1F1B, not GPipe: rank r never holds more than pp - r micro-batches.
    assert peak_in_flight(schedule) == [4, 3, 2, 1]
    for r, order in enumerate(trace.order):
        held = peak = 0
        for a in order:
            held += 1 if a.startswith("F") else -1
            peak = max(peak, held)
        assert peak == PP - r
    assert trace.order[1] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    # The traced graph makes every action wait for its predecessor on the same rank.
    assert check_graph_order(graph, trace) > 0


def test_graph_order_check_detects_a_missing_dependency(toy):
    _, trace, _, graph, _, _ = toy
    broken = PipelineTrace(order=trace.order, scopes=trace.scopes, markers=trace.markers,
                           ops=[list(o) for o in trace.ops])
    broken.ops[0][1], broken.ops[0][2] = broken.ops[0][2], broken.ops[0][1]  # F2 claims to follow F0
    with pytest.raises(AssertionError, match="does not wait"):
        check_graph_order(graph, broken)


def test_1f1b_order_at_run_time_from_the_profiler(toy, tmp_path):
    """The TensorFlow executor's own record (profiler trace) shows the 1F1B order per rank."""
    schedule, _, step, _, _, _ = toy
    step()  # (traced and run once outside the profile)
    tf.profiler.experimental.start(str(tmp_path))
    try:
        step()
    finally:
        tf.profiler.experimental.stop()
    actions = profile_actions(str(tmp_path))
    assert executed_order(actions, PP) == [[str(a) for a in rank] for rank in schedule.per_stage]
    assert 0.0 <= measured_bubble(actions, PP) < 1.0


def test_accumulation_steps_carry_one_sum_and_start_after_the_previous_step(toy, devices):
    """Two accumulation steps (``initial``: the first step's sums): the gradients are the tape's
    over both steps' micro-batches, and each rank's first action of the second step waits for the
    first step's sum of its stage (a control or data input of every op that action starts with),
    so a rank never holds the two steps' activations at once."""
    schedule, _, _, _, weights, x = toy
    rows = ROWS // MB
    second, sums = PipelineTrace(), []

    def forward_on(part):
        def forward(stage, mb, h):
            with tf.device(devices[stage]):
                start = (part * MB + mb) * rows // 2
                h = x[start:start + rows // 2] if stage == 0 else h
                out = tf.tanh(h @ weights[stage])
                return tf.reduce_mean(tf.square(out)) if stage == PP - 1 else out
        return forward

    @tf.function(autograph=False)
    def step():
        first, loss0 = run_schedule(schedule, forward_on(0), [[w] for w in weights], tf.constant(0.5 / MB),
                                    prefix="dp0_acc0")
        grads, loss1 = run_schedule(schedule, forward_on(1), [[w] for w in weights], tf.constant(0.5 / MB),
                                    trace=second, prefix="dp0_acc1", initial=first)
        sums[:] = [g[0].op.name for g in first]  # the first step's sum of each stage (stage r on rank r)
        return [g[0] for g in grads], loss0 + loss1

    graph = step.get_concrete_function().graph
    by_name = {op.name: op for op in graph.get_operations()}
    for rank in range(PP):
        names = set(second.ops[rank][0])
        roots = [by_name[n] for n in second.ops[rank][0] if not any(i.op.name in names for i in by_name[n].inputs)]
        assert roots
        for op in roots:
            before = {c.name for c in op.control_inputs} | {i.op.name for i in op.inputs}
            assert sums[rank] in before, (rank, op.name, sums[rank])
    with tf.GradientTape() as tape:  # the reference: the mean loss of the 8 half micro-batches
        losses = []
        for k in range(2 * MB):
            h = x[k * rows // 2:(k + 1) * rows // 2]
            for w in weights:
                h = tf.tanh(h @ w)
            losses.append(tf.reduce_mean(tf.square(h)))
        loss = tf.add_n(losses) * (0.5 / MB)
    want = tape.gradient(loss, weights)
    grads, _ = step()
    for g, w in zip(grads, want):  # float32 sums of 8 micro-batches in another order
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)
