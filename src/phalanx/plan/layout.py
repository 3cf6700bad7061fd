"""A parallel layout as the planner sees it, and how the model is cut into stages.

Example:
    >>> lay = Layout(dp=2, tp=4, pp=2, microbatches=4, micro_batch=1)
    >>> lay.devices, lay.global_batch
    (16, 8)
    >>> stage_layers(10, pp=2, virtual_stages=2)   # equal counts (the engine balances FLOPs instead)
    [3, 3, 2, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.plan.arithmetic import RECOMPUTE_MODES
from phalanx.parallel.schedules import SCHEDULE_NAMES

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# How data-parallel gradients are summed: "one" = add_n onto one device per shard and every
# replica reads the sum back (the single-process mesh engine, MirroredStrategy with
# ReductionToOneDevice); "ring" = collective ring all-reduce (MultiWorkerMirroredStrategy, RING).
REDUCTIONS = ("one", "ring")


@dataclass(frozen=True)
class Layout:
    """Degrees and knobs of one training layout.

    ``micro_batch``: sequences per micro-batch per data-parallel replica; the global
    batch is ``dp x microbatches x micro_batch`` (``microbatches`` covers both pipeline
    micro-batches and gradient-accumulation steps). ``accum``: times the whole pipeline
    schedule runs per optimizer step (``train.grad_accum``; each run flushes the
    pipeline, so prefer more ``microbatches``). ``zero``: ZeRO stage 0-3 over the
    ``data`` axis. ``sequence_parallel``: Megatron sequence parallelism alongside ``tp``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    micro_batch: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    policy: str = "mixed_bfloat16"
    accum: int = 1
    reduction: str = "one"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "micro_batch", "virtual_stages", "accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule {self.schedule!r} is not known; choose one of {SCHEDULE_NAMES}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"precision policy must be one of {POLICIES}, got {self.policy!r}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.micro_batch * self.accum

    def describe(self) -> str:
        sched = self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        return (f"dp={self.dp} tp={self.tp}{'+sp' if self.sequence_parallel else ''} pp={self.pp} "
                f"m={self.microbatches} b={self.micro_batch}{f' accum={self.accum}' if self.accum > 1 else ''} {sched} zero={self.zero} recompute={self.recompute}")

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "microbatches": self.microbatches,
                "micro_batch": self.micro_batch, "schedule": self.schedule,
                "virtual_stages": self.virtual_stages, "zero": self.zero, "recompute": self.recompute,
                "sequence_parallel": self.sequence_parallel, "policy": self.policy,
                "grad_accum": self.accum, "reduction": self.reduction}


def stage_layers(layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Transformer blocks per model stage (``pp * virtual_stages`` stages, earlier ones take the remainder)."""
    n = pp * virtual_stages
    if layers < n:
        raise ValueError(f"{layers} layers cannot fill pp x virtual_stages = {n} pipeline stages")
    base, extra = divmod(layers, n)
    return [base + (1 if i < extra else 0) for i in range(n)]
