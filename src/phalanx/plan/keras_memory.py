"""Peak memory of every device of the Keras-model engine: the planner's one memory model.

:class:`~phalanx.engines.keras_model.KerasModelEngine` trains the built-in GPT for
``phalanx train`` on every layout but parameter servers
(:class:`~phalanx.engines.keras_gpt.KerasGPTEngine`: phalanx's AdamW as a Keras optimizer,
``optimizer="phalanx"``), and any Keras model for ``phalanx.fit`` (here
:func:`phalanx.models.transformer.gpt` compiled as ``phalanx.fit`` compiles a model without an
optimizer: Keras's ``AdamW`` from ``train.*``, :func:`phalanx.train.keras_api.default_optimizer`,
and ``SparseCategoricalCrossentropy(from_logits=True)``; ``optimizer="keras"``). This module
predicts each of its devices (:func:`keras_devices`); :func:`phalanx.plan.memory.memory_per_device`
plans with its fullest device. The terms, as found in the allocator's record of real steps
(``phalanx plan --calibrate`` and ``--keras --calibrate``, :mod:`phalanx.train.calibrate`):

* **placement**: float32 weights where ``tf.device`` puts them (tensor rank ``t`` holds its
  column/row/vocabulary shards; LayerNorms, row-parallel biases and the positions sit on
  tensor rank 0; the tied embedding's mirror on the last stage), a copy of every trainable
  weight on each data replica > 0;
* **activations**: each stage's blocks (the tensor-parallel split of
  :func:`~phalanx.plan.activations.layer_activation_bytes`, fused kernels) times the
  micro-batches the schedule keeps in flight on that rank, walked on the very table the
  executor runs (:func:`rank_peak_parts`; with ``interleaved``, chunk by chunk); under a mixed
  policy each set also keeps the compute-dtype casts of its stage's weights (Keras casts a
  kernel per call and the backward reads the cast); the last stage's logits;
* **gradients**: every backward adds its float32 gradients into one running sum per weight
  (:func:`phalanx.parallel.pipeline.run_schedule`), so a rank holds one gradient set once its
  first backward has run; with ``train.grad_accum > 1`` the engine carries the sums from one
  accumulation step into the next and starts a step on a rank once the previous one ended there,
  so a later step holds them from its start (``summed`` in :func:`rank_peak_parts`);
* **traced stage calls** (:mod:`phalanx.parallel.stage_calls`, which the engine runs when
  ``microbatches x grad_accum > 1``, :func:`stage_calls_used`): a call's backward returns its
  micro-batch's whole gradient set beside the sums and the call's saved activations, one more
  float32 copy of the stage's weights in the backward's working set
  (:data:`CALL_BACKWARD_GRADIENTS`);
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
* **the loss is Keras's on joined logits**: the tied head's logits gathered whole on tensor
  rank 0 of the last stage (``[micro, seq, vocab]`` in the compute dtype, and float32 inside
  the loss), as the engine runs a model with compiled metrics. With no compiled metric the
  engine computes the vocabulary-parallel loss on the shard logits instead
  (:func:`phalanx.engines.keras_model.vocab_loss_plan`) and holds less there: this term is then
  an upper bound (measured 2026-11-26 with it: tp2 +3.3/+2.9%, tp2 x pp2 -1.7..+6.7% in float32,
  every device within the 10% bound; the terms were not refitted);
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

**Expert parallelism** (``phalanx train`` with ``parallel.ep > 1``:
:class:`~phalanx.engines.keras_gpt.KerasGPTEngine`, the same engine with phalanx's AdamW,
``optimizer="phalanx"``; what :func:`phalanx.plan.memory.memory_per_device` plans for those
layouts, :func:`keras_devices`):

* **data replicas**: replicas 1..dp-1 hold a copy of every weight (no optimizer slots); an
  expert shard's copy is its ep group's, held by the group's replica of that shard, so every
  device holds ``experts/ep`` experts of each MoE block. AdamW's moments sit beside the
  weights themselves: replica 0 for the dense ones, group 0's replicas for their shards;
* **experts whole on tensor rank 0**: the MoE layer, its router (float32, whole) and its
  experts run on the replica's tensor rank 0 (experts are not cut by tp);
* **an MoE block's activations**, per micro-batch under balanced routing (each shard runs
  ``top_k`` x a replica's tokens / ``ep`` for each replica of its group): the experts' hidden
  activation (:data:`MOE_HIDDEN_SETS`; the experts' tanh GELU is Keras's, unfused), the routed
  rows split by expert and stitched back (:data:`MOE_ROUTED_COPIES`), the router's float32
  input and probabilities (:data:`MOE_ROUTER`); ``capacity_factor`` < 1 keeps that share of
  the tokens;
* **every replica's calls at once**: a shard's device holds the MoE calls of all ``ep``
  replicas of its group, as when the replicas run concurrently on separate accelerators (each
  replica's forward reaches its backward with its calls on every shard alive).
  ``group_calls=1`` (:func:`keras_devices`) is the other end: one replica's calls at a time;
* **the MoE backward** (:data:`MOE_BACKWARD_SHARDS`, :data:`MOE_HIDDEN_FREED`): each expert's
  slice of a shard gets a gradient of the whole shard's shape before they are summed;
* **mixed precision**: one compute-dtype copy of the device's expert shards through the step
  (:data:`MOE_EXPERT_CASTS`: the engine casts each shard once per device and step);
* **the optimizer phase**: each weight's gradient summed over the replicas on the weight's own
  device, and phalanx's AdamW temporaries (:data:`PHALANX_OPT_TEMPORARIES`; the phase was the
  peak of no measured layout).

Checked (2026-11-26, ``phalanx plan --calibrate``, tests/test_calibrate_keras.py; load 4-8 on 2
cores): 4 layers, d_model 256, seq 128, batch 8, 4 experts in every second block, ``top_k=4``
(every token to every expert: the balanced routing assumed, the same in every step). One CPU
executor runs the replicas in an order that is the same in every step of a run but not from
run to run (it follows the load; the allocator's record showed a shard's device holding one
replica's calls, three of four, or all), so a device's peak moved by up to 48% between runs:
the model is the concurrent end of that range, an upper bound here, and the one-replica figure
(``group_calls=1``) the lower end. With four inter-op threads (the replicas run concurrently,
as the model assumes), error per device, float32: dp2 x ep2 +3.3/+2.5%, dp2 x tp2 x ep2
+1.0/+2.4/-0.7/+5.5%, dp2 x ep2 x pp2 (2 micro-batches) +1.1/+6.3/+0.9/+0.0% (the
constants were read off these); mixed_bfloat16 dp2 x ep2 +3.1/+2.8%; on a shape they were not
read from (d_model 192, seq 96, vocab 512, dp4 x ep2) +4.1/+4.6/+5.8/+5.2%. With one inter-op
thread (``phalanx plan --calibrate``), the planner's figure was 0.7% below to 48.5% above the
measured peak (the one-replica figure 30.7% below to 23.1% above: on the last stage of
dp2 x ep2 x pp2 the peak can come while a call is partly freed); d_model 192 dp4 x ep2
+16.6/+12.0/+4.8/+5.2%. Earlier fits (MOE_HIDDEN_SETS 2.5: half the group's calls) missed the
concurrent order by up to 28% below. With top-2 of 4 at random initialisation the shards'
loads are not balanced and move from step to step (up to 7% between profiled steps; measured
before this refit).

**ZeRO by slices** (``parallel.zero``, :mod:`phalanx.parallel.keras_zero`; byte counts of the
engine's placement, no fitted constant): every trainable variable is cut into ``dp`` slices of
``ceil(rows / dp)`` rows (:func:`slice_elements`, over the GPT's own variable shapes,
:func:`gpt_device_shapes`; an expert shard over the ``dp / ep`` groups that hold it), slice
``k`` on replica ``k``'s device for the variable's stage and tensor rank:

* **zero=1**: each device keeps the whole weights it computes with (replica 0 the variables,
  the others copies), the slices of them and of Adam's ``m`` and ``v`` (float32); the step
  holds the replica's whole gradient sum, as without ZeRO; the update goes weight by weight:
  the all-reduced sum of each is formed whole on every slice's device and the slice cut from it
  (a view, so the whole sum stays until the optimizer has applied), and a replica's own sum of
  it is freed once every device has read it: the update starts with the sums and one weight's
  reduction beside them, and ends with every weight's whole reduced sum;
* **zero=2**: the same state and step; the update sums slices only: it ends with the summed
  slices (``1/dp``), so ZeRO-2 saves over ZeRO-1 where the update's end is a device's peak;
* **zero=3**: between steps only the slices (weights, ``m``, ``v``); in the step the stage's
  weights gathered whole on each replica's devices (float32, kept for every micro-batch and
  the backward; under a mixed policy the backward reads the compute-dtype casts, so the
  gathered weights are held until the rank's last forward) and each replica's running
  gradient sum of every slice on the slice's device: ``dp`` sums of ``1/dp`` (a tied
  embedding's slices get the last stage's sums too); at the update their sum;
* the **host copy** (the CPU of the process: ``model.optimizer``'s whole slots,
  :data:`HOST_SLOTS`, and at zero=3 the model's weights) is not on an accelerator; on logical
  CPUs (``parallel.devices=cpu:N``) the host is device 0, which holds it.

**Recomputation** (``parallel.recompute``, :mod:`phalanx.parallel.recompute`): ``full`` runs a
stage as ``ceil(sqrt(ops))`` recomputed pieces (:func:`full_recompute_ops`): a micro-batch
keeps the pieces' inputs (the residual stream on tensor rank 0) and no weight casts, and the
backward re-runs one piece (its blocks' activations and casts); ``selective`` keeps no
attention core and the backward re-runs one block's core. As stage calls (several micro-batches
or accumulation steps) the same: a call's forward keeps what the pieces keep inline (the saved
set), and its backward adds the call's returned gradients (:data:`CALL_BACKWARD_GRADIENTS`) to the
re-run piece: measured (``--calibrate``, 2026-11-28, load 10) pp2 with 2 micro-batches, full
+8.4/+4.3% (phalanx's AdamW) and +8.4/+3.7% (Keras's), selective -0.1/+0.1%; selective with
``grad_accum=2`` dp2 +3.1/+5.5%, pp2 +2.7/+6.9%. pp2 gpipe with 4 micro-batches, full: +11.8/+15.7%
(inline it was -0.8/+15.2%: the last stage's head is over-counted under ``full``, not the call).

Checked (2026-11-27, ``--keras --calibrate``, tests/test_calibrate_keras.py, 4 layers, d_model
256, seq 128, batch 8): zero=3 dp2 float32 +2.4/+3.6%, mixed_bfloat16 +2.5/+4.3%; dp2 x pp2
float32 -3.9/+5.4/+0.2/+6.3%, mixed_bfloat16 -3.6/+2.8/+2.7/-0.4% (the mixed policy's
gathered-weights rule was read off dp2: counted through the step it gave +16.4/+29.4%); dp2
zero=1 and 2 float32 +1.2/+1.6% (the step phase the peak); with activations so small that
the update is the peak (seq 16, batch 2) dp2 zero=1 +2.5/+2.4%, zero=2 +7.1/+1.2% (the first
formula, every weight's whole reduced sum beside the replicas' sums, gave +26.6% on device 1;
the weight decay's products counted on replica 0's first device only); dp2 zero=3 with ``full`` -0.3/+5.5%, ``selective`` +3.4/+5.3%.
With the stages as stage calls (:data:`CALL_BACKWARD_GRADIENTS`, 2026-11-28): dp2 x pp2 zero=3
float32 +3.1/+4.6/+5.9/+2.6%, mixed_bfloat16 +2.7/+5.0/+5.9/+5.0% (without the term -5.2 to
-16.4%); tp2 x pp2 float32 -3.7/+1.3/+4.6/+4.7% (``--calibrate`` runs it inline).

``phalanx train``'s own layouts, measured with phalanx's AdamW (``phalanx plan --calibrate``,
tests/test_plan_engine.py, 4 layers, d_model 256, seq 128, batch 8, 2026-11-27): dp2 +1.5/+2.2%,
tp2 +3.3/+2.9%, pp2 mixed_bfloat16 +1.1/+5.8%, dp2 x tp2 x pp2 mixed_bfloat16 +0.4..+6.2%, dp2 x
tp2 x pp2 with 4 micro-batches at ZeRO-1 -2.8..+0.8%, dp2 ZeRO-2 +1.2/+1.6%, pp2 with
``recompute=full`` +1.7/-3.7%.

``train.grad_accum=2`` (2026-11-28, ``--keras --calibrate``, tests/test_calibrate_keras.py, 4
layers, d_model 256, seq 128, batch 8, float32; stage calls as the engine runs them, load 8):
dp2 -2.4/-0.9%, pp2 with 2 micro-batches 1f1b -2.8/-1.2%, gpipe -2.8/-0.5%, dp2 zero=2
-1.2/-0.7%, dp2 zero=3 +1.9/+3.0% (no stage calls at ZeRO-3), tp2 +2.1/+2.7% (inline: calibrate
runs no calls under tp); mixed_bfloat16 pp2 1f1b -0.0/+1.8%, dp2 zero=3 +1.0/+1.9%;
``grad_accum=4`` (batch 16) pp2 1f1b -4.6/-1.2%; ``phalanx plan --calibrate`` (phalanx's AdamW)
dp2 -1.2/-0.9%, pp2 1f1b -2.9/+1.2%. No constant was read off these. Before the engine carried the sums and ordered the
steps (each step its own sums, joined at the end; nothing ordered two steps, and with a
pipeline the executor ran the next step's forwards beside the last one's backwards): pp2 1f1b
device 0 held 68.1 MiB, 54.5 MiB after.
Planned but not measured (:func:`keras_devices` models
them, :func:`check_calibrated` refuses to calibrate them): the interleaved schedule (the walk per
chunk), sequence parallelism (every tensor rank keeps ``1/tp`` of a block's activations), dropout (its
masks, :func:`~phalanx.plan.activations.layer_activation_bytes`), ``mixed_float16`` (as
``mixed_bfloat16``: 2-byte activations and casts), the ``zb`` schedule (plan only), ZeRO-3 with
experts (plan only: expert shards sliced over their groups), experts for ``phalanx.fit``
(Keras's AdamW).

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

import functools
import math
from dataclasses import dataclass

from phalanx.config import Config, ConfigError, parse_devices, resolve_degrees
from phalanx.core.costs import RECOMPUTE_MODES, ModelSpec
from phalanx.parallel.schedules import build_schedule, calls_used
from phalanx.plan.engine_rules import stage_bounds
from phalanx.plan.activations import (ACTIVATION_BYTES, in_flight_estimate, layer_activation_bytes,
                                      schedule_in_flight)

# The backward's working set when it starts, in float32 copies of one block's MLP hidden
# activation on a tensor rank (seq x micro-batch x ffn / tp): the GELU's gradient and the
# gradient of the MLP-down matmul's input. Measured at tp2 and tp2 x pp2 (4 layers,
# d_model 256, micro-batches of 8 and 4), float32 and mixed_bfloat16: 2.0-2.1 copies.
BACKWARD_MLP_SETS = 2.0

# A stage call's backward (parallel/stage_calls.py) holds, beyond BACKWARD_MLP_SETS, this many
# float32 copies of the stage's weights on the device: the backward is one function call,
# whose caller holds every tensor the forward saved for it until the call returns, and the
# call returns every gradient of the stage at once (inline, each activation is freed once its
# gradient op has read it, and each gradient is added to the running sum as it is made).
CALL_BACKWARD_GRADIENTS = 1.0
# Under full recomputation inside a stage call, the share of those returned gradients still
# alive beside the re-run block's working set (the call frees the re-run's tensors as its
# gradients form). Fitted: 4 layers d_model 256 pp2 with 2 micro-batches, float32, where one
# device's measured peak moved by up to 10% between runs (40.9-44.5 and 41.9-46.6 MiB); counting
# both whole planned 48.2 / 48.6 MiB, counting the larger only 39.6 / 40.1 MiB.
CALL_RERUN_OVERLAP = 0.5

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

# Keras's per-variable AdamW temporaries are OPT_TEMPORARIES; phalanx's AdamW (KerasGPTEngine)
# decays a weight into a temporary and scales its gradient into another before the fused
# update, one variable after another: float32 copies of the largest weight on the device.
PHALANX_OPT_TEMPORARIES = 2.0
# A mixture-of-experts block's activations beyond its experts' MLPs, on tensor rank 0 of the
# replica (router) or of the expert shard's replica (the rest), per micro-batch and replica call:
# the router keeps a float32 copy of its input and of its probabilities (``MOE_ROUTER`` float32
# copies of tokens x (d_model + experts)); each routed token's assignment is gathered, split by
# expert and its output kept for the gate's gradient (``MOE_ROUTED_COPIES`` compute-dtype
# copies of top_k x tokens x d_model).
MOE_ROUTER = 1.0
MOE_ROUTED_COPIES = 2.0
# The experts' hidden activation per routed assignment and micro-batch, in compute-dtype copies
# of ``ffn`` elements: the MLP-in output and the tanh-approximate GELU's unfused intermediates
# (the experts' GELU is Keras's, not the blocks' fused kernel): 5 per call in the allocator's
# record (the MLP-in output, x^3, its scaled sum with x, 0.5 x, and the GELU's output).
MOE_HIDDEN_SETS = 5.0
# The backward of an MoE block on the shard's device: each expert's slice of the shard's weights
# gets a gradient of the whole shard's shape (StridedSliceGrad) before they are summed; float32
# copies of one block's expert shard alive at once.
MOE_BACKWARD_SHARDS = 5.0
# ... while that block's backward has already freed this many of its MOE_HIDDEN_SETS copies
# (the GELU's intermediates are read once, by the GELU's gradient; fitted with every call of
# the group held: dp2 x ep2 x pp2, where an MoE backward is the first stage's peak).
MOE_HIDDEN_FREED = 4.0
# Compute-dtype copies of a device's expert shard held through the step under a mixed policy: the
# engine casts each shard once per device and step, and every call of the group, every
# micro-batch, reads that copy (keras_model's _expert_casts; 4.0 MiB, both blocks' shards, in the
# allocator's record of dp2 x ep2 mixed_bfloat16).
MOE_EXPERT_CASTS = 1.0

# Float32 bytes per parameter of the whole model that ZeRO keeps on the host (the CPU of the
# process that owns the mesh): ``model.optimizer``'s whole-shaped Adam slots ``m`` and ``v``,
# written at each epoch's end for checkpoints (zero >= 1); under zero=3 the model's own weights
# too (4 more). On logical CPUs the host is device 0.
HOST_SLOTS = 8.0

SCHEDULES = ("1f1b", "gpipe")
POLICIES = ("float32", "mixed_bfloat16")
OPTIMIZERS = ("keras", "phalanx")


def _elements(shape) -> int:
    return math.prod(int(x) for x in shape)


def slice_elements(shape, n: int) -> int:
    """Elements of one of the ``n`` ZeRO slices of a variable of ``shape``, padding included, as
    :class:`phalanx.parallel.keras_zero.SliceLayout` cuts it: ``ceil(rows / n)`` rows of the
    first dimension when it has at least ``n`` rows, else ``ceil(size / n)`` of the flat value.

    >>> slice_elements((5, 2), 2), slice_elements((3,), 4), slice_elements((), 2)
    (6, 1, 1)
    """
    shape = tuple(int(x) for x in shape)
    if n <= 1:
        return _elements(shape)
    if shape and shape[0] >= n:
        return -(-shape[0] // n) * _elements(shape[1:])
    return -(-_elements(shape) // n)


@functools.lru_cache(maxsize=4096)
def _slice_totals(m: ModelSpec, first: int, blocks: int, pp: int, r: int, tp: int, tr: int, ep: int, dp: int,
                  groups: int) -> tuple[float, float]:
    """``(pieces, largest)``: the elements of the ZeRO slices that stage ``r`` on tensor rank ``tr``
    holds (its dense variables cut ``dp`` ways, its expert shards ``groups`` ways) and of the largest
    one. The same for every replica and for every schedule and micro-batch count: cached, since
    the planner's search asks for it thousands of times."""
    dense_shapes, expert_shapes = gpt_device_shapes(m, first, blocks, pp, r, tp, tr, ep)
    cuts = [slice_elements(x, dp) for x in dense_shapes] + [slice_elements(x, groups) for x in expert_shapes]
    return float(sum(cuts)), float(max(cuts, default=0))


def gpt_device_shapes(m: ModelSpec, first: int, blocks: int, pp: int, r: int, tp: int, tr: int,
                      ep: int = 1) -> tuple[list[tuple], list[tuple]]:
    """``(dense, experts)``: the shapes of the trainable variables of
    :func:`phalanx.models.transformer.gpt` that pipeline stage ``r`` (blocks ``first`` to
    ``first + blocks - 1``) holds on tensor rank ``tr`` (the variables homed there: a tied
    embedding's home is the first stage). Tensor shards sit on their rank; whole variables
    (LayerNorms, row-parallel biases, positions, the router) on rank 0; an MoE block's expert
    shard (``experts / ep`` experts) whole on rank 0.

    >>> m = ModelSpec(layers=1, d_model=8, heads=2, ffn=16, vocab=32, seq_len=4)
    >>> dense, _ = gpt_device_shapes(m, 0, 1, 1, 0, 2, 1)      # tensor rank 1 of tp=2
    >>> dense
    [(16, 8), (8, 1, 4), (1, 4), (8, 1, 4), (1, 4), (8, 1, 4), (1, 4), (1, 4, 8), (8, 8), (8,), (8, 8)]
    """
    d, f, h, V, s = m.d_model, m.ffn_dim, m.heads, m.vocab, m.seq_len
    hd, hh = d // h, h // tp
    dense: list[tuple] = []
    experts: list[tuple] = []
    if r == 0:
        dense.append((V // tp, d))
        if tr == 0:
            dense.append((s, d))
    for i in range(first, first + blocks):
        moe = bool(m.experts) and (i + 1) % m.moe_every == 0
        if tr == 0:
            dense += [(d,), (d,)]                              # ln1
        for _ in range(3):                                     # query, key, value and their biases
            dense += [(d, hh, hd), (hh, hd)]
        dense.append((hh, hd, d))                              # attention output
        if tr == 0:
            dense += [(d,), (d,), (d,)]                        # output bias, ln2
        if moe:
            if tr == 0:
                e = m.experts // ep
                dense.append((d, m.experts))                   # router
                experts += [(e, d, f), (e, f), (e, f, d), (e, d)]
        else:
            dense += [(d, f // tp), (f // tp,), (f // tp, d)]  # MLP up, its bias, down
            if tr == 0:
                dense.append((d,))                             # down bias
    if r == pp - 1:
        if tr == 0:
            dense += [(d,), (d,)]                              # final LayerNorm
        if not m.tie_embeddings:
            dense.append((d, V // tp))                         # the head
    return dense, experts


def full_recompute_ops(blocks: int, r: int, pp: int) -> int:
    """Keras ops that hold weights in pipeline stage ``r`` of the GPT (the embedding and positions
    on the first, the final LayerNorm and the head, or the tied embedding's reverse call, on the
    last; a transformer block is one op): ``parallel.recompute=full`` cuts the stage into
    ``ceil(sqrt(ops))`` recomputed blocks (:func:`phalanx.parallel.recompute.cut_stage`)."""
    return blocks + (2 if r == 0 else 0) + (2 if r == pp - 1 else 0)


def check_calibrated(cfg: Config, dp: int, optimizer: str = "keras") -> None:
    """Refuse what this memory model was not checked against, naming the key. ``optimizer``:
    as :func:`keras_memory_per_device`'s (``"phalanx"``: ``phalanx train``'s expert-parallel
    engine, measured with data replicas and experts; ``"keras"``: ``phalanx.fit``'s, without)."""
    m, p = cfg.model, cfg.parallel
    why = "the Keras-engine memory model (phalanx.plan.keras_memory) was measured"
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: one of {OPTIMIZERS}")
    if cfg.precision.policy not in POLICIES:
        raise ConfigError("precision.policy", f"{cfg.precision.policy!r}: {why} under {' and '.join(POLICIES)} "
                                              f"only (mixed_float16 adds Keras's loss-scaling optimizer)")
    if m.dropout:
        raise ConfigError("model.dropout", f"{m.dropout}: {why} without dropout; use model.dropout=0")
    if m.experts and optimizer == "keras":
        raise ConfigError("model.experts", f"{m.experts}: {why} for phalanx.fit of dense models; plan a mixture "
                                           f"of experts as phalanx train runs it (parallel.ep > 1, without --keras)")
    if p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", f"true: {why} without sequence parallelism")
    if p.zero == 3 and p.ep > 1:
        raise ConfigError("parallel.zero", f"3 with parallel.ep={p.ep}: {why} without ZeRO-3 for expert "
                                           f"parallelism (a group's gathered expert shard is not measured yet); "
                                           f"use parallel.zero=2 (or 1, 0) with expert parallelism, or parallel.ep=1")
    if p.pp > 1 and p.schedule not in SCHEDULES:
        raise ConfigError("parallel.schedule", f"{p.schedule!r}: {why} for {' and '.join(SCHEDULES)} only")


def keras_memory_per_device(cfg: Config, blocks_per_stage: list[int] | None = None,
                            optimizer: str | None = None, calls: bool | None = None) -> dict[int, DeviceMemory]:
    """Device index (mesh order: data, pipe, tensor; as ``parallel.devices`` numbers them) ->
    predicted peak bytes of one training step of :func:`phalanx.models.transformer.gpt`
    ``(cfg.model)`` on the Keras-model engine.

    ``optimizer``: ``"keras"``, ``phalanx.fit``'s (Keras's AdamW from ``train.*``), or
    ``"phalanx"``, ``phalanx train``'s for expert parallelism
    (:class:`~phalanx.engines.keras_gpt.KerasGPTEngine`: phalanx's AdamW as a Keras optimizer);
    by default ``"phalanx"`` when ``parallel.ep > 1`` (the layouts ``phalanx train`` runs there),
    else ``"keras"``.

    ``blocks_per_stage``: the transformer blocks of each pipeline stage, when known from the
    engine's own cut (:func:`phalanx.parallel.keras_graph.split_keras_model`, read by
    :func:`phalanx.train.calibrate.engine_blocks_per_stage`); by default the planner's
    FLOP-balanced cut, :func:`~phalanx.plan.engine_rules.stage_bounds`. The two agree for the
    models measured here (4 and 6 blocks on 2 stages) but not always for a small model whose
    head and loss weigh much (3 blocks of d_model 32: 1 + 2 here, 2 + 1 there).

    ``calls``: whether the stages run as stage calls (:func:`stage_calls_used`, the engine's
    rule, by default).
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    kind, n = parse_devices(p.devices)
    dp, pp, tp = resolve_degrees(cfg, n or max(p.dp, 1) * max(p.pp, 1) * max(p.tp, 1))
    optimizer = optimizer or ("phalanx" if p.ep > 1 else "keras")
    check_calibrated(cfg, dp, optimizer)
    return keras_devices(ModelSpec.from_config(m), dp=dp, pp=pp, tp=tp, ep=p.ep, microbatches=p.microbatches,
                         micro_batch=t.global_batch // (dp * t.grad_accum * p.microbatches), schedule=p.schedule,
                         policy=cfg.precision.policy, weight_decay=t.weight_decay, optimizer=optimizer,
                         capacity_factor=m.capacity_factor, blocks_per_stage=blocks_per_stage, zero=p.zero,
                         recompute=p.recompute, host_on_device0=kind == "cpu", accum=t.grad_accum,
                         calls=stage_calls_used(p.microbatches, t.grad_accum, m.experts)
                         if calls is None else calls)


def stage_calls_used(microbatches: int, grad_accum: int, experts: int) -> bool:
    """Whether the engine runs the GPT's pipeline stages as stage calls
    (:class:`~phalanx.parallel.stage_calls.StageCalls`): a replica runs a stage more than once
    (:func:`~phalanx.parallel.schedules.calls_used`), no experts (their layers place ops by
    their inputs' devices); under ``parallel.recompute`` too (the recomputed pieces run inside
    the call).

    >>> stage_calls_used(2, 1, 0), stage_calls_used(1, 2, 0), stage_calls_used(1, 1, 0), stage_calls_used(2, 1, 4)
    (True, True, False, False)
    """
    return calls_used(microbatches, grad_accum) and not experts


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted peak bytes of one device, by kind."""

    weights: float
    optimizer: float
    gradients: float
    activations: float
    temporaries: float
    params: float = 0.0           # parameters whose weights the device holds
    expert_params: float = 0.0    # of them, experts
    in_flight: int = 0            # activation sets (micro-batch x chunk) the device's rank holds at most

    @property
    def total(self) -> float:
        return self.weights + self.optimizer + self.gradients + self.activations + self.temporaries

    def to_dict(self) -> dict:
        return {"total": self.total, "weights": self.weights, "optimizer": self.optimizer,
                "gradients": self.gradients, "activations": self.activations, "temporaries": self.temporaries}


def _block_params(d: int, f: int, tp: int, t: int) -> float:
    """One dense block's parameters on tensor rank ``t``: split kernels and biases, plus (rank 0)
    the replicated LayerNorms and row-parallel biases."""
    split = (3 * d * d + 3 * d + d * d + d * f + f + f * d) / tp
    return split + (4 * d + 2 * d if t == 0 else 0)


def rank_peak(schedule, rank: int, set_bytes, grad_bytes: float, backward_bytes: float,
              summed: bool = False) -> float:
    """Most bytes rank ``rank`` holds while it runs its actions of ``schedule`` (a
    :class:`~phalanx.parallel.schedules.Schedule`): :func:`rank_peak_parts`' first figure.

    >>> from phalanx.parallel.schedules import build_schedule, calls_used
    >>> sched = build_schedule("1f1b", 2, 4, 1)     # rank 0: F0 F1 B0 F2 B1 F3 B2 B3
    >>> rank_peak(sched, 0, set_bytes=10, grad_bytes=1, backward_bytes=0)   # F2 and F3 beside the sum
    21
    """
    return rank_peak_parts(schedule, rank, set_bytes, grad_bytes, backward_bytes, summed)[0]


def rank_peak_parts(schedule, rank: int, set_bytes, grad_bytes: float, backward_bytes: float,
                    summed: bool = False) -> tuple[float, int, int, bool]:
    """The peak of rank ``rank`` walking its actions, and what is alive there: ``(peak,
    activation sets held, gradient sets held (0 or 1), whether a backward's working set is)``.

    Activation sets in flight (``set_bytes`` each, or ``set_bytes[chunk]`` per virtual stage of
    the rank), plus once a backward has run the one float32 running sum of the weight gradients
    (``grad_bytes``: each backward adds its gradients into it before the rank's next action,
    :func:`phalanx.parallel.pipeline.run_schedule`), plus the backward's working set while a
    backward starts. ``summed``: the sum is there from the start (an accumulation step after the
    first: the engine carries the replica's sums from one step into the next). With a split backward (``zb``) a micro-batch's activations and weight gradient go at
    its ``W``.

    >>> from phalanx.parallel.schedules import build_schedule, calls_used
    >>> rank_peak_parts(build_schedule("1f1b", 2, 4, 1), 0, 10, 1, 0)
    (21, 2, 1, False)
    >>> rank_peak_parts(build_schedule("1f1b", 2, 4, 1), 0, 10, 1, 0, summed=True)   # F2, F3 beside the sum
    (21, 2, 1, False)
    >>> rank_peak_parts(build_schedule("interleaved", 2, 2, 2), 0, [10, 1], 1, 0)[:2]   # F0 F1 F0c1 F1c1
    (22, 4)
    """
    per_chunk = set_bytes if isinstance(set_bytes, (list, tuple)) else None
    release = "W" if schedule.split_backward else "B"
    held_bytes = 0
    held = 0
    done = 1 if summed else 0
    best = (done * grad_bytes, 0, done, False)
    for a in schedule.per_stage[rank]:
        size = per_chunk[a.chunk] if per_chunk is not None else set_bytes
        grads = min(done, 1)
        if a.kind == "F":
            held += 1
            held_bytes += size
            if held_bytes + grads * grad_bytes > best[0]:
                best = (held_bytes + grads * grad_bytes, held, grads, False)
        elif a.kind == release:
            if held_bytes + grads * grad_bytes + backward_bytes > best[0]:
                best = (held_bytes + grads * grad_bytes + backward_bytes, held, grads, True)
            held -= 1
            held_bytes -= size
            done += 1
    end = min(done, 1)  # the sum, handed to the optimizer
    return best if end * grad_bytes <= best[0] else (end * grad_bytes, 0, end, False)


def step_peak_estimate(held: int, backwards: int, set_bytes: float, grad_bytes: float,
                       backward_bytes: float, summed: bool = False) -> tuple[float, int, int, bool]:
    """:func:`rank_peak_parts` in closed form (the search's pre-filter), for a rank that holds
    at most ``held`` activation sets and runs ``backwards`` backward actions: the peak is at the
    first backward after the last forward (``held`` sets, the gradient sum if a backward ran
    before), at the next backward (``held - 1`` sets and the sum), at the last backward (one set
    and the sum) or at the end (the sum); ``summed`` as there. Exact for gpipe and
    1f1b (tested against the walk).

    >>> step_peak_estimate(2, 4, 10, 1, 5)     # 1f1b, pp=2, m=4, rank 0: B2 with F2, F3 held
    (26, 2, 1, True)
    """
    n, w = backwards, min(held, backwards)

    def sums(before: int) -> int:  # gradient sets held once ``before`` backwards have run
        return 1 if summed else min(before, 1)

    bwd = backward_bytes
    cands = [(w * set_bytes + sums(n - w) * grad_bytes + bwd, w, sums(n - w), True)]
    if w >= 2:
        cands.append(((w - 1) * set_bytes + grad_bytes + bwd, w - 1, 1, True))
    cands.append((set_bytes + sums(n - 1) * grad_bytes + bwd, 1, sums(n - 1), True))
    cands.append((sums(n) * grad_bytes, 0, sums(n), False))
    return max(cands, key=lambda c: c[0])


def _ranks_to_model(chunk_blocks: list[tuple[int, int]], pp: int, v: int, peaks) -> list[int]:
    """The pipeline ranks whose peaks can differ: the first and the last, and of the middle ranks
    holding the same blocks (their chunks' dense and MoE counts) the ones with the most and the
    fewest activation sets in flight (the peak grows with them): the others lie between."""
    chosen = {0, pp - 1}
    middle: dict[tuple, list[int]] = {}
    for r in range(1, pp - 1):
        middle.setdefault(tuple(chunk_blocks[c * pp + r] for c in range(v)), []).append(r)
    for group in middle.values():
        chosen |= {max(group, key=lambda r: peaks[r]), min(group, key=lambda r: peaks[r])}
    return sorted(chosen)


def keras_devices(spec: ModelSpec, *, dp: int = 1, pp: int = 1, tp: int = 1, ep: int = 1, microbatches: int = 1,
                  micro_batch: int = 1, schedule: str = "1f1b", policy: str = "float32", weight_decay: float = 0.0,
                  optimizer: str = "keras", capacity_factor: float = 0.0,
                  blocks_per_stage: list[int] | None = None, exact: bool = True,
                  distinct: bool = False, group_calls: int | None = None, zero: int = 0, recompute: str = "none",
                  host_on_device0: bool = False, virtual_stages: int = 1, sequence_parallel: bool = False,
                  accum: int = 1, fused: bool = True, calls: bool = False) -> dict[int, DeviceMemory]:
    """:func:`keras_memory_per_device` from the model's shape and the layout's degrees (what
    the planner's :func:`phalanx.plan.memory.memory_per_device` has), unchecked: device index
    -> predicted peak bytes. ``micro_batch``: sequences per micro-batch of one replica.
    ``exact=False``: closed-form schedule peaks (:func:`step_peak_estimate`, for big tables).
    ``distinct=True``: only the devices that can differ (replica 0, a replica holding expert
    shards' slots, one holding copies only; tensor ranks 0 and 1; the pipeline ranks of
    :func:`_ranks_to_model`), for the planner. ``group_calls``: how many replicas of an ep
    group have their MoE calls on a shard's device alive at once: ``ep`` (the default) when the
    replicas run concurrently, as on separate accelerators (every replica's forward reaches the
    backward with its calls held); 1 when an executor runs one replica's forward and backward
    after another's (the least a shard's device can hold; one CPU executor orders the replicas
    in between, from run to run: the module docstring). ``virtual_stages``: model chunks per
    pipeline rank (the ``interleaved`` schedule; chunk ``c`` on rank ``c % pp``).
    ``sequence_parallel``: the blocks' LayerNorm, dropout and residual on sequence chunks (every
    tensor rank holds ``1/tp`` of a block's activations). ``accum``: ``train.grad_accum``.
    ``fused``: activations as fused kernels keep them (:func:`layer_activation_bytes`).
    ``calls``: the stages run as stage calls (:data:`CALL_BACKWARD_GRADIENTS`).

    >>> m = ModelSpec(layers=2, d_model=64, heads=4, ffn=128, vocab=256, seq_len=32, experts=4, top_k=2)
    >>> mem = keras_devices(m, dp=4, ep=2, optimizer="phalanx")
    >>> [round(mem[i].expert_params) for i in range(4)]   # 2 of 4 experts in each of 2 MoE blocks per device
    [66304, 66304, 66304, 66304]
    >>> mem[0].optimizer > mem[1].optimizer > mem[2].optimizer == 0   # slots: dense on 0, experts on group 0
    True
    >>> serial = keras_devices(m, dp=4, ep=2, optimizer="phalanx", group_calls=1)
    >>> serial[0].total < mem[0].total and serial[0].weights == mem[0].weights   # fewer calls held, same state
    True
    """
    m = spec
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: one of {OPTIMIZERS}")
    if accum < 1:
        raise ValueError(f"accum={accum}: train.grad_accum is at least 1")
    group_calls = ep if group_calls is None else group_calls
    if not 1 <= group_calls <= max(ep, 1):
        raise ValueError(f"group_calls={group_calls}: between 1 and ep={ep} replicas' calls")
    v = virtual_stages if pp > 1 else 1
    chunks = pp * v
    if blocks_per_stage is None:
        blocks_per_stage = [b - a for a, b in stage_bounds(spec, pp, v)]
    if len(blocks_per_stage) != chunks or sum(blocks_per_stage) != m.layers:
        raise ValueError(f"blocks_per_stage={blocks_per_stage}: expected {chunks} stages holding {m.layers} blocks")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero}: one of 0, 1, 2, 3")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}: one of {RECOMPUTE_MODES}")
    first = [sum(blocks_per_stage[:c]) for c in range(chunks)]
    n_moe = [sum(1 for i in range(first[c], first[c] + blocks_per_stage[c])
                 if m.experts and (i + 1) % m.moe_every == 0) for c in range(chunks)]
    n_dense = [blocks_per_stage[c] - n_moe[c] for c in range(chunks)]
    micro = micro_batch
    name = schedule if pp > 1 else "1f1b"
    if exact:
        sched = build_schedule(name, pp, microbatches, v)
        peaks, last_peak = schedule_in_flight(name, pp, microbatches, v)
    else:
        peaks, last_peak = in_flight_estimate(name, pp, microbatches, v)

    def step_peak(r: int, set_bytes: list[float], grad: float, backward: float) -> tuple[float, float, bool]:
        """(peak, gradient bytes held there, whether a backward's working set is) of the rank's
        fullest accumulation step: with ``accum > 1`` a later one, which starts with the sums"""
        if exact:
            peak, _, n_grads, in_bwd = rank_peak_parts(sched, r, set_bytes if v > 1 else set_bytes[0], grad,
                                                       backward, accum > 1)
        else:
            peak, _, n_grads, in_bwd = step_peak_estimate(peaks[r], microbatches * v, max(set_bytes), grad,
                                                          backward, accum > 1)
        return peak, n_grads * grad, in_bwd

    e = ACTIVATION_BYTES[policy]
    cast = e if e < 4 else 0  # a compute-dtype copy of each weight per activation set held
    d, f, s, V, E, k = m.d_model, m.ffn_dim, m.seq_len, m.vocab, m.experts, m.top_k
    # selective recomputation: the attention cores' activations are not kept (their term is
    # in the tensor-split part); full: handled per stage below, from the blocks' activations
    kept_mode = "selective" if recompute == "selective" else "none"
    whole = layer_activation_bytes(spec, micro, 1, kept_mode, False, e, False, fused=fused)
    split_part = layer_activation_bytes(spec, micro, tp, kept_mode, False, e, False, fused=fused)
    unsplit = (whole - split_part * tp) / (1 - tp) if tp > 1 else whole
    if sequence_parallel and tp > 1:  # every tensor rank holds 1/tp of all of it
        split_part = layer_activation_bytes(spec, micro, tp, kept_mode, True, e, False, fused=fused)
        unsplit = 0.0
    tokens = s * micro                     # one micro-batch of one replica
    # MoE block (module docstring): the attention's share as a dense block's; the experts run on
    # tensor rank 0 of the shard's replica, on top_k x its own tokens under balanced routing
    # (capacity_factor < 1 keeps that share of them)
    # ... group_calls of the group's ep calls (top_k x tokens / ep rows each) held at once
    kept = k * (min(capacity_factor, 1.0) if capacity_factor > 0 else 1.0) * group_calls / max(ep, 1)
    moe_acts = kept * tokens * (MOE_HIDDEN_SETS * e * f + MOE_ROUTED_COPIES * e * d) + MOE_ROUTER * 4 * tokens * (d + E)
    expert_block = E / ep * (2 * d * f + f + d) if E else 0.0

    def params(c: int, tr: int) -> tuple[float, float, float, float]:
        """(dense parameters, mirrored parameters, expert parameters, largest tensor) of model
        stage ``c`` on tensor rank ``tr``."""
        own = n_dense[c] * _block_params(d, f, tp, tr)
        own += n_moe[c] * ((4 * d * d + 3 * d) / tp + (4 * d + d + d * E if tr == 0 else 0))
        experts = n_moe[c] * expert_block if tr == 0 else 0.0
        largest = max(d * f / tp, d * d / tp) if blocks_per_stage[c] else 0.0
        if n_moe[c] and tr == 0:
            largest = max(largest, E / ep * d * f)
        mirror = 0.0
        if c == 0:
            own += V * d / tp + (s * d if tr == 0 else 0)
            largest = max(largest, V * d / tp, s * d if tr == 0 else 0)
        if c == chunks - 1:
            own += 2 * d if tr == 0 else 0
            if not m.tie_embeddings:
                own += V * d / tp
            elif pp > 1:
                mirror = V * d / tp
            largest = max(largest, V * d / tp)
        return own, mirror, experts, largest

    def rank_params(r: int, tr: int) -> tuple[float, float, float, float]:
        parts = [params(c, tr) for c in range(r, chunks, pp)]
        return (sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts),
                max(p[3] for p in parts))

    sliced = zero and dp > 1
    groups = max(dp // max(ep, 1), 1)      # the replicas that slice an expert shard: one per ep group
    host = 0.0
    if sliced and host_on_device0:         # the host copy (module docstring), whole, on device 0 here
        total = sum(sum(map(_elements, dense)) + sum(map(_elements, experts))
                    for c in range(chunks) for j in range(tp)
                    for dense, experts in [gpt_device_shapes(m, first[c], blocks_per_stage[c], chunks, c, tp, j, 1)])
        host = (HOST_SLOTS + (4.0 if zero == 3 else 0.0)) * total
    core_one = e * m.heads / tp * s * s * micro     # one block's attention core, recomputed (selective)

    out: dict[int, DeviceMemory] = {}
    replicas = sorted({0, min(1, dp - 1), min(ep, dp - 1)}) if distinct else range(dp)
    chunk_blocks = [(n_dense[c], n_moe[c]) for c in range(chunks)]
    ranks = _ranks_to_model(chunk_blocks, pp, v, peaks) if distinct else range(pp)
    for rep in replicas:
        for r in ranks:
            rank_chunks = list(range(r, chunks, pp))
            for tr in (sorted({0, min(1, tp - 1)}) if distinct else range(tp)):
                own, mirror, experts, largest = rank_params(r, tr)
                held = own + mirror + experts          # every replica reads its own copy; an expert shard's
                weights = 4.0 * held                   # copy is its group's (one per device)
                # slots (float32 m and v) next to each variable; replicas > 0 hold copies only, except
                # that group 0's replicas hold the expert shards themselves
                slotted = (own if rep == 0 else 0.0) + (experts if rep < ep else 0.0)
                optimizer_b = 8.0 * slotted
                grad = 4.0 * held
                pieces = 0.0        # ZeRO: this device's slice of every variable homed on it (padded)
                largest_piece = 0.0
                if sliced:
                    for c in rank_chunks:
                        p_c, l_c = _slice_totals(m, first[c], blocks_per_stage[c], chunks, c, tp, tr, ep, dp, groups)
                        pieces += p_c
                        largest_piece = max(largest_piece, l_c)
                    optimizer_b = 8.0 * pieces                          # every replica: its slices' m and v
                    weights = 4.0 * (held + pieces) if zero < 3 else 4.0 * pieces
                gathered = 4.0 * held if sliced and zero == 3 else 0.0  # the stage's weights, gathered for the step
                if sliced and zero == 3:
                    # each replica's running sum of every slice lives on the slice's device until the
                    # step joins them: dp partial sums of this device's slices (and, on the first stage,
                    # those of the tied embedding's slices from the last stage's use of it)
                    mirror_pieces = slice_elements((V // tp, d), dp) if r == 0 and m.tie_embeddings and pp > 1 \
                        else 0
                    grad = 4.0 * dp * (pieces + mirror_pieces)
                set_bytes, backward = [], 0.0
                for c in rank_chunks:
                    own_c, mirror_c, _, _ = params(c, tr)
                    per_set = n_dense[c] * (split_part if tr == 0 else split_part - unsplit)
                    attention = split_part - 2 * e * tokens * f / tp          # a block without its MLP share
                    per_set += n_moe[c] * ((attention + moe_acts) if tr == 0 else attention - unsplit)
                    cast_set = cast * (own_c + mirror_c)  # the forward's compute-dtype weights, kept for the backward
                    bwd = BACKWARD_MLP_SETS * 4.0 * tokens * f / tp if n_dense[c] else 0.0
                    if n_moe[c] and tr == 0:
                        bwd = max(bwd, MOE_BACKWARD_SHARDS * 4.0 * expert_block
                                  - MOE_HIDDEN_FREED * e * kept * tokens * f)
                    if calls:
                        # a stage call's backward is one call: it holds the micro-batch's saved tensors
                        # until it ends, when the float32 gradients of the stage's weights it returns
                        # are all made and its first block's working set is still alive
                        bwd += CALL_BACKWARD_GRADIENTS * 4.0 * (own_c + mirror_c)
                    if recompute == "full" and blocks_per_stage[c]:
                        # the stage runs as ceil(sqrt(ops)) recomputed blocks: a set keeps their inputs (the
                        # residual stream, on tensor rank 0), the backward re-runs one block at a time
                        pieces_n = math.ceil(math.sqrt(full_recompute_ops(blocks_per_stage[c], c, chunks)))
                        per_block = per_set / blocks_per_stage[c]
                        rerun = math.ceil(blocks_per_stage[c] / pieces_n) * (per_block + cast * (own_c + mirror_c)
                                                                              / blocks_per_stage[c])
                        if calls:  # the re-run block's working set and the returned gradients overlap in part
                            rerun -= (1.0 - CALL_RERUN_OVERLAP) * CALL_BACKWARD_GRADIENTS * 4.0 * (own_c + mirror_c)
                        bwd += rerun
                        per_set = pieces_n * e * tokens * d if tr == 0 else 0.0
                        cast_set = 0.0
                    elif recompute == "selective" and blocks_per_stage[c]:
                        bwd += core_one
                    set_bytes.append(per_set + cast_set)
                    backward = max(backward, bwd)
                head = 0.0
                if r == pp - 1:  # this rank's logits; on rank 0 the final LayerNorm, the gathered logits, the loss
                    head = e * tokens * V / tp
                    if tr == 0:
                        # Keras's loss makes a float32 copy of the logits; phalanx's TokenCrossEntropy
                        # reads them in their own dtype (layers/losses.py)
                        head += e * tokens * d + (e + (0 if optimizer == "phalanx" else 4)) * tokens * V
                    head *= last_peak
                # train.grad_accum > 1: each backward of a later accumulation step adds into the sums
                # carried from the earlier steps (a stage call's whole gradient set: in ``backward``)
                step, grads_held, in_bwd = step_peak(r, set_bytes, grad, backward)
                step += head + cast * MOE_EXPERT_CASTS * experts
                if gathered and cast:
                    # under a mixed policy the gathered float32 weights are read by the stage's forwards
                    # only (each casts them; the backward reads the casts): whole until the rank's last
                    # forward starts, beside the sets then in flight (one fewer than its peak) and the
                    # gradient sums if a backward ran before it; that forward frees them layer by layer
                    before = grad if microbatches > peaks[r] or accum > 1 else 0.0
                    forward_end = gathered + max(peaks[r] - 1, 0) * max(set_bytes) + before + \
                        cast * MOE_EXPERT_CASTS * experts
                    if forward_end > step:
                        step, working, grads_held = forward_end, 0.0, before
                    else:
                        gathered, working = 0.0, backward if in_bwd else 0.0
                else:
                    step += gathered
                    working = backward if in_bwd else 0.0
                # the optimizer phase: the gradients summed on each weight's own device
                summed = 4.0 * ((own + mirror if rep == 0 else 0.0) + (experts if rep < ep else 0.0))
                if sliced:
                    # The update, variable by variable: zero 1 forms each weight's all-reduced sum whole
                    # on every slice's device and cuts its slice from it (a view: the whole sum stays
                    # until the optimizer has applied), zero 2 sums each slice only; a replica's own
                    # sum of a weight is freed once every device has read it. So the update starts
                    # with the step's gradient sums and one weight's reduction beside them, and ends
                    # with the reduced sums (zero 1 whole, zero 2 slices), Adam's temporaries on a
                    # slice and one weight joined from its slices onto each copy (the all-gather).
                    # zero 3: the replicas' partial sums of this device's slices, then their sum.
                    if zero == 3:
                        summed = (dp + 1) * 4.0 * pieces
                        opt = summed + OPT_TEMPORARIES * 4.0 * largest_piece
                    else:
                        reduced = 4.0 * (own + experts) if zero == 1 else 4.0 * pieces
                        start = grad + (4.0 * largest if zero == 1 else 4.0 * largest_piece)
                        end = reduced + OPT_TEMPORARIES * 4.0 * largest_piece
                        summed = grad if start >= end else reduced
                        opt = max(start, end)
                    if optimizer == "keras" and pp == 1 and (rep, tr) == (0, 0) and weight_decay > 0:
                        # the slices' decay products, all on the first device (none measured elsewhere)
                        opt += DECAY_PRODUCTS * 4.0 * sum(params(0, j)[0] for j in range(tp))
                elif optimizer == "keras":
                    opt = summed + OPT_TEMPORARIES * 4.0 * largest
                    if pp == 1 and (rep, tr) == (0, 0) and weight_decay > 0:  # replica 0 holds the weights
                        opt += DECAY_PRODUCTS * 4.0 * sum(params(0, j)[0] for j in range(tp))
                else:
                    opt = summed + (PHALANX_OPT_TEMPORARIES * 4.0 * largest if summed else 0.0)
                device_host = host if (rep, r, tr) == (0, 0, 0) else 0.0
                if step >= opt:
                    mem = DeviceMemory(weights + gathered + device_host, optimizer_b, grads_held,
                                       step - working - gathered - grads_held, working, held, experts, peaks[r])
                else:
                    mem = DeviceMemory(weights + device_host, optimizer_b, summed, 0.0, opt - summed, held, experts,
                                       peaks[r])
                out[(rep * pp + r) * tp + tr] = mem
    return out
