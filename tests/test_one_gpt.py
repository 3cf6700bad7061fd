"""The engine ``phalanx train`` builds for one device (the Keras-model engine) trains phalanx's one GPT (``phalanx.models.transformer.gpt``) while
their state keeps the built-in logical names and shapes (``phalanx.models.gpt.weight_shapes``):
a checkpoint of that layout (as every earlier version wrote it: one whole tensor per name)
restores exactly, its fused ``qkv`` kernel lands in the attention's query, key and value by the
layout the model's own math uses (checked against a plain NumPy attention), and the engine
saves it back in the same layout."""

import json

import numpy as np

from phalanx import checkpoint
from phalanx.config import Config
from phalanx.engines.factory import make_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines.task import GPTTask
from phalanx.mesh import Mesh
from phalanx.models import gpt, transformer

MODEL = {"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "vocab": 256, "seq_len": 8, "tie_embeddings": False}


def test_a_checkpoint_by_logical_name_round_trips_through_the_engine(tmp_path):
    cfg = Config().replace(model=MODEL, train={"global_batch": 4})
    rng = np.random.default_rng(0)
    shapes = gpt.weight_shapes(cfg.model)
    state = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    state.update({f"optimizer/{slot}/{n}": np.abs(rng.standard_normal(s)).astype(np.float32)
                  for slot in "mv" for n, s in shapes.items()})
    state["optimizer/step"] = np.array(7, np.int64)
    engine = make_engine(GPTTask(cfg.model), Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), cfg)
    assert isinstance(engine, KerasGPTEngine)
    state.update({k: v for k, v in engine.state_dict().items() if k not in state})  # the loss scale's, as built
    checkpoint.save(tmp_path, 7, checkpoint.whole_tensor_sets(state))
    checkpoint.load_into(engine, checkpoint.restore(checkpoint.latest(tmp_path)))
    got = engine.state_dict()
    assert sorted(got) == sorted(state)
    for name, value in state.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)

    # block 0's attention, computed in NumPy from the checkpoint's fused kernel, equals the model's
    block = transformer.blocks(engine.model)[0]
    x = rng.standard_normal((2, 8, 16)).astype(np.float32)
    w = {k[len("block_0/"):]: v for k, v in state.items() if k.startswith("block_0/attn/")}
    q, k, v = (y.reshape(2, 8, 2, 8).transpose(0, 2, 1, 3)
               for y in np.split(x @ w["attn/qkv/kernel"] + w["attn/qkv/bias"], 3, axis=-1))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(8) + np.triu(np.full((8, 8), -1e9, np.float32), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = (probs @ v).transpose(0, 2, 1, 3).reshape(2, 8, 16) @ w["attn/out/kernel"] + w["attn/out/bias"]
    np.testing.assert_allclose(block.attention(x).numpy(), want, rtol=1e-4, atol=1e-5)

    # saved again: one whole piece per logical name, the same values
    saved = checkpoint.save(tmp_path / "again", 7, checkpoint.state_of(engine))
    checkpoint.verify(saved)
    pieces = {n: len(t["pieces"]) for n, t in json.loads((saved / checkpoint.INDEX).read_text())["tensors"].items()}
    assert pieces == {n: 1 for n in state}
    restored = checkpoint.restore(saved)
    for name, value in state.items():
        np.testing.assert_array_equal(restored.tensors[name], value, err_msg=name)
