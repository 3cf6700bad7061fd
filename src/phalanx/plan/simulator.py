"""Replay a pipeline schedule table with per-stage costs: timeline, bubble, memory.

The simulator runs exactly the table :func:`phalanx.parallel.schedules.build_schedule`
gives the executor. Each rank executes its actions in table order; an action starts
when the rank is free and all its dependencies have finished (plus a point-to-point
transfer time when the dependency ran on another rank).

With equal stages, GPipe's (and 1F1B's) idle fraction is exactly
``(p-1)/(m+p-1)`` (Huang et al. 2019; Narayanan et al. 2021 eq. 1 as a fraction of
the step rather than of the ideal time).

Example:
    >>> from phalanx.parallel.schedules import build_schedule
    >>> tl = simulate(build_schedule("gpipe", 4, 8), fwd_cost=1.0, bwd_cost=2.0)
    >>> round(tl.bubble_fraction, 6), round(3 / 11, 6)
    (0.272727, 0.272727)
    >>> tl.makespan
    33.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from phalanx.parallel.schedules import Action, Schedule

Costs = float | Sequence[float]


@dataclass(frozen=True)
class Event:
    """One executed action: on ``rank``, from ``start`` to ``end`` (cost units or seconds)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`."""

    schedule: Schedule
    events: tuple[Event, ...]
    makespan: float
    busy: tuple[float, ...]            # busy time per rank
    peak_in_flight: tuple[int, ...]    # peak activation sets (micro-batch x chunk) held per rank

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``1 - sum(busy) / (pp * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def _per_stage(costs: Costs, n: int, what: str, share: float) -> list[float]:
    if isinstance(costs, (int, float)):
        if costs < 0:
            raise ValueError(f"{what} must be >= 0, got {costs}")
        return [float(costs) * share] * n
    values = [float(c) for c in costs]
    if len(values) != n:
        raise ValueError(f"{what} needs one cost per model stage (pp x virtual_stages = {n}), got {len(values)}")
    if any(c < 0 for c in values):
        raise ValueError(f"{what} costs must be >= 0, got {values}")
    return values


def simulate(schedule: Schedule, fwd_cost: Costs = 1.0, bwd_cost: Costs = 2.0, comm_cost: float = 0.0,
             wgrad_share: float = 0.5) -> Timeline:
    """Replay ``schedule`` with costs and return its :class:`Timeline`.

    ``fwd_cost``/``bwd_cost``: a number (the cost of one micro-batch through one
    rank's whole share of the model; each of its ``virtual_stages`` chunks costs
    ``1/virtual_stages`` of it) or a list with one cost per model stage
    (``pp * virtual_stages`` entries, stage ``chunk * pp + rank``). ``comm_cost``:
    time of one activation/gradient transfer between ranks. ``wgrad_share``: for
    schedules that split the backward, the part of ``bwd_cost`` spent in ``W``.
    """
    if not 0.0 <= wgrad_share <= 1.0:
        raise ValueError(f"wgrad_share must be in [0, 1], got {wgrad_share}")
    if comm_cost < 0:
        raise ValueError(f"comm_cost must be >= 0, got {comm_cost}")
    n = schedule.num_stages
    share = 1.0 / schedule.virtual_stages
    f = _per_stage(fwd_cost, n, "fwd_cost", share)
    b = _per_stage(bwd_cost, n, "bwd_cost", share)
    split = schedule.split_backward

    # Finish times indexed [kind][model stage][microbatch]; plain lists keep the replay
    # fast enough for thousand-device plans (tens of thousands of actions).
    pp, m = schedule.pp, schedule.microbatches
    kind_index = {"F": 0, "B": 1, "W": 2}
    finish = [[[None] * m for _ in range(n)] for _ in range(3)]
    stage_cost = [f, [x * (1.0 - wgrad_share) for x in b] if split else b, [x * wgrad_share for x in b]]
    free = [0.0] * pp
    pos = [0] * pp
    events: list[Event] = []
    total = sum(len(a) for a in schedule.per_stage)
    last = n - 1
    while len(events) < total:
        progressed = False
        for r, actions in enumerate(schedule.per_stage):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                k, mb = kind_index[a.kind], a.microbatch
                s = a.chunk * pp + r
                ready = 0.0
                if k == 0:
                    if s > 0:
                        t = finish[0][s - 1][mb]
                        if t is None:
                            break
                        ready = t + (comm_cost if (s - 1) % pp != r else 0.0)
                elif k == 1:
                    t = finish[0][s][mb]
                    if t is None:
                        break
                    ready = t
                    if s < last:
                        t = finish[1][s + 1][mb]
                        if t is None:
                            break
                        ready = max(ready, t + (comm_cost if (s + 1) % pp != r else 0.0))
                else:
                    t = finish[1][s][mb]
                    if t is None:
                        break
                    ready = t
                start = free[r] if free[r] > ready else ready
                end = start + stage_cost[k][s]
                finish[k][s][mb] = free[r] = end
                events.append(Event(r, a, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule.name!r} deadlocks in simulation")
    busy = [0.0] * schedule.pp
    for e in events:
        busy[e.rank] += e.end - e.start
    events.sort(key=lambda e: (e.start, e.rank))
    return Timeline(schedule, tuple(events), max(free), tuple(busy), tuple(_peaks(schedule, events)))


def _peaks(schedule: Schedule, events: list[Event]) -> list[int]:
    """Peak activation sets per rank in simulated time (equals the order-based count)."""
    release = "W" if schedule.split_backward else "B"
    peaks = []
    for r in range(schedule.pp):
        held = peak = 0
        for e in (e for e in events if e.rank == r):
            if e.action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif e.action.kind == release:
                held -= 1
        peaks.append(peak)
    return peaks


def render_timeline_text(timeline: Timeline, width: int = 100) -> str:
    """A time-aligned character chart: one row per rank, ``.`` for idle.

    >>> from phalanx.parallel.schedules import build_schedule
    >>> print(render_timeline_text(simulate(build_schedule("gpipe", 2, 2), 1, 1), width=8))
    rank 0 |FF..BB|
    rank 1 |.FFBB.|
    """
    if timeline.makespan <= 0:
        return ""
    # one column per unit of the shortest action, capped at ``width`` columns
    shortest = min((e.end - e.start for e in timeline.events if e.end > e.start), default=1.0)
    cols = min(width, max(1, round(timeline.makespan / shortest)))
    cols = max(cols, 1)
    scale = cols / timeline.makespan
    rows = []
    for r in range(timeline.schedule.pp):
        line = ["."] * cols
        for e in timeline.events:
            if e.rank != r:
                continue
            lo, hi = round(e.start * scale), round(e.end * scale)
            for c in range(lo, max(hi, lo + 1)):
                if c < cols:
                    line[c] = e.action.kind
        rows.append(f"rank {r} |{''.join(line)}|")
    return "\n".join(rows)
