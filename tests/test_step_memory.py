"""What a step holds beyond the model state, measured per device from the allocator's record
(phalanx.train.calibrate, the machinery of `phalanx plan --calibrate`).

The pipeline executor (the engine phalanx train builds) adds each micro-batch's weight
gradients into one running sum as its backward ends, so more micro-batches do not mean more
gradient memory (before: every micro-batch's gradient stayed alive until one AddN at the end
of the step: +1 gradient set per micro-batch).

A weight-heavy GPT (short sequences, small batch) makes the gradient buffers the step's
largest temporaries, so the differences show well above the run-to-run noise (< 2%).
"""

from __future__ import annotations

import numpy as np
import pytest

from phalanx.config import Config
from phalanx.engines.factory import make_engine
from phalanx.engines.task import GPTTask
from phalanx.mesh import Mesh
from phalanx.train.calibrate import _short, _trace_placement, measure_step_memory

MODEL = dict(layers=2, d_model=128, heads=2, ffn=512, vocab=256, seq_len=8)


def _routed_engine(devices, **parallel):
    """The engine phalanx train builds for the layout (engines/factory.py)."""
    dp, pp = parallel.get("dp", 1), parallel.get("pp", 1)
    cfg = Config().replace(model=MODEL, train={"global_batch": 16, "warmup": 1},
                           precision={"policy": "float32"}, parallel=parallel)
    return make_engine(GPTTask(cfg.model), Mesh.from_devices(devices[: dp * pp], dp, pp, 1), cfg)


def _peaks_above_state(engine, steps: int = 2) -> dict[str, float]:
    """Each device's peak during one step minus what it holds between steps (variables): the
    least over ``steps`` profiled steps (the executor's inter-op threads order independent ops
    differently from step to step, and a device's step peak with them)."""
    batch = np.random.default_rng(0).integers(0, 256, size=(16, 9)).astype(np.int32)
    placement = _trace_placement(engine, batch)  # the first step traces and allocates
    peaks = [measure_step_memory(engine, batch, placement)[0] for _ in range(steps)]
    state = _state_bytes(engine, weights_only=False)
    return {dev: min(p[dev] for p in peaks) - state[dev] for dev in state}


def _state_bytes(engine, weights_only: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    # the Keras-model engine: the model's variables where they were placed, AdamW slots beside them
    variables = [v.value for v in engine.model.trainable_variables]
    if not weights_only:
        variables += [v.value for v in engine.optimizer.m + engine.optimizer.v]
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
    few = _peaks_above_state(_routed_engine(devices, pp=2, microbatches=2))
    many_engine = _routed_engine(devices, pp=2, microbatches=8)
    many = _peaks_above_state(many_engine)
    grad_set = _state_bytes(many_engine, weights_only=True)  # one float32 gradient per weight
    print("pp2 step peaks above state: m=2", few, "m=8", many, "gradient set", grad_set)
    # (the same model state is subtracted on both sides: the bound is on the peaks' difference; on
    # the Keras-model engine the figures above state measured negative, -0.4 to -0.9 MB, and m=8
    # within 12 bytes of m=2 on CPU:0, 0.24 MB lower on CPU:1)
    for dev in grad_set:
        assert many[dev] <= few[dev] + 0.25 * grad_set[dev], (dev, many, few, grad_set)
