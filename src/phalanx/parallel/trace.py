"""What the TensorFlow executor ran of a pipeline step, read from a profiler trace.

:func:`profile_actions` groups the executed ops of a ``tf.profiler.experimental`` trace
by the pipeline action whose name scope they carry (the scopes
:func:`phalanx.parallel.pipeline.run_schedule` opens, ``<prefix>_r<rank>_<action>``);
:func:`executed_order` and :func:`measured_bubble` say in which order each rank finished
its actions and how long it sat idle. Tests and ``benchmarks/bench_parallel.py`` compare
them with the schedule table.

Example:
    >>> a = [ExecutedAction("p_r0_F0", 0, "F0", 0, 10, [(0, 10)]), ExecutedAction("p_r1_F0", 1, "F0", 10, 20, [(10, 20)])]
    >>> executed_order(a, 2), measured_bubble(a, 2)
    ([['F0'], ['F0']], 0.5)
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

from tensorflow.tsl.profiler.protobuf import xplane_pb2


_ACTION_RE = re.compile(r"((?:[A-Za-z0-9]+_)*?r(\d+)_([FBW]\d+(?:c\d+)?))(?:_\d+)?/")
_GRAD_PREFIX = "gradient_tape/"


@dataclass
class ExecutedAction:
    """One action as executed: its scope, rank, name and op time span (picoseconds)."""

    scope: str
    rank: int
    action: str
    start: int
    end: int
    intervals: list[tuple[int, int]]


def profile_actions(logdir: str, prefix: str = "dp0_acc0") -> list[ExecutedAction]:
    """Read the newest ``*.xplane.pb`` under ``logdir`` (written by ``tf.profiler.experimental``)
    and group the executed ops by the pipeline action whose scope they carry.

    Only scopes starting with ``prefix`` (replica 0, first accumulation step) are kept.
    """
    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb profile under {logdir!r}; run the step under "
                                f"tf.profiler.experimental.start/stop first")
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as fh:
        space.ParseFromString(fh.read())
    spans: dict[str, ExecutedAction] = {}
    for plane in space.planes:
        meta = plane.event_metadata
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = meta[event.metadata_id].name
                # "<op name>:<op type>". Transfers (_Send/_Recv) are named after the producer
                # but run on the consumer's side and start early to wait: not compute.
                if name.rpartition(":")[2].startswith("_"):
                    continue
                # Gradient ops carry their forward op's scope: they are the backward's work.
                backward = name.startswith(_GRAD_PREFIX)
                if backward:
                    name = name[len(_GRAD_PREFIX):]
                if not name.startswith(prefix):
                    continue
                match = _ACTION_RE.match(name)
                if match is None:
                    continue
                scope, action = match.group(1), match.group(3)
                if backward and action.startswith("F"):
                    action = "B" + action[1:]
                    scope = scope[: match.start(3)] + action
                start = base + event.offset_ps
                end = start + event.duration_ps
                item = spans.get(scope)
                if item is None:
                    spans[scope] = ExecutedAction(scope, int(match.group(2)), action, start, end,
                                                  [(start, end)])
                else:
                    item.start, item.end = min(item.start, start), max(item.end, end)
                    item.intervals.append((start, end))
    return sorted(spans.values(), key=lambda a: a.start)


def executed_order(actions: list[ExecutedAction], pp: int) -> list[list[str]]:
    """Per rank, action names in the order they completed (their last op ended).

    Completion, not first start: Grappler rewrites a few cheap gradient ops (e.g. parts
    of the GELU derivative that only read forward values) so that they may start as soon
    as the forward is done, ahead of the control dependency; the work that produces an
    action's outputs still follows the table.
    """
    order: list[list[str]] = [[] for _ in range(pp)]
    for a in sorted(actions, key=lambda a: a.end):
        order[a.rank].append(a.action)
    return order


def measured_bubble(actions: list[ExecutedAction], pp: int) -> float:
    """Mean over ranks of the fraction of the step's pipeline span in which the rank ran
    no op of any action (the union of its ops' execution intervals is its busy time)."""
    if not actions:
        return 0.0
    t0, t1 = min(a.start for a in actions), max(a.end for a in actions)
    idle = []
    for r in range(pp):
        intervals = sorted(i for a in actions if a.rank == r for i in a.intervals)
        busy, cur_s, cur_e = 0, None, None
        for s, e in intervals:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        idle.append(1.0 - busy / max(t1 - t0, 1))
    return sum(idle) / pp
