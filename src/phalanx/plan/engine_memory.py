"""Peak memory of every device of a configured run, as phalanx's engines place things.

:func:`phalanx.plan.memory.memory_per_device` answers "does the fullest device fit" for
any hardware; this module predicts *each* device of the run ``phalanx train`` would start
with this config, for ``phalanx plan --calibrate`` to compare with measurements. It
follows the engines' placement and step (read from ``engines/mesh.py``,
``models/transformer.py``, ``parallel/zero.py``, ``parallel/pipeline.py`` and
``engines/strategy.py``), term by term, as found in the allocator's record of real steps
(``phalanx.train.calibrate``):

* persistent: float32 weights where ``tf.device`` puts them (tensor rank ``t`` holds its
  column/row/vocab slices; replicated LayerNorm parameters, row-parallel biases and the
  position table sit on tensor rank 0; the tied embedding's second copy on the last
  stage), AdamW ``m`` and ``v`` (float32) on each shard's primary device, divided by ``dp``
  under ZeRO >= 1;
* the mesh engine's optimizer reads every parameter group into one flat float32 buffer
  (``ShardedAdamW._flat_params``), 4 bytes per parameter, in the optimizer step only (the
  read waits for the gradients' norm); under ZeRO >= 1 only the replica's piece of it
  (``1/dp``);
* under a mixed policy every layer casts its kernel to the compute dtype in each forward
  and the backward reads the cast copy: ``e`` bytes per parameter per activation set held;
* activations: each stage's blocks on its devices (the tensor-parallel split of
  :func:`~phalanx.plan.activations.layer_activation_bytes`, fused kernels: the GPT's LayerNorm,
  softmax and GELU are XLA-compiled functions that keep only their inputs) times the
  micro-batches the schedule keeps in flight on that rank, read from the schedule table;
  with the head's logits and float32 softmax on the last stage;
* the backward's working set when it starts (the first block's gradients of activations
  and of the fused kernels): :data:`BACKWARD_SETS` of one block's activations on that device;
* gradients: every backward adds its float32 weight gradients into one running sum per
  weight before the rank's next action starts (``parallel/pipeline.run_schedule``; across
  ``train.grad_accum`` steps too), so a rank holds one gradient set once its first backward
  has run, whatever the number of micro-batches (:func:`rank_peak` walks the rank's
  schedule); in the optimizer step without ZeRO the flat gradient and AdamW's flat
  temporaries (:data:`OPT_BUFFERS` per parameter) join the state beside the flat parameters,
  and the peak is the larger of the phases. Under ``zero=0`` the flat gradients are summed on
  replica 0's devices and the sum sent to the other replicas: logical CPUs of one process
  share it (TensorFlow passes a tensor between them without a copy), so there a replica
  other than 0 holds one buffer fewer. Under ZeRO >= 1 each replica cuts its gradient
  straight into the ``dp`` pieces, and the flat parameters, the reduced gradient and AdamW's
  temporary are the replica's piece: :data:`ZERO_GRAD_SETS` and :data:`ZERO_PIECE_SETS`.

The StrategyEngine (``dp`` on tf.distribute, no ``tp``/``pp``/ZeRO) has no flat buffers:
Keras's optimizer updates each variable; its optimizer phase holds every gradient.

Example:
    >>> from phalanx.config import load_config
    >>> cfg = load_config(None, ["model.layers=2", "parallel.tp=2", "parallel.devices=cpu:2",
    ...                          "precision.policy=float32"])
    >>> mem = engine_memory_per_device(cfg)
    >>> sorted(mem), mem[0].total > mem[1].total     # device 0 also holds LayerNorms and positions
    ([0, 1], True)
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.config import Config, parse_devices, resolve_degrees
from phalanx.core.costs import ModelSpec
from phalanx.plan.engine_rules import stage_bounds
from phalanx.parallel.schedules import build_schedule
from phalanx.plan.activations import ACTIVATION_BYTES, layer_activation_bytes, schedule_in_flight

# Float32 buffers per parameter, beyond the flat parameter copy, alive at the peak of the mesh
# engine's optimizer step: the flat gradient of every group (the global norm needs all of them
# before any update) and the AdamW temporary of the group being updated (its weight-decayed
# or its clipped gradient, one after the other: core.optim.apply_adamw). ShardedAdamW.apply
# updates one group after another on each device, each once the norm exists, so the same
# buffers are alive at the peak in every run.
OPT_BUFFERS = 2.0
# Under ZeRO >= 1 (dp > 1) the optimizer step's float32 buffers per parameter of the device:
# the gradient sums of the backward (one set, each shard's freed once its pieces are cut) beside
# the pieces being cut from them, then per replica piece (1/dp): the reduced gradient, the flat
# parameters and AdamW's temporary. Measured with --calibrate on a weight-heavy GPT (2 layers,
# d_model 128, ffn 512, seq 8) at dp4 zero 1 and 2 and dp2 x tp2 x pp2 zero 2.
ZERO_GRAD_SETS = 1.0
ZERO_PIECE_SETS = 2.0
# One block's activations, counted at 4 bytes an element, is the working set the backward holds
# when it starts: the same bytes under float32 and mixed_bfloat16 (under a mixed policy the
# gradients are cast to float32 beside their compute-dtype values). Measured with --calibrate
# at tp2, pp2 (1 and 4 micro-batches), dp2 and dp2 x tp2 x pp2, 4 layers, d_model 256.
BACKWARD_SETS = 0.375


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted peak bytes of one device, by kind."""

    weights: float
    optimizer: float
    gradients: float
    activations: float
    temporaries: float
    params: float = 0.0           # parameters whose weights the device holds (the Keras-engine model fills it)
    expert_params: float = 0.0    # of them, experts

    @property
    def total(self) -> float:
        return self.weights + self.optimizer + self.gradients + self.activations + self.temporaries

    def to_dict(self) -> dict:
        return {"total": self.total, "weights": self.weights, "optimizer": self.optimizer,
                "gradients": self.gradients, "activations": self.activations, "temporaries": self.temporaries}


def _block_params(d: int, f: int, tp: int, t: int) -> float:
    """One block's parameters on tensor rank ``t``: split kernels and biases, plus (rank 0)
    the replicated LayerNorms and row-parallel biases."""
    split = (3 * d * d + 3 * d + d * d + d * f + f + f * d) / tp
    return split + (4 * d + 2 * d if t == 0 else 0)


def rank_peak(schedule, rank: int, set_bytes: float, grad_bytes: float, backward_bytes: float) -> float:
    """Most bytes rank ``rank`` holds while it runs its actions of ``schedule`` (a
    :class:`~phalanx.parallel.schedules.Schedule`): activation sets in flight (``set_bytes``
    each) plus, once a backward has run, the one float32 running sum of the weight gradients
    (``grad_bytes``: each backward adds its gradients into it before the rank's next action,
    :func:`phalanx.parallel.pipeline.run_schedule`), plus the backward's working set while a
    backward starts.

    >>> from phalanx.parallel.schedules import build_schedule
    >>> sched = build_schedule("1f1b", 2, 4, 1)     # rank 0: F0 F1 B0 F2 B1 F3 B2 B3
    >>> rank_peak(sched, 0, set_bytes=10, grad_bytes=1, backward_bytes=0)   # F2 and F3 beside the sum
    21
    """
    return rank_peak_parts(schedule, rank, set_bytes, grad_bytes, backward_bytes)[0]


def rank_peak_parts(schedule, rank: int, set_bytes: float, grad_bytes: float,
                    backward_bytes: float) -> tuple[float, int, int, bool]:
    """:func:`rank_peak` and what is alive at that peak: ``(peak, activation sets held,
    gradient sets held (0 or 1), whether a backward's working set is)`` (the planner's breakdown).

    >>> from phalanx.parallel.schedules import build_schedule
    >>> rank_peak_parts(build_schedule("1f1b", 2, 4, 1), 0, 10, 1, 0)
    (21, 2, 1, False)
    """
    held = done = 0
    best = (0.0, 0, 0, False)
    for a in schedule.per_stage[rank]:
        grads = min(done, 1)
        if a.kind == "F":
            held += 1
            if held * set_bytes + grads * grad_bytes > best[0]:
                best = (held * set_bytes + grads * grad_bytes, held, grads, False)
        else:
            if held * set_bytes + grads * grad_bytes + backward_bytes > best[0]:
                best = (held * set_bytes + grads * grad_bytes + backward_bytes, held, grads, True)
            held -= 1
            done += 1
    end = min(done, 1)  # the sum, handed to the optimizer
    return best if end * grad_bytes <= best[0] else (end * grad_bytes, 0, end, False)


def step_peak_estimate(held: int, backwards: int, set_bytes: float, grad_bytes: float,
                       backward_bytes: float) -> tuple[float, int, int, bool]:
    """:func:`rank_peak_parts` in closed form (the search's
    pre-filter), for a rank that holds at most ``held`` activation sets and runs ``backwards``
    backward actions: the peak is at the first backward after the last forward (``held`` sets,
    the gradient sum if a backward ran before), at the next backward (``held - 1`` sets and the
    sum), at the last backward (one set and the sum) or at the end (the sum). Exact for gpipe
    and 1f1b (tested against the walk).

    >>> step_peak_estimate(2, 4, 10, 1, 5)     # 1f1b, pp=2, m=4, rank 0: B2 with F2, F3 held
    (26, 2, 1, True)
    >>> rank_peak_parts(build_schedule("1f1b", 2, 4, 1), 0, 10, 1, 5)
    (26, 2, 1, True)
    """
    n, w = backwards, min(held, backwards)
    cands = [(w * set_bytes + min(n - w, 1) * grad_bytes + backward_bytes, w, min(n - w, 1), True)]
    if w >= 2:
        cands.append(((w - 1) * set_bytes + grad_bytes + backward_bytes, w - 1, 1, True))
    cands.append((set_bytes + min(n - 1, 1) * grad_bytes + backward_bytes, 1, min(n - 1, 1), True))
    cands.append((min(n, 1) * grad_bytes, 0, min(n, 1), False))
    return max(cands, key=lambda c: c[0])


def engine_memory_per_device(cfg: Config) -> dict[int, DeviceMemory]:
    """Device index (mesh order: data, pipe, tensor; as ``parallel.devices`` numbers them) ->
    predicted peak bytes of one training step of ``cfg``."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    kind, n = parse_devices(p.devices)
    dp, pp, tp = resolve_degrees(cfg, n or max(p.dp, 1) * max(p.pp, 1) * max(p.tp, 1))
    spec = ModelSpec.from_config(m)
    mesh = tp > 1 or pp > 1 or p.zero > 0 or p.recompute != "none" or p.strategy == "mesh"
    v = p.virtual_stages if p.schedule == "interleaved" else 1
    micro = t.global_batch // (dp * t.grad_accum * p.microbatches)
    bounds = stage_bounds(spec, pp, v)
    sched = build_schedule(p.schedule if pp > 1 else "1f1b", pp, p.microbatches, v)
    _, last_peak = schedule_in_flight(sched.name, pp, p.microbatches, v)
    e = ACTIVATION_BYTES[cfg.precision.policy]
    cast = e if e < 4 else 0  # bytes of a compute-dtype copy of a weight
    d, f, s, V = m.d_model, m.ffn_dim, m.seq_len, m.vocab
    whole = layer_activation_bytes(spec, micro, 1, p.recompute, False, e, False, fused=True)
    split_part = layer_activation_bytes(spec, micro, tp, p.recompute, False, e, False, fused=True)
    # tensor rank 0 keeps the unsplit part (LayerNorms, residual) and its slice of the rest
    unsplit = (whole - split_part * tp) / (1 - tp) if tp > 1 else whole
    whole4 = layer_activation_bytes(spec, micro, 1, p.recompute, False, 4, False, fused=True)
    split4 = layer_activation_bytes(spec, micro, tp, p.recompute, False, 4, False, fused=True)
    unsplit4 = (whole4 - split4 * tp) / (1 - tp) if tp > 1 else whole4
    out: dict[int, DeviceMemory] = {}
    for rep in range(dp):
        for r in range(pp):
            for tr in range(tp):
                blocks = sum(b - a for c, (a, b) in enumerate(bounds) if c % pp == r)
                params = blocks * _block_params(d, f, tp, tr)
                copy = 0.0
                if r == 0:
                    params += V * d / tp + (s * d if tr == 0 else 0)
                if r == pp - 1:
                    params += 2 * d if tr == 0 else 0
                    if m.tie_embeddings and pp > 1:
                        copy = V * d / tp
                    elif not m.tie_embeddings:
                        params += V * d / tp
                per_block = split_part if tr == 0 else split_part - unsplit
                per_set = max(sum(b - a for c, (a, b) in enumerate(bounds) if c % pp == r and c == ch)
                              for ch in range(len(bounds))) * per_block
                head = 0.0
                if r == pp - 1:  # final LayerNorm and this tensor rank's logits and float32 softmax
                    head = last_peak * ((e * s * micro * d if tr == 0 else 0) + (e + 4) * s * micro * V / tp)
                weights = 4.0 * (params + copy)
                optimizer = 8.0 * params / (dp if p.zero >= 1 else 1)
                grad = 4.0 * (params + copy)
                set_bytes = per_set + cast * (params + copy)
                backward = BACKWARD_SETS * (split4 if tr == 0 else split4 - unsplit4)
                if mesh:
                    step = rank_peak(sched, r, set_bytes, grad, backward) + head
                    if p.zero >= 1 and dp > 1:  # ZeRO: flat buffers of the replica's piece only
                        opt = 4.0 * params * (ZERO_GRAD_SETS + ZERO_PIECE_SETS / dp)
                    else:
                        flat = 4.0 * params  # the optimizer's flat parameter copy, optimizer step only
                        buffers = OPT_BUFFERS
                        if p.zero == 0 and rep > 0 and kind == "cpu":  # the gradient sum is replica 0's buffer
                            buffers -= 1
                        opt = flat + buffers * 4.0 * params
                else:  # StrategyEngine: one micro-batch, Keras updates each variable
                    step = set_bytes + backward + head
                    opt = grad
                if step >= opt:
                    out_mem = DeviceMemory(weights, optimizer, 0.0, step - backward, backward)
                else:
                    out_mem = DeviceMemory(weights, optimizer, grad, 0.0, opt - grad)
                out[(rep * pp + r) * tp + tr] = out_mem
    return out
