"""Sequence parallelism of the built-in GPT on the engine ``phalanx train`` builds for it (the
Keras-model engine), and the positional dropout masks every layout draws.

Oracles: Keras's own one-device ``train_on_batch`` of the same Keras model
(tests/gpt_oracle.py, as in tests/test_parallel.py); the masks against a NumPy implementation
of their hash. Dropout on every layout (sequence parallelism included) is
tests/test_keras_gpt_dropout_prune.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import assert_same_run as same_run
import gpt_oracle
from phalanx.config import Config, ConfigError
from phalanx.engines.factory import build_engine, make_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines.task import GPTTask
from phalanx.layers import dropout as dropout_lib
from phalanx.mesh import Mesh

from helpers import ADAM_EPS

STEPS = 3
MODEL = dict(layers=2, d_model=32, heads=4, ffn=64, vocab=256, seq_len=16)
# Weights: AdamW with train.eps=ADAM_EPS (1e-4; default 1e-8). With a tiny eps an element whose
# gradient is ~0 turns float round-off into a step of up to lr either way (measured 2.8e-5 here, 1
# element in 2048, with eps 1e-8: more on another CPU); with 1e-4 a gradient round-off d (~1e-7)
# moves a step by at most ~2 x lr x d / eps = 2e-6, 6e-6 in the STEPS compared (derivation:
# tests/helpers.py ADAM_EPS). A wrong gradient moves a weight by ~lr = 1e-3 per step, so atol 5e-5
# (as tests/test_parallel.py) still catches every real bug.
RTOL, W_ATOL = 1e-5, 5e-5


def make_cfg(dropout: float = 0.0, **parallel) -> Config:
    return Config().replace(model={**MODEL, "dropout": dropout}, precision={"policy": "float32"},
                            train={"global_batch": 4, "warmup": 1, "steps": 10, "lr": 1e-3, "eps": ADAM_EPS}, parallel=parallel)


def batches(n: int = STEPS) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size=(4, MODEL["seq_len"] + 1)).astype(np.int32) for _ in range(n)]


def train(engine) -> tuple[list[float], dict]:
    losses = [float(engine.train_step(b)["loss"]) for b in batches()]
    return losses, engine.weights()


def assert_same_run(got, want):
    same_run(got, want, RTOL, W_ATOL)


# -- the positional masks against NumPy ------------------------------------------------------


def _fmix32(h):
    h = h.astype(np.uint64)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_keep_mask_is_the_documented_hash_and_slices_like_the_whole():
    key, rate = dropout_lib.fold(7, 2, 1), 0.25
    b, t, d = 3, 10, 12
    k = np.uint64(int(key.numpy()))
    rows, pos, f = np.arange(b, dtype=np.uint64), np.arange(t, dtype=np.uint64), np.arange(d, dtype=np.uint64)
    h_row = _fmix32(k ^ _fmix32(rows))
    h_pos = _fmix32(pos ^ np.uint64(0x7F4A7C15))
    h = _fmix32(h_row[:, None] ^ h_pos[None, :])
    g = _fmix32((f * np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF))
    want = _fmix32((h[:, :, None] + g[None, None, :]) & 0xFFFFFFFF) >= round(rate * 2 ** 32)
    whole = dropout_lib.keep_mask(key, [b, t, d], rate).numpy()
    np.testing.assert_array_equal(whole, want)
    np.testing.assert_array_equal(dropout_lib.keep_mask(key, [2, 4, d], rate, 1, 5).numpy(), whole[1:3, 5:9])
    big = dropout_lib.keep_mask(key, [16, 64, 64], 0.1).numpy()
    assert abs(big.mean() - 0.9) < 0.01
    other = dropout_lib.keep_mask(dropout_lib.fold(7, 3, 1), [16, 64, 64], 0.1).numpy()
    assert abs((big == other).mean() - 0.82) < 0.01  # another step: an independent mask


# -- sequence parallelism (no dropout): Keras's one-device step is the oracle ------------------


@pytest.fixture(scope="module")
def single_device():
    losses, _, weights = gpt_oracle.run(make_cfg(), batches())
    return losses, weights


SP_LAYOUTS = {  # id: (dp, tp, pp, extra parallel keys)
    "tp2-sp": (1, 2, 1, {}),
    "tp2-pp2-sp": (1, 2, 2, {"microbatches": 2}),
    "dp2-tp2-sp": (2, 2, 1, {}),
}


@pytest.mark.parametrize("name", list(SP_LAYOUTS))
def test_sequence_parallel_matches_single_device(name, devices, single_device):
    dp, tp, pp, extra = SP_LAYOUTS[name]
    cfg = make_cfg(dp=dp, tp=tp, pp=pp, sequence_parallel=True, **extra)
    engine = make_engine(cfg.model, Mesh.from_devices(devices[: dp * tp * pp], dp, pp, tp), cfg)
    assert isinstance(engine, KerasGPTEngine)
    blocks = [layer for layer in engine.model.layers if layer.name.startswith("block_")]
    assert blocks and all(block.sequence_parallel for block in blocks)
    assert_same_run(train(engine), single_device)


def test_sequence_parallel_errors_name_the_key(devices):
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel.*tp > 1"):
        make_cfg(sequence_parallel=True)
    cfg = make_cfg(tp=2, sequence_parallel=True)  # on a mesh without tensor ranks: refused at build
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel.*tp > 1"):
        make_engine(cfg.model, Mesh.from_devices(devices[:1], 1, 1, 1), cfg)
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel.*tp > 1"):  # refused as the config is read
        make_cfg(sequence_parallel=True, devices="cpu:1")
    cfg = make_cfg(sequence_parallel=True, tp=-1, devices="cpu:1")  # tp=-1 fills one device: refused at build
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel.*tp > 1"):
        build_engine(cfg, GPTTask(cfg.model))
    cfg = Config().replace(model={**MODEL, "seq_len": 18}, parallel={"tp": 4, "sequence_parallel": True})
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel.*seq_len=18"):
        make_engine(cfg.model, Mesh.from_devices(devices[:4], 1, 1, 4), cfg)
