"""The built-in GPT on the engine ``phalanx train`` routes it to (the Keras-model engine):
gradient accumulation equals one big batch; dp=2 on two logical CPUs equals dp=1; mixed
precision and float16 loss scaling behave. The oracle is Keras's own one-device
``train_on_batch`` of the same Keras model with the same optimizer (tests/gpt_oracle.py)."""

import numpy as np
import pytest

import gpt_oracle
from phalanx.config import Config
from phalanx.engines.factory import make_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines.task import GPTTask
from phalanx.mesh import Mesh

from helpers import ADAM_EPS

TINY = {"layers": 2, "d_model": 32, "heads": 4, "ffn": 64, "vocab": 256, "seq_len": 16}


def tiny_cfg(**train):
    return Config().replace(model=TINY, train={"global_batch": 8, "warmup": 1, "steps": 10, **train})


def batches(n=3, b=8, t=16, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, [b, t + 1]).astype(np.int32) for _ in range(n)]


def engine(cfg, devices, policy="float32"):
    """The engine phalanx train builds for the built-in GPT on ``devices`` (data parallel)."""
    cfg = cfg.replace(precision={"policy": policy}, parallel={"dp": len(devices)})
    built = make_engine(GPTTask(cfg.model, policy, cfg.train.seed), Mesh.from_devices(list(devices), len(devices), 1, 1),
                        cfg)
    assert isinstance(built, KerasGPTEngine)
    return built


def train(e, data):
    return [float(e.train_step(b)["loss"]) for b in data], e.weights()


def assert_weights_close(a, b, rtol=1e-4, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


# Several AdamW steps compared at atol 1e-5 run with train.eps=ADAM_EPS (1e-4; default 1e-8): the
# gradient round-off bounded by test_gradients_equal_one_device_big_batch (1e-7 absolute) then moves a
# step by < 2e-6 at lr 1e-3, 6e-6 in three, inside atol 1e-5 on any CPU (derivation: tests/helpers.py).


@pytest.fixture(scope="module")
def reference():
    """Keras's one-device train_on_batch: (data, (losses, weights), gradient norms)."""
    data = batches()
    losses, norms, weights = gpt_oracle.run(tiny_cfg(eps=ADAM_EPS), data)
    return data, (losses, weights), norms


@pytest.mark.parametrize("replicas, accum", [(1, 4), (2, 1), (2, 2)])
def test_training_matches_one_device(reference, devices, replicas, accum):
    """Three AdamW steps with gradient accumulation, dp=2 and both equal one device with one
    big batch: losses and gradient norms to float32 round-off (the same sums in another order),
    weights within atol 1e-5 (see ADAM_EPS)."""
    data, (losses, weights), norms = reference
    e = engine(tiny_cfg(grad_accum=accum, eps=ADAM_EPS), devices[:replicas])
    got_losses, got_norms = [], []
    for b in data:
        out = e.train_step(b)
        got_losses.append(float(out["loss"]))
        got_norms.append(float(out["grad_norm"]))
    np.testing.assert_allclose(got_losses, losses, rtol=1e-5)
    np.testing.assert_allclose(got_norms, norms, rtol=1e-5)
    assert_weights_close(e.weights(), weights)


def test_state_dict_round_trip_continues_identically(reference, devices):
    data, (losses, weights), _ = reference
    first = engine(tiny_cfg(eps=ADAM_EPS), devices[:1])
    train(first, data[:2])
    second = engine(tiny_cfg(eps=ADAM_EPS), devices[:2])  # another layout
    second.load_state_dict(first.state_dict())
    last_loss, last_weights = train(second, data[2:])
    np.testing.assert_allclose(last_loss, losses[2:], rtol=1e-5)
    assert_weights_close(last_weights, weights)  # atol 1e-5: see ADAM_EPS


def test_state_dict_rejects_other_model(devices):
    small = engine(tiny_cfg(), devices[:1]).state_dict()
    other = Config().replace(model={**TINY, "d_model": 64}, train={"global_batch": 8})
    with pytest.raises(ValueError, match="has shape"):
        engine(other, devices[:1]).load_state_dict(small)


def test_bfloat16_close_to_float32_and_falls(reference, devices):
    data, (losses, _), _ = reference
    bf_losses, _ = train(engine(tiny_cfg(), devices[:1], "mixed_bfloat16"), data)
    np.testing.assert_allclose(bf_losses, losses, rtol=2e-2)


def test_float16_overflow_step_is_skipped_and_counted(devices):
    cfg = tiny_cfg().replace(precision={"policy": "mixed_float16", "loss_scale_init": 1e10})
    e = engine(cfg, devices[:1], "mixed_float16")
    before = e.weights()
    out = e.train_step(batches(1)[0])
    assert float(out["skipped"]) == 1.0
    state = e.state_dict()
    assert state["loss_scale/skipped"] == 1 and state["loss_scale/scale"] == pytest.approx(5e9)
    assert state["optimizer/step"] == 0
    assert_weights_close(e.weights(), before, rtol=0, atol=0)
    # the scale halves until the gradients fit in float16, then training proceeds
    for b in batches(30, seed=1):
        out = e.train_step(b)
    assert float(out["skipped"]) == 0.0 and e.state_dict()["optimizer/step"] > 0
