"""Strategies across processes: choice and checks (in-process), and real multi-process
runs through `phalanx launch` (slow; every one bounded by a subprocess timeout)."""

import json
import re
import signal
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
    (cfg("parameter_server", tp=2), info(2, 1), "need parallel.strategy=mesh"),
])
def test_resolve_errors(config, cluster, fragment):
    with pytest.raises(ConfigError) as err:
        resolve_strategy_name(config, cluster)
    assert err.value.key == "parallel.strategy" and fragment in str(err.value)


def test_multi_worker_is_each_workers_own_layout_and_parameter_servers_data_parallel_only():
    # multi_worker: parallel.* is each worker's layout on the Keras-model engine.
    assert resolve_strategy_name(cfg("multi_worker", tp=2, pp=2), info(2)) == "multi_worker"
    # parameter servers run a whole step on one worker: data parallel only.
    with pytest.raises(ConfigError, match=r"parallel.strategy: parameter_server is data parallel only.*mesh"):
        resolve_strategy_name(cfg("parameter_server", tp=2), info(2, 1))


def test_mesh_is_not_built_here():
    with pytest.raises(ConfigError, match="parallel.strategy: mesh .* placed by the engine itself"):
        make_strategy(cfg("mesh", pp=2), SINGLE)


def test_a_one_process_mirrored_set_up_trains_the_builtin_gpt_on_the_keras_model_engine(devices):
    """A set-up made in one process for ``mirrored`` (Trainer(cfg, cluster=setup_cluster(cfg)))
    trains the built-in GPT on the engine phalanx train builds in one process, over the
    strategy's devices, honouring what that engine honours (here ZeRO-1); its losses are Keras's
    own one-device train_on_batch's (tests/gpt_oracle.py)."""
    import gpt_oracle
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.task import GPTTask

    model = {"layers": 1, "d_model": 16, "heads": 2, "ffn": 32, "vocab": 256, "seq_len": 8}
    train = {"global_batch": 4, "warmup": 1, "lr": 1e-3}
    c = Config().replace(parallel={"strategy": "mirrored", "dp": 2, "zero": 1}, model=model, train=train)
    setup = strategies.setup_cluster(c, SINGLE, devices=devices[:2])
    engine = build_engine(c, GPTTask(c.model, "float32", c.train.seed), setup)
    assert type(engine) is KerasGPTEngine and engine.dp == 2 and engine.engine.zero == 1
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, size=(4, 9)).astype(np.int32) for _ in range(2)]
    got = [float(engine.train_step(b)["loss"]) for b in data]
    want = gpt_oracle.run(Config().replace(model=model, train=train), data)[0]
    # float32: the same sums over two replicas in another order (~1e-7 relative); one AdamW step
    # of lr 1e-3 between the losses; a wrong gradient or replica split moves the second by ~1e-3
    np.testing.assert_allclose(got, want, rtol=1e-5)


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

    def wait(server, chief):
        calls.append(("served until the chief left", chief))

    serve_if_server_task(info(2, 1, "chief:0"), start_server=FakeServer, wait=wait)  # the coordinator returns at once
    serve_if_server_task(info(2, 0, "worker:1"), start_server=FakeServer, wait=wait)  # collective workers too
    serve_if_server_task(SINGLE, start_server=FakeServer, wait=wait)
    assert calls == []
    serve_if_server_task(info(2, 1, "ps:0"), start_server=FakeServer, wait=wait)
    spec, job, index, protocol, start = calls[0]
    assert (job, index, protocol, start) == ("ps", 0, "grpc", True)
    assert spec == {"chief": ["127.0.0.1:9000"], "worker": ["127.0.0.1:9001", "127.0.0.1:9002"],
                    "ps": ["127.0.0.1:9003"]}
    assert calls[1] == ("served until the chief left", "127.0.0.1:9000")


def test_setup_cluster_one_process(devices):
    setup = setup_cluster(Config().replace(parallel={"dp": 2}, train={"global_batch": 8}), SINGLE, devices[:2])
    assert setup.name == "mirrored"
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

def test_a_step_whose_worker_died_after_running_it_is_lost_not_fatal(capsys, monkeypatch):
    """A step's results stay on its worker until the chief copies them: when a worker dies
    the copy can fail though the step ran (its update is on the ps). A copy cancelled while
    TensorFlow handled the failure is tried again; one that keeps failing loses that step's
    values (NaN, ``lost``, said once on stderr), and the run goes on; a step's own error, or
    a step aborted before it ran, is raised. TensorFlow's own RemoteValue, its state set as
    the coordinator sets it; only the copy to the chief is made to fail as it does then."""
    import tensorflow as tf
    from tensorflow.python.distribute.coordinator import values

    from phalanx.engines import ps
    from phalanx.engines.ps import RemoteScalar, StepResult, _LostSteps

    monkeypatch.setattr(ps, "FETCH_RETRY_S", 0.0)

    class CancelledOnce(values.RemoteValueImpl):
        tries = 0

        def _copy_to_local(self):
            self.tries += 1
            if self.tries == 1:
                raise tf.errors.CancelledError(None, None, "RecvFromRemoteAsync is cancelled.")
            return self._values

    again = CancelledOnce(None, None)
    again._set_values({"loss": np.float32(0.5)})
    assert float(RemoteScalar(StepResult(again, _LostSteps()), "loss")) == 0.5 and again.tries == 2

    class WorkerGone(values.RemoteValueImpl):
        def _copy_to_local(self):  # TensorFlow's copies with an Identity placed on the chief
            raise tf.errors.CancelledError(None, None, "RecvFromRemoteAsync is cancelled. 0 successful operations.")

    class WorkerThere(values.RemoteValueImpl):
        def _copy_to_local(self):  # (no cluster here to copy from)
            return self._values

    ran = WorkerGone(None, None)
    ran._set_values({"loss": tf.constant(1.5)})
    lost_steps = _LostSteps()
    result = StepResult(ran, lost_steps)
    loss, lr = RemoteScalar(result, "loss"), RemoteScalar(result, "lr")
    assert np.isnan(float(loss)) and np.isnan(float(lr)) and loss.lost and result.lost
    assert lost_steps.count == 1 and result.done()
    assert capsys.readouterr().err.count("a worker died holding the results of a step") == 1

    fine = WorkerThere(None, None)
    fine._set_values({"loss": np.float32(2.5)})
    assert float(RemoteScalar(StepResult(fine, lost_steps), "loss")) == 2.5 and lost_steps.count == 1

    failed = WorkerGone(None, None)
    failed._set_error(tf.errors.InvalidArgumentError(None, None, "the step's own error"))
    with pytest.raises(tf.errors.InvalidArgumentError, match="the step's own error"):
        float(RemoteScalar(StepResult(failed, lost_steps), "loss"))
    aborted = WorkerGone(None, None)
    aborted._set_aborted(tf.errors.UnavailableError(None, None, "worker gone before the step ran"))
    with pytest.raises(tf.errors.CancelledError, match="aborted"):
        float(RemoteScalar(StepResult(aborted, lost_steps), "loss"))
    assert lost_steps.count == 1


# A Keras linear regression through the parameter-server engine: variables on the ps task,
# 20 steps scheduled on the workers by the chief (asynchronously), fed by the chief.
PARAMETER_SERVER_SCRIPT = textwrap.dedent('''
    import json
    import numpy as np
    from phalanx.config import Config
    from phalanx.cluster.strategies import setup_cluster
    cfg = Config().replace(parallel={"strategy": "parameter_server"}, train={"global_batch": 16, "steps": 20})
    setup = setup_cluster(cfg)                   # worker and ps tasks serve in here, then exit 0
    assert setup.is_chief and setup.name == "parameter_server"
    import keras
    from phalanx.engines.ps import KerasParameterServerEngine
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype("float32")
    Y = X @ rng.normal(size=(4, 1)).astype("float32")
    keras.utils.set_random_seed(0)

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(0.3), loss="mse")
        return model

    engine = KerasParameterServerEngine(build, setup.strategy, setup.coordinator, (X[:16], Y[:16]),
                                        setup.info.num_workers)

    def mean_loss():                             # the loss of all 64 rows on the weights now
        engine.join()
        engine.model.reset_metrics()
        for i in range(0, 64, 16):
            engine.test_step((X[i:i + 16], Y[i:i + 16]))
        engine.join()
        return float(engine.model.get_metrics_result()["loss"])

    losses, logs = [mean_loss()], []
    for k in range(20):
        logs.append(engine.train_step((X[(k * 16) % 64:][:16], Y[(k * 16) % 64:][:16])))
        if k % 5 == 4:
            losses.append(mean_loss())
    print("RAN", sum(bool(np.isfinite(float(step["loss"]))) for step in logs))  # each step's logs, from its worker
    print("DEVICE", engine.variable_devices()[0])
    print("STEP", int(engine.model.optimizer.iterations.numpy()))
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
def test_parameter_server_training_converges(tmp_path):
    script = tmp_path / "ps_loop.py"
    script.write_text(PARAMETER_SERVER_SCRIPT)
    out, pids = run_launch(["--workers", "2", "--ps", "1"], script)
    assert tagged(out.stdout, "DEVICE", "[chief:0] ") == ["/job:ps/replica:0/task:0/device:CPU:0"]
    assert tagged(out.stdout, "RAN", "[chief:0] ") == ["20"]
    # Keras's optimizer counts its iterations with a read and a write (KerasVariable.assign_add):
    # two steps in flight on two workers can count once (measured: 18 of 20). Asynchronous training.
    assert 10 <= int(tagged(out.stdout, "STEP", "[chief:0] ")[0]) <= 20
    [losses] = [json.loads(x) for x in tagged(out.stdout, "LOSSES", "[chief:0] ")]
    assert len(losses) == 5 and all(np.isfinite(losses))  # before training, then every 5 steps
    assert losses[-1] < 0.2 * losses[0], losses
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


# ---------------------------------------------------------------------------
# A mesh across workers (in-process parts; the real run is in test_cluster_train.py)


def test_needs_cluster():
    from phalanx.cluster.strategies import needs_cluster
    assert not needs_cluster(cfg(), SINGLE)
    assert needs_cluster(cfg("multi_worker"), SINGLE)
    assert needs_cluster(cfg(pp=2), info(2))             # auto + TF_CONFIG: the mesh spans the workers
    assert needs_cluster(cfg("mesh"), info(2))
    assert not needs_cluster(cfg("mirrored"), info(1))   # a one-worker TF_CONFIG is one process


@pytest.mark.parametrize("parallel, workers, expected", [
    ({"pp": 2}, 2, 1), ({"dp": 2, "pp": 2}, 2, 2), ({"pp": 2, "tp": 2}, 2, 2), ({"pp": 4}, 2, 2),
    ({"dp": -1, "pp": 2, "devices": "cpu:2"}, 2, 2),
])
def test_devices_per_task(parallel, workers, expected):
    from phalanx.cluster.mesh_cluster import devices_per_task
    assert devices_per_task(Config().replace(parallel=parallel), workers) == expected


@pytest.mark.parametrize("parallel, fragment", [
    ({"pp": 3}, "cannot be spread evenly over the 2 workers"),
    ({"pp": 2, "tp": 2, "devices": "cpu:4"}, "use parallel.devices=cpu:2 or auto"),
    ({"dp": -1, "pp": 2}, "needs the devices of each worker"),
])
def test_devices_per_task_errors(parallel, fragment):
    from phalanx.cluster.mesh_cluster import devices_per_task
    with pytest.raises(ConfigError, match=fragment):
        devices_per_task(Config().replace(parallel=parallel), 2)


def test_mesh_tasks_order_and_no_ps():
    from phalanx.cluster.mesh_cluster import mesh_tasks
    chief = parse_tf_config({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"]}, "task": {"type": "chief", "index": 0}})
    assert mesh_tasks(chief) == [("chief", 0), ("worker", 0), ("worker", 1)]
    with pytest.raises(ConfigError, match="mesh does not use parameter servers"):
        mesh_tasks(info(2, 1))


def test_serving_task_exits_0_when_the_chief_has_gone(tmp_path):
    # A serving task in a subprocess: the "chief" is a listening socket here; closing it ends the task.
    import socket as socket_lib
    chief = socket_lib.socket()
    chief.bind(("127.0.0.1", 0))
    chief.listen(8)
    port = chief.getsockname()[1]
    code = ("from phalanx.cluster.mesh_cluster import serve_until_chief_exits\n"
            f"serve_until_chief_exits(object(), '127.0.0.1:{port}', poll_s=0.1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        import time
        chief.settimeout(30)
        chief.accept()[0].close()  # the task polls the chief: its SIGTERM handler is in place
        proc.send_signal(signal.SIGTERM)  # the variables may live here: SIGTERM waits for the chief
        time.sleep(1.0)
        assert proc.poll() is None  # the chief is there: keep serving
        chief.close()
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0 and "has exited; stopping this task" in out
    finally:
        chief.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _keras_engine_setup(workers=2):
    from phalanx.cluster.strategies import MULTI_WORKER, ClusterSetup
    return ClusterSetup(info=info(workers), strategy=None, coordinator=None, name=MULTI_WORKER)


@pytest.mark.parametrize("setting", ["model.dropout=0.1", "train.prune.target=0.5", "parallel.recompute=full",
                                     "parallel.zero=1", "parallel.zero=2", "parallel.zero=3"])
def test_the_builtin_gpt_across_workers_takes_what_its_engine_runs(setting):
    """phalanx train's multi_worker run is the Keras-model engine on every worker, which runs
    dropout, pruning, recomputation and ZeRO (sliced over every worker's replicas, so even one
    replica per worker slices): each is accepted before anything is built."""
    from phalanx.config import load_config
    from phalanx.engines.factory import refuse_before_build
    from phalanx.engines.task import GPTTask

    cfg = load_config(None, ["parallel.strategy=multi_worker", "model.layers=1", "model.d_model=32",
                             "model.heads=2", "model.seq_len=8", setting])
    refuse_before_build(cfg, GPTTask(cfg.model), _keras_engine_setup())
