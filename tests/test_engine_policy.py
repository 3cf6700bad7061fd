"""No silent precision: an engine trains in its config's ``precision.policy``.

A task that names no policy (``GPTTask(cfg.model)``) takes the config's
(:func:`phalanx.engines.task.for_config`); one built for another policy is refused with a
ConfigError naming ``precision.policy`` and both values, by every engine that takes a config
and a task (KerasGPTEngine, and ``build_engine`` choosing the engine ``phalanx train`` runs). The policy that ran is read off
the step's own ops: the dtype of the matrix products TensorFlow executed.
"""

import doctest
from collections import Counter

import numpy as np
import pytest
import tensorflow as tf

from phalanx.config import Config, ConfigError
from phalanx.engines.factory import build_engine
from phalanx.engines.keras_gpt import KerasGPTEngine
from phalanx.engines import task as task_module
from phalanx.engines.task import GPTTask
from phalanx.mesh import Mesh
from phalanx.train.calibrate import run_with_metadata

TINY = {"layers": 1, "d_model": 16, "heads": 2, "ffn": 32, "vocab": 256, "seq_len": 8}


def auto_config(monkeypatch, policy: str, **sections) -> Config:
    """A config whose ``precision.policy=auto`` resolves to ``policy``, as it does on a machine
    with (mixed_bfloat16) or without (float32) bfloat16 units."""
    monkeypatch.setenv("PHALANX_AUTO_PRECISION", policy)
    sections.setdefault("parallel", {"devices": "cpu:1"})
    cfg = Config().replace(model=sections.pop("model", TINY), train={"global_batch": 4, "warmup": 1}, **sections)
    assert cfg.precision.policy == policy
    return cfg


def matmul_dtypes(step) -> Counter:
    """How many matrix products of each dtype one call of ``step`` executed (its partition
    graphs: the ops that ran, after Grappler's rewrites)."""
    _, meta = run_with_metadata(step)
    counts = Counter()
    for function in meta.function_graphs:
        for part in function.partition_graphs:
            for node in part.node:
                if "MatMul" in node.op or "Einsum" in node.op:  # oneDNN renames them (_MklMatMul, ...)
                    counts[tf.as_dtype(node.attr["T"].type).name] += 1
    return counts


def batch(rows: int = 4) -> np.ndarray:
    return np.random.default_rng(0).integers(0, TINY["vocab"], [rows, TINY["seq_len"] + 1]).astype(np.int32)


@pytest.mark.parametrize("policy, compute", [("mixed_bfloat16", "bfloat16"), ("float32", "float32")])
def test_a_gpt_task_without_a_policy_trains_in_the_configs(monkeypatch, devices, policy, compute):
    """The bug: precision.policy=auto picked mixed_bfloat16 and the engine built from
    GPTTask(cfg.model) trained float32. Now the task takes the config's policy: every matrix
    product of the step runs in its compute dtype, and the weights stay float32."""
    cfg = auto_config(monkeypatch, policy)
    task = GPTTask(cfg.model)
    engine = build_engine(cfg, task)
    assert isinstance(engine, KerasGPTEngine)
    counts = matmul_dtypes(lambda: float(engine.train_step(batch())["loss"]))
    assert counts[compute] > 0 and set(counts) == {compute}, counts
    assert {v.dtype for v in engine.model.trainable_variables} == {"float32"}
    assert task.dtype_policy is None  # the caller's task is left as it was


@pytest.mark.parametrize("policy, other", [("mixed_bfloat16", "float32"), ("float32", "mixed_bfloat16")])
def test_a_task_built_for_another_policy_is_refused_by_every_engine(monkeypatch, devices, policy, other):
    cfg = auto_config(monkeypatch, policy)
    expert = auto_config(monkeypatch, policy, model={**TINY, "layers": 2, "experts": 2, "moe_every": 2},
                         parallel={"devices": "cpu:2", "dp": 2, "ep": 2})
    one = Mesh.from_devices(devices[:1], 1, 1, 1)
    engines = {
        "KerasGPTEngine (one device)": lambda: KerasGPTEngine(cfg, GPTTask(cfg.model, other), one),
        "build_engine": lambda: build_engine(cfg, GPTTask(cfg.model, other)),
        "build_engine (ep)": lambda: build_engine(expert, GPTTask(expert.model, other)),
        "KerasGPTEngine": lambda: KerasGPTEngine(expert, GPTTask(expert.model, other),
                                                 Mesh.from_devices(devices[:2], 2, 1, 1)),
    }
    for name, make in engines.items():
        with pytest.raises(ConfigError) as err:
            make()
        assert err.value.key == "precision.policy", name
        message = str(err.value)
        assert message.startswith(f"precision.policy: {policy}, but") and f"built for {other}" in message, (name, message)


def test_the_same_policy_named_twice_is_fine(monkeypatch, devices):
    cfg = auto_config(monkeypatch, "float32")
    engine = build_engine(cfg, GPTTask(cfg.model, "float32"))
    assert np.isfinite(float(engine.train_step(batch())["loss"]))


def test_expert_parallel_gpt_without_a_policy_computes_in_the_configs(monkeypatch, devices):
    cfg = auto_config(monkeypatch, "mixed_bfloat16", model={**TINY, "layers": 2, "experts": 2, "moe_every": 2},
                      parallel={"devices": "cpu:2", "dp": 2, "ep": 2})
    engine = build_engine(cfg, GPTTask(cfg.model))
    assert isinstance(engine, KerasGPTEngine)
    moe = engine.model.get_layer("block_1").moe
    assert moe.compute_dtype == "bfloat16" and moe.w_in[0].dtype == "float32"
    counts = matmul_dtypes(lambda: float(engine.train_step(batch())["loss"]))
    # the router stays float32 by design (phalanx.layers.moe); everything else is bfloat16
    assert counts["bfloat16"] > counts["float32"] > 0, counts


def test_doctests():
    assert doctest.testmod(task_module).failed == 0
