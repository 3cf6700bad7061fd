"""Search (dp, tp, pp, micro-batches, ZeRO, recomputation, schedule, and ep for a mixture of
experts) for the fastest layout that fits.

Two passes: every candidate is first scored with closed-form in-flight counts and
bubble (microseconds each); the best ones are then re-estimated exactly, replaying the
schedule tables in the simulator, and any that no longer fit are rejected. So a
returned candidate always fits by the exact count and always divides.

Rejections are counted by reason: tp not dividing heads/ffn/vocab (the engine's rule),
tp crossing a node, global batch not divisible, pipeline deeper than the model, a fixed
ep that does not divide dp and the expert count, not fitting (by how much).

Expert parallelism: for a mixture-of-experts model every ``ep`` that divides both ``dp``
and ``model.experts`` is tried (:func:`ep_choices`); a dense model takes ep=1.

Only layouts the engine runs are ranked as candidates. Layouts the planner can model
but the engine cannot run (the ``zb`` schedule, ZeRO-3 across nodes or with ep, sequence
parallelism for the MoE GPT, experts across nodes; see
:func:`phalanx.plan.engine_rules.plan_only_reasons`) are searched too and returned in
``plan_only``, each with its reasons; they are never the best candidate.

Example:
    >>> from phalanx.core.costs import ModelSpec
    >>> from phalanx.plan.hardware import get_hardware
    >>> m = ModelSpec(layers=24, d_model=2048, heads=16, vocab=51200, seq_len=2048)
    >>> res = search(m, get_hardware("a100-40gb"), devices=16, global_batch=64, top=3)
    >>> len(res.candidates), all(p.fits for p in res.candidates)
    (3, True)
    >>> all(c.layout.zero < 3 and c.layout.schedule != "zb" for c in res.candidates)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.core.costs import ModelSpec
from phalanx.plan.engine_rules import divisibility_reason, plan_only_reasons
from phalanx.plan.estimate import Plan, estimate
from phalanx.plan.hardware import GiB, Hardware
from phalanx.plan.layout import Layout, expert_parallel_error
from phalanx.plan.memory import DEFAULT_OVERHEAD_FRACTION
from phalanx.plan.timing import DEFAULT_UTILIZATION

MICRO_BATCH_CHOICES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class Rejections:
    """Why candidates were dropped: reason -> count, plus one example each."""

    counts: dict = field(default_factory=dict)
    examples: dict = field(default_factory=dict)
    closest_misfit: tuple | None = None   # (overshoot ratio, layout description, needed, available)

    def add(self, reason: str, example: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, example)

    def misfit(self, plan: Plan) -> None:
        ratio = plan.memory.total / plan.hardware.memory_bytes
        self.add("does not fit in device memory", plan.layout.describe())
        if self.closest_misfit is None or ratio < self.closest_misfit[0]:
            self.closest_misfit = (ratio, plan.layout.describe(), plan.memory.total, plan.hardware.memory_bytes)

    def lines(self) -> list[str]:
        out = []
        for reason, n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            out.append(f"{n:>8} rejected: {reason} (e.g. {self.examples[reason]})")
        if self.closest_misfit:
            ratio, desc, need, have = self.closest_misfit
            out.append(f"closest misfit: {desc} needs {need / GiB:.1f} GiB of {have / GiB:.1f} GiB "
                       f"(+{(ratio - 1) * 100:.1f}%)")
        return out

    def to_dict(self) -> dict:
        d = {"counts": dict(self.counts), "examples": dict(self.examples)}
        if self.closest_misfit:
            ratio, desc, need, have = self.closest_misfit
            d["closest_misfit"] = {"layout": desc, "needed_bytes": need, "available_bytes": have}
        return d


@dataclass
class SearchResult:
    candidates: list[Plan]          # runnable by the engine, fastest first
    rejections: Rejections
    considered: int
    plan_only: list[Plan] = field(default_factory=list)   # modelled, not runnable: never "best"

    def plan_only_reasons(self, plan: Plan) -> list[str]:
        return plan_only_reasons(plan.model, plan.layout, plan.hardware)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_choices(m: ModelSpec, dp: int) -> list[int]:
    """Expert-parallel degrees to try on ``dp`` replicas: divisors of both ``dp`` and the
    expert count (``[1]`` for a dense model).

    >>> ep_choices(ModelSpec(layers=2, d_model=8, heads=2, experts=8), 12)
    [1, 2, 4]
    """
    if not m.experts:
        return [1]
    return [e for e in _divisors(dp) if m.experts % e == 0]


def search(m: ModelSpec, hw: Hardware, devices: int, global_batch: int, *, policy: str = "mixed_bfloat16",
           top: int = 5, tokens: float | None = None, utilization: float = DEFAULT_UTILIZATION,
           overhead_fraction: float = DEFAULT_OVERHEAD_FRACTION, dp_overlap: float = 0.0,
           schedules: tuple[str, ...] = ("1f1b", "interleaved", "zb", "gpipe"), zero_stages: tuple[int, ...] = (0, 1, 2, 3),
           recompute_modes: tuple[str, ...] = ("none", "selective", "full"), sequence_parallel: bool = False,
           virtual_stages: tuple[int, ...] = (2,), fixed: dict | None = None, reduction: str = "one",
           fused: bool | None = None) -> SearchResult:
    """The ``top`` fastest fitting layouts of ``devices`` devices for ``global_batch`` sequences per step.

    ``fixed``: degrees the user set (``{"dp": 2, "tp": 1, "pp": 2, "microbatches": 4, "ep": 2}``,
    any subset); only layouts with those values are searched. ``reduction``: how the engine
    sums gradients (``one`` in one process, ``ring`` across workers with multi_worker).
    """
    if devices < 1 or global_batch < 1 or top < 1:
        raise ValueError(f"devices, global_batch and top must be >= 1, got {devices}, {global_batch}, {top}")
    fixed = dict(fixed or {})
    rej = Rejections()
    scored: list[tuple[float, Plan]] = []
    considered = 0
    for tp in _divisors(devices):
        if fixed.get("tp", tp) != tp:
            continue
        reason = divisibility_reason(m, tp)
        if reason:
            rej.add("tp does not divide model.heads, model.ffn and model.vocab", reason)
            continue
        if tp > hw.devices_per_node:
            rej.add("tp crosses a node", f"tp={tp} > {hw.devices_per_node} devices per node")
            continue
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            if fixed.get("pp", pp) != pp or fixed.get("dp", dp) != dp:
                continue
            if pp > m.layers:
                rej.add("more pipeline stages than layers", f"pp={pp} > {m.layers} layers")
                continue
            if global_batch % dp:
                rej.add("global batch not divisible by dp", f"{global_batch} sequences over dp={dp}")
                continue
            per_replica = global_batch // dp
            eps = ep_choices(m, dp)
            if "ep" in fixed:
                if fixed["ep"] not in eps:
                    rej.add("parallel.ep does not divide dp and model.experts",
                            f"parallel.ep={expert_parallel_error(m.experts, fixed['ep'], dp)}")
                    continue
                eps = [fixed["ep"]]
            for ep in eps:
                for b in MICRO_BATCH_CHOICES:
                    if per_replica % b:
                        continue
                    mb = per_replica // b
                    # without a pipeline the micro-batches are accumulation steps (train.grad_accum)
                    micro, accum = (mb, 1) if pp > 1 else (1, mb)
                    if fixed.get("microbatches", micro) != micro:
                        continue
                    for sched, v in _schedule_options(schedules, virtual_stages, pp, mb, m.layers, rej):
                        for recompute in recompute_modes:
                            for zero in zero_stages:
                                if zero and dp == 1:
                                    continue  # nothing to shard
                                considered += 1
                                lay = Layout(dp, tp, pp, micro, b, sched, v, zero, recompute,
                                             sequence_parallel and tp > 1, policy, accum=accum,
                                             reduction=reduction, ep=ep)
                                plan = estimate(m, lay, hw, tokens, utilization, overhead_fraction, dp_overlap,
                                                exact_schedule=False, fused=fused)
                                if not plan.fits:
                                    rej.misfit(plan)
                                    continue
                                scored.append((plan.tokens_per_s, plan))
                                break  # higher ZeRO stages cost as much or more time: the lowest that fits wins
    scored.sort(key=lambda sp: -sp[0])
    final: list[Plan] = []
    plan_only: list[Plan] = []
    for _, rough in scored:
        bucket = plan_only if plan_only_reasons(m, rough.layout, hw) else final
        if len(bucket) >= top:
            if len(final) >= top and len(plan_only) >= top:
                break
            continue
        plan = estimate(m, rough.layout, hw, tokens, utilization, overhead_fraction, dp_overlap,
                        exact_schedule=True, fused=fused)
        if plan.fits:
            bucket.append(plan)
        else:
            rej.misfit(plan)
    # the exact pass may reorder neighbours; re-rank what was kept
    final.sort(key=lambda p: -p.tokens_per_s)
    plan_only.sort(key=lambda p: -p.tokens_per_s)
    return SearchResult(final, rej, considered, plan_only)


def _schedule_options(schedules, virtual_stages, pp, mb, layers, rej):
    if pp == 1:
        yield "1f1b", 1  # without a pipeline every schedule is plain accumulation
        return
    for sched in schedules:
        if sched == "interleaved":
            for v in virtual_stages:
                if mb % pp:
                    rej.add("interleaved needs micro-batches divisible by pp", f"m={mb}, pp={pp}")
                elif layers < pp * v:
                    rej.add("more pipeline chunks than layers", f"pp x v = {pp * v} > {layers}")
                else:
                    yield sched, v
        elif sched == "zb" and pp * mb > 4096:
            rej.add("zb table too large to replay in the search", f"pp={pp}, m={mb}")
        else:
            yield sched, 1
