"""Memory per device for a layout: weights, gradients, optimizer states, activations.

Model states, as phalanx's engines keep them (read from ``parallel/zero.py``,
``parallel/params.py``, ``parallel/pipeline.py``): float32 master weights (4 bytes per
parameter, whatever the precision policy: bfloat16/float16 compute copies are cast per
use), float32 gradients (4 per set; the pipeline executor casts every gradient to float32)
and float32 AdamW ``m`` and ``v`` (8): the 16 bytes per parameter of Rajbhandari et al.
2020 ("ZeRO", section 3.1: 2 + 2 + 12 for mixed-precision Adam) split differently.

The step, as the engine runs it, is :mod:`phalanx.plan.engine_memory`'s (one definition;
:func:`memory_per_device` takes its constants and its walk of the schedule, and a test
holds the two equal on the engine's layouts): one float32 gradient set (the running sum
each backward adds its micro-batch's gradients into) once a backward has run, compute-dtype
weight casts per activation set in flight, the backward's working set, and the optimizer
step's flat buffers (under ZeRO, of the replica's piece), whichever phase is larger. What only the planner models (ZeRO-3, experts split
by ``ep``, sequence parallelism, unfused activations, the overhead line) is added on top.
ZeRO over the ``dp`` replicas, as the engine does it:

* stage 1 keeps ``m`` and ``v`` of ``1/dp`` of every flat parameter group (padded), and
  reads, updates and gathers only its piece of the flat parameters;
* stage 2 reduce-scatters the gradient *sum*, but each replica still builds its whole
  local float32 gradient (the running sums, cut straight into the pieces), so its
  gradient memory is not divided by ``dp``: as stage 1;
* stage 3 (weights sliced too) runs on the Keras-model engine, and is planned with its memory
  model (:func:`phalanx.plan.engine_rules.runs_on_keras_engine`,
  :func:`phalanx.plan.keras_memory.keras_devices`: slices of ``1/dp`` between steps, a stage's
  gathered weights through the step, every replica's gradient sums on the slices' devices);
  the layouts it does not plan there (interleaved, zb, sequence parallelism, with ep: plan
  only) keep the paper's ``16/dp`` bytes per parameter below.

With ``pp > 1`` and tied embeddings the last stage holds a second copy of the token
embedding (weights and gradient; its AdamW states live with the first copy).

Expert parallelism (``parallel.ep``, :class:`~phalanx.plan.layout.Layout` ``ep``): each
replica of an ep group holds ``experts/ep`` experts of every MoE block; the attention,
router, LayerNorms and embeddings stay whole (data parallel). Activations do not change with
``ep`` under balanced routing: a device runs its experts on ``top_k`` x its own token count,
received from the group. ``phalanx train`` runs those layouts (with dp, tp and pp) on the
Keras-model engine (:class:`~phalanx.engines.keras_gpt.KerasGPTEngine`), and their memory is
that engine's (:func:`runs_on_keras_engine`, :func:`phalanx.plan.keras_memory.keras_devices`,
checked against measurements): AdamW's moments next to each weight (replica 0 for the dense
weights, the ep group's replicas for their expert shards), every other replica's copy of the
weights, experts whole on tensor rank 0, the router's and the dispatch's buffers. ZeRO with ep
(ZeRO-1 runs; its partition by whole variables is not modelled yet) and the layouts the engine
does not run with ep (recomputation; plan only) keep the mesh engine's terms below: the
experts' states divided by ``ep``, ZeRO sharding the dense states over the ``dp`` replicas and
the expert states over the ``dp/ep`` replicas that hold the same experts.

Activations per block and the in-flight counts of a schedule are
:mod:`phalanx.plan.activations`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from phalanx.parallel.schedules import build_schedule
from phalanx.core.costs import ModelSpec
from phalanx.plan.activations import ACTIVATION_BYTES, in_flight_estimate, layer_activation_bytes, schedule_in_flight
from phalanx.plan.engine_memory import (BACKWARD_SETS, OPT_BUFFERS, ZERO_GRAD_SETS, ZERO_PIECE_SETS,
                                       rank_peak_parts, step_peak_estimate)
from phalanx.plan.keras_memory import keras_devices
from phalanx.plan.engine_rules import runs_on_keras_engine, stage_bounds
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
    params: float = 0.0           # parameters held on that device (before ZeRO-3 sharding)
    in_flight: int = 0            # peak activation sets (micro-batch x chunk) on that rank
    expert_params: float = 0.0    # of ``params``, expert weights (1/ep of each MoE block's experts)
    temporaries: float = 0.0      # the step's buffers: weight casts, working sets, optimizer's flat buffers

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.temporaries + self.overhead

    def to_dict(self) -> dict:
        return {"total": self.total, "weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "activations": self.activations, "temporaries": self.temporaries,
                "overhead": self.overhead}


def _layer_param_split(m: ModelSpec, tp: int, ep: int, moe: bool) -> tuple[float, float]:
    """(dense params, expert params) of one block on one device."""
    d, f = m.d_model, m.ffn_dim
    attn = (4 * d * d + 3 * d) / tp + d           # column/row-parallel kernels; out-bias replicated
    norms = 4 * d
    if not moe:
        return attn + (2 * d * f + f) / tp + d + norms, 0.0
    experts = m.experts / ep * ((2 * d * f + f) / tp + d)
    return attn + norms + d * m.experts, experts


@lru_cache(maxsize=1024)
def stage_kinds(m: ModelSpec, pp: int, virtual_stages: int) -> tuple[tuple[int, int], ...]:
    """Per model stage: (dense blocks, MoE blocks), stages cut as the engine cuts them
    (:func:`phalanx.plan.engine_rules.stage_bounds`). Block ``i`` is MoE when ``(i+1) % moe_every == 0``."""
    out = []
    for first, end in stage_bounds(m, pp, virtual_stages):
        moe = sum(1 for i in range(first, end) if m.experts and (i + 1) % m.moe_every == 0)
        out.append((end - first - moe, moe))
    return tuple(out)


@lru_cache(maxsize=256)
def _walk_schedule(name: str, pp: int, microbatches: int, virtual_stages: int):
    """The schedule table whose actions :func:`~phalanx.plan.engine_memory.rank_peak_parts`
    walks. With a split backward (``zb``, plan only) a micro-batch's activations and its
    weight gradient are released at ``W``, so only ``F`` and ``W`` actions are kept."""
    sched = build_schedule(name, pp, microbatches, virtual_stages)
    if not sched.split_backward:
        return sched
    return SimpleNamespace(per_stage=tuple(tuple(a for a in acts if a.kind != "B") for acts in sched.per_stage))


def runs_on_mesh_engine(lay: Layout) -> bool:
    """Whether ``phalanx train`` runs ``lay`` on the mesh engine (flat optimizer buffers,
    micro-batch schedule) rather than tf.distribute (data parallel only: Keras updates each
    variable), as :func:`~phalanx.plan.engine_memory.engine_memory_per_device` decides with
    ``parallel.strategy=auto``."""
    return lay.tp > 1 or lay.pp > 1 or lay.zero > 0 or lay.recompute != "none"


def _keras_engine_memory(m: ModelSpec, lay: Layout, overhead_bytes: float, overhead_fraction: float,
                         exact: bool) -> Memory:
    """The fullest device of :func:`~phalanx.plan.keras_memory.keras_devices` (phalanx's AdamW,
    the engine's own step, its ZeRO slices; ``train.grad_accum`` adds nothing: the running sums
    carry over the accumulation steps). Slices padded as the engine pads them; ZeRO's host copy
    (the user's optimizer's whole slots, and under ZeRO-3 the weights) is host memory, not the
    device's."""
    devices = keras_devices(m, dp=lay.dp, pp=lay.pp, tp=lay.tp, ep=lay.ep, microbatches=lay.microbatches,
                            micro_batch=lay.micro_batch, schedule=lay.schedule, policy=lay.policy,
                            optimizer="phalanx", exact=exact, distinct=True, zero=lay.zero, recompute=lay.recompute)
    index, dev = max(devices.items(), key=lambda kv: kv[1].total)
    rank = index // lay.tp % lay.pp
    peaks = (schedule_in_flight if exact else in_flight_estimate)(lay.schedule if lay.pp > 1 else "1f1b", lay.pp,
                                                                  lay.microbatches, 1)[0]
    return Memory(dev.weights, dev.gradients, dev.optimizer, dev.activations,
                  overhead_bytes + overhead_fraction * dev.total, rank, dev.params, peaks[rank], dev.expert_params,
                  dev.temporaries)


def memory_per_device(m: ModelSpec, lay: Layout, overhead_bytes: float = 0.0,
                      overhead_fraction: float = DEFAULT_OVERHEAD_FRACTION, exact_schedule: bool = True,
                      fused: bool = True) -> Memory:
    """Peak bytes on the most loaded device of layout ``lay`` (see the module docstring).

    The step's terms are the engine's, from :mod:`phalanx.plan.engine_memory` (its
    constants and its walk of the schedule): the compute-dtype weight casts per activation
    set in flight, the float32 gradient sum once a backward has run, the backward's working
    set, and the optimizer phase (flat parameter copy, flat gradient and AdamW temporary; under
    ZeRO 1/2 the gradient cut into pieces and those buffers of the replica's piece) when it is
    larger than the backward phase. On top, what only
    the planner models: ZeRO-3 (every per-parameter term divided by ``dp``), experts split
    by ``ep``, sequence parallelism, unfused activations, and the overhead line.

    ``overhead_bytes`` (runtime context, communication buffers) plus ``overhead_fraction``
    of everything else (allocator fragmentation) make the overhead line.
    ``exact_schedule=False`` uses closed-form in-flight counts and peaks (fast, for the search).
    ``fused``: activations as fused GPU/TPU kernels keep them (Korthikanti et al.), or as
    unfused TensorFlow ops do (see :func:`layer_activation_bytes`).

    >>> m = ModelSpec(layers=2, d_model=64, heads=4, vocab=256, seq_len=16)
    >>> z0 = memory_per_device(m, Layout(dp=4, zero=0), overhead_fraction=0)
    >>> z2 = memory_per_device(m, Layout(dp=4, zero=2), overhead_fraction=0)
    >>> z2.optimizer == z0.optimizer / 4   # the engine's ZeRO-2 shards AdamW's moments only
    True
    """
    w_b, g_b, o_b = ENGINE_STATE_BYTES
    e = ACTIVATION_BYTES[lay.policy]
    cast_b = e if e < w_b else 0            # bytes of a compute-dtype copy of a float32 weight
    v, tp, dp = lay.virtual_stages, lay.tp, lay.dp
    check_expert_parallel(m, lay)
    ep = lay.ep
    exact = exact_schedule or lay.pp * lay.microbatches * v <= 4096
    if runs_on_keras_engine(lay):
        return _keras_engine_memory(m, lay, overhead_bytes, overhead_fraction, exact)
    if exact:
        peaks, last_peak = schedule_in_flight(lay.schedule, lay.pp, lay.microbatches, v)
        sched = _walk_schedule(lay.schedule, lay.pp, lay.microbatches, v)
    else:
        peaks, last_peak = in_flight_estimate(lay.schedule, lay.pp, lay.microbatches, v)
    mesh = runs_on_mesh_engine(lay)
    d, s, b = m.d_model, m.seq_len, lay.micro_batch
    embed = m.vocab * d / tp + m.seq_len * d
    final_ln = 2 * d
    head = m.vocab * d / tp if not m.tie_embeddings else 0.0          # an own head: with AdamW states
    tied_copy = m.vocab * d / tp if (m.tie_embeddings and lay.pp > 1) else 0.0  # weights + gradient only
    dense_layer, _ = _layer_param_split(m, tp, ep, False)
    moe_dense, moe_expert = _layer_param_split(m, tp, ep, True) if m.experts else (0.0, 0.0)
    act_args = (b, tp, lay.recompute, lay.sequence_parallel)
    act_dense = layer_activation_bytes(m, *act_args, e, False, fused)
    act_moe = layer_activation_bytes(m, *act_args, e, True, fused) if m.experts else 0.0
    # the backward's working set: a fraction of one block's activations counted at 4 bytes
    backward = BACKWARD_SETS * max(layer_activation_bytes(m, *act_args, 4, False, fused),
                                   layer_activation_bytes(m, *act_args, 4, True, fused) if m.experts else 0.0)
    kinds = stage_kinds(m, lay.pp, v)
    # ZeRO shards over the replicas that hold the same tensor: dp for dense, dp/ep for experts
    shard_d, shard_e = dp, max(dp // ep, 1)
    best: Memory | None = None
    # Stages are cut by FLOPs, so any rank may be the fullest. Middle ranks holding the same
    # blocks differ only by their in-flight count, and the peak grows or shrinks with it:
    # the ranks with the most and the fewest stand for them all.
    middle: dict[tuple, set[int]] = {}
    for r in range(1, lay.pp - 1):
        key = tuple(kinds[c * lay.pp + r] for c in range(v))
        group = middle.setdefault(key, set())
        group.add(r)
    chosen = {0, lay.pp - 1}
    for group in middle.values():
        chosen |= {max(group, key=lambda r: peaks[r]), min(group, key=lambda r: peaks[r])}
    for r in sorted(chosen):
        dense = expert = 0.0
        act_per_set = 0.0
        for c in range(v):
            n_dense, n_moe = kinds[c * lay.pp + r]
            dense += n_dense * dense_layer + n_moe * moe_dense
            expert += n_moe * moe_expert
            act_per_set = max(act_per_set, n_dense * act_dense + n_moe * act_moe)
        copy = 0.0
        if r == 0:
            dense += embed
        head_acts = 0.0
        if r == lay.pp - 1:
            dense += final_ln + head
            copy = tied_copy
            # final LayerNorm input + logits (compute dtype) + float32 softmax for the loss
            head_acts = last_peak * (e * s * b * d + (e + 4) * s * b * m.vocab / tp)
        params = dense + expert
        # parameters whose float32 weight, gradient and flat copy this device keeps (ZeRO-3: its shard)
        held = (dense / shard_d + expert / shard_e + copy / dp) if lay.zero >= 3 else params + copy
        weights = w_b * held
        optim = o_b * ((dense / shard_d + expert / shard_e) if lay.zero >= 1 else params)
        grad_set = g_b * held
        cast = cast_b * (params + copy)      # the forward's casts are of whole (gathered) weights
        set_bytes = act_per_set + cast
        # The two phases composed as engine_memory_per_device composes them (the test
        # test_planner_memory_is_the_engines holds the two equal on the engine's layouts).
        if mesh:
            if exact:
                step, n_sets, n_grads, in_bwd = rank_peak_parts(sched, r, set_bytes, grad_set, backward)
            else:
                step, n_sets, n_grads, in_bwd = step_peak_estimate(
                    peaks[r], lay.microbatches * v, set_bytes, grad_set, backward)
            own = held - copy / (dp if lay.zero >= 3 else 1)      # the tied copy is in no optimizer group
            if lay.zero in (1, 2) and dp > 1:  # the gradient cut into pieces; the replica's piece's buffers
                opt_phase = g_b * own * (ZERO_GRAD_SETS + ZERO_PIECE_SETS / dp)
            else:  # optimizer step: the flat parameter copy, the flat gradient and AdamW's temporary
                opt_phase = w_b * own + OPT_BUFFERS * g_b * own
        else:  # tf.distribute: one micro-batch, Keras updates each variable with its gradient
            step, n_sets, n_grads, in_bwd = set_bytes + backward, 1, 0, True
            opt_phase = grad_set
        if step + head_acts >= opt_phase:
            acts = n_sets * act_per_set + head_acts
            grads = n_grads * grad_set
            temps = n_sets * cast + (backward if in_bwd else 0.0)
        else:  # the optimizer step is the peak: one gradient set and the optimizer's buffers
            acts, grads, temps = 0.0, grad_set, opt_phase - grad_set
        subtotal = weights + grads + optim + acts + temps
        mem = Memory(weights, grads, optim, acts, overhead_bytes + overhead_fraction * subtotal, r,
                     params + copy, peaks[r], expert, temps)
        if best is None or mem.total > best.total:
            best = mem
    assert best is not None
    return best
