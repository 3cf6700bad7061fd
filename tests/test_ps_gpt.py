"""`phalanx train parallel.strategy=parameter_server`: the built-in GPT as the Keras model it is on
every layout, on the one parameter-server engine (engines/ps_gpt.py on engines/ps.py), against
Keras's own one-device ``train_on_batch`` (tests/gpt_oracle.py).

With one worker the coordinator runs the steps one after another, each on the weights the
previous one wrote: asynchronous training with nothing in flight beside a step is synchronous
training, so the losses must be the oracle's on the same batches (the stream the trainer feeds,
:mod:`phalanx.data.pipeline`), also across resumes from checkpoints (the weights, AdamW moments,
step and data position): a one-process run's resumed on parameter servers, and the chief's
resumed there again with ``train.grad_accum=2``. Real runs of
``phalanx launch --workers 1 --ps 1`` on loopback, bounded in time; what two workers do
(asynchronous: the loss falls, a killed worker is survived) is in test_cluster_train.py and
test_faults_cluster.py.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import gpt_oracle
from cluster_helpers import PHALANX, TINY, assert_gone, env, task_pids

ONE, FIRST, STEPS = 2, 4, 6  # steps run in one process, then on parameter servers, then again after a stop


def _train(cache, run_dir, steps, *extra, ps=True):
    launch = [*PHALANX, "launch", "--workers", "1", "--ps", "1", "--timeout", "200", "--grace", "3", "--"]
    cmd = [*(launch if ps else []), *PHALANX, "train", *(["parallel.strategy=parameter_server"] if ps else []),
           *TINY, f"data.cache_dir={cache}", f"run.dir={run_dir}", f"train.steps={steps}", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert_gone(task_pids(out.stderr).values())
    return out.stderr


@pytest.mark.slow
def test_one_worker_gives_keras_one_device_losses_across_a_resume(tmp_path):
    from phalanx.config import load_config
    from phalanx.data import pipeline

    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    _train(cache, run_dir, ONE, ps=False)  # one process (the Keras-model engine on one device)
    err = _train(cache, run_dir, FIRST)     # resumed on parameter servers from its checkpoint
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{ONE:08d}'} (step {ONE})" in err, err[-3000:]
    # resumed from the chief's checkpoint at step FIRST, each batch now cut into 2 micro-batches
    err = _train(cache, run_dir, STEPS, "train.grad_accum=2")
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{FIRST:08d}'} (step {FIRST})" in err, err[-3000:]
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    assert sorted(rows) == list(range(1, STEPS + 1))
    meta = json.loads((run_dir / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())
    assert meta["layout"]["engine"] == "GPTParameterServerEngine"

    # The oracle: Keras's train_on_batch on one device, one call per step on the batch the trainer fed.
    cfg = load_config(None, [*TINY, f"data.cache_dir={cache}", f"run.dir={run_dir}", f"train.steps={STEPS}"])
    data = pipeline.make_datasets(cfg, progress=False).train_iterator(0)
    batches = [np.asarray(next(data)) for _ in range(STEPS)]
    losses, norms, _ = gpt_oracle.run(cfg, batches)
    got = np.array([rows[s]["loss"] for s in range(1, STEPS + 1)])
    got_norms = np.array([rows[s]["grad_norm"] for s in range(1, STEPS + 1)])
    print("relative loss differences", np.abs(got / np.asarray(losses) - 1).tolist())
    # Steps 1..FIRST (ONE of them in one process): the same arithmetic on the same CPU kernels, on
    # parameter servers the variables on the ps task and the step on the worker: equal to float32
    # round-off (1e-6 relative; measured bit-equal).
    np.testing.assert_allclose(got[:FIRST], losses[:FIRST], rtol=1e-6)
    np.testing.assert_allclose(got_norms[:FIRST], norms[:FIRST], rtol=1e-6)
    # After the resume (weights, AdamW moments, step and data position from the checkpoint) with
    # train.grad_accum=2: the gradients of the two half-batches (each of its mean loss / 2) are summed,
    # for the dense GPT the gradient of the whole batch's mean loss up to float32 summation order
    # (~1e-7 relative), and the loss reported is the mean of the halves' means, the batch's mean. Adam
    # divides by sqrt(v) over the 3 steps after it (a tiny model, near-zero moments amplify round-off):
    # 1e-5 relative bounds it with margin (measured: 0 to 9e-8).
    np.testing.assert_allclose(got[FIRST:], losses[FIRST:], rtol=1e-5)
    np.testing.assert_allclose(got_norms[FIRST:], norms[FIRST:], rtol=1e-5)
    assert got[-1] < got[0]  # the steps do train (not no-ops)


PS_REFUSED = [({"parallel": {"dp": 2}}, "parallel.dp"),
              ({"parallel": {"sequence_parallel": True}}, "parallel.sequence_parallel"),
              ({"train": {"prune": {"target": 0.5}}}, "train.prune.target"),
              ({"parallel": {"zero": 1}}, "parallel.zero"),
              ({"parallel": {"recompute": "full"}}, "parallel.recompute")]


@pytest.mark.parametrize("keys,key", PS_REFUSED, ids=[k for _, k in PS_REFUSED])
def test_what_parameter_servers_cannot_honour_is_refused_before_anything_is_built(keys, key):
    """phalanx train's refusals (engines.factory.refuse_before_build, run before the run directory
    is touched) under a parameter-server set-up: a ConfigError naming the key."""
    from types import SimpleNamespace

    from phalanx.config import Config, ConfigError
    from phalanx.engines.factory import refuse_before_build
    from phalanx.engines.task import GPTTask

    ps = SimpleNamespace(name="parameter_server", coordinator=object(), devices=())
    tiny = {"layers": 1, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 8}
    cfg = Config().replace(model=tiny, parallel={"strategy": "parameter_server"}, train={"global_batch": 8})
    refuse_before_build(cfg, GPTTask(cfg.model), ps)  # the plain run is accepted
    with pytest.raises(ConfigError) as err:
        bad = cfg.replace(**keys)  # (a deep update: the other keys stay)
        refuse_before_build(bad, GPTTask(bad.model), ps)
    assert err.value.key == key, err.value
    with pytest.raises(TypeError, match=r"trains the built-in GPT .*phalanx\.fit\("):  # a Keras model: phalanx.fit
        refuse_before_build(cfg, object(), ps)
