"""Peak memory of every device of a configured run, as phalanx's engines place things.

:func:`phalanx.plan.memory.memory_per_device` answers "does the fullest device fit" for
any hardware; this module predicts *each* device of the run ``phalanx train`` would start
with this config, for ``phalanx plan --calibrate`` to compare with measurements. It
follows the engines' placement (read from ``parallel/mesh_engine.py``, ``tensor.py``,
``zero.py``, ``pipeline.py`` and ``train/engine.py``):

* persistent: float32 weights where ``tf.device`` puts them (tensor rank ``t`` holds its
  column/row/vocab slices; replicated LayerNorm parameters, row-parallel biases and the
  position table sit on tensor rank 0; the tied embedding's second copy on the last
  stage), AdamW ``m`` and ``v`` (float32) on each shard's primary device, divided by ``dp``
  under ZeRO >= 1;
* activations: each stage's blocks on its devices (the tensor-parallel split of
  :func:`~phalanx.plan.memory.layer_activation_bytes`, counted as fused kernels keep them:
  phalanx's GPT ops are fused kernels on every device, ``models/gpt_ops.py``) times the
  micro-batches the schedule keeps in flight on that rank;
* gradients: a float32 accumulator per weight on the weight's device;
* the optimizer step of the mesh engine builds flat float32 buffers per parameter group
  (the gradient concatenation, ZeRO pieces; AdamW itself updates in place): ``OPT_BUFFERS``
  of them per parameter held at the peak, measured; TensorFlow's executor starts a group's
  update as soon as its gradients exist, so these overlap the end of the backward;
* the backward: ``GradientTape.gradient`` ops carry no device, so TensorFlow's placer puts
  every one of them on the step function's default device, the mesh's first device
  (measured from the partition graphs: all gradient MatMuls of pp2 and tp2 ran on CPU:0);
  that device holds the backward's working set of every replica: ``MESH_BACKWARD_SETS``
  of one block's activations each (the mesh engine's peak falls in the optimizer step,
  when most of the backward's tensors are gone), and with ``dp > 1`` and ZeRO < 2 the
  first replica's devices also hold the ``add_n`` of all replicas' gradients;
* tf.distribute replicas (``dp`` only) run their own backward and per-variable updates on
  their own devices: covered by the planner's stated 5% overhead.

The two measured factors come from ``--calibrate`` runs on logical CPUs (see
``tests/test_plan_engine.py`` and the figures recorded there).

Example:
    >>> from phalanx.config import load_config
    >>> cfg = load_config(None, ["model.layers=2", "parallel.tp=2", "parallel.devices=cpu:2"])
    >>> mem = engine_memory_per_device(cfg)
    >>> sorted(mem), mem[0].total > mem[1].total     # device 0 also runs the backward
    ([0, 1], True)
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.config import Config, parse_devices, resolve_degrees

# Flat float32 buffers, per parameter a device holds, alive at the peak of the mesh engine's
# optimizer step (concatenated gradient, its pieces, AdamW's temporaries). Measured with
# --calibrate at tp2 and pp2 (4 layers, d_model 256): since AdamW updates in place and the
# GPT's ops are fused kernels (issue 14), no device's peak falls in the optimizer step any
# more (it was 3.0 when AdamW built new m, v and weights).
OPT_BUFFERS = 0.0
# Block activations' worth of gradient tensors alive at the peak on the device that runs the
# mesh engine's backward (measured as above: 0.6 of a block's fused-kernel activations;
# 0.25 of the larger unfused set before issue 14).
MESH_BACKWARD_SETS = 0.6


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted peak bytes of one device, by kind."""

    weights: float
    optimizer: float
    gradients: float
    activations: float
    temporaries: float

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


def engine_memory_per_device(cfg: Config) -> dict[int, DeviceMemory]:
    """Device index (mesh order: data, pipe, tensor; as ``parallel.devices`` numbers them) ->
    predicted peak bytes of one training step of ``cfg``."""
    from phalanx.plan.arithmetic import ModelSpec
    from phalanx.plan.engine_rules import stage_bounds
    from phalanx.plan.memory import (ACTIVATION_BYTES, DEFAULT_OVERHEAD_FRACTION, layer_activation_bytes,
                                     schedule_in_flight)

    m, p, t = cfg.model, cfg.parallel, cfg.train
    _, n = parse_devices(p.devices)
    dp, pp, tp = resolve_degrees(cfg, n or max(p.dp, 1) * max(p.pp, 1) * max(p.tp, 1))
    spec = ModelSpec.from_config(m)
    mesh = tp > 1 or pp > 1 or p.zero > 0 or p.recompute != "none" or p.strategy == "mesh"
    v = p.virtual_stages if p.schedule == "interleaved" else 1
    micro = t.global_batch // (dp * t.grad_accum * p.microbatches)
    bounds = stage_bounds(spec, pp, v)
    peaks, last_peak = schedule_in_flight(p.schedule if pp > 1 else "1f1b", pp, p.microbatches, v)
    e = ACTIVATION_BYTES[cfg.precision.policy]
    d, f, s, V = m.d_model, m.ffn_dim, m.seq_len, m.vocab
    whole = layer_activation_bytes(spec, micro, 1, p.recompute, False, e, False, fused=True)
    split_part = layer_activation_bytes(spec, micro, tp, p.recompute, False, e, False, fused=True)
    # tensor rank 0 keeps the unsplit part (LayerNorms, residual) and its slice of the rest
    unsplit = (whole - split_part * tp) / (1 - tp) if tp > 1 else whole
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
                per_block = (split_part - unsplit) + unsplit if tr == 0 else split_part - unsplit
                per_set = max(sum(b - a for c, (a, b) in enumerate(bounds) if c % pp == r and c == ch)
                              for ch in range(len(bounds))) * per_block
                acts = peaks[r] * per_set
                if r == pp - 1:  # final LayerNorm and this tensor rank's logits and float32 softmax
                    acts += last_peak * ((e * s * micro * d if tr == 0 else 0) + (e + 4) * s * micro * V / tp)
                weights = 4.0 * (params + copy)
                optimizer = 8.0 * params / (dp if p.zero >= 1 else 1)
                grads = 4.0 * (params + copy)
                temps = OPT_BUFFERS * 4.0 * (params + copy) if mesh else 0.0
                if not mesh:
                    # tf.distribute replicas: each runs its own backward and per-variable updates
                    # on its device; the planner's stated overhead covers them (measured: within
                    # 7% at one device and dp2)
                    temps = DEFAULT_OVERHEAD_FRACTION * (weights + optimizer + grads + acts)
                if mesh and dp > 1 and rep == 0 and p.zero < 2:
                    temps += 4.0 * (params + copy)  # the add_n of all replicas' gradients lands here
                if rep == 0 and r == 0 and tr == 0 and mesh:
                    # every replica's backward runs on this one device (see the module docstring)
                    temps += MESH_BACKWARD_SETS * whole * dp
                out[(rep * pp + r) * tp + tr] = DeviceMemory(weights, optimizer, grads, acts, temps)
    return out
