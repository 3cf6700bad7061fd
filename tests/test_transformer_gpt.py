"""The transformer block and the GPT written from the parallel layers, against independent
oracles: the block without sequence parallelism (forward and gradients, rtol 1e-5), a plain
NumPy GPT written here on the built-in weight names (same weights: same logits; its MoE blocks
call a stand-alone :class:`phalanx.layers.MoE`, tested in test_moe.py) and Keras's
own one-device ``model.fit`` of the tp=1 model (per-step losses of ``phalanx.fit`` on tp2,
tp2 x pp2, dp2 x tp2 x pp2 with sequence parallelism, dp2 x ep2 for experts; rtol 1e-4).
Placement is read from the traced training step of the engine."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import phalanx
from phalanx.config import ModelConfig, load_config
from phalanx.layers import TransformerBlock
from phalanx.layers.sharding import placement_of
from phalanx.models import gpt as builtin
from phalanx.models.transformer import gpt, gpt_weights, load_gpt_weights

from helpers import ghost_batches

RTOL, ATOL = 1e-5, 1e-6
DENSE = ModelConfig(layers=2, d_model=16, heads=2, ffn=32, vocab=32, seq_len=8)
MOE = ModelConfig(layers=2, d_model=16, heads=2, ffn=24, vocab=32, seq_len=8, tie_embeddings=False, experts=4,
                  top_k=2, moe_every=2, capacity_factor=1.0, aux_loss_coef=0.01)
rng = np.random.default_rng(0)


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def _logical_grads(block, grads) -> dict:
    by_var = {id(v): g for v, g in zip(block.trainable_weights, grads)}
    out = {}
    for prefix, layer in block._children().items():
        for name, (variables, axis, _) in layer._logical.items():
            if variables[0].trainable:
                parts = [np.asarray(by_var[id(v)]) for v in variables]
                out[f"{prefix}/{name}"] = parts[0] if axis is None else np.concatenate(parts, axis=axis)
    return out


def _run(block, x, compiled: bool):
    """(output, logical gradients) of a fixed weighted sum of ``block(x)``, eager or in a graph
    (where the next block may take the chunks of a sequence-parallel output)."""
    cotangent = tf.constant(np.linspace(-1.0, 1.0, x.size).reshape(x.shape), tf.float32)

    def step(x):
        with tf.GradientTape() as tape:
            y = block(x)
            loss = tf.reduce_sum(y * cotangent)
        return y, tape.gradient(loss, block.trainable_weights)

    y, grads = (tf.function(step) if compiled else step)(tf.constant(x))
    return y.numpy(), _logical_grads(block, grads)


# -- the block ------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,kind", [(2, "plain"), (2, "gated_gqa"), (4, "plain"), (2, "moe")])
def test_sequence_parallel_block_equals_the_plain_block(tp, kind):
    args = dict(num_heads=4, head_dim=4, ffn_dim=32, tp=tp, seed=1)
    if kind == "gated_gqa":
        args.update(gated=True, activation="silu", num_kv_heads=2 if tp == 2 else 4, rope_max_wavelength=10000)
    if kind == "moe":
        args.update(moe={"num_experts": 4, "top_k": 2, "capacity_factor": 1.0})
    plain, sp = TransformerBlock(**args), TransformerBlock(sequence_parallel=True, **args)
    x = rng.normal(size=(2, 8, 16)).astype("float32")
    for block in (plain, sp):
        block.build(x.shape)
    sp.set_logical_weights(plain.logical_weights())
    assert list(sp.logical_weights()) == list(plain.logical_weights())
    for compiled in (False, True):
        y, g = _run(plain, x, compiled)
        y_sp, g_sp = _run(sp, x, compiled)
        close(y_sp, y)
        assert sorted(g_sp) == sorted(g)
        for name in g:
            close(g_sp[name], g[name], atol=1e-5)
    if kind == "moe":  # the balancing loss over the whole call, not per chunk
        plain(x), sp(x)
        close([float(v) for v in sp.losses], [float(v) for v in plain.losses])


def test_block_weights_have_stable_names_and_the_config_round_trips():
    block = TransformerBlock(4, 4, 32, tp=2, gated=True, sequence_parallel=True, dropout=0.1, name="b")
    block.build((None, 8, 16))
    names = list(block.logical_weights())
    assert names == ["ln1/gamma", "ln1/beta", "attention/query", "attention/query_bias", "attention/key",
                     "attention/key_bias", "attention/value", "attention/value_bias", "attention/output",
                     "attention/output_bias", "ln2/gamma", "ln2/beta", "mlp/up", "mlp/up_bias", "mlp/gate",
                     "mlp/gate_bias", "mlp/down", "mlp/down_bias"]
    assert {placement_of(v).rank for v in block.attention.weights if placement_of(v)} == {0, 1}
    again = TransformerBlock.from_config(block.get_config())
    again.build((None, 8, 16))
    assert again.get_config() == block.get_config() and list(again.logical_weights()) == names
    with pytest.raises(ValueError, match="no logical weight 'mlp/nope'"):
        block.set_logical_weights({"mlp/nope": np.zeros(3)})


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_masks_are_drawn_in_training_only(sequence_parallel):
    """The MLP branch zeroed, ``y - x`` is the dropped attention output: about half of it is
    0, the rest is the attention output / (1 - rate); every call draws new masks, and
    inference is the block without dropout."""
    args = dict(num_heads=4, head_dim=4, ffn_dim=32, tp=2, sequence_parallel=sequence_parallel)
    block, reference = TransformerBlock(dropout=0.5, seed=3, **args), TransformerBlock(**args)
    x = rng.normal(size=(4, 8, 16)).astype("float32")
    for b in (block, reference):
        b.build(x.shape)
    weights = reference.logical_weights()
    weights.update({k: np.zeros_like(v) for k, v in weights.items() if k.startswith("mlp/")})
    for b in (block, reference):
        b.set_logical_weights(weights)
    attn = reference(x).numpy() - x
    close(block(x, training=False), reference(x))
    step = tf.function(lambda t: block(t, training=True))
    drops = [step(tf.constant(x)).numpy() - x for _ in range(2)]
    for dropped in drops:
        zero = np.abs(dropped) < 1e-6
        assert 0.4 < zero.mean() < 0.6
        close(dropped[~zero], attn[~zero] * 2.0, rtol=1e-4, atol=1e-5)
        if sequence_parallel:  # each chunk draws its own mask
            assert not np.array_equal(zero[:, :4], zero[:, 4:])
    assert not np.array_equal(np.abs(drops[0]) < 1e-6, np.abs(drops[1]) < 1e-6)


def _engine(model, tp: int, x, y, pp: int = 1):
    from phalanx.mesh import Mesh
    from phalanx.engines.factory import make_engine

    cfg = load_config(None, [f"parallel.devices=cpu:{tp * pp}", f"parallel.tp={tp}", f"parallel.pp={pp}"])
    mesh = Mesh.from_devices([f"/device:CPU:{i}" for i in range(tp * pp)], 1, pp, tp)
    return make_engine(model, mesh, cfg, sample_batch=(x, y, None))


def test_sequence_parallel_runs_chunk_r_on_tensor_device_r():
    """tp=2 through the engine (dropout on): in the traced training step, the LayerNorm and
    dropout ops of chunk r (forward and backward) run on CPU:r; the second block takes the
    first block's chunks without splitting its output; the step trains."""
    cfg = ModelConfig(layers=2, d_model=16, heads=2, ffn=32, vocab=32, seq_len=8, dropout=0.1)
    model = gpt(cfg, tp=2, sequence_parallel=True)
    model.compile(optimizer=keras.optimizers.AdamW(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = rng.integers(0, 32, (4, 8)).astype("int32")
    engine = _engine(model, 2, x, np.roll(x, -1, axis=1))
    graph = engine._train_fn.get_concrete_function(tf.constant(x), tf.constant(x), None).graph
    seen = {0: 0, 1: 0}
    for op in graph.get_operations():
        for r in (0, 1):
            if f"sp_chunk{r}/" in op.name and ("layer_norm" in op.name or "dropout" in op.name):
                assert tf.DeviceSpec.from_string(op.device).device_index == r, (op.name, op.device)
                seen[r] += 1
    assert min(seen.values()) > 20, seen
    splits = [op.name for op in graph.get_operations() if op.type == "Split" and "sequence_chunks" in op.name]
    assert splits and all("/block_0" in n for n in splits), splits  # block_1 reads block_0's chunks
    losses = [float(engine.train_step((x, np.roll(x, -1, axis=1), None))["loss"]) for _ in range(3)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


# -- the GPT ----------------------------------------------------------------------------------


class _Reference:
    """The GPT of docs/DESIGN.md in NumPy (float32) on weights by built-in name: pre-LN blocks,
    causal attention from the fused ``qkv`` kernel, tanh-GELU MLP, tied or untied head. An MoE
    block's experts are a stand-alone MoE layer given that block's weights; ``losses`` are
    their balancing losses of the last call."""

    def __init__(self, cfg: ModelConfig, weights: dict):
        from phalanx.layers import MoE
        from phalanx.layers.transformer import gelu_approximate

        self.cfg, self.w, self.moes = cfg, {k: np.asarray(v, np.float32) for k, v in weights.items()}, {}
        for i in range(cfg.layers):
            if cfg.is_moe_block(i):
                moe = MoE(cfg.experts, cfg.ffn_dim, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                          aux_loss_coef=cfg.aux_loss_coef, activation=gelu_approximate)
                moe.build((None, None, cfg.d_model))
                moe.set_logical_weights({s: self.w[f"block_{i}/moe/{s}"] for s in ("router", "w_in", "b_in", "w_out",
                                                                                   "b_out")})
                self.moes[i] = moe

    @staticmethod
    def _ln(x, gamma, beta):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * gamma + beta

    def __call__(self, ids):
        cfg, w = self.cfg, self.w
        b, t = ids.shape
        d, heads = cfg.d_model, cfg.heads
        hd = d // heads
        x = w["embed/tokens"][ids] + w["embed/positions"][:t]
        self.losses = []
        for i in range(cfg.layers):
            p = f"block_{i}/"
            h = self._ln(x, w[p + "ln1/gamma"], w[p + "ln1/beta"]) @ w[p + "attn/qkv/kernel"] + w[p + "attn/qkv/bias"]
            q, k, v = (h[..., j * d:(j + 1) * d].reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for j in range(3))
            scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + np.triu(np.full((t, t), -1e9, np.float32), 1)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            o = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
            x = x + o @ w[p + "attn/out/kernel"] + w[p + "attn/out/bias"]
            h = self._ln(x, w[p + "ln2/gamma"], w[p + "ln2/beta"])
            if i in self.moes:
                x = x + self.moes[i](h.astype(np.float32)).numpy()
                self.losses += [float(v) for v in self.moes[i].losses]
            else:
                u = h @ w[p + "mlp/fc/kernel"] + w[p + "mlp/fc/bias"]
                u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))
                x = x + u @ w[p + "mlp/proj/kernel"] + w[p + "mlp/proj/bias"]
        x = self._ln(x, w["final_ln/gamma"], w["final_ln/beta"])
        return x @ (w["embed/tokens"].T if cfg.tie_embeddings else w["head/kernel"])


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_gpt_gives_the_reference_logits_in_every_layout(cfg):
    weights = builtin.initial_weights(cfg, seed=5)
    ids = rng.integers(0, cfg.vocab, (4, cfg.seq_len)).astype("int32")
    reference = _Reference(cfg, weights)
    want = reference(ids)
    want_losses = reference.losses
    for tp, ep, sp in [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]:
        model = gpt(cfg, tp=tp, ep=ep, sequence_parallel=sp, seed=5)
        close(model(ids), want)
        if cfg.experts:  # the balancing loss too
            close([float(v) for v in model.losses], want_losses)
        close(tf.function(model)(tf.constant(ids)), want)
        if sp:  # shorter prompts: 6 positions in chunks of 3; 5 (indivisible) without sequence parallelism
            for t in (6, 5):
                close(model(ids[:, :t]), reference(ids[:, :t]))
        got = gpt_weights(model)
        assert list(got) == list(builtin.weight_shapes(cfg))
        for name, value in weights.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    model = gpt(cfg, seed=None)  # Keras initialisers; then the built-in GPT's weights by name
    load_gpt_weights(model, weights)
    close(model(ids), want)
    with pytest.raises(ValueError, match="missing"):
        load_gpt_weights(model, {k: v for k, v in weights.items() if k != "final_ln/beta"})


def test_gpt_saves_and_loads_across_layouts(tmp_path):
    ids = rng.integers(0, 32, (2, 8)).astype("int32")
    model = gpt(DENSE, tp=2, sequence_parallel=True, seed=2)
    want = model(ids).numpy()
    path = str(tmp_path / "gpt.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("block_1").sequence_parallel and loaded.get_layer("block_1").tp == 2
    close(loaded(ids), want)
    one = gpt(DENSE, seed=None)
    one.load_weights(path)  # logical weights: a tp=2 file loads into tp=1
    close(one(ids), want)


# -- training: phalanx.fit against Keras's own fit --------------------------------------------

N, BATCH, EPOCHS = 16, 8, 2
LAYOUTS = {
    "tp2": (["parallel.devices=cpu:2", "parallel.tp=2"], 2, 1, 1),
    "tp2pp2": (["parallel.devices=cpu:4", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"], 2, 1, 2),
    "dp2tp2pp2": (["parallel.devices=cpu:8", "parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                   "parallel.microbatches=2"], 2, 1, 4),
    "dp2ep2": (["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"], 1, 2, 2),
}


class StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def _data(cfg):
    x = np.random.default_rng(1).integers(0, cfg.vocab, (N, cfg.seq_len)).astype("int32")
    return x, np.roll(x, -1, axis=1)


def _compiled(model):
    model.compile(optimizer=keras.optimizers.AdamW(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@functools.lru_cache(maxsize=None)
def _keras_losses(kind: str, chunks: int) -> tuple:
    """Keras's own fit of the tp=1 model on one device (an MoE: as phalanx's micro-batches,
    each with its own capacity and balancing loss, ``helpers.ghost_batches``)."""
    cfg = MOE if kind == "moe" else DENSE
    model = gpt(cfg, seed=7)
    trained = _compiled(ghost_batches(model, chunks, average_added_losses=True) if chunks > 1 else model)
    record = StepLosses()
    trained.fit(*_data(cfg), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record])
    return tuple(record.losses)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_phalanx_fit_equals_keras_fit(layout, tmp_path):
    overrides, tp, ep, chunks = LAYOUTS[layout]
    kind = "moe" if ep > 1 else "dense"
    cfg = MOE if kind == "moe" else DENSE
    model = _compiled(gpt(cfg, tp=tp, ep=ep, sequence_parallel=tp > 1, seed=7))
    record = StepLosses()
    phalanx.fit(model, *_data(cfg), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[record],
                overrides=overrides + [f"run.dir={tmp_path / layout}"])
    want = _keras_losses(kind, chunks if kind == "moe" else 1)
    assert len(record.losses) == len(want) == EPOCHS * N // BATCH
    np.testing.assert_allclose(record.losses, want, rtol=1e-4)
    if tp > 1:  # the trained shards live on their tensor ranks' devices
        block = model.get_layer("block_0")
        devices = {tf.DeviceSpec.from_string(v.value.device).device_index for v in block.attention.weights
                   if placement_of(v) and placement_of(v).rank == 1}
        assert devices == {1}, devices
