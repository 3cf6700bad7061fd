"""Expert parallelism for a Keras model across the workers of ``phalanx launch`` (loopback).

Under ``parallel.strategy=multi_worker`` the ``parallel.*`` keys are each worker's local
layout: ``parallel.ep`` groups a worker's own data replicas, so every worker holds all
the experts (shard j with its replica j) and the all-to-all stays inside the worker; the
workers are data parallel (gradients all-reduced). 2 workers x (dp2, ep2) are checked
against Keras's own one-device fit of the 4-chunk ghost batch (losses, every logical
weight, rtol 1e-4, no token dropped) and the chief's MoE rows against the same layout in
one process (dp4, ep2: the whole-batch figures). Bounded by the launcher's --timeout and
a subprocess timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import phalanx
from phalanx.train.progress import read_metrics

from helpers import ghost_batches
from test_keras_cluster import env

MODEL = '''
import keras
import numpy as np
from phalanx.layers import MoE

def build(seed, ep):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(16, 8)(tokens)
    h = h + MoE(num_experts=4, hidden_dim=16, top_k=2, aux_loss_coef=0.05, ep=ep, name="moe")(h)
    model = keras.Model(tokens, keras.layers.Dense(16)(keras.layers.LayerNormalization()(h)))
    compile_model(model)
    return model

def compile_model(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (16, 6)).astype("int32")
    return x, np.roll(x, 1, axis=1)

STATISTICS = ("dropped_fraction", "load_min", "load_max", "balance")  # the last call's: averaged over workers

def logical(model):
    from phalanx.layers.sharding import ShardedLayer
    out = []
    for layer in model.layers:
        out += [w for k, w in layer.logical_weights().items() if k not in STATISTICS] \\
            if isinstance(layer, ShardedLayer) else [np.asarray(w) for w in layer.get_weights()]
    return out
'''

SCRIPT = '''
import json, os, sys
import phalanx
args = json.loads(sys.argv[1])
cfg = phalanx.init("parallel.strategy=multi_worker", "run.dir=" + args["run_dir"], *args["overrides"])
exec(args["model"])
rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
model = build(4 + 100 * rank, 2)  # each worker its own initial weights: the chief's are broadcast
x, y = data()
history = phalanx.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=2, config=cfg)
with open(args["out"] + "." + str(rank) + ".json", "w") as f:
    json.dump({"history": history.history, "weights": [w.tolist() for w in logical(model)],
               "devices": [v.value.device for v in model.get_layer("moe").w_in]}, f)
'''


def namespace() -> dict:
    ns: dict = {}
    exec(MODEL, ns)
    return ns


@pytest.mark.slow
def test_two_workers_with_expert_parallel_groups_equal_keras_fit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    run_dir, out = tmp_path / "run", tmp_path / "out"
    args = {"run_dir": str(run_dir), "model": MODEL, "out": str(out),
            "overrides": ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"]}
    cmd = [sys.executable, "-m", "phalanx.cli", "launch", "--workers", "2", "--timeout", "120", "--grace", "3", "--",
           sys.executable, str(script), json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "on 2 workers x dp=2 pp=1" in proc.stderr
    results = [json.loads(Path(f"{out}.{k}.json").read_text()) for k in (0, 1)]
    # The oracle: Keras's fit of the model on 4 chunks per batch (2 workers x 2 replicas).
    ns = namespace()
    reference = ns["build"](4, 1)
    trained = ghost_batches(reference, 4, average_added_losses=True)
    ns["compile_model"](trained)
    ref = trained.fit(*ns["data"](), batch_size=8, epochs=2, shuffle=False, verbose=0).history
    for result in results:
        np.testing.assert_allclose(result["history"]["loss"], ref["loss"], rtol=1e-4)
        for mine, want in zip(result["weights"], ns["logical"](reference)):
            np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-5)
        # Each worker holds both expert shards, on its own two devices.
        assert [d.rsplit(":", 1)[-1] for d in result["devices"]] == ["0", "1"]
    assert "/task:1/" in results[1]["devices"][0]
    # The chief's MoE figures are the whole global batch's: those of dp4 x ep2 in one process.
    model = ns["build"](4, 2)
    phalanx.fit(model, *ns["data"](), batch_size=8, epochs=2, shuffle=False, verbose=0,
                overrides=["parallel.devices=cpu:4", "parallel.dp=4", "parallel.ep=2", f"run.dir={tmp_path / 'one'}"])
    keys = ["loss", "moe_aux_loss", "moe_balance", "moe_dropped", "moe_load_min", "moe_load_max"]
    cluster_rows, one_rows = read_metrics(run_dir), read_metrics(tmp_path / "one")
    np.testing.assert_allclose([[r[k] for k in keys] for r in cluster_rows], [[r[k] for k in keys] for r in one_rows],
                               rtol=1e-4, atol=1e-6)
    assert all(r["moe_dropped"] == 0.0 for r in cluster_rows)


def test_experts_sharded_across_workers_are_refused_naming_the_key_and_strategy():
    from phalanx.config import ConfigError, load_config
    from phalanx.engines.keras_model import check_expert_layout

    # ep=4 over 2 workers x dp2 would shard the experts across workers: not built.
    with pytest.raises(ConfigError, match=r"parallel.ep.*4 does not divide parallel.dp=2.*multi_worker.*never "
                                          r"across workers"):
        load_config(None, ["parallel.strategy=multi_worker", "parallel.dp=2", "parallel.ep=4"])
    # dp=-1 is resolved from the devices: the engine says the same about this worker's mesh.
    with pytest.raises(ConfigError, match=r"parallel.ep.*2 does not divide dp=1.*multi_worker over 2 workers.*never "
                                          r"across workers"):
        check_expert_layout(namespace()["build"](4, 2), 2, 1, workers=2)
