"""Peak memory of every device when ``phalanx.fit`` trains phalanx's GPT as a Keras model.

:mod:`phalanx.plan.engine_memory` predicts the mesh engine (``phalanx train``); this module
predicts :class:`~phalanx.engines.keras_model.KerasModelEngine` — the engine behind
``phalanx.fit`` — running :func:`phalanx.models.transformer.gpt` (the built-in GPT written
from the parallel Keras layers) compiled as ``phalanx.fit`` compiles a model without an
optimizer: Keras's ``AdamW`` from ``train.*`` (:func:`phalanx.train.keras_api.default_optimizer`)
and ``SparseCategoricalCrossentropy(from_logits=True)``. It reuses engine_memory's terms
(parameters per tensor rank, the fused activations per block, the schedule walk) and
differs where the engines differ, as found in the allocator's record of real steps
(``phalanx plan --keras --calibrate``, :func:`phalanx.train.calibrate.calibrate_keras`):

* **no flat buffers**: Keras's optimizer updates each variable in place; its ``m`` and
  ``v`` slots (float32, 8 bytes per parameter) live next to each weight (a tensor shard's
  on its rank), none for the last stage's mirror of a tied embedding;
* **weight decay waits for the gradients**: Keras's AdamW decays each weight
  (``w -= lr * wd * w``) before it looks at any gradient; the engine makes the whole update
  wait for every gradient of the step, so the decay is part of the optimizer phase (its
  products are :data:`OPT_TEMPORARIES`). Without that wait the executor ran the decay as
  soon as the forward had read a weight, while the read was still held for the backward:
  the decayed weight went to a new buffer (every weight held twice), and with ``pp > 1``
  the first stage's decay products waited on the first device (measured 2026-11-26 on the
  shapes below: device 0 held 8.4 MiB more at tp2 float32, 9.3 MiB more at tp2 x pp2);
* **the loss is Keras's**: the tied head's logits are gathered whole on tensor rank 0 of
  the last stage (``[micro, seq, vocab]`` in the compute dtype, and float32 inside the
  loss), not the vocabulary-parallel cross-entropy of the mesh engine;
* **the backward's working set** is two float32 copies of one block's tensor-parallel MLP
  hidden activation (the GELU's gradient and the MLP input's), :data:`BACKWARD_MLP_SETS`;
* **the optimizer phase** holds every gradient (the global-norm clip reads them all) and
  Keras's per-variable temporaries (:data:`OPT_TEMPORARIES` of the largest weight).

Checked (2026-11-26, ``--calibrate``, error per device): the constants were read off
4 layers, d_model 256, seq 128, batch 8 at tp2 and tp2 x pp2 (2 micro-batches), float32 and
mixed_bfloat16 (tests/test_calibrate_keras.py); on a shape they were not read from (6
layers, d_model 192, vocab 512, seq 96): tp2 float32 +3.7/+1.7%, tp2 x pp2 mixed_bfloat16
with an untied head +1.0/+1.7/+7.1/+2.5%, tp2 x pp2 float32 with 4 micro-batches
-1.3/-0.6/+4.5/+1.2%; with activations so small that the optimizer phase is device 0's
peak (4 layers, d_model 256, seq 16, batch 2, float32): tp2 +1.9/+3.8% (read off it,
:data:`DECAY_PRODUCTS`), tp2 x pp2 -1.8/+2.7/+1.1/+2.4%.

What was not measured is refused (:func:`check_calibrated`): ``dp > 1`` (replica weight
copies and the gradient sum), ``train.grad_accum > 1``, ``mixed_float16``, dropout, experts,
sequence parallelism and the interleaved schedule.

Example:
    >>> from phalanx.config import load_config
    >>> cfg = load_config(None, ["model.layers=2", "parallel.tp=2", "parallel.devices=cpu:2",
    ...                          "precision.policy=float32"])
    >>> mem = keras_memory_per_device(cfg)
    >>> sorted(mem), mem[0].total > mem[1].total     # device 0 also holds LayerNorms and positions
    ([0, 1], True)
    >>> mem[0].optimizer == 2 * mem[0].weights       # Keras's Adam slots, next to each weight
    True
"""

from __future__ import annotations

from phalanx.config import Config, ConfigError, parse_devices, resolve_degrees
from phalanx.core.costs import ModelSpec
from phalanx.parallel.schedules import build_schedule
from phalanx.plan.engine_memory import DeviceMemory, _block_params, rank_peak
from phalanx.plan.engine_rules import stage_bounds
from phalanx.plan.activations import ACTIVATION_BYTES, layer_activation_bytes, schedule_in_flight

# The backward's working set when it starts, in float32 copies of one block's MLP hidden
# activation on a tensor rank (seq x micro-batch x ffn / tp): the GELU's gradient and the
# gradient of the MLP-down matmul's input. Measured at tp2 and tp2 x pp2 (4 layers,
# d_model 256, micro-batches of 8 and 4), float32 and mixed_bfloat16: 2.0-2.1 copies.
BACKWARD_MLP_SETS = 2.0
# Keras's per-variable AdamW temporaries in the optimizer phase, in float32 copies of the
# largest weight on the device. A rough allowance: the optimizer phase was the peak of no
# measured layout (its temporaries measured 2.5 such copies at tp2, up to 8 at tp2 x pp2).
OPT_TEMPORARIES = 2.0
# Float32 copies of every tensor rank's weights that the decay products ``w * (lr * wd)``
# make on the mesh's first device in the optimizer phase without a pipeline: Keras gives
# those ops no device, and once the update waits for the gradients they are all ready at
# once. Measured once, at tp2 (4 layers, d_model 256, seq 16, batch 2: the optimizer phase
# is the peak only with activations this small): 10.4 MiB beside 12.4 MiB of weights. At
# tp2 x pp2 the same shape showed no such pile-up, so it is not added there.
DECAY_PRODUCTS = 0.85

SCHEDULES = ("1f1b", "gpipe")
POLICIES = ("float32", "mixed_bfloat16")


def check_calibrated(cfg: Config, dp: int) -> None:
    """Refuse what this memory model was not checked against, naming the key."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    why = "the Keras-engine memory model (phalanx.plan.keras_memory) was measured"
    if dp != 1:
        raise ConfigError("parallel.dp", f"{dp}: {why} for dp=1 only (replica weight copies and the gradient "
                                         f"sum over replicas are not modelled); plan tp x pp with parallel.dp=1")
    if t.grad_accum != 1:
        raise ConfigError("train.grad_accum", f"{t.grad_accum}: {why} with train.grad_accum=1 only")
    if cfg.precision.policy not in POLICIES:
        raise ConfigError("precision.policy", f"{cfg.precision.policy!r}: {why} under {' and '.join(POLICIES)} "
                                              f"only (mixed_float16 adds Keras's loss-scaling optimizer)")
    if m.dropout:
        raise ConfigError("model.dropout", f"{m.dropout}: {why} without dropout; use model.dropout=0")
    if m.experts:
        raise ConfigError("model.experts", f"{m.experts}: {why} for dense models; use model.experts=0")
    if p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", f"true: {why} without sequence parallelism")
    if p.zero:
        raise ConfigError("parallel.zero", f"{p.zero}: a Keras model's optimizer state stays next to each weight "
                                           f"(KerasModelEngine refuses ZeRO); use parallel.zero=0")
    if p.recompute != "none":
        raise ConfigError("parallel.recompute", f"{p.recompute!r}: KerasModelEngine does not recompute; use "
                                                f"parallel.recompute=none")
    if p.pp > 1 and p.schedule not in SCHEDULES:
        raise ConfigError("parallel.schedule", f"{p.schedule!r}: {why} for {' and '.join(SCHEDULES)} only")


def keras_memory_per_device(cfg: Config, blocks_per_stage: list[int] | None = None) -> dict[int, DeviceMemory]:
    """Device index (mesh order: data, pipe, tensor; as ``parallel.devices`` numbers them) ->
    predicted peak bytes of one ``phalanx.fit`` step of :func:`phalanx.models.transformer.gpt`
    ``(cfg.model)`` on the Keras-model engine.

    ``blocks_per_stage``: the transformer blocks of each pipeline stage, when known from the
    engine's own cut (:func:`phalanx.parallel.keras_graph.split_keras_model`, read by
    :func:`phalanx.train.calibrate.engine_blocks_per_stage`); by default the mesh engine's
    FLOP-balanced cut, :func:`~phalanx.plan.engine_rules.stage_bounds`. The two agree for the
    models measured here (4 and 6 blocks on 2 stages) but not always for a small model whose
    head and loss weigh much (3 blocks of d_model 32: 1 + 2 here, 2 + 1 there).
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _, n = parse_devices(p.devices)
    dp, pp, tp = resolve_degrees(cfg, n or max(p.dp, 1) * max(p.pp, 1) * max(p.tp, 1))
    check_calibrated(cfg, dp)
    spec = ModelSpec.from_config(m)
    if blocks_per_stage is None:
        blocks_per_stage = [b - a for a, b in stage_bounds(spec, pp)]
    if len(blocks_per_stage) != pp or sum(blocks_per_stage) != m.layers:
        raise ValueError(f"blocks_per_stage={blocks_per_stage}: expected {pp} stages holding {m.layers} blocks")
    micro = t.global_batch // p.microbatches
    sched = build_schedule(p.schedule if pp > 1 else "1f1b", pp, p.microbatches, 1)
    _, last_peak = schedule_in_flight(sched.name, pp, p.microbatches, 1)
    e = ACTIVATION_BYTES[cfg.precision.policy]
    cast = e if e < 4 else 0  # a compute-dtype copy of each weight per activation set held
    d, f, s, V = m.d_model, m.ffn_dim, m.seq_len, m.vocab
    whole = layer_activation_bytes(spec, micro, 1, "none", False, e, False, fused=True)
    split_part = layer_activation_bytes(spec, micro, tp, "none", False, e, False, fused=True)
    unsplit = (whole - split_part * tp) / (1 - tp) if tp > 1 else whole

    def params(r: int, tr: int) -> tuple[float, float, float]:
        """(parameters with optimizer slots, mirrored parameters, largest tensor) on (r, tr)."""
        own = blocks_per_stage[r] * _block_params(d, f, tp, tr)
        largest = max(d * f / tp, d * d / tp) if blocks_per_stage[r] else 0.0
        mirror = 0.0
        if r == 0:
            own += V * d / tp + (s * d if tr == 0 else 0)
            largest = max(largest, V * d / tp, s * d if tr == 0 else 0)
        if r == pp - 1:
            own += 2 * d if tr == 0 else 0
            if not m.tie_embeddings:
                own += V * d / tp
            elif pp > 1:
                mirror = V * d / tp
            largest = max(largest, V * d / tp)
        return own, mirror, largest

    out: dict[int, DeviceMemory] = {}
    for r in range(pp):
        for tr in range(tp):
            own, mirror, largest = params(r, tr)
            weights = 4.0 * (own + mirror)
            optimizer = 8.0 * own
            grad = 4.0 * (own + mirror)
            per_set = blocks_per_stage[r] * (split_part if tr == 0 else split_part - unsplit)
            set_bytes = per_set + cast * (own + mirror)
            backward = BACKWARD_MLP_SETS * 4.0 * s * micro * f / tp if blocks_per_stage[r] else 0.0
            head = 0.0
            if r == pp - 1:  # this rank's logits; on rank 0 the final LayerNorm, the gathered logits, Keras's loss
                head = e * s * micro * V / tp
                if tr == 0:
                    head += e * s * micro * d + (e + 4) * s * micro * V
                head *= last_peak
            step = rank_peak(sched, r, set_bytes, grad, backward) + head
            opt = grad + OPT_TEMPORARIES * 4.0 * largest
            if pp == 1 and tr == 0 and t.weight_decay > 0:
                opt += DECAY_PRODUCTS * 4.0 * sum(params(0, k)[0] for k in range(tp))
            if step >= opt:
                mem = DeviceMemory(weights, optimizer, 0.0, step - backward, backward)
            else:
                mem = DeviceMemory(weights, optimizer, grad, 0.0, opt - grad)
            out[r * tp + tr] = mem
    return out
