"""What the mesh engine's step holds beyond the model state, measured per device from the
allocator's record (phalanx.train.calibrate, the machinery of `phalanx plan --calibrate`).

* The pipeline adds each micro-batch's weight gradients into one running sum as its backward
  ends, so more micro-batches do not mean more gradient memory (before: every micro-batch's
  gradient stayed alive until one AddN at the end of the step: +1 gradient set per micro-batch).
* ZeRO-1/2 read and update only the replica's piece of the flat parameters (before: every
  replica built a flat float32 copy of all its parameters, and a padded second one, in the
  optimizer step).

A weight-heavy GPT (short sequences, small batch) makes the gradient and optimizer buffers the
step's largest temporaries, so the differences show well above the run-to-run noise (< 2%).
"""

from __future__ import annotations

import numpy as np
import pytest

from phalanx.config import Config
from phalanx.engines.mesh import MeshEngine
from phalanx.engines.task import GPTTask
from phalanx.mesh import Mesh
from phalanx.train.calibrate import _short, _trace_placement, measure_step_memory

MODEL = dict(layers=2, d_model=128, heads=2, ffn=512, vocab=256, seq_len=8)


def _engine(devices, **parallel) -> MeshEngine:
    dp, pp = parallel.get("dp", 1), parallel.get("pp", 1)
    cfg = Config().replace(model=MODEL, train={"global_batch": 16, "warmup": 1},
                           precision={"policy": "float32"}, parallel=parallel)
    return MeshEngine(cfg, Mesh.from_devices(devices[: dp * pp], dp, pp, 1), GPTTask(cfg.model))


def _peaks_above_state(engine) -> dict[str, float]:
    """Each device's peak during one step minus what it holds between steps (variables)."""
    batch = np.random.default_rng(0).integers(0, 256, size=(16, 9)).astype(np.int32)
    placement = _trace_placement(engine, batch)  # the first step traces and allocates
    peaks = [measure_step_memory(engine, batch, placement)[0] for _ in range(2)]
    state = _state_bytes(engine, weights_only=False)
    return {dev: min(p[dev] for p in peaks) - state[dev] for dev in state}


def _state_bytes(engine, weights_only: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    variables = [v for shard in engine.params.shards.values() for copies in shard.copies for v in copies]
    if not weights_only:
        variables += [v for rows in (engine.optimizer.m, engine.optimizer.v) for vs in rows for v in vs]
    for v in variables:
        out[_short(v.device)] = out.get(_short(v.device), 0.0) + v.shape.num_elements() * 4
    return out


@pytest.mark.memory_peak
@pytest.mark.slow  # the profiler's allocation record of 6 steps: 30-50 s at load 10
def test_pipeline_gradients_do_not_grow_with_micro_batches(devices):
    """pp2: 8 micro-batches hold no more than 2 do (+1/4 of a gradient set for noise); each
    rank's weight-gradient set is the step's largest temporary here. Before the running sum,
    m=8 held 4.3 and 4.9 more gradient sets than m=2 on the two ranks (6.7 and 7.0 MB against
    2.8 and 2.4 MB); now both peak in the optimizer step (2.8 and 2.4 MB)."""
    few = _peaks_above_state(_engine(devices, pp=2, microbatches=2))
    many_engine = _engine(devices, pp=2, microbatches=8)
    many = _peaks_above_state(many_engine)
    grad_set = _state_bytes(many_engine, weights_only=True)  # one float32 gradient per weight
    for dev in grad_set:
        assert many[dev] <= few[dev] + 0.25 * grad_set[dev], (dev, many, few, grad_set)


@pytest.fixture(scope="module")
def dp4_zero0(devices) -> dict[str, float]:
    return _peaks_above_state(_engine(devices, dp=4))


@pytest.mark.memory_peak
@pytest.mark.slow  # the profiler's allocation record of 9 steps on 4 devices: 40-60 s at load 10
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_optimizer_temporaries_are_the_replicas_piece(devices, dp4_zero0, zero):
    """dp4: under ZeRO the optimizer step's flat parameters, gradient pieces and AdamW
    temporary are the replica's quarter, so each device's step peak above its state is at
    least 1/4 of a gradient set below zero=0's (which holds a flat copy of the parameters, the
    flat gradient and AdamW's temporary). Measured: zero=0 5.1, 3.4, 3.4, 3.4 MB; zero=1
    2.3-2.5 and zero=2 2.0-2.3 MB (a gradient set is 1.7 MB). Before, ZeRO read every
    parameter into a flat buffer and padded it on every replica: zero=1 3.9, 3.4, 3.4, 3.4 MB
    and zero=2 3.4 MB on every device, no lower than zero=0's on devices 1-3."""
    plain = dp4_zero0
    sharded_engine = _engine(devices, dp=4, zero=zero)
    sharded = _peaks_above_state(sharded_engine)
    grad_set = _state_bytes(sharded_engine, weights_only=True)
    for dev in grad_set:
        assert sharded[dev] <= plain[dev] - 0.25 * grad_set[dev], (dev, sharded, plain, grad_set)
