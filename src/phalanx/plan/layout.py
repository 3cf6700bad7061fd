"""A parallel layout as the planner sees it, and how the model is cut into stages.

Example:
    >>> lay = Layout(dp=2, tp=4, pp=2, microbatches=4, micro_batch=1)
    >>> lay.devices, lay.global_batch
    (16, 8)
    >>> stage_layers(10, pp=2, virtual_stages=2)   # equal counts (the engine balances FLOPs instead)
    [3, 3, 2, 2]
    >>> Layout(dp=4, ep=2).describe()
    'dp=4 ep=2 tp=1 pp=1 m=1 b=1 1f1b zero=0 recompute=none'
    >>> expert_parallel_error(8, ep=3, dp=6)
    '3 does not divide model.experts=8: each replica of an ep group holds experts/ep experts; pick ep from [1, 2]'
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.config import ConfigError
from phalanx.core.costs import RECOMPUTE_MODES
from phalanx.parallel.schedules import SCHEDULE_NAMES

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# How data-parallel gradients are summed: "one" = add_n onto one device per weight and every
# replica reads the sum back (the engine in one process); "ring" = collective ring all-reduce
# (across workers, parallel.strategy=multi_worker).
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
    ep: int = 1
    parameter_server: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatches", "micro_batch", "virtual_stages", "accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ep < 1 or self.dp % self.ep:
            raise ConfigError("parallel.ep", _ep_dp_error(self.ep, self.dp))
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
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"dp={self.dp}{ep} tp={self.tp}{'+sp' if self.sequence_parallel else ''} pp={self.pp} "
                f"m={self.microbatches} b={self.micro_batch}{f' accum={self.accum}' if self.accum > 1 else ''} {sched} zero={self.zero} recompute={self.recompute}"
                f"{' parameter_server' if self.parameter_server else ''}")

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "microbatches": self.microbatches,
                "micro_batch": self.micro_batch, "schedule": self.schedule,
                "virtual_stages": self.virtual_stages, "zero": self.zero, "recompute": self.recompute,
                "sequence_parallel": self.sequence_parallel, "policy": self.policy,
                "grad_accum": self.accum, "reduction": self.reduction, "ep": self.ep,
                "parameter_server": self.parameter_server, "config": self.config_overrides()}

    def config_overrides(self) -> list[str]:
        """The config keys that run this layout (overrides for ``phalanx train``, ``phalanx.init``),
        besides ``parallel.devices`` and the model's keys. Without a pipeline the micro-batches
        are accumulation steps: ``train.grad_accum`` (the config takes ``parallel.microbatches``
        with ``parallel.pp > 1`` only).

        Example:
            >>> Layout(dp=2, micro_batch=4, accum=2, zero=1).config_overrides()
            ['parallel.dp=2', 'parallel.tp=1', 'parallel.pp=1', 'train.grad_accum=2', 'train.global_batch=16', \
'parallel.zero=1', 'precision.policy=mixed_bfloat16']
        """
        keys = [f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}"]
        accum = self.accum
        if self.pp > 1:
            keys += [f"parallel.microbatches={self.microbatches}", f"parallel.schedule={self.schedule}"]
            if self.virtual_stages > 1:
                keys.append(f"parallel.virtual_stages={self.virtual_stages}")
        else:
            accum *= self.microbatches
        if accum > 1:
            keys.append(f"train.grad_accum={accum}")
        keys.append(f"train.global_batch={self.global_batch}")
        keys += [f"parallel.{name}={value}" for name, value, default in
                 (("ep", self.ep, 1), ("zero", self.zero, 0), ("recompute", self.recompute, "none"))
                 if value != default]
        if self.sequence_parallel:
            keys.append("parallel.sequence_parallel=true")
        if self.parameter_server or self.reduction == "ring":
            keys.append(f"parallel.strategy={'parameter_server' if self.parameter_server else 'multi_worker'}")
        return keys + [f"precision.policy={self.policy}"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ep_dp_error(ep: int, dp: int) -> str:
    if ep < 1:
        return f"must be >= 1, got {ep}"
    return (f"{ep} does not divide parallel.dp={dp}: experts are sharded over groups of ep data replicas; "
            f"pick ep from {_divisors(dp)}")


def expert_parallel_error(experts: int, ep: int, dp: int) -> str | None:
    """Why ``parallel.ep=ep`` is impossible for a model with ``experts`` experts per MoE block
    on ``dp`` data replicas (None: it is possible). ep divides dp and the expert count; a
    dense model (``experts == 0``) has nothing to shard and takes ep=1 only."""
    if ep == 1:
        return None
    if ep < 1 or dp % ep:
        return _ep_dp_error(ep, dp)
    if not experts:
        return f"{ep} needs a mixture-of-experts model (model.experts >= 2); a dense model takes ep=1"
    if experts % ep:
        return (f"{ep} does not divide model.experts={experts}: each replica of an ep group holds experts/ep "
                f"experts; pick ep from {[d for d in _divisors(dp) if experts % d == 0]}")
    return None


def check_expert_parallel(m, lay: Layout) -> None:
    """Raise :class:`~phalanx.config.ConfigError` (key ``parallel.ep``) when ``lay.ep`` is
    impossible for model ``m`` (see :func:`expert_parallel_error`)."""
    err = expert_parallel_error(m.experts, lay.ep, lay.dp)
    if err:
        raise ConfigError("parallel.ep", err)


def stage_layers(layers: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Transformer blocks per model stage (``pp * virtual_stages`` stages, earlier ones take the remainder)."""
    n = pp * virtual_stages
    if layers < n:
        raise ValueError(f"{layers} layers cannot fill pp x virtual_stages = {n} pipeline stages")
    base, extra = divmod(layers, n)
    return [base + (1 if i < extra else 0) for i in range(n)]
