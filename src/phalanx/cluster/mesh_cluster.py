"""A mesh whose devices span the workers of a TF_CONFIG cluster (``parallel.strategy=mesh``).

The engine (the Keras-model engine for the built-in GPT) places every weight, activation and gradient with ``tf.device`` on the device names of
its :class:`~phalanx.mesh.Mesh`. Those names may be remote:
once a process has called ``tf.config.experimental_connect_to_cluster``, a
``tf.function`` can place ops on ``/job:worker/replica:0/task:1/device:CPU:0`` and
TensorFlow moves tensors between the tasks over gRPC. So a pipeline stage (or a
data-parallel replica) can live on another worker without a line of the engine
changing (ARCHITECTURE.md: remote placement works).

Roles (every task runs the same ``phalanx train`` command):

* the chief (``worker:0``, or the ``chief`` task) runs the training loop: it joins
  the cluster as its own task, and builds the mesh from all tasks' device names;
  it feeds the data, writes metrics and checkpoints;
* every other task makes its devices, starts a ``tf.distribute.Server`` and serves
  the chief; it exits 0 when the chief has gone (training done, or the chief failed:
  the launcher or the cluster manager then sees the chief's status). SIGTERM waits
  for that too: the chief reads the variables held here to write its checkpoint.

Layout: the ``dp x pp x tp`` devices are spread evenly over the W tasks, each task
holding ``dp*pp*tp / W`` consecutive devices of the row-major ``(data, pipe, tensor)``
grid. Hence ``pp=2`` on 2 workers puts one stage on each; ``dp=2 pp=2`` on 2 workers
keeps a pipeline inside each worker and replicates across workers; ``pp=2 tp=2`` on 2
workers runs a tensor-parallel stage on each.

Example (on a 2-worker cluster; worker:1 serves inside ``setup_mesh_cluster``)::

    devices = setup_mesh_cluster(cfg, info)   # chief: ['/job:worker/replica:0/task:0/device:CPU:0',
                                              #         '/job:worker/replica:0/task:1/device:CPU:0']
    mesh = build_mesh(cfg, devices)

    >>> from phalanx.config import Config
    >>> mesh_tasks(ClusterInfo(cluster={"worker": ("h:1", "h:2")}, task_type="worker", task_index=0))
    [('worker', 0), ('worker', 1)]
    >>> devices_per_task(Config().replace(parallel={"pp": 2}), 2)
    1
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from phalanx.cluster.tf_config import ClusterInfo
from phalanx.config import ConfigError, parse_devices

#: How often a serving task checks that the chief is still there (seconds).
POLL_S = 1.0


def mesh_tasks(info: ClusterInfo) -> list[tuple[str, int]]:
    """The tasks that hold mesh devices, in mesh order: the chief task (if any), then the workers."""
    if info.num_ps:
        raise ConfigError("parallel.strategy", f"mesh does not use parameter servers, but TF_CONFIG has "
                                               f"{info.num_ps} ps task(s); launch without --ps")
    return [("chief", i) for i in range(len(info.cluster.get("chief", ())))] + \
           [("worker", i) for i in range(len(info.cluster.get("worker", ())))]


def devices_per_task(cfg: Any, tasks: int) -> int:
    """Mesh devices on each task: ``dp x pp x tp / tasks`` (``parallel.devices=cpu:N``, if
    given, names N per task)."""
    p = cfg.parallel
    _, per_task = parse_devices(p.devices)
    degrees = (p.dp, p.pp, p.tp)
    if -1 in degrees:
        if not per_task:
            raise ConfigError("parallel.devices", "a degree of -1 across workers needs the devices of each worker, "
                                                  "e.g. parallel.devices=cpu:2")
        return per_task
    total = p.dp * p.pp * p.tp
    if total % tasks:
        raise ConfigError("parallel.pp", f"dp x pp x tp = {p.dp} x {p.pp} x {p.tp} = {total} devices cannot be "
                                         f"spread evenly over the {tasks} workers; use a multiple of {tasks}")
    if per_task and per_task != total // tasks:
        raise ConfigError("parallel.devices", f"{p.devices!r} per worker, but dp x pp x tp = {total} over {tasks} "
                                              f"workers is {total // tasks} each; use parallel.devices="
                                              f"cpu:{total // tasks} or auto")
    return total // tasks


def setup_mesh_cluster(cfg: Any, info: ClusterInfo) -> list[str]:
    """Chief: join the cluster and return the mesh's device names (all tasks, mesh order).
    Any other task: serve the chief, then exit the process (never returns).

    Call it first in the process, before any other TensorFlow op (it configures devices).
    """
    import tensorflow as tf

    tasks = mesh_tasks(info)
    per_task = devices_per_task(cfg, len(tasks))
    kind = _device_kind(cfg)
    if kind == "CPU" and per_task > 1:  # before the runtime starts; remote tasks do the same
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * per_task)
    spec = tf.train.ClusterSpec(info.cluster_spec_dict())
    if not info.is_chief:
        # A server takes its CPU devices from its ConfigProto, not from the logical device configuration.
        config = tf.compat.v1.ConfigProto(device_count={"CPU": per_task}) if kind == "CPU" else None
        server = tf.distribute.Server(spec, job_name=info.task_type, task_index=info.task_index,
                                      protocol=info.rpc_layer, config=config, start=True)
        serve_until_chief_exits(server, _chief_address(info))
    # The chief is a task of the cluster itself (its ops and the input pipeline run locally).
    tf.config.experimental_connect_to_cluster(spec, job_name=info.task_type, task_index=info.task_index,
                                              protocol=info.rpc_layer)
    return [f"/job:{job}/replica:0/task:{i}/device:{kind}:{k}" for job, i in tasks for k in range(per_task)]


def _device_kind(cfg: Any) -> str:
    kind, _ = parse_devices(cfg.parallel.devices)
    if kind == "auto":
        import tensorflow as tf
        return "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    return kind.upper()


def _chief_address(info: ClusterInfo) -> str:
    job = "chief" if info.has_chief else "worker"
    return info.cluster[job][0]


def serve_until_chief_exits(server: Any, chief: str, poll_s: float = POLL_S) -> None:
    """Keep ``server`` serving until the chief at ``chief`` (``host:port``) has gone, then end
    the process with status 0 (never returns).

    The variables of the run may live on this task (ps tasks, remote pipeline stages),
    and the chief reads them to write its checkpoint, so SIGTERM (the launcher's or a
    preemption notice sent to every task) does not end the task while the chief is
    still there: it ends it as soon as the chief is unreachable, even if it was never
    seen. A task whose chief never appears and no SIGTERM comes is the cluster
    manager's (or the launcher's ``--grace`` SIGKILL's) to end. ``server`` is only kept
    alive here: it serves from its own threads.
    """
    terminating: list[int] = []

    def on_term(signum, frame):
        terminating.append(signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    host, port = chief.rsplit(":", 1)
    seen, misses = False, 0
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            seen, misses = True, 0
        except OSError:
            misses += 1
        # Two misses in a row, so that one refused connection under load is not taken for an exit.
        if misses >= 2 and (seen or terminating):
            why = "has exited" if seen else "is unreachable and SIGTERM was received"
            print(f"[phalanx.cluster] the chief at {chief} {why}; stopping this task", flush=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # the gRPC server's threads would keep a normal interpreter exit waiting
        time.sleep(poll_s)
