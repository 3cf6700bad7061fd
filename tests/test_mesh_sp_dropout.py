"""Sequence parallelism and dropout of the built-in GPT: sequence parallelism on the engine
``phalanx train`` builds for it (the Keras-model engine), dropout on the mesh engine.

Oracles: without dropout, Keras's own one-device ``train_on_batch`` of the same Keras model
(tests/gpt_oracle.py, as in tests/test_parallel.py).
With dropout, a plain one-device GPT written here in TensorFlow ops, its masks drawn over
the whole ``[batch, seq, d]`` tensor by the positional scheme of :mod:`phalanx.layers.dropout`
(itself checked against a NumPy implementation of its hash): it gives the loss and the
gradients the one-device mesh run must reproduce at every step; every layout (tp, pp with
micro-batches, dp, sequence parallelism, their product) must then give the one-device
run's losses and weights, float32, to rtol 1e-5.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import tensorflow as tf

from helpers import assert_same_run as same_run
import gpt_oracle
from phalanx.config import Config, ConfigError
from phalanx.engines.factory import build_engine, make_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines.mesh import MeshEngine  # (dropout: the row still on the mesh engine)
from phalanx.engines.task import GPTTask
from phalanx.layers import dropout as dropout_lib
from phalanx.mesh import Mesh
from phalanx.models import gpt

from helpers import ADAM_EPS

STEPS = 3
MODEL = dict(layers=2, d_model=32, heads=4, ffn=64, vocab=256, seq_len=16)
# Weights: AdamW with train.eps=ADAM_EPS (1e-4; default 1e-8). With a tiny eps an element whose
# gradient is ~0 turns float round-off into a step of up to lr either way (measured 2.8e-5 here, 1
# element in 2048, with eps 1e-8: more on another CPU); with 1e-4 a gradient round-off d (~1e-7)
# moves a step by at most ~2 x lr x d / eps = 2e-6, 6e-6 in the STEPS compared (derivation:
# tests/helpers.py ADAM_EPS). A wrong gradient moves a weight by ~lr = 1e-3 per step, so atol 5e-5
# (as tests/test_parallel.py) still catches every real bug, and the losses (rtol 1e-5) catch a
# wrong mask (it moves them by ~1e-3).
RTOL, W_ATOL = 1e-5, 5e-5


def make_cfg(dropout: float = 0.0, **parallel) -> Config:
    return Config().replace(model={**MODEL, "dropout": dropout}, precision={"policy": "float32"},
                            train={"global_batch": 4, "warmup": 1, "steps": 10, "lr": 1e-3, "eps": ADAM_EPS}, parallel=parallel)


def batches(n: int = STEPS) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, size=(4, MODEL["seq_len"] + 1)).astype(np.int32) for _ in range(n)]


def mesh_engine(devices, dropout=0.0, dp=1, tp=1, pp=1, **extra) -> MeshEngine:
    cfg = make_cfg(dropout, dp=dp, tp=tp, pp=pp, **extra)
    return MeshEngine(cfg, Mesh.from_devices(devices[: dp * tp * pp], dp, pp, tp), GPTTask(cfg.model))


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


def test_sequence_parallel_activations_are_sequence_chunks_on_their_ranks(devices):
    """In the traced step (tp=2, 2 blocks) every forward LayerNorm / dropout op of the blocks'
    sequence chunk r has the shape [b, s/tp, d] and runs on tensor rank r's device; block 1
    takes block 0's chunks (no split of the residual stream after the embedding)."""
    engine = mesh_engine(devices, dropout=0.1, tp=2, sequence_parallel=True)
    graph = engine._train_fn.get_concrete_function(tf.constant(batches(1)[0])).graph
    b, s, d = 4, MODEL["seq_len"], MODEL["d_model"]
    seen = {(i, r): 0 for i in range(2) for r in range(2)}
    for op in graph.get_operations():
        m = re.search(r"block_(\d)/sp_chunk(\d)(?:_\d+)?/(layer_norm|dropout)/", op.name)
        if not m or "gradient" in op.name.lower():
            continue
        i, r = int(m.group(1)), int(m.group(2))
        for out in op.outputs:  # the activations (not the reads of the whole LayerNorm weights)
            if out.dtype == tf.float32 and out.shape.rank == 3:
                assert out.shape.as_list() == [b, s // 2, d], (op.name, out.shape)
                assert tf.DeviceSpec.from_string(op.device).device_index == r, (op.name, op.device)
                seen[(i, r)] += 1
    assert min(seen.values()) > 3, seen
    splits = [op.name for op in graph.get_operations() if op.type == "Split" and "sequence_chunks" in op.name
              and "gradient" not in op.name.lower()]
    assert splits and all("block_0" in n for n in splits), splits


# -- dropout: a plain one-device GPT with the whole-tensor masks is the oracle ----------------


def _layer_norm(x, g, b):
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-5) * g + b


def _gelu(x):
    return 0.5 * x * (1.0 + tf.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def reference_loss(w: dict, tokens: np.ndarray, seed: int, step: int, rate: float):
    """The GPT (docs/DESIGN.md) on one device in plain ops; dropout (``rate`` > 0) after the
    embedding and on each block's attention and MLP outputs, with the masks of the whole
    batch: key fold(fold(seed, step), layer) (layer -1: the embedding), a block's folded with its
    site (0: attention, 1: MLP)."""
    x_in, y = tokens[:, :-1], tokens[:, 1:]
    bsz, t = x_in.shape
    d, h = MODEL["d_model"], MODEL["heads"]
    hd = d // h
    step_key = dropout_lib.fold(seed, step)

    def drop(x, layer, site=None):
        if not rate:
            return x
        key = dropout_lib.fold(step_key, layer)
        keep = dropout_lib.keep_mask(key if site is None else dropout_lib.fold(key, site), [bsz, t, d], rate)
        return tf.where(keep, x / (1.0 - rate), 0.0)

    x = drop(tf.gather(w["embed/tokens"], x_in) + w["embed/positions"][:t], -1)
    causal = tf.linalg.band_part(tf.ones([t, t]), -1, 0) > 0
    for i in range(MODEL["layers"]):
        p = f"block_{i}/"
        a = _layer_norm(x, w[p + "ln1/gamma"], w[p + "ln1/beta"]) @ w[p + "attn/qkv/kernel"] + w[p + "attn/qkv/bias"]
        q, k, v = [tf.transpose(tf.reshape(z, [bsz, t, h, hd]), [0, 2, 1, 3]) for z in tf.split(a, 3, axis=-1)]
        scores = tf.where(causal, q @ tf.transpose(k, [0, 1, 3, 2]) / math.sqrt(hd), -1e30)
        att = tf.reshape(tf.transpose(tf.nn.softmax(scores) @ v, [0, 2, 1, 3]), [bsz, t, d])
        x = x + drop(att @ w[p + "attn/out/kernel"] + w[p + "attn/out/bias"], i, 0)
        m = _gelu(_layer_norm(x, w[p + "ln2/gamma"], w[p + "ln2/beta"]) @ w[p + "mlp/fc/kernel"] + w[p + "mlp/fc/bias"])
        x = x + drop(m @ w[p + "mlp/proj/kernel"] + w[p + "mlp/proj/bias"], i, 1)
    logits = _layer_norm(x, w["final_ln/gamma"], w["final_ln/beta"]) @ tf.transpose(w["embed/tokens"])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def reference_grads(weights: dict, tokens, seed: int, step: int, rate: float):
    w = {n: tf.Variable(v) for n, v in weights.items()}
    with tf.GradientTape() as tape:
        loss = reference_loss(w, tokens, seed, step, rate)
    grads = tape.gradient(loss, w)
    return float(loss), {n: g.numpy() for n, g in grads.items()}


def test_reference_without_dropout_is_the_single_device_engine(single_device):
    """The plain reference is the GPT: without dropout its loss is Keras's one-device step's."""
    cfg = make_cfg()
    weights = gpt.initial_weights(cfg.model, cfg.train.seed)
    loss, _ = reference_grads(weights, batches(1)[0], 0, 0, 0.0)
    np.testing.assert_allclose(loss, single_device[0][0], rtol=RTOL)


@pytest.fixture(scope="module")
def one_device_dropout(devices):
    """The one-device mesh run at dropout 0.1, each step's loss and gradients checked against
    the plain reference with the whole-batch masks of that step."""
    engine = mesh_engine(devices, dropout=0.1)
    seed, losses = engine.dropout_seed, []
    for step, batch in enumerate(batches()):
        want_loss, want = reference_grads(engine.weights(), batch, seed, step, 0.1)
        got = engine.gradients(batch)
        for name, g in got.items():
            np.testing.assert_allclose(g, want[name], rtol=1e-4, atol=1e-6, err_msg=f"step {step}: {name}")
        losses.append(float(engine.train_step(batch)["loss"]))
        np.testing.assert_allclose(losses[-1], want_loss, rtol=RTOL)
    no_drop, _ = reference_grads(engine.weights(), batches(1)[0], seed, 0, 0.0)
    np.testing.assert_allclose(float(engine.eval_step(batches(1)[0])), no_drop, rtol=RTOL)  # eval: no dropout
    return losses, engine.weights()


def test_one_device_dropout_matches_the_reference(one_device_dropout, single_device):
    losses, _ = one_device_dropout
    assert not np.allclose(losses, single_device[0], rtol=1e-4)  # the masks change the losses


DROPOUT_LAYOUTS = {  # id: (dp, tp, pp, extra parallel keys)
    "tp2": (1, 2, 1, {}),
    "pp2-mb2": (1, 1, 2, {"microbatches": 2}),
    "dp2": (2, 1, 1, {}),
    "tp2-sp": (1, 2, 1, {"sequence_parallel": True}),
    "tp2-pp2-mb2-sp": (1, 2, 2, {"microbatches": 2, "sequence_parallel": True}),
    "tp2-sp-recompute": (1, 2, 1, {"sequence_parallel": True, "recompute": "full"}),  # the same masks again
}


@pytest.mark.parametrize("name", list(DROPOUT_LAYOUTS))
def test_dropout_layouts_match_one_device(name, devices, one_device_dropout):
    dp, tp, pp, extra = DROPOUT_LAYOUTS[name]
    assert_same_run(train(mesh_engine(devices, dropout=0.1, dp=dp, tp=tp, pp=pp, **extra)), one_device_dropout)


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
