"""Step time of a layout: compute at an assumed utilisation, pipeline bubble, communication.

Model:

* Compute: each model stage's forward and backward FLOPs per micro-batch (from
  :mod:`phalanx.core.costs`, recomputation added to the backward) divided by
  ``peak FLOP/s x utilization``; with ``tp > 1`` a block's FLOPs are split over the
  tensor ranks except an MoE block's router and experts, which run whole on tensor rank 0
  (:func:`rank0_block_flops`). The default utilisation, 0.5, is about what
  Megatron-LM sustained on A100s for 1T parameters (163 of 312 TFLOP/s, Narayanan
  et al. 2021, Table 1); override it with ``--utilization``.
* Tensor parallelism, as the engine's parallel layers do it (``layers/tensor_parallel.py`` ``add_shards``): per block and
  micro-batch, the two row-parallel partial sums are added with ``add_n`` on the group's
  first device (it receives ``t-1`` activations each) and the two LayerNorm outputs are
  read from there by the other ``t-1`` devices (it sends ``t-1`` each); the backward moves
  the same volume the other way (+ the forward again under full recomputation). The
  first device's link carries ``2 (t-1) b s h`` bytes each way per block and pass, where a
  ring all-reduce would carry ``4 (t-1)/t``. With sequence parallelism (plan only) the
  Megatron reduce-scatter + all-gather ring is priced instead. Not overlapped.
* Pipeline: a ``b s h`` activation per micro-batch and stage boundary each way, as the
  simulator's ``comm_cost``; the bubble comes from replaying the schedule table.
* Data parallelism: the float32 gradients (``G`` bytes) are summed once per step as the
  chosen engine sums them (:data:`phalanx.plan.layout.REDUCTIONS`), priced by the bytes
  crossing the busiest device's link in one direction:

  - ``one`` (the engine in one process: each weight's sum formed on the weight's device):
    ZeRO-0: ``add_n`` on the first replica, which receives ``(dp-1) G`` and sends the sum
    back to ``dp-1`` replicas; ZeRO-1: the same sum, then ``G/dp`` pieces out and an
    all-gather of the updated float32 weights (``(dp-1)/dp W``); ZeRO-2: a direct
    reduce-scatter (``(dp-1)/dp G`` per device) and the same all-gather;
  - ``ring`` (MultiWorkerMirroredStrategy, collective RING): ``2 (dp-1)/dp G``
    (Patarasuk & Yuan 2009, bandwidth-optimal all-reduce);
  - ZeRO-3 (plan only): 1.5x the ring volume (Rajbhandari et al. 2020 section 7.2.2).

  A fraction ``dp_overlap`` (default 0) is hidden behind the backward.
* Expert parallelism (``ep > 1``), the pattern of GShard (Lepikhin et al. 2020, "GShard:
  Scaling Giant Models with Conditional Computation and Automatic Sharding": a dispatch
  all-to-all, the experts, a combine all-to-all) as DeepSpeed-MoE trains it (Rajbhandari et
  al. 2022, "DeepSpeed-MoE": expert parallelism over the data-parallel ranks, non-expert
  weights data parallel): per MoE block and micro-batch each
  device sends every token routed to an expert of another replica of its ep group and gets
  the expert's output back. With balanced routing a fraction ``(ep-1)/ep`` of the ``top_k``
  copies of its ``b s`` tokens leaves the device, so one all-to-all moves
  ``b s h x bytes-per-activation x top_k x (ep-1)/ep`` bytes out of (and as many into) each
  device (:func:`all_to_all_bytes`): dispatch and combine in the forward, their gradients in
  the backward (4 per block and micro-batch; 6 under full recomputation, which re-runs the
  forward's two). With more than one expert per shard the dispatch also carries each routed
  row's expert within the shard (int32, :func:`dispatch_index_bytes`). These are the tensors
  the engine's step sends between devices (KerasGPTEngine: per replica and remote shard, the
  routed rows and their expert indices out, the experts' output back; in the backward the
  output's gradient out and the rows' gradient back), counted from its partition graphs in
  tests/test_plan_engine.py. Priced on the link of the data axis (ep groups are data
  replicas), on the critical path, not overlapped. Tokens over an expert's capacity are not
  sent; padding to the capacity (GShard's dense dispatch) is not counted. The experts'
  gradients are summed over the ``dp/ep`` replicas holding the same experts, the rest over
  all ``dp``.

Links: ranks are numbered tp fastest, then dp, then pp (Megatron's order), so a tp group
shares a node when ``tp`` divides the node size; a dp group or pipeline neighbour crosses
nodes when ``tp x dp`` (resp. ``tp x dp`` for the next stage) leaves the node.

Example:
    >>> from phalanx.core.costs import ModelSpec
    >>> from phalanx.plan.hardware import get_hardware
    >>> from phalanx.plan.layout import Layout
    >>> m = ModelSpec(layers=24, d_model=2048, heads=16, vocab=51200, seq_len=2048)
    >>> t = step_time(m, Layout(dp=8, microbatches=4, micro_batch=2), get_hardware("a100-80gb"))
    >>> 0 < t.step_time_s < 10 and t.bubble_fraction == 0.0
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from phalanx.parallel.schedules import build_schedule, bubble_formula
from phalanx.core.costs import (ModelSpec, layer_forward_flops_per_token, logits_forward_flops_per_token,
                                     attention_core_flops_per_token)
from phalanx.plan.hardware import Hardware
from phalanx.plan.layout import Layout, check_expert_parallel
from phalanx.plan.activations import ACTIVATION_BYTES
from phalanx.plan.memory import ENGINE_STATE_BYTES, memory_per_device, stage_kinds
from phalanx.plan.simulator import simulate

DEFAULT_UTILIZATION = 0.5


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    compute_s: float             # the pipeline makespan (compute + tp and p2p comm + bubble)
    bubble_fraction: float
    tp_comm_s: float             # per step, on the critical path
    pp_comm_s: float             # per transfer
    dp_comm_s: float             # exposed gradient synchronisation
    moe_comm_s: float            # expert-parallel all-to-alls per step, on the busiest rank (in the pipeline time)
    comm_bytes: dict             # per device per step, by collective

    def to_dict(self) -> dict:
        return {"step_time_s": self.step_time_s, "pipeline_s": self.compute_s,
                "bubble_fraction": self.bubble_fraction, "tp_comm_s": self.tp_comm_s,
                "pp_comm_s_per_transfer": self.pp_comm_s, "dp_comm_s": self.dp_comm_s,
                "moe_comm_s": self.moe_comm_s, "comm_bytes_per_device": self.comm_bytes}


def _ring(nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring all-reduce of ``nbytes`` over ``n`` devices."""
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def dp_sync_bytes(grad_bytes: float, dp: int, zero: int, reduction: str) -> float:
    """Bytes through the busiest device's link (one direction) to sum ``grad_bytes`` of
    float32 gradients over ``dp`` replicas and, under ZeRO, gather the updated weights
    (float32, the same size) — see the module docstring.

    >>> G = 100.0
    >>> dp_sync_bytes(G, 4, 0, "one"), dp_sync_bytes(G, 4, 0, "ring"), dp_sync_bytes(G, 4, 2, "one")
    (300.0, 150.0, 150.0)
    """
    if dp <= 1:
        return 0.0
    piece = (dp - 1) / dp * grad_bytes
    if zero >= 3:
        return 1.5 * _ring(grad_bytes, dp)
    if reduction == "ring":
        return _ring(grad_bytes, dp)
    if zero == 0:
        return (dp - 1) * grad_bytes          # into the root, and the same out again
    if zero == 1:
        return (dp - 1) * grad_bytes + piece  # into the root: the sum's inputs and the gathered pieces
    return 2 * piece                          # reduce-scatter, then all-gather, every device alike


def all_to_all_bytes(m: ModelSpec, lay: Layout) -> float:
    """Bytes one device sends (and receives) in one expert-parallel all-to-all — the dispatch or
    the combine of one MoE block for one micro-batch, forward or backward: its tokens x
    ``d_model`` x bytes per activation x ``top_k`` x ``(ep-1)/ep`` (see the module docstring).

    >>> m = ModelSpec(layers=2, d_model=64, heads=4, vocab=256, seq_len=32, experts=8, top_k=2)
    >>> all_to_all_bytes(m, Layout(dp=4, ep=4, micro_batch=2, policy="float32")) == 2 * 32 * 64 * 4 * 2 * 3 / 4
    True
    """
    if lay.ep <= 1 or not m.experts:
        return 0.0
    tokens = lay.micro_batch * m.seq_len / (lay.tp if lay.sequence_parallel else 1)
    return tokens * m.d_model * ACTIVATION_BYTES[lay.policy] * m.top_k * (lay.ep - 1) / lay.ep


def dispatch_index_bytes(m: ModelSpec, lay: Layout) -> float:
    """Bytes of expert indices one device sends with one dispatch: each routed row carries its
    expert within the receiving shard (int32) when a shard holds more than one expert.

    >>> m = ModelSpec(layers=2, d_model=64, heads=4, vocab=256, seq_len=32, experts=8, top_k=2)
    >>> dispatch_index_bytes(m, Layout(dp=4, ep=4, micro_batch=2)) == 2 * 32 * 4 * 2 * 3 / 4
    True
    """
    if lay.ep <= 1 or not m.experts or m.experts // lay.ep == 1:
        return 0.0
    tokens = lay.micro_batch * m.seq_len / (lay.tp if lay.sequence_parallel else 1)
    return tokens * 4 * m.top_k * (lay.ep - 1) / lay.ep


def rank0_block_flops(m: ModelSpec, moe: bool, tp: int) -> float:
    """Forward FLOPs per token of one block on its busiest tensor rank (rank 0): a dense
    block's split ``1/tp``; an MoE block's attention split ``1/tp`` but its router and
    ``top_k`` expert MLPs whole, since :class:`phalanx.layers.MoE` is never cut over tensor
    devices (the engine runs it on the replica's tensor rank 0, the expert shards on their
    replicas' rank 0) and the other tensor ranks wait for its output.

    >>> m = ModelSpec(layers=2, d_model=64, heads=4, ffn=256, vocab=256, seq_len=32, experts=4, top_k=2)
    >>> attention = 2 * 4 * 64 * 64 + 4 * 32 * 64           # projections, QK^T and AV
    >>> rank0_block_flops(m, True, 2) == attention / 2 + 2 * (2 * 2 * 64 * 256) + 2 * 64 * 4
    True
    >>> rank0_block_flops(m, False, 2) == (attention + 2 * 2 * 64 * 256) / 2
    True
    """
    whole = layer_forward_flops_per_token(m, moe)
    if not moe:
        return whole / tp
    attention = layer_forward_flops_per_token(m) - 2 * 2 * m.d_model * m.ffn_dim
    return attention / tp + (whole - attention)


def links(lay: Layout, hw: Hardware) -> dict[str, float]:
    """Bandwidth used by each kind of traffic, given the rank order tp < dp < pp."""
    node = hw.devices_per_node
    intra, inter = hw.intra_node_bw, hw.inter_node_bw
    return {
        "tp": intra if lay.tp <= node else inter,
        "dp": intra if lay.tp * lay.dp <= node else inter,
        "pp": intra if lay.tp * lay.dp * 2 <= node else inter,
    }


@lru_cache(maxsize=2048)
def _simulate_cached(name: str, pp: int, m: int, v: int, f: tuple, b: tuple, comm: float) -> tuple[float, float]:
    tl = simulate(build_schedule(name, pp, m, v), list(f), list(b), comm)
    return tl.makespan, tl.bubble_fraction


def step_time(m: ModelSpec, lay: Layout, hw: Hardware, utilization: float = DEFAULT_UTILIZATION,
              dp_overlap: float = 0.0, exact_schedule: bool = True) -> StepTime:
    """Seconds per optimizer step of ``lay`` on ``hw`` (see the module docstring for the model).

    ``exact_schedule=False`` replaces the simulator by the equal-stage bubble formula
    scaled to the slowest stage (for the search's first pass).
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if not 0 <= dp_overlap <= 1:
        raise ValueError(f"dp_overlap must be in [0, 1], got {dp_overlap}")
    check_expert_parallel(m, lay)
    rate = hw.peak_flops(lay.policy) * utilization
    if rate <= 0:
        raise ValueError(f"hardware {hw.name!r} has no peak FLOP/s for {lay.policy}; pass --peak-tflops")
    e = ACTIVATION_BYTES[lay.policy]
    tokens = lay.micro_batch * m.seq_len  # per micro-batch
    act = tokens * m.d_model * e          # one b x s x h activation
    bw = links(lay, hw)

    # tensor-parallel traffic per block per micro-batch and pass, through the busiest link
    if lay.sequence_parallel:   # plan only: Megatron's ring collectives
        tp_pass_bytes = 2 * _ring(act, lay.tp)
    else:                       # the engine: 2 sums onto the first device, 2 reads from it
        tp_pass_bytes = 2 * (lay.tp - 1) * act
    tp_ar = tp_pass_bytes / 2 / bw["tp"] if lay.tp > 1 else 0.0
    tp_fwd, tp_bwd = 2 * tp_ar, 2 * tp_ar + (2 * tp_ar if lay.recompute == "full" else 0.0)

    # expert parallelism: a dispatch and a combine all-to-all per MoE block and pass (GShard;
    # DeepSpeed-MoE), on the data axis's link; full recomputation re-runs the forward's two
    a2a_bytes, index_bytes = all_to_all_bytes(m, lay), dispatch_index_bytes(m, lay)
    a2a, index = a2a_bytes / bw["dp"], index_bytes / bw["dp"]
    a2a_fwd, a2a_bwd = 2 * a2a + index, 2 * a2a + (2 * a2a + index if lay.recompute == "full" else 0.0)

    kinds = stage_kinds(m, lay.pp, lay.virtual_stages)
    counts = [a + b for a, b in kinds]
    per_block = {}
    for moe in ((False, True) if m.experts else (False,)):
        fl = rank0_block_flops(m, moe, lay.tp) * tokens / rate
        extra = 0.0
        if lay.recompute == "full":
            extra = fl
        elif lay.recompute == "selective":
            extra = attention_core_flops_per_token(m) * tokens / lay.tp / rate
        per_block[moe] = (fl + tp_fwd + (a2a_fwd if moe else 0.0),
                          2 * fl + extra + tp_bwd + (a2a_bwd if moe else 0.0))
    f_costs, b_costs = [], []
    for n_dense, n_moe in kinds:
        f_costs.append(n_dense * per_block[False][0] + (n_moe * per_block[True][0] if n_moe else 0.0))
        b_costs.append(n_dense * per_block[False][1] + (n_moe * per_block[True][1] if n_moe else 0.0))
    logits = logits_forward_flops_per_token(m) * tokens / lay.tp / rate
    f_costs[-1] += logits
    b_costs[-1] += 2 * logits
    # embedding lookup: negligible FLOPs; its gradient scatter is memory-bound, ignored

    p2p = act / (lay.tp if lay.sequence_parallel else 1) / bw["pp"] if lay.pp > 1 else 0.0
    if exact_schedule:
        # rounded so that layouts differing only in dp share one simulation
        key = (tuple(round(x, 12) for x in f_costs), tuple(round(x, 12) for x in b_costs))
        makespan, bubble = _simulate_cached(lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages,
                                            key[0], key[1], round(p2p, 12))
    else:
        per_rank = [0.0] * lay.pp
        for stage, (f, b) in enumerate(zip(f_costs, b_costs)):
            per_rank[stage % lay.pp] += f + b
        busiest = max(per_rank) * lay.microbatches
        eff_v = lay.virtual_stages
        if lay.schedule == "zb":
            eff_v = 3  # ZB-H1 at equal F, B, W
        bubble = bubble_formula(lay.pp, lay.microbatches, eff_v) if lay.pp > 1 else 0.0
        makespan = busiest / (1 - bubble) + 2 * (lay.pp - 1) * p2p * lay.virtual_stages

    # data-parallel gradient synchronisation, once per step; with ep the experts' gradients
    # are summed over the dp/ep replicas that hold the same experts, the rest over all dp
    mem = memory_per_device(m, lay, exact_schedule=False)
    g_b = ENGINE_STATE_BYTES[1]  # the engine's gradients are float32
    dp_bytes = (dp_sync_bytes((mem.params - mem.expert_params) * g_b, lay.dp, lay.zero, lay.reduction)
                + dp_sync_bytes(mem.expert_params * g_b, lay.dp // lay.ep, lay.zero, lay.reduction))
    dp_s = dp_bytes / bw["dp"] * (1 - dp_overlap) if lay.dp > 1 else 0.0

    blocks_per_rank = sum(counts[0::lay.pp])  # rank 0 holds the most blocks
    moe_per_rank = max(sum(n_moe for _, n_moe in kinds[r::lay.pp]) for r in range(lay.pp))
    n_a2a = 4 + (2 if lay.recompute == "full" else 0)
    n_index = 1 + (1 if lay.recompute == "full" else 0)
    a2a_step_bytes = (n_a2a * a2a_bytes + n_index * index_bytes) * moe_per_rank * lay.microbatches
    n_ar = 4 + (2 if lay.recompute == "full" else 0)
    tp_bytes = tp_pass_bytes / 2 * n_ar * blocks_per_rank * lay.microbatches if lay.tp > 1 else 0.0
    comm_bytes = {
        "tp_allreduce": tp_bytes,
        "dp_gradients": dp_bytes,
        "pp_p2p": 2 * act / (lay.tp if lay.sequence_parallel else 1) * lay.microbatches * lay.virtual_stages
        if lay.pp > 1 else 0.0,
        "moe_all_to_all": a2a_step_bytes,
    }
    tp_s = tp_bytes / bw["tp"] if lay.tp > 1 else 0.0
    a = lay.accum  # the schedule runs once per accumulation step; gradients sync once per step
    comm_bytes = {k: (v if k == "dp_gradients" else v * a) for k, v in comm_bytes.items()}
    return StepTime(a * makespan + dp_s, a * makespan, bubble, a * tp_s, p2p, dp_s,
                    a * a2a_step_bytes / bw["dp"], comm_bytes)
