"""``phalanx train``'s built-in GPT with ZeRO-2/3 and recomputation on the Keras-model engine
(:class:`~phalanx.engines.keras_gpt.KerasGPTEngine`), and its ZeRO checkpoints by slices.

The oracle is Keras's own one-device ``train_on_batch`` of the same Keras model
(:func:`phalanx.models.transformer.gpt` at tp=1, started from
:func:`phalanx.models.gpt.initial_weights`) compiled with the same optimizer, phalanx's AdamW as a
Keras optimizer (:class:`~phalanx.engines.keras_gpt.PhalanxAdamW`: the trainer's schedule,
clipping and decay mask): Keras's forward, backward and apply on one device, none of the engine's
placement, micro-batches, slices or recomputation.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from phalanx import checkpoint
from phalanx.config import ConfigError, load_config
from phalanx.engines.factory import build_engine
from phalanx.engines.keras_gpt import KerasGPTEngine, PhalanxAdamW
from phalanx.engines.task import GPTTask
from phalanx.models import gpt as builtin
from phalanx.models import transformer
from phalanx.parallel import recompute

STEPS = 4
# train.eps 1e-4 (default 1e-8), lr 1e-3: summed in another order (replicas, micro-batches, tensor
# shards, slices) a gradient differs by float32 round-off (<= 1e-7 absolute: tests/test_engine.py,
# test_gradients_equal_one_device_big_batch), which moves an AdamW step by at most ~2 x lr x 1e-7 /
# eps = 2e-6 (derivation: tests/test_engine.py ADAM_EPS), 8e-6 in four steps: weights at atol 1e-5.
# train.clip_norm=0.5 clips every step here (the norms are ~1-2): the clip over all slices is checked.
SMALL = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=64", "model.seq_len=16",
         "train.global_batch=8", "train.lr=1e-3", "train.warmup=1", "train.min_lr_ratio=1", "train.clip_norm=0.5",
         "train.eps=1e-4", f"train.steps={STEPS}", "precision.policy=float32"]
W_RTOL, W_ATOL = 1e-4, 1e-5
MOE = ["model.experts=2", "model.moe_every=2", "model.top_k=2", "model.capacity_factor=0", "model.aux_loss_coef=0"]


def batches(n: int = STEPS) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, (8, 17)).astype(np.int32) for _ in range(n)]


def keras_oracle(cfg, data, policy: str | None = None):
    """Keras's one-device ``train_on_batch`` of the GPT with PhalanxAdamW: losses, clipped-before
    gradient norms per step, and the logical weights after the steps."""
    model = transformer.gpt(cfg.model, seed=cfg.train.seed, dtype_policy=policy)
    decays = {id(part.variable): builtin.decays(name)
              for name, parts in transformer.weight_parts(model).items() for part in parts}
    optimizer = PhalanxAdamW(cfg, decays, "/device:CPU:0")
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses, norms = [], []
    for b in data:
        losses.append(float(model.train_on_batch(b[:, :-1], b[:, 1:])))
        norms.append(float(optimizer.last["grad_norm"].numpy()))
    return losses, norms, transformer.gpt_weights(model)


@pytest.fixture(scope="module")
def oracle():
    cache = {}

    def get(extra: tuple = (), policy: str | None = None):
        if (extra, policy) not in cache:
            cache[(extra, policy)] = keras_oracle(load_config(None, SMALL + list(extra)), batches(), policy)
        return cache[(extra, policy)]

    return get


def phalanx_train_engine(extra: list[str]):
    """The engine ``phalanx train`` builds for ``SMALL + extra`` (engines/factory.py)."""
    cfg = load_config(None, SMALL + extra)
    engine = build_engine(cfg, GPTTask(cfg.model, cfg.precision.policy, cfg.train.seed))
    assert isinstance(engine, KerasGPTEngine)
    return engine


def run(engine, data) -> tuple[list[float], list[float]]:
    out = [engine.train_step(b) for b in data]
    return [float(o["loss"]) for o in out], [float(o["grad_norm"]) for o in out]


def assert_weights(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=W_RTOL, atol=W_ATOL, err_msg=name)


DP2, PP2 = ["parallel.devices=cpu:2", "parallel.dp=2"], ["parallel.pp=2", "parallel.microbatches=2"]
DP2_TP2_PP2 = ["parallel.devices=cpu:8", "parallel.dp=2", "parallel.tp=2"] + PP2
LAYOUTS = {  # id: (the run's keys, model keys both runs share)
    "zero2-dp2-accum2": (DP2 + ["parallel.zero=2", "train.grad_accum=2"], []),
    "zero3-dp2": (DP2 + ["parallel.zero=3"], []),
    "zero2-dp2xtp2xpp2": (DP2_TP2_PP2 + ["parallel.zero=2"], []),
    "zero3-dp2xtp2xpp2": (DP2_TP2_PP2 + ["parallel.zero=3"], []),
    "zero3-dp2xtp2-sequence-parallel": (["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2",
                                         "parallel.sequence_parallel=true", "parallel.zero=3"], []),
    "zero3-dp2xpp2-interleaved": (["parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2",
                                   "parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.zero=3"],
                                  ["model.layers=4"]),
    "recompute-full-pp2": (["parallel.devices=cpu:2"] + PP2 + ["parallel.recompute=full"], []),
    "recompute-selective-tp2-zero3-dp2": (["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2",
                                           "parallel.zero=3", "parallel.recompute=selective"], []),
    "moe-ep2-zero2-recompute-full": (DP2 + ["parallel.ep=2", "parallel.zero=2", "parallel.recompute=full"], MOE),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_phalanx_train_equals_keras_train_on_batch(name, oracle):
    """Losses and clipped norms step by step, then every weight, against Keras's one-device
    ``train_on_batch`` (losses and norms: float32 round-off of the sums in another order)."""
    keys, model_keys = LAYOUTS[name]
    engine = phalanx_train_engine(keys + model_keys)
    want_losses, want_norms, want_weights = oracle(tuple(model_keys))
    losses, norms = run(engine, batches())
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-4)
    assert min(norms) > 0.5  # the clip was active in every step
    assert_weights(engine.weights(), want_weights)
    zero = int(next((k for k in keys if k.startswith("parallel.zero=")), "=0").split("=")[1])
    assert engine.engine.zero == zero


def test_zero3_with_mixed_bfloat16_equals_keras_train_on_batch(oracle):
    """ZeRO-3 at dp2 under mixed_bfloat16 against Keras's one-device run under the same policy:
    the first step's loss agrees to float32 round-off (the same weights, each replica's rows
    computed alike); later steps' weights differ by the bfloat16 rounding of gradients summed in
    another order, which AdamW's step (sign-like for small gradients) turns into weight
    differences of up to lr, so the losses are compared at 1e-3 (measured 4e-5 relative)."""
    engine = phalanx_train_engine(DP2 + ["parallel.zero=3", "precision.policy=mixed_bfloat16"])
    losses, _ = run(engine, batches())
    want, _, _ = oracle(("precision.policy=mixed_bfloat16",), "mixed_bfloat16")
    np.testing.assert_allclose(losses[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(losses, want, rtol=1e-3)


def test_selective_recompute_recomputes_the_gpt_attention_cores(monkeypatch):
    """``parallel.recompute=selective`` on phalanx train's GPT: the recomputed calls are the
    attention cores of its blocks, each a ``(q, k, v)`` of ``[rows, seq, heads / tp, head_dim]``
    per tensor shard and block, and each runs its forward again in the backward (traced again);
    nothing else is recomputed. With ``none`` nothing is. Two accumulation steps run the stage as
    a stage call, traced once and called twice, so each core is recorded once."""
    calls = []
    original = recompute.recompute

    def spy(forward, args, again=None, **kwargs):
        record = {"shapes": [tuple(a.shape) for a in args], "runs": 0}
        calls.append(record)

        def counted(*xs):
            record["runs"] += 1
            return forward(*xs)

        return original(counted, args, again=again, **kwargs)

    monkeypatch.setattr(recompute, "recompute", spy)
    tp2 = ["parallel.devices=cpu:2", "parallel.tp=2", "train.grad_accum=2"]
    phalanx_train_engine(tp2).train_step(batches(1)[0])
    assert calls == []
    phalanx_train_engine(tp2 + ["parallel.recompute=selective"]).train_step(batches(1)[0])
    # 2 blocks x 2 tensor shards, 4 rows each; 2 heads / tp2 = 1 head of 16
    assert len(calls) == 2 * 2
    assert all(c["shapes"] == [(4, 16, 1, 16)] * 3 for c in calls), calls
    assert all(c["runs"] >= 2 for c in calls), calls  # the forward, and again in the backward


def test_zero3_checkpoint_resumes_across_layouts(oracle, tmp_path):
    """A run saved at dp2 x zero=3 writes each replica's slices (weights and AdamW moments) in its
    own shard set, and goes on; the checkpoint resumes on one device, and one saved on one device
    resumes at dp2 x tp2 x zero=3: each gives the uninterrupted losses and weights (Keras's
    one-device run)."""
    data = batches()
    want_losses, _, want_weights = oracle()
    zero3 = phalanx_train_engine(DP2 + ["parallel.zero=3"])
    first, _ = run(zero3, data[:2])
    sets = checkpoint.state_of(zero3)
    assert [s.name for s in sets] == ["dp0-pp0-tp0", "dp1-pp0-tp0"]
    tokens = builtin.weight_shapes(zero3.cfg.model)["embed/tokens"]
    for s in sets:  # each replica holds half of every weight and moment, none whole
        held = [slot for slot in s.slots if slot.name in ("embed/tokens", "optimizer/m/embed/tokens")]
        assert [slot.local_shape for slot in held] == [(tokens[0] // 2, tokens[1])] * 2
    weight_bytes = 4 * sum(int(np.prod(shape)) for shape in builtin.weight_shapes(zero3.cfg.model).values())
    assert abs(sets[1].nbytes - 3 * weight_bytes / 2) <= 3 * 4 * 32 * 2  # weights, m, v; a few padded rows
    saved = checkpoint.save(tmp_path / "zero3", 2, sets)
    rest, _ = run(zero3, data[2:])  # saving leaves the run as it was
    np.testing.assert_allclose(first + rest, want_losses, rtol=1e-5)

    one = phalanx_train_engine(["parallel.devices=cpu:1"])
    checkpoint.load_into(one, checkpoint.restore(saved))
    resumed, _ = run(one, data[2:])
    np.testing.assert_allclose(first + resumed, want_losses, rtol=1e-5)
    assert_weights(one.weights(), want_weights)

    one = phalanx_train_engine(["parallel.devices=cpu:1"])
    first, _ = run(one, data[:2])
    saved = checkpoint.save(tmp_path / "one", 2, checkpoint.state_of(one))
    back = phalanx_train_engine(["parallel.devices=cpu:4", "parallel.dp=2", "parallel.tp=2", "parallel.zero=3"])
    checkpoint.load_into(back, checkpoint.restore(saved))
    resumed, _ = run(back, data[2:])
    np.testing.assert_allclose(first + resumed, want_losses, rtol=1e-5)
    assert_weights(back.weights(), want_weights)
    state = back.state_dict()  # the whole state, gathered from the slices
    assert int(state["optimizer/step"]) == STEPS and np.any(state["optimizer/v/embed/tokens"] > 0)


