"""Memory per device for a layout: weights, gradients, optimizer states, activations.

``phalanx train`` runs the built-in GPT on one engine for every layout but parameter servers:
the Keras-model engine (the GPT of parallel Keras layers, cut into stages, placed in place,
phalanx's AdamW as a Keras optimizer, ZeRO by slices). Its memory, device by device, is
:func:`phalanx.plan.keras_memory.keras_devices` (checked against the allocator's record of
real steps, ``phalanx plan --calibrate``); :func:`memory_per_device` is its fullest device
plus the overhead line. What that model says, in short:

* **state**: float32 weights where the engine places them (tensor shards on their rank, whole
  variables on tensor rank 0, the first stage's tied embedding mirrored on the last stage), a
  copy of every weight on each data replica, float32 AdamW ``m`` and ``v`` beside the weights
  of replica 0 (the expert shards': their group's replica);
* **the step**: the activation sets the schedule keeps in flight on each rank (walked on the
  very table the executor runs; with ``interleaved`` chunk by chunk), the compute-dtype weight
  casts each set keeps under a mixed policy, one float32 running sum of the gradients once a
  backward has run (``train.grad_accum > 1``: the sum carried from one accumulation step into
  the next, held from a later step's start, and a stage call's backward forming its micro-batch's
  gradient set beside it), the backward's working set; then the update: every gradient summed beside the weights and
  phalanx's AdamW temporaries;
* **ZeRO** over the ``dp`` replicas (:mod:`phalanx.parallel.keras_zero`), every variable cut
  into ``dp`` slices of ``ceil(rows / dp)`` rows: stage 1 keeps ``m`` and ``v`` of the slices
  only; its update forms each weight's all-reduced sum whole on every slice's device. Stage 2
  keeps the same state and step, but reduce-scatters: the update ends with summed *slices*, so
  it saves over stage 1 only where the update's end is the device's peak (the step's own
  gradient sum is whole on every replica either way). Stage 3 keeps only slices between steps
  (weights too), gathers a stage's weights for the step, and each replica's running sums of a
  slice sit on the slice's device;
* **recomputation**: ``full`` keeps the inputs of ``ceil(sqrt(ops))`` recomputed pieces per
  stage and re-runs one in the backward; ``selective`` keeps no attention core;
* **expert parallelism**: ``experts/ep`` experts of each MoE block per device, the router and
  the dispatch's buffers, every replica's MoE calls on a shard's device (upper bound).

Parameter servers (``parallel.strategy=parameter_server``, :attr:`Layout.parameter_server`)
run on their own engine: a simple whole-variable figure (:func:`parameter_server_memory`).

Activations per block and the in-flight counts of a schedule are
:mod:`phalanx.plan.activations`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from phalanx.core.costs import ModelSpec, param_count
from phalanx.plan.activations import ACTIVATION_BYTES, layer_activation_bytes
from phalanx.plan.engine_rules import stage_bounds
from phalanx.plan.keras_memory import keras_devices, stage_calls_used
from phalanx.plan.layout import Layout, check_expert_parallel

# bytes per parameter the engine keeps, for every policy: (weights, gradients, optimizer states)
ENGINE_STATE_BYTES = (4, 4, 8)
DEFAULT_OVERHEAD_FRACTION = 0.05


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded device (the pipeline rank with the largest total)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    overhead: float
    rank: int = 0                 # which pipeline rank this is
    params: float = 0.0           # parameters whose weights that device holds (whole, before ZeRO-3 slicing)
    in_flight: int = 0            # peak activation sets (micro-batch x chunk) on that rank
    expert_params: float = 0.0    # of ``params``, expert weights (1/ep of each MoE block's experts)
    temporaries: float = 0.0      # the step's buffers: backward working set, optimizer temporaries

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.temporaries + self.overhead

    def to_dict(self) -> dict:
        return {"total": self.total, "weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations, "temporaries": self.temporaries,
                "overhead": self.overhead}


@lru_cache(maxsize=1024)
def stage_kinds(m: ModelSpec, pp: int, virtual_stages: int) -> tuple[tuple[int, int], ...]:
    """Per model stage: (dense blocks, MoE blocks), stages cut as the engine cuts them
    (:func:`phalanx.plan.engine_rules.stage_bounds`). Block ``i`` is MoE when ``(i+1) % moe_every == 0``."""
    out = []
    for first, end in stage_bounds(m, pp, virtual_stages):
        moe = sum(1 for i in range(first, end) if m.experts and (i + 1) % m.moe_every == 0)
        out.append((end - first - moe, moe))
    return tuple(out)


def parameter_server_memory(m: ModelSpec, lay: Layout, overhead_bytes: float = 0.0,
                            overhead_fraction: float = DEFAULT_OVERHEAD_FRACTION, fused: bool = True) -> Memory:
    """A worker of the parameter-server engine, whole variables: the weights it reads (float32),
    one gradient of each, AdamW's ``m`` and ``v`` (counted here too, an upper bound for a worker:
    they live with the variables on the parameter servers), and one micro-batch's activations
    through every block, the logits and the float32 softmax.

    >>> m = ModelSpec(layers=2, d_model=64, heads=4, vocab=256, seq_len=16)
    >>> mem = parameter_server_memory(m, Layout(dp=2, parameter_server=True), overhead_fraction=0)
    >>> mem.weights == 4 * param_count(m) and mem.optimizer == 8 * param_count(m)
    True
    """
    w_b, g_b, o_b = ENGINE_STATE_BYTES
    e = ACTIVATION_BYTES[lay.policy]
    n = param_count(m)
    n_moe = sum(1 for i in range(m.layers) if m.experts and (i + 1) % m.moe_every == 0)
    acts = (m.layers - n_moe) * layer_activation_bytes(m, lay.micro_batch, 1, lay.recompute, False, e, False, fused)
    if n_moe:
        acts += n_moe * layer_activation_bytes(m, lay.micro_batch, 1, lay.recompute, False, e, True, fused)
    acts += lay.micro_batch * m.seq_len * (e * m.d_model + (e + 4) * m.vocab)
    subtotal = (w_b + g_b + o_b) * n + acts
    return Memory(w_b * n, g_b * n, o_b * n, acts, overhead_bytes + overhead_fraction * subtotal, 0, n, 1,
                  0.0, 0.0)


@lru_cache(maxsize=4096)
def _fullest(m: ModelSpec, lay: Layout, exact: bool, fused: bool):
    """``(device index, DeviceMemory)`` of the engine's fullest device for ``lay``."""
    devices = keras_devices(m, dp=lay.dp, pp=lay.pp, tp=lay.tp, ep=lay.ep, microbatches=lay.microbatches,
                            micro_batch=lay.micro_batch, schedule=lay.schedule, policy=lay.policy,
                            optimizer="phalanx", exact=exact, distinct=True, zero=lay.zero, recompute=lay.recompute,
                            virtual_stages=lay.virtual_stages, sequence_parallel=lay.sequence_parallel,
                            accum=lay.accum, fused=fused,
                            calls=stage_calls_used(lay.microbatches, lay.accum, m.experts))
    return max(devices.items(), key=lambda kv: kv[1].total)


def memory_per_device(m: ModelSpec, lay: Layout, overhead_bytes: float = 0.0,
                      overhead_fraction: float = DEFAULT_OVERHEAD_FRACTION, exact_schedule: bool = True,
                      fused: bool = True) -> Memory:
    """Peak bytes on the most loaded device of layout ``lay`` (see the module docstring): the
    fullest device of :func:`~phalanx.plan.keras_memory.keras_devices` (phalanx's AdamW, the
    engine's step, its ZeRO slices, padded as the engine pads them; ZeRO's host copy of the
    whole optimizer state is host memory, not a device's), plus the overhead line.

    ``overhead_bytes`` (runtime context, communication buffers) plus ``overhead_fraction``
    of everything else (allocator fragmentation) make the overhead line.
    ``exact_schedule=False`` uses closed-form in-flight counts and peaks (fast, for the search).
    ``fused``: activations as fused GPU/TPU kernels keep them (Korthikanti et al.), or as
    unfused TensorFlow ops do (see :func:`~phalanx.plan.activations.layer_activation_bytes`).

    >>> m = ModelSpec(layers=2, d_model=64, heads=4, vocab=256, seq_len=16)
    >>> z0 = memory_per_device(m, Layout(dp=4, zero=0, policy="float32"), overhead_fraction=0)
    >>> z1 = memory_per_device(m, Layout(dp=4, zero=1, policy="float32"), overhead_fraction=0)
    >>> z1.optimizer < z0.optimizer / 3   # ZeRO-1: AdamW's moments of a quarter (padded)
    True
    """
    check_expert_parallel(m, lay)
    if lay.parameter_server:
        return parameter_server_memory(m, lay, overhead_bytes, overhead_fraction, fused)
    exact = exact_schedule or lay.pp * lay.microbatches * lay.virtual_stages <= 4096
    index, dev = _fullest(m, lay, exact, fused)
    rank = index // lay.tp % lay.pp
    return Memory(dev.weights, dev.gradients, dev.optimizer, dev.activations,
                  overhead_bytes + overhead_fraction * dev.total, rank, dev.params, dev.in_flight, dev.expert_params,
                  dev.temporaries)
