"""The MoE GPT data parallel (dp > 1) on the engine ``phalanx train`` builds: each replica's
loss has its own balancing loss, and the MoE statistics are the whole batch's.

The balancing loss is a product of two means over the tokens a call sees (Switch eq. 4), so
a data-parallel step's loss is the mean over replicas of ``cross-entropy + balancing loss of
that replica's rows``. The oracles: (1) the one-device model called on each replica's rows,
its balancing loss read from the MoE layers' ``balance`` of that call (not from the losses
the task adds); (2) Keras's own one-device ``train_on_batch`` of the same model with each batch
cut into the replicas' rows x micro-batches, each balanced alone (tests/gpt_oracle.py with
``chunks``: no replica can see another's losses).
The batch is skewed (one replica's rows use 4 token ids) so the replicas' balancing losses
differ, and ``aux_loss_coef`` is large so a mix-up is far above float32 noise."""

from __future__ import annotations

import numpy as np
import pytest

import gpt_oracle
from phalanx.config import Config
from phalanx.engines.factory import make_engine
from phalanx.engines.task import GPTTask
from phalanx.layers.moe import MoE
from phalanx.mesh import Mesh
from phalanx.models import gpt, transformer
from phalanx.train.moe_stats import MoEStats

MODEL = {"layers": 2, "d_model": 32, "heads": 2, "ffn": 32, "vocab": 256, "seq_len": 8, "experts": 4,
         "top_k": 2, "moe_every": 1, "aux_loss_coef": 0.5}

# AdamW epsilon 1e-2 on both sides (default 1e-8): a gradient's float32 round-off d (~1e-7: sums in
# another order) moves a step by at most ~2 x lr x d / eps (derivation: tests/test_engine.py
# ADAM_EPS): 3 steps at lr <= 1e-2 move an element by at most 6e-7, inside the weights' atol 1e-6.
ADAM_EPS = 1e-2


def config(accum: int = 1, **model) -> Config:
    return Config().replace(model={**MODEL, **model},
                            train={"global_batch": 8, "warmup": 1, "steps": 10, "lr": 1e-2, "grad_accum": accum,
                                   "eps": ADAM_EPS},
                            precision={"policy": "float32"})


def skewed_batches(n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        b = rng.integers(0, 256, [8, 9]).astype(np.int32)
        b[4:] %= 4  # the second replica's rows: 4 token ids only, so its routing differs
        out.append(b)
    return out


def random_weights(cfg: Config) -> dict[str, np.ndarray]:
    """Non-zero weights (the built-in initializer zeroes the router: every router uniform)."""
    rng = np.random.default_rng(1)
    return {n: (rng.standard_normal(s) * 0.3).astype(np.float32) for n, s in gpt.weight_shapes(cfg.model).items()}


def engine(cfg: Config, devices: list[str], weights: dict[str, np.ndarray]):
    """The engine phalanx train builds for ``cfg`` data parallel over ``devices``, from ``weights``."""
    cfg = cfg.replace(parallel={"dp": len(devices)})
    e = make_engine(GPTTask(cfg.model, "float32", 0), Mesh.from_devices(list(devices), len(devices), 1, 1), cfg)
    state = e.state_dict()
    state.update(weights)
    e.load_state_dict(state)
    return e


def oracle(cfg: Config, weights: dict[str, np.ndarray], chunks: int) -> gpt_oracle.KerasGPT:
    ref = gpt_oracle.KerasGPT(cfg, chunks=chunks)
    ref.load_weights(weights)
    return ref


def moe_layers(model) -> list[MoE]:
    return [b.moe for b in transformer.blocks(model) if b.moe is not None]


def reference_loss(cfg: Config, weights, rows: np.ndarray) -> float:
    """Cross-entropy + aux_loss_coef x sum over MoE layers of the ``balance`` of one call on
    ``rows`` (a one-device model, eager)."""
    model = GPTTask(cfg.model).build()
    transformer.load_gpt_weights(model, weights)
    logits = model(rows[:, :-1], training=True)
    balances = [float(m.balance.numpy()) for m in moe_layers(model)]
    return float(gpt.lm_loss(logits, rows[:, 1:])) + cfg.model.aux_loss_coef * sum(balances)


def test_dp2_loss_is_the_mean_of_each_replicas_own_loss(devices):
    cfg, batch = config(), skewed_batches(1)[0]
    weights = random_weights(cfg)
    halves = [reference_loss(cfg, weights, batch[:4]), reference_loss(cfg, weights, batch[4:])]
    whole = reference_loss(cfg, weights, batch)
    assert abs(halves[0] - halves[1]) > 1e-2 and abs(np.mean(halves) - whole) > 1e-3  # the test can tell
    two = engine(cfg, devices[:2], weights)
    np.testing.assert_allclose(float(two.eval_step(batch)), np.mean(halves), rtol=1e-5)
    np.testing.assert_allclose(float(two.train_step(batch)["loss"]), np.mean(halves), rtol=1e-5)


@pytest.mark.parametrize("accum", [1, 2])
def test_dp2_trains_as_one_device_with_grad_accum_dp(devices, accum):
    """dp2 x accum = one device with its batch cut into 2 x accum micro-batches: losses, weights
    and the MoE statistics (of the whole step: every replica's micro-batches) step for step;
    capacity drops assignments."""
    weights = random_weights(config())
    two = engine(config(accum, capacity_factor=0.5), devices[:2], weights)
    one = oracle(config(capacity_factor=0.5), weights, chunks=2 * accum)
    stats_two, stats_one = MoEStats(two.model), MoEStats(one.gpt)
    for batch in skewed_batches():
        np.testing.assert_allclose(float(two.train_step(batch)["loss"]), one.train_step(batch)["loss"], rtol=1e-5)
        row_two, row_one = stats_two.read(), stats_one.read()
        assert row_two.keys() == row_one.keys() and row_one["moe_dropped"] > 0
        for key in row_one:
            np.testing.assert_allclose(row_two[key], row_one[key], rtol=1e-5, err_msg=key)
        for m in moe_layers(two.model):  # the whole batch: 2 x accum calls, 8 x 8 tokens x top_k
            calls, _, assignments, _ = (float(np.sum(v.numpy())) for v in m.statistics_totals())
            assert (calls, assignments) == (2 * accum, 8 * 8 * 2)
    d, got = MODEL["d_model"], two.weights()
    for name, value in one.weights().items():
        if name.endswith("attn/qkv/bias"):
            # the key bias: softmax ignores it, so its gradient is float32 rounding noise,
            # which AdamW scales to lr-sized steps: neither run's value is a figure
            keep = np.r_[0:d, 2 * d:3 * d]
            value, got[name] = value[keep], got[name][keep]
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def test_dropout_state_still_advances_under_the_moe_loss(devices):
    """The balancing loss is collected per call, with the call's variable updates applied after
    it: the dropout seeds advance, so two steps on one batch drop different units."""
    cfg = config(dropout=0.5, layers=1)  # one MoE block shows it (each block's step traced for 2 replicas)
    e = engine(cfg, devices[:2], random_weights(cfg))
    seeds = [v for v in e.model.variables if "seed_generator" in v.path]
    assert seeds
    before = [np.asarray(v.numpy()).copy() for v in seeds]
    e.train_step(skewed_batches(1)[0])
    assert any(not np.array_equal(b, np.asarray(v.numpy())) for b, v in zip(before, seeds))


def test_phalanx_train_dp2_rows_equal_one_device_with_grad_accum_2(tmp_path):
    """Through ``phalanx train`` (configs/moe.yaml, small): the logged loss and MoE figures of
    dp2 equal one device with train.grad_accum=2."""
    from pathlib import Path

    from phalanx.cli import main
    from phalanx.train.progress import read_metrics

    config = str(Path(__file__).resolve().parents[1] / "configs" / "moe.yaml")
    small = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=32", "model.seq_len=16",
             "model.aux_loss_coef=0.5", "model.capacity_factor=1.0", "train.global_batch=8", "train.steps=2",
             "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", "precision.policy=float32",
             "data.max_bytes=200000", f"data.cache_dir={tmp_path / 'cache'}"]
    rows = {}
    for run, layout in (("dp2", ["parallel.devices=cpu:2", "parallel.dp=2"]),
                        ("accum2", ["parallel.devices=cpu:1", "parallel.dp=1", "train.grad_accum=2"])):
        assert main(["train", config, "--quiet", *small, *layout, f"run.dir={tmp_path / run}"]) == 0
        rows[run] = read_metrics(tmp_path / run)
    assert len(rows["dp2"]) == len(rows["accum2"]) == 2
    for got, want in zip(rows["dp2"], rows["accum2"]):
        assert want["moe_dropped"] > 0 and want["moe_aux_loss"] > 0
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_balance", "moe_dropped", "moe_load_min", "moe_load_max"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
