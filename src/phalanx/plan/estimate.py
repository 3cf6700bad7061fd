"""One plan: a layout's parameters, FLOPs, memory per device and time, as one document.

Example:
    >>> from phalanx.core.costs import ModelSpec
    >>> from phalanx.plan.hardware import get_hardware
    >>> from phalanx.plan.layout import Layout
    >>> m = ModelSpec(layers=12, d_model=768, heads=12, vocab=50304, seq_len=1024)
    >>> p = estimate(m, Layout(dp=8, microbatches=4, micro_batch=4), get_hardware("a100-40gb"), tokens=1e9)
    >>> p.fits, sorted(p.to_dict()["memory_per_device_bytes"])
    (True, ['activations', 'gradients', 'optimizer', 'overhead', 'temporaries', 'total', 'weights'])
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.core.costs import ModelSpec, active_param_count, flops_per_token, param_count
from phalanx.plan.engine_rules import plan_only_reasons
from phalanx.plan.hardware import Hardware
from phalanx.plan.layout import Layout
from phalanx.plan.memory import DEFAULT_OVERHEAD_FRACTION, Memory, memory_per_device
from phalanx.plan.timing import DEFAULT_UTILIZATION, StepTime, step_time


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    layout: Layout
    hardware: Hardware
    memory: Memory
    time: StepTime
    tokens: float | None
    utilization: float

    @property
    def plan_only(self) -> list[str]:
        """Why the engine cannot run this layout (empty: it can)."""

        return plan_only_reasons(self.model, self.layout, self.hardware)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hardware.memory_bytes

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch * self.model.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.time.step_time_s

    @property
    def days(self) -> float | None:
        return None if not self.tokens else self.tokens / self.tokens_per_s / 86400

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: FLOPs without recomputation, per second, over the peak."""
        peak = self.hardware.peak_flops(self.layout.policy) * self.layout.devices
        return flops_per_token(self.model, "none") * self.tokens_per_s / peak

    def to_dict(self) -> dict:
        """The ``--json`` document (issue 4 item 8 keys, plus context)."""
        m = self.model
        return {
            "layout": self.layout.to_dict(),
            "devices": self.layout.devices,
            "hardware": self.hardware.name,
            "params": param_count(m),
            "active_params": active_param_count(m),
            "flops_per_token": flops_per_token(m, self.layout.recompute),
            "model_flops_per_token": flops_per_token(m, "none"),
            "memory_per_device_bytes": self.memory.to_dict(),
            "device_memory_bytes": self.hardware.memory_bytes,
            "fits": self.fits,
            "runs_on_engine": not self.plan_only,
            "plan_only_reasons": self.plan_only,
            "global_batch": self.layout.global_batch,
            "tokens_per_step": self.tokens_per_step,
            "step_time_s": self.time.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "days": self.days,
            "bubble_fraction": self.time.bubble_fraction,
            "mfu": self.mfu,
            "utilization_assumed": self.utilization,
            "time_breakdown": self.time.to_dict(),
        }


def estimate(m: ModelSpec, lay: Layout, hw: Hardware, tokens: float | None = None,
             utilization: float = DEFAULT_UTILIZATION, overhead_fraction: float = DEFAULT_OVERHEAD_FRACTION,
             dp_overlap: float = 0.0, exact_schedule: bool = True, fused: bool | None = None) -> Plan:
    """Memory and time of ``lay`` for model ``m`` on ``hw``.

    ``fused``: whether activations are counted as fused kernels keep them; default: the
    hardware's own (``hw.fused_kernels``; True for ``this-cpu`` too: phalanx's GPT ops are fused).
    """
    fused = hw.fused_kernels if fused is None else fused
    mem = memory_per_device(m, lay, hw.overhead_bytes, overhead_fraction, exact_schedule, fused)
    t = step_time(m, lay, hw, utilization, dp_overlap, exact_schedule)
    return Plan(m, lay, hw, mem, t, tokens, utilization)
