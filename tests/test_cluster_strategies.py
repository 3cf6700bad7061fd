"""Strategies across processes: choice and checks (in-process), and real multi-process
runs through `phalanx launch` (slow; every one bounded by a subprocess timeout)."""

import json
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from phalanx.cluster import strategies
from phalanx.cluster.strategies import (check_batch, make_coordinator, make_strategy, resolve_strategy_name,
                                        serve_if_server_task, setup_cluster)
from phalanx.cluster.tf_config import ClusterInfo, local_tf_configs, parse_tf_config
from phalanx.config import Config, ConfigError

LAUNCH = [sys.executable, "-m", "phalanx.cluster.launch"]
SINGLE = ClusterInfo.single_process()


def info(workers=2, ps=0, task=None):
    configs = dict(local_tf_configs(workers, ps, ports=list(range(9000, 9000 + workers + ps + (1 if ps else 0)))))
    return parse_tf_config(configs[task or ("chief:0" if ps else "worker:0")])


def cfg(strategy="auto", **parallel):
    return Config().replace(parallel={"strategy": strategy, **parallel})


@pytest.mark.parametrize("config, cluster, expected", [
    (cfg(), SINGLE, "mirrored"),
    (cfg(dp=2), SINGLE, "mirrored"),
    (cfg(), info(2), "multi_worker"),
    (cfg(), info(2, 1), "parameter_server"),
    (cfg(pp=2), SINGLE, "mesh"),
    (cfg("multi_worker"), SINGLE, "multi_worker"),  # a one-worker cluster is allowed
    (cfg("parameter_server"), info(1, 1), "parameter_server"),
])
def test_resolve(config, cluster, expected):
    assert resolve_strategy_name(config, cluster) == expected


@pytest.mark.parametrize("config, cluster, fragment", [
    (cfg("mirrored"), info(2), "mirrored trains in one process, but TF_CONFIG names 2 workers"),
    (cfg("multi_worker"), info(2, 1), "does not use parameter servers"),
    (cfg("parameter_server"), info(2), "needs a cluster with ps tasks"),
    (cfg("parameter_server"), SINGLE, "phalanx launch --workers 2 --ps 1"),
    (cfg("multi_worker", tp=2), info(2), "need parallel.strategy=mesh"),
])
def test_resolve_errors(config, cluster, fragment):
    with pytest.raises(ConfigError) as err:
        resolve_strategy_name(config, cluster)
    assert err.value.key == "parallel.strategy" and fragment in str(err.value)


def test_mesh_is_not_built_here():
    with pytest.raises(ConfigError, match="parallel.strategy: mesh .* built by the mesh engine"):
        make_strategy(cfg("mesh", pp=2), SINGLE)


def test_local_strategies(devices):
    two = make_strategy(cfg("mirrored", dp=2), SINGLE, devices=devices[:2])
    assert isinstance(two, tf.distribute.MirroredStrategy) and two.num_replicas_in_sync == 2
    assert check_batch(Config().replace(parallel={"dp": 2}, train={"global_batch": 8}), two) == 8
    one = make_strategy(cfg(), SINGLE, devices=devices[:1])
    assert isinstance(one, tf.distribute.OneDeviceStrategy)
    default = make_strategy(cfg(dp=4), SINGLE)  # the first 4 logical devices
    assert default.num_replicas_in_sync == 4
    assert make_coordinator(default) is None


def test_too_many_replicas_for_the_devices():
    with pytest.raises(ConfigError, match=r"parallel.dp: 64 replicas need 64 devices, but only \d+ exist"):
        make_strategy(Config().replace(parallel={"dp": 64}, train={"global_batch": 64}), SINGLE)


def test_check_batch_errors(devices):
    two = make_strategy(cfg(dp=2), SINGLE, devices=devices[:2])
    with pytest.raises(ConfigError, match="parallel.dp: 4 does not match the 2 replicas"):
        check_batch(Config().replace(parallel={"dp": 4}, train={"global_batch": 8}), two)
    with pytest.raises(ConfigError, match="parallel.dp: 1 does not match"):  # dp=1 is only 'unset' across workers
        check_batch(Config().replace(train={"global_batch": 8}), two)
    # global_batch=7 passes Config's own check (dp=-1 counts as 1) but not 2 replicas.
    with pytest.raises(ConfigError, match="train.global_batch: 7 is not divisible by replicas x train.grad_accum = 2 x 1"):
        check_batch(Config().replace(parallel={"dp": -1}, train={"global_batch": 7}), two)


def test_serve_if_server_task():
    calls = []

    class FakeServer:
        def __init__(self, spec, job_name, task_index, protocol, start):
            calls.append((spec.as_dict(), job_name, task_index, protocol, start))

        def join(self):
            calls.append("joined")

    serve_if_server_task(info(2, 1, "chief:0"), start_server=FakeServer)  # the coordinator returns at once
    serve_if_server_task(info(2, 0, "worker:1"), start_server=FakeServer)  # collective workers too
    serve_if_server_task(SINGLE, start_server=FakeServer)
    assert calls == []
    serve_if_server_task(info(2, 1, "ps:0"), start_server=FakeServer)
    spec, job, index, protocol, start = calls[0]
    assert (job, index, protocol, start) == ("ps", 0, "grpc", True)
    assert spec == {"chief": ["127.0.0.1:9000"], "worker": ["127.0.0.1:9001", "127.0.0.1:9002"],
                    "ps": ["127.0.0.1:9003"]}
    assert calls[1] == "joined"


def test_setup_cluster_one_process(devices):
    setup = setup_cluster(Config().replace(parallel={"dp": 2}, train={"global_batch": 8}), SINGLE, devices[:2])
    assert (setup.name, setup.data_index, setup.data_count, setup.local_batch) == ("mirrored", 0, 1, 8)
    assert setup.is_chief and setup.coordinator is None and setup.strategy.num_replicas_in_sync == 2


def test_setup_cluster_reports_config_errors_before_serving():
    # A ps task with a wrong strategy must fail at once, not start serving forever.
    with pytest.raises(ConfigError, match="multi_worker does not use parameter servers"):
        setup_cluster(cfg("multi_worker"), info(2, 1, "ps:0"))


def test_parameter_server_strategy_only_on_the_chief():
    with pytest.raises(RuntimeError, match="task worker:0 must call serve_if_server_task"):
        strategies.parameter_server_strategy(info(2, 1, "worker:0"))


# ---------------------------------------------------------------------------
# Multi-process (slow)

# A stand-alone custom loop: a 2-layer Keras model, hand-written SGD, 3 steps, global
# batch 8. "multi": one replica per worker process, each feeding its 4 rows; "mirrored":
# one process, MirroredStrategy on 2 logical CPUs fed all 8 rows.
MULTI_WORKER_SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    import tensorflow as tf
    mode = sys.argv[1]
    if mode == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    from phalanx.config import Config
    from phalanx.cluster.strategies import setup_cluster
    cfg = Config().replace(parallel={"strategy": "multi_worker" if mode == "multi" else "mirrored", "dp": 2},
                           train={"global_batch": 8})
    setup = setup_cluster(cfg)                   # first: before any other TF op
    strategy, rows = setup.strategy, setup.local_batch   # rows: this process's share of the global batch
    import keras
    rng = np.random.default_rng(0)
    X = rng.normal(size=(3, 8, 5)).astype("float32")
    Y = rng.normal(size=(3, 8, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
    variables = [v.value for v in model.trainable_variables]  # the tf.Variables under Keras's wrappers
    local = len(strategy.extended.worker_devices)

    def replica_grads(x, y):
        ctx = tf.distribute.get_replica_context()
        n = tf.shape(x)[0] // local
        i = ctx.replica_id_in_sync_group % local
        x, y = x[i * n:(i + 1) * n], y[i * n:(i + 1) * n]
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x) - y)) / 8.0   # mean over the GLOBAL batch
        return loss, tape.gradient(loss, variables)

    @tf.function
    def step(x, y):
        loss, grads = strategy.run(replica_grads, args=(x, y))
        grads = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, list(zip(grads, variables)))
        for v, g in zip(variables, grads):
            strategy.extended.update(v, lambda var, g: var.assign_sub(0.1 * g), args=(g,), group=False)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    w = setup.data_index
    losses = [float(step(X[k][w * rows:(w + 1) * rows], Y[k][w * rows:(w + 1) * rows])) for k in range(3)]
    print("SETUP", strategy.num_replicas_in_sync, rows, type(strategy).__name__, setup.data_index, setup.data_count)
    print("LOSSES", json.dumps(losses))
''')

# The chief trains a linear regression on the ps-held variables: 12 steps fed by the
# chief (exactly-once data), then 8 steps from per-worker datasets.
PARAMETER_SERVER_SCRIPT = textwrap.dedent('''
    import json
    import numpy as np
    from phalanx.config import Config
    from phalanx.cluster.strategies import per_worker_dataset, setup_cluster
    cfg = Config().replace(parallel={"strategy": "parameter_server"}, train={"global_batch": 16})
    setup = setup_cluster(cfg)                   # worker and ps tasks serve in here, forever
    strategy, coordinator, rows = setup.strategy, setup.coordinator, setup.local_batch
    assert (setup.data_index, setup.data_count, setup.is_chief) == (0, 1, True)
    import tensorflow as tf, keras
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype("float32")
    Y = X @ rng.normal(size=(4, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    variables = [v.value for v in model.trainable_variables]

    @tf.function
    def train_step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            for v, g in zip(variables, tape.gradient(loss, variables)):
                v.assign_sub(0.2 * g)
            return loss
        return strategy.run(replica, args=(x, y))

    @tf.function
    def iterator_step(it):
        x, y = next(it)
        return train_step(x, y)

    losses = [float(coordinator.schedule(train_step, args=(X[i:i + rows], Y[i:i + rows])).fetch())
              for i in [(k * rows) % 64 for k in range(12)]]
    it = iter(per_worker_dataset(coordinator, strategy,
                                 lambda ctx: tf.data.Dataset.from_tensor_slices((X, Y)).repeat().batch(rows)))
    remote = [coordinator.schedule(iterator_step, args=(it,)) for _ in range(8)]
    coordinator.join()
    losses += [float(r.fetch()) for r in remote]
    print("DEVICE", variables[0].device)
    print("LOSSES", json.dumps(losses))
''')


def run_launch(args, script, mode=None, timeout=120):
    cmd = [*LAUNCH, *args, "--timeout", str(timeout - 20), "--grace", "3", "--", sys.executable, str(script)]
    out = subprocess.run(cmd + ([mode] if mode else []), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out.stderr)]
    return out, pids


def tagged(text, tag, prefix=""):
    return [line.split(f"{tag} ", 1)[1] for line in text.splitlines() if line.startswith(f"{prefix}{tag} ")]


@pytest.mark.slow
def test_two_workers_equal_mirrored_on_two_devices(tmp_path):
    script = tmp_path / "multi_worker_loop.py"
    script.write_text(MULTI_WORKER_SCRIPT)
    ref = subprocess.run([sys.executable, str(script), "mirrored"], capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr[-4000:]
    assert tagged(ref.stdout, "SETUP") == ["2 8 MirroredStrategy 0 1"]
    [expected] = [json.loads(x) for x in tagged(ref.stdout, "LOSSES")]

    out, pids = run_launch(["--workers", "2"], script, "multi")
    for w in (0, 1):
        assert tagged(out.stdout, "SETUP", f"[worker:{w}] ") == [f"2 4 CollectiveAllReduceStrategy {w} 2"]  # MultiWorkerMirroredStrategy's class
        [losses] = [json.loads(x) for x in tagged(out.stdout, "LOSSES", f"[worker:{w}] ")]
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert expected[0] != expected[1]  # the model does train (the steps are not no-ops)
    _assert_gone(pids)


@pytest.mark.slow
def test_parameter_server_training_converges(tmp_path):
    script = tmp_path / "ps_loop.py"
    script.write_text(PARAMETER_SERVER_SCRIPT)
    out, pids = run_launch(["--workers", "1", "--ps", "1"], script)
    assert tagged(out.stdout, "DEVICE", "[chief:0] ") == ["/job:ps/replica:0/task:0/device:CPU:0"]
    [losses] = [json.loads(x) for x in tagged(out.stdout, "LOSSES", "[chief:0] ")]
    assert len(losses) == 20 and all(np.isfinite(losses))
    assert max(losses[-4:]) < 0.05 * losses[0]
    _assert_gone(pids)


def _assert_gone(pids):
    import time

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    end = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "processes left behind"
