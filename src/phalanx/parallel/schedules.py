"""Pipeline schedules as data: the ordered forward/backward actions of every rank.

A schedule is a pure table. The pipeline executor runs it, the planner's simulator
replays it with per-stage costs, and ``phalanx schedule`` prints and draws it; all
three read the same :class:`Schedule`, so what you see is what runs.

Vocabulary: ``pp`` pipeline *ranks* (devices along the ``pipe`` axis); each rank
holds ``virtual_stages`` model *chunks*; chunk ``c`` of rank ``r`` is model stage
``c * pp + r`` (Megatron's interleaved placement), so with one chunk the model stage
is the rank. ``microbatches`` is the number of micro-batches per step.

Schedules (``build_schedule(name, ...)``):

* ``gpipe``: all forwards, then all backwards (Huang et al. 2019). Every rank holds
  the activations of all ``m`` micro-batches.
* ``1f1b``: ``pp - 1 - r`` warm-up forwards on rank ``r``, then one forward / one
  backward alternately, then the remaining backwards (PipeDream-Flush, Narayanan et
  al. 2021). Same bubble as GPipe, at most ``pp - r`` micro-batches in flight.
* ``interleaved``: Megatron's interleaved 1F1B with ``virtual_stages`` chunks per
  rank (Narayanan et al. 2021, section 2.2.2); ``microbatches % pp == 0``. The bubble
  shrinks by the factor ``virtual_stages`` at the cost of more point-to-point traffic.
* ``zb``: a zero-bubble-style schedule (after Qi et al. 2023, "Zero Bubble Pipeline
  Parallelism", ZB-H1 idea): the backward is split into ``B`` (gradient w.r.t. the
  stage input, on the critical path) and ``W`` (gradient w.r.t. the weights, which
  nothing downstream waits for), and ``W`` actions are deferred into the bubbles.
  The order is produced by a greedy list scheduler at unit costs; it holds up to
  ``2 pp`` micro-batches in flight (counted until their ``W``).

Example:
    >>> s = build_schedule("1f1b", pp=2, microbatches=3)
    >>> [str(a) for a in s.per_stage[0]]
    ['F0', 'F1', 'B0', 'F2', 'B1', 'B2']
    >>> [str(a) for a in s.per_stage[1]]
    ['F0', 'B0', 'F1', 'B1', 'F2', 'B2']
    >>> peak_in_flight(s)
    [2, 1]
    >>> validate_order(s)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb")
ACTION_KINDS = ("F", "B", "W")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work on one rank.

    ``kind``: ``F`` forward, ``B`` backward (the whole backward, or only the
    input-gradient part when the schedule also has ``W``), ``W`` weight-gradient part.
    ``microbatch``: index in ``[0, microbatches)``. ``chunk``: virtual stage index on
    this rank (model stage ``chunk * pp + rank``).

    >>> str(Action("F", 3)), str(Action("B", 3, chunk=1))
    ('F3', 'B3c1')
    """

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ValueError(f"Action.kind must be one of {ACTION_KINDS}, got {self.kind!r}")
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(f"Action microbatch and chunk must be >= 0, got {self.microbatch}, {self.chunk}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """The ordered actions of every pipeline rank: ``per_stage[rank]``."""

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    per_stage: tuple[tuple[Action, ...], ...]

    @property
    def num_stages(self) -> int:
        """Model stages (chunks) in total: ``pp * virtual_stages``."""
        return self.pp * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into ``B`` (input grad) and ``W`` (weight grad)."""
        return any(a.kind == "W" for a in self.per_stage[0])

    def model_stage(self, rank: int, action: Action) -> int:
        """The model stage (chunk index over the whole model) ``action`` runs on ``rank``."""
        return action.chunk * self.pp + rank

    def rank_of(self, model_stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding ``model_stage``."""
        return model_stage % self.pp, model_stage // self.pp


# ---------------------------------------------------------------------------
# Building


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule table ``name`` for ``pp`` ranks and ``microbatches`` micro-batches.

    Raises ``ValueError`` naming the bad argument and what would be valid.

    >>> build_schedule("gpipe", 2, 2).per_stage[1]
    (Action(kind='F', microbatch=0, chunk=0), Action(kind='F', microbatch=1, chunk=0), \
Action(kind='B', microbatch=0, chunk=0), Action(kind='B', microbatch=1, chunk=0))
    >>> build_schedule("interleaved", 2, 4, virtual_stages=2).num_stages
    4
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"schedule {name!r} is not known; choose one of: {', '.join(SCHEDULE_NAMES)}")
    for arg, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arg} must be an integer >= 1, got {value!r}")
    if virtual_stages > 1 and name != "interleaved":
        raise ValueError(f"virtual_stages={virtual_stages} needs the 'interleaved' schedule, not {name!r}")
    if name == "interleaved" and microbatches % pp != 0:
        raise ValueError(f"the interleaved schedule needs microbatches to be a multiple of pp={pp}, "
                         f"got microbatches={microbatches}")
    builder = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb": _zero_bubble}[name]
    per_stage = builder(pp, microbatches, virtual_stages)
    return Schedule(name, pp, microbatches, virtual_stages, tuple(tuple(r) for r in per_stage))


def _gpipe(pp: int, m: int, v: int) -> list[list[Action]]:
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(pp)]


def _one_f_one_b(pp: int, m: int, v: int) -> list[list[Action]]:
    ranks = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        order = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, one backward
            order += [Action("F", warmup + i), Action("B", i)]
        order += [Action("B", i) for i in range(m - warmup, m)]
        ranks.append(order)
    return ranks


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    if v == 1:  # one chunk per rank: interleaving degenerates to plain 1F1B
        return _one_f_one_b(pp, m, v)
    total = m * v

    # The k-th forward (backward) of a rank: micro-batches go in groups of pp, and
    # each group passes through chunk 0, 1, ..., v-1 (backward: v-1, ..., 0).
    def unit(kind: str, k: int) -> Action:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, group * pp + within % pp, chunk)

    ranks = []
    for r in range(pp):
        # Warm-up long enough that the first backward of the last chunk can reach this
        # rank: the round trip through the later ranks twice, plus the other chunks.
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        order = [unit("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [unit("F", warmup + k), unit("B", k)]
        order += [unit("B", k) for k in range(total - warmup, total)]
        ranks.append(order)
    return ranks


def _zero_bubble(pp: int, m: int, v: int) -> list[list[Action]]:
    """Greedy list scheduling at unit costs (F = B = W = 1).

    A free rank runs, by priority: a ready ``B`` (it is on the critical path); a
    ready ``F`` if fewer than ``pp - r`` micro-batches await their ``B`` (1F1B's
    bound) and at most ``pp`` weight gradients are deferred; otherwise a deferred
    ``W``. At unit costs this reaches the ZB-H1 bubble ``(p-1)/(3m+p-1)`` (Qi et al.
    2023) with up to ``2 pp`` activation sets not yet released by their ``W`` (those
    awaiting only ``W`` hold just the inputs of the weight matmuls).
    """
    never = 1 << 60
    f_done = [[never] * m for _ in range(pp)]  # finish time of F / B per (rank, micro-batch)
    b_done = [[never] * m for _ in range(pp)]
    next_f, next_b, next_w = [0] * pp, [0] * pp, [0] * pp
    order: list[list[Action]] = [[] for _ in range(pp)]
    t = 0
    while any(w < m for w in next_w):
        chosen: list[tuple[int, str]] = []
        for r in range(pp):
            i, j = next_f[r], next_b[r]
            pending_w = j - next_w[r]
            b_ready = j < i and f_done[r][j] <= t and (r == pp - 1 or b_done[r + 1][j] <= t)
            f_ready = i < m and (r == 0 or f_done[r - 1][i] <= t)
            if b_ready:
                chosen.append((r, "B"))
            elif f_ready and i - j < pp - r and pending_w <= pp:
                chosen.append((r, "F"))
            elif pending_w > 0:
                chosen.append((r, "W"))
        for r, kind in chosen:  # commit after all ranks chose, so that time steps are simultaneous
            if kind == "F":
                order[r].append(Action("F", next_f[r]))
                f_done[r][next_f[r]] = t + 1
                next_f[r] += 1
            elif kind == "B":
                order[r].append(Action("B", next_b[r]))
                b_done[r][next_b[r]] = t + 1
                next_b[r] += 1
            else:
                order[r].append(Action("W", next_w[r]))
                next_w[r] += 1
        t += 1
        if t > 10 * (m + pp) * 3:  # cannot happen for a correct scheduler; fail loudly rather than spin
            raise RuntimeError(f"zb scheduler did not finish for pp={pp}, microbatches={m}")
    return order


# ---------------------------------------------------------------------------
# Dependencies and validity


def _deps(pp: int, v: int, rank: int, action: Action) -> list[tuple[int, Action]]:
    stage = action.chunk * pp + rank
    last = pp * v - 1
    mb = action.microbatch

    def at(kind: str, s: int) -> tuple[int, Action]:
        return s % pp, Action(kind, mb, s // pp)

    if action.kind == "F":
        return [at("F", stage - 1)] if stage > 0 else []
    if action.kind == "B":
        deps = [at("F", stage)]
        if stage < last:
            deps.append(at("B", stage + 1))
        return deps
    return [at("B", stage)]  # W: the weight gradient needs this stage's output gradient


def dependencies(schedule: Schedule, rank: int, action: Action) -> tuple[tuple[int, Action], ...]:
    """The ``(rank, action)`` pairs that must finish before ``action`` can run on ``rank``.

    F of stage s needs F of stage s-1; B of stage s needs F of stage s and B of stage
    s+1 (the last stage's B starts from the loss); W needs B of the same stage.

    >>> s = build_schedule("1f1b", 4, 4)
    >>> dependencies(s, 1, Action("B", 2))
    ((1, Action(kind='F', microbatch=2, chunk=0)), (2, Action(kind='B', microbatch=2, chunk=0)))
    """
    return tuple(_deps(schedule.pp, schedule.virtual_stages, rank, action))


def validate_order(schedule: Schedule) -> None:
    """Raise ``ValueError`` unless the table is complete and runs without deadlock.

    Complete: every rank runs F (and B, and W when split) of every micro-batch and
    chunk exactly once. Deadlock-free: executing each rank's list in order, some rank
    can always proceed because its next action's dependencies have already run.
    """
    pp, m, v = schedule.pp, schedule.microbatches, schedule.virtual_stages
    if len(schedule.per_stage) != pp:
        raise ValueError(f"schedule {schedule.name!r} has {len(schedule.per_stage)} rank lists, expected pp={pp}")
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    expected = sorted(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))
    for r, actions in enumerate(schedule.per_stage):
        if sorted(actions) != expected:
            missing = sorted(set(expected) - set(actions))[:5]
            extra = [a for a in actions if a not in set(expected)][:5]
            dup = len(actions) - len(set(actions))
            raise ValueError(f"rank {r} of schedule {schedule.name!r} is incomplete: missing "
                             f"{[str(a) for a in missing]}, unexpected {[str(a) for a in extra]}, {dup} duplicates")
    _execution_order(schedule)


def _execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """A global order consistent with every rank's list and all dependencies."""
    pos = [0] * schedule.pp
    finished: set[tuple[int, Action]] = set()
    out: list[tuple[int, Action]] = []
    total = sum(len(a) for a in schedule.per_stage)
    while len(out) < total:
        progressed = False
        for r, actions in enumerate(schedule.per_stage):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if not all(d in finished for d in dependencies(schedule, r, a)):
                    break
                finished.add((r, a))
                out.append((r, a))
                pos[r] += 1
                progressed = True
        if not progressed:
            waiting = {r: str(schedule.per_stage[r][pos[r]]) for r in range(schedule.pp)
                       if pos[r] < len(schedule.per_stage[r])}
            raise ValueError(f"schedule {schedule.name!r} deadlocks: every rank waits; next actions {waiting}")
    return out


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, chunk) activation sets held at once.

    A set is held from its ``F`` until its last backward part (``W`` when the
    backward is split, since the weight gradient still reads the stored inputs).

    >>> peak_in_flight(build_schedule("gpipe", 4, 8))
    [8, 8, 8, 8]
    >>> peak_in_flight(build_schedule("1f1b", 4, 8))
    [4, 3, 2, 1]
    """
    release = "W" if schedule.split_backward else "B"
    peaks = []
    for actions in schedule.per_stage:
        held = peak = 0
        for a in actions:
            if a.kind == "F":
                held += 1
                peak = max(peak, held)
            elif a.kind == release:
                held -= 1
        peaks.append(peak)
    return peaks


def bubble_formula(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a flush pipeline with equal stages: ``(p-1) / (v*m + p-1)``.

    Narayanan et al. 2021 give the bubble *relative to ideal* as ``(p-1)/(v*m)``;
    as a fraction of the step it is the expression here (``v = 1``: GPipe / 1F1B).

    >>> bubble_formula(4, 8)
    0.2727272727272727
    """
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


# ---------------------------------------------------------------------------
# Display


def render_text(schedule: Schedule) -> str:
    """The order table: one row per rank, one column per step of that rank.

    >>> print(render_text(build_schedule("gpipe", 2, 2)))
    gpipe  pp=2  microbatches=2
    rank 0 | F0 F1 B0 B1
    rank 1 | F0 F1 B0 B1
    """
    cells = [[str(a) for a in actions] for actions in schedule.per_stage]
    width = max((len(c) for row in cells for c in row), default=2)
    head = f"{schedule.name}  pp={schedule.pp}  microbatches={schedule.microbatches}"
    if schedule.virtual_stages > 1:
        head += f"  virtual_stages={schedule.virtual_stages}"
    lines = [head]
    for r, row in enumerate(cells):
        lines.append(f"rank {r:<{len(str(schedule.pp - 1))}} | " + " ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)


def iter_actions(schedule: Schedule) -> Iterable[tuple[int, Action]]:
    """A global dependency-respecting order of ``(rank, action)``: handy for a serial executor."""
    return iter(_execution_order(schedule))


def calls_used(microbatches: int, grad_accum: int) -> bool:
    """Whether the Keras-model engine runs its stages as stage calls
    (:mod:`phalanx.parallel.stage_calls`): when a replica runs a stage more than once (a call
    is per replica: replicas reuse nothing), except where a stage reads expert shards.

    >>> calls_used(1, 1), calls_used(2, 1), calls_used(1, 2)
    (False, True, True)
    """
    return microbatches * grad_accum > 1
