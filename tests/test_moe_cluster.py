"""Expert parallelism for a Keras model across the workers of ``phalanx launch`` (loopback).

Under ``parallel.strategy=multi_worker`` the ``parallel.*`` keys are each worker's local
layout: ``parallel.ep`` groups a worker's own data replicas, so every worker holds all
the experts (shard j with its replica j) and the all-to-all stays inside the worker; the
workers are data parallel (gradients all-reduced). 2 workers x (dp2, ep2) are checked
against Keras's own one-device fit of the 4-chunk ghost batch (losses, every logical
weight, rtol 1e-4, no token dropped) and the chief's MoE rows against the same layout in
one process (dp4, ep2: the whole-batch figures). Bounded by the launcher's --timeout and
a subprocess timeout.

The same for ``phalanx train`` of the built-in MoE GPT (``configs/moe.yaml``, made small):
2 workers x (dp2, ep2, pp2), stopped at a checkpoint and resumed by a second launch, give the
per-step losses, MoE rows, evaluation and checkpointed weights of dp4 x ep2 x pp2 in one
process (the one-process engine is checked against the one-device GPT in
tests/test_moe_train.py). Layouts the cluster cannot run are refused before anything starts.
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

from cluster_helpers import PHALANX, assert_gone, task_pids
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
    # Adam epsilon 1e-3 on both sides: 4 steps at lr 0.01 move an element by at most
    # 4 x 2 x 0.01 x 1e-7 / 1e-3 = 8e-6 for gradient round-off of 1e-7, inside atol 1e-5
    # (derivation: tests/helpers.py ADAM_EPS).
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-3),
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
    assert "on layout dp=2 tp=1 pp=1 " in proc.stderr and " workers=2" in proc.stderr
    results = [json.loads(Path(f"{out}.{k}.json").read_text()) for k in (0, 1)]
    # The oracle: Keras's fit of the model on 4 chunks per batch (2 workers x 2 replicas).
    ns = namespace()
    reference = ns["build"](4, 1)
    trained = ghost_batches(reference, 4, average_added_losses=True, replicas=4)
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


# -- phalanx train of the built-in MoE GPT across workers ---------------------------------------

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "moe.yaml")
# configs/moe.yaml made small: 2 blocks (block 1 MoE: 4 experts, top-2, no token dropped), float32,
# a constant learning rate after the warm-up (min_lr_ratio=1), so that a run of 4 steps is the first
# half of a run of 8, and an evaluation at step 8.
SMALL_MOE = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=64", "model.seq_len=32",
             "model.experts=4", "model.aux_loss_coef=0.05", "data.max_bytes=300000", "train.global_batch=8",
             "train.warmup=2", "train.lr=3e-3", "train.min_lr_ratio=1.0", "train.log_every=1",
             "train.eval_every=8", "train.eval_batches=2", "checkpoint.every=4", "precision.policy=float32",
             # AdamW epsilon 5e-3 in the oracle and the cluster alike (default 1e-8): 8 steps at lr 3e-3
             # move an element by at most 8 x 2 x 3e-3 x 1e-7 / 5e-3 < 1e-6 for gradient round-off of
             # 1e-7, inside the checkpoint's atol 1e-6 (derivation: tests/helpers.py ADAM_EPS).
             "train.eps=5e-3"]
ROW_KEYS = ("loss", "grad_norm", "lr", "moe_aux_loss", "moe_balance", "moe_dropped", "moe_load_min", "moe_load_max")


def _launch_train(run_dir: Path, cache: Path, steps: int) -> str:
    """``phalanx train`` of the small MoE GPT on 2 workers, each with the local layout ``PER_WORKER``."""
    cmd = [*PHALANX, "launch", "--workers", "2", "--timeout", "240", "--grace", "5", "--",
           *PHALANX, "train", CONFIG, "parallel.strategy=multi_worker", *SMALL_MOE, *PER_WORKER,
           f"data.cache_dir={cache}", f"run.dir={run_dir}", f"train.steps={steps}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=270, env=env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_gone(task_pids(proc.stderr).values())
    return proc.stderr


# Each worker: 2 data replicas forming one ep2 group, each replica a 2-stage pipeline of 2 micro-batches,
# on its own 4 logical CPUs; the global batch of 16 splits over 2 workers x 2 replicas x 2 micro-batches.
# (The layout without a pipeline, 2 workers x (dp2, ep2), is the phalanx.fit test above: the same
# engine and worker group under a user's Keras model.)
PIPE = ["parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2", "train.global_batch=16"]
PER_WORKER = [*PIPE, "parallel.devices=cpu:4", "parallel.dp=2"]


@pytest.mark.slow
def test_train_moe_gpt_on_two_workers_with_expert_groups_and_pipelines_equals_one_process(tmp_path):
    """2 workers x (dp2, ep2, pp2), 4 steps, then resumed by a second launch to step 8: the per-step
    rows (MoE figures included), the evaluation and the step-8 checkpoint (weights and AdamW
    moments) of dp4 x ep2 x pp2 on 8 logical CPUs in one process, and the loss falls."""
    from phalanx import checkpoint
    from phalanx.config import load_config
    from phalanx.models import gpt as builtin
    from phalanx.train.trainer import Trainer

    cache = tmp_path / "cache"
    # The oracle: the same global batches in one process (this one), dp4 x ep2 x pp2 on 8 logical CPUs.
    one = tmp_path / "one"
    cfg = load_config(CONFIG, [*SMALL_MOE, *PIPE, "parallel.devices=cpu:8", "parallel.dp=4",
                               f"data.cache_dir={cache}", f"run.dir={one}", "train.steps=8"])
    Trainer(cfg, quiet=True).fit()
    want = {r["step"]: r for r in read_metrics(one)}

    run_dir = tmp_path / "run"
    first = _launch_train(run_dir, cache, 4)
    assert "layout dp=4 tp=1 pp=2" in first  # 2 workers x 2 local replicas, each a 2-stage pipeline
    second = _launch_train(run_dir, cache, 8)  # resumes from the checkpoint of step 4
    assert "resumed from" in second and "(step 4)" in second, second[-3000:]
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(rows) == sorted(want) == list(range(1, 9))
    np.testing.assert_allclose([[rows[s][k] for k in ROW_KEYS] for s in range(1, 9)],
                               [[want[s][k] for k in ROW_KEYS] for s in range(1, 9)], rtol=1e-4, atol=1e-6)
    assert all(rows[s]["moe_dropped"] == 0.0 for s in rows)
    np.testing.assert_allclose(rows[8]["eval_loss"], want[8]["eval_loss"], rtol=1e-4)
    assert rows[8]["loss"] < rows[1]["loss"] - 0.3, [rows[s]["loss"] for s in rows]  # it trains

    # The checkpoints of step 8: the chief's (whole tensors, the built-in GPT's names) and the oracle's.
    mine = checkpoint.restore(checkpoint.step_dir(run_dir / "checkpoints", 8)).tensors
    ref = checkpoint.restore(checkpoint.step_dir(one / "checkpoints", 8)).tensors
    meta = json.loads((checkpoint.step_dir(run_dir / "checkpoints", 8) / "meta.json").read_text())
    assert (meta["layout"]["engine"], meta["layout"]["dp"]) == ("KerasGPTEngine", 4)
    assert int(mine["optimizer/step"]) == int(ref["optimizer/step"]) == 8
    d = cfg.model.d_model
    for name in builtin.weight_shapes(cfg.model):
        # The key bias: softmax ignores it, so its gradient is float32 rounding noise, which AdamW
        # scales to lr-sized steps: neither run's value is a figure (as tests/test_strategy_moe.py).
        keep = np.r_[0:d, 2 * d:3 * d] if name.endswith("attn/qkv/bias") else slice(None)
        np.testing.assert_allclose(mine[name][keep], ref[name][keep], rtol=1e-4, atol=1e-6, err_msg=name)
        for slot in ("m", "v"):  # the AdamW moments, relative to their own size
            a, b = mine[f"optimizer/{slot}/{name}"][keep], ref[f"optimizer/{slot}/{name}"][keep]
            assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b), (slot, name)


def _two_workers(ps: int = 0):
    from phalanx.cluster.tf_config import ClusterInfo

    cluster = {"worker": ("127.0.0.1:1", "127.0.0.1:2")}
    if ps:
        cluster = {"chief": ("127.0.0.1:3",), **cluster, "ps": ("127.0.0.1:4",)}
    return ClusterInfo(cluster=cluster, task_type="worker", task_index=0)


@pytest.mark.parametrize("strategy,ps,match", [
    ("mesh", 0, r"mesh: expert parallelism \(parallel.ep=2\).*multi_worker only"),
    ("parameter_server", 1, r"parameter_server: expert parallelism.*without --ps"),
    ("auto", 1, r"parameter_server \(TF_CONFIG has ps tasks\): expert parallelism"),
])
def test_train_moe_gpt_across_workers_refuses_other_cluster_strategies(strategy, ps, match):
    from phalanx.cluster.strategies import resolve_strategy_name
    from phalanx.config import ConfigError, load_config

    cfg = load_config(CONFIG, ["parallel.dp=2", "parallel.ep=2", f"parallel.strategy={strategy}"])
    with pytest.raises(ConfigError, match=r"parallel.strategy.*" + match):
        resolve_strategy_name(cfg, _two_workers(ps))


def test_train_moe_gpt_across_workers_resolves_and_checks_the_local_layout():
    from phalanx.cluster.strategies import MULTI_WORKER, resolve_strategy_name, setup_cluster
    from phalanx.config import ConfigError, load_config
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import refuse_unhonoured as keras_gpt_refusals
    from phalanx.engines.task import GPTTask
    from phalanx.mesh import Mesh

    # auto under a cluster of workers: multi_worker, each worker's own layout (a local pipeline too).
    cfg = load_config(CONFIG, ["parallel.dp=2", "parallel.ep=2", "parallel.pp=2", "parallel.microbatches=2"])
    assert resolve_strategy_name(cfg, _two_workers()) == MULTI_WORKER
    # The global batch splits over 2 workers x dp2 x 3 accumulation steps: 18 does not (refused before any
    # device is made), although it splits over one worker's 2 x 3.
    cfg = load_config(CONFIG, ["parallel.strategy=multi_worker", "parallel.devices=cpu:2", "parallel.dp=2",
                               "parallel.ep=2", "train.grad_accum=3", "train.global_batch=18"])
    with pytest.raises(ConfigError, match=r"train.global_batch.*18 is not divisible by workers x parallel.dp x "
                                          r"train.grad_accum x parallel.microbatches = 2 x 2 x 3 x 1"):
        setup_cluster(cfg, _two_workers())
    # Experts sharded across workers are not built: a worker's mesh of one replica cannot hold an ep2 group.
    cfg = load_config(CONFIG, ["parallel.strategy=multi_worker", "parallel.devices=cpu:1", "parallel.dp=-1",
                               "parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"parallel.ep: 2 does not divide parallel.dp=1.*each worker's own "
                                          r"replicas.*never across workers"):
        keras_gpt_refusals(cfg, Mesh.from_devices(["/device:CPU:0"], 1, 1, 1))
