"""Under a mixed policy the Keras-model engine casts each expert shard once per device and step.

Every replica of an ep group reads the shard on the shard's device; each used to cast it to
the compute dtype for its own call, so a device held one bfloat16 copy per reading call
between its forward and its backward (measured, dp4 x ep2, 4 layers, d_model 256: two copies
of every shard at each device's peak). The engine now casts it once and every call reads that
copy (:func:`phalanx.layers.moe.attach_compute_copy`; under ZeRO-3 the copy is cast where the
group's one gathered shard is made). The oracle is the per-call cast itself
(the engine without the hand-over): the same losses, norms and weights, bit for bit.
"""

import doctest

import numpy as np
import pytest
import tensorflow as tf

from phalanx.config import load_config
from phalanx.engines import keras_model
from phalanx.engines.factory import build_engine
from phalanx.engines.task import GPTTask
from phalanx.layers import moe

MODEL = ["model.layers=2", "model.d_model=16", "model.heads=2", "model.ffn=32", "model.seq_len=8",
         "model.experts=4", "model.top_k=2", "model.moe_every=2", "model.aux_loss_coef=0.01",
         "train.global_batch=8", "train.warmup=1", "precision.policy=mixed_bfloat16"]


def expert_casts(engine) -> dict[str, int]:
    """Device -> bfloat16 casts of a whole expert-shard matrix (w_in ``[E/ep, d, f]``, w_out
    ``[E/ep, f, d]``) in the traced training step."""
    (step,) = engine.engine._train_fn._list_all_concrete_functions_for_serialization()
    shapes = {(2, 16, 32), (2, 32, 16)}
    counts: dict[str, int] = {}
    for op in step.graph.get_operations():
        if op.type == "Cast" and op.outputs[0].dtype == tf.bfloat16 and tuple(op.outputs[0].shape) in shapes:
            device = tf.DeviceSpec.from_string(op.device)
            key = f"{device.device_type}:{device.device_index}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def run(layout: list[str], steps: int = 2):
    cfg = load_config(None, MODEL + layout)
    engine = build_engine(cfg, GPTTask(cfg.model))
    batches = [np.random.default_rng(i).integers(0, 256, [8, 9]).astype(np.int32) for i in range(steps)]
    outs = [{k: float(v) for k, v in engine.train_step(b).items()} for b in batches]
    return engine, outs, engine.weights(), float(engine.eval_step(batches[0]))


@pytest.mark.slow
@pytest.mark.parametrize("layout, per_call", [
    (["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"], 2),
    (["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", "parallel.zero=1"], 2),
    (["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2", "train.grad_accum=2"], 4),
    # ZeRO-3: the shard is gathered on its owner once for the group, and cast where it is gathered
    (["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", "parallel.zero=3"], 2),
])
def test_one_cast_per_device_and_the_same_training_as_a_cast_per_call(monkeypatch, layout, per_call):
    engine, outs, weights, evaluated = run(layout)
    block = engine.model.get_layer("block_1").moe
    assert block.compute_dtype == "bfloat16" and block.w_in[0].dtype == "float32"
    once = expert_casts(engine)
    # each device holds one shard of each weight matrix of the one MoE block: w_in and w_out
    assert once and set(once.values()) == {2}, once

    # the oracle: every call casts the shard it reads (the engine before the hand-over)
    monkeypatch.setattr(keras_model.KerasModelEngine, "_expert_dtypes", lambda self: {})
    ref, ref_outs, ref_weights, ref_evaluated = run(layout)
    per_call_casts = expert_casts(ref)
    assert set(per_call_casts) == set(once) and set(per_call_casts.values()) == {2 * per_call}, per_call_casts
    assert outs == ref_outs and evaluated == ref_evaluated
    for name in weights:
        np.testing.assert_array_equal(weights[name], ref_weights[name], err_msg=name)


def test_float32_casts_nothing(devices):
    cfg = load_config(None, [m for m in MODEL if not m.startswith("precision")] +
                      ["precision.policy=float32", "parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"])
    engine = build_engine(cfg, GPTTask(cfg.model))
    engine.train_step(np.zeros([8, 9], np.int32))
    (step,) = engine.engine._train_fn._list_all_concrete_functions_for_serialization()
    assert not [op for op in step.graph.get_operations() if op.type == "Cast" and op.outputs[0].dtype == tf.bfloat16]


def test_doctests():
    assert doctest.testmod(moe).failed == 0
