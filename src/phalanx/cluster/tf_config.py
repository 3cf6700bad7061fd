"""TF_CONFIG: parse and validate it, describe this process's place in the cluster,
and build it for a local cluster on loopback.

TF_CONFIG is the JSON environment variable through which TensorFlow clusters
(Kubeflow TFJob, Slurm scripts, Ray Train, ``phalanx launch``) tell each process
who is in the cluster and which task it is::

    {"cluster": {"worker": ["host0:2222", "host1:2222"], "ps": ["host2:2222"]},
     "task": {"type": "worker", "index": 1}}

Everything wrong with it is reported as :class:`TFConfigError` (a
:class:`phalanx.config.ConfigError`, so the CLI exits 2) naming the field at
fault, e.g. ``TF_CONFIG.task.index: 2 is out of range: cluster.worker has 2
tasks (valid: 0..1)``.

Example:
    >>> info = parse_tf_config('{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},'
    ...                        ' "task": {"type": "worker", "index": 1}}')
    >>> info.num_workers, info.task_name, info.is_chief
    (2, 'worker:1', False)
    >>> [name for name, _ in local_tf_configs(workers=2, ps=1, ports=[5000, 5001, 5002, 5003])]
    ['chief:0', 'worker:0', 'worker:1', 'ps:0']
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from phalanx.config import ConfigError

#: Job names TensorFlow's strategies understand, in the order tasks are listed.
JOB_TYPES = ("chief", "worker", "ps", "evaluator")
#: Jobs that may hold at most one task.
SINGLE_TASK_JOBS = ("chief", "evaluator")
ENV_VAR = "TF_CONFIG"


class TFConfigError(ConfigError):
    """TF_CONFIG is malformed; ``key`` names the field, e.g. ``TF_CONFIG.task.index``."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{ENV_VAR}.{field}" if field else ENV_VAR, message)


@dataclass(frozen=True)
class ClusterInfo:
    """This process's view of the cluster (validated; immutable).

    ``cluster`` maps job name -> task addresses (``"host:port"``); it is empty for a
    single process without TF_CONFIG.

    >>> ClusterInfo.single_process().is_chief
    True
    >>> info = parse_tf_config({"cluster": {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]},
    ...                         "task": {"type": "ps", "index": 0}})
    >>> info.num_workers, info.num_ps, info.is_chief, info.is_server_task
    (2, 1, False, True)
    """

    cluster: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int
    rpc_layer: str = "grpc"

    @staticmethod
    def single_process() -> "ClusterInfo":
        """A process that is not part of a cluster (no TF_CONFIG)."""
        return ClusterInfo(cluster={}, task_type="worker", task_index=0)

    @property
    def is_distributed(self) -> bool:
        """True when TF_CONFIG names a cluster."""
        return bool(self.cluster)

    @property
    def num_workers(self) -> int:
        """Tasks that compute gradients: the workers (the chief counts as one when
        there are no parameter servers, as in MultiWorkerMirroredStrategy; with
        parameter servers the chief only coordinates)."""
        if not self.cluster:
            return 1
        workers = len(self.cluster.get("worker", ()))
        if not self.num_ps:
            workers += len(self.cluster.get("chief", ()))
        return workers

    @property
    def num_ps(self) -> int:
        return len(self.cluster.get("ps", ()))

    @property
    def has_chief(self) -> bool:
        return bool(self.cluster.get("chief"))

    @property
    def is_chief(self) -> bool:
        """The task that writes checkpoints and logs: the chief task, or worker 0
        when the cluster has no chief."""
        if self.has_chief:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def is_server_task(self) -> bool:
        """With parameter servers, the worker and ps tasks only serve the chief
        (the coordinator that runs the training loop): they run ``tf.distribute.Server``."""
        return self.num_ps > 0 and self.task_type in ("worker", "ps")

    @property
    def worker_index(self) -> int:
        """Index of this task among the gradient-computing workers (input sharding):
        with a chief and no ps, the chief is 0 and ``worker:i`` is ``i + 1``."""
        if self.has_chief and not self.num_ps:
            return 0 if self.task_type == "chief" else self.task_index + 1
        return self.task_index

    @property
    def task_name(self) -> str:
        return f"{self.task_type}:{self.task_index}"

    @property
    def address(self) -> str | None:
        """This task's ``host:port`` (None outside a cluster or for an evaluator not listed)."""
        tasks = self.cluster.get(self.task_type, ())
        return tasks[self.task_index] if self.task_index < len(tasks) else None

    def cluster_spec_dict(self) -> dict[str, list[str]]:
        """The cluster as plain lists, e.g. for ``tf.train.ClusterSpec``."""
        return {job: list(tasks) for job, tasks in self.cluster.items()}


def cluster_info_from_env(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Parse ``$TF_CONFIG``; a missing or empty variable means a single process.

    >>> cluster_info_from_env({}).is_distributed
    False
    """
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_VAR, "").strip()
    if not text:
        return ClusterInfo.single_process()
    return parse_tf_config(text)


def cluster_from_env(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Alias of :func:`cluster_info_from_env` (the name the trainer's CLI uses)."""
    return cluster_info_from_env(environ)


def parse_tf_config(config: str | Mapping[str, Any]) -> ClusterInfo:
    """Validate a TF_CONFIG (JSON text or the decoded mapping) into a :class:`ClusterInfo`."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as err:
            raise TFConfigError("", f"is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); "
                                    'expected e.g. {"cluster": {"worker": ["host:port", ...]}, '
                                    '"task": {"type": "worker", "index": 0}}') from None
    if not isinstance(config, Mapping):
        raise TFConfigError("", f"must be a JSON object with keys cluster and task, got {type(config).__name__}")
    unknown = sorted(set(config) - {"cluster", "task", "rpc_layer", "environment"})
    if unknown:
        raise TFConfigError(unknown[0], "unknown key; valid keys: cluster, task, rpc_layer, environment")

    cluster = _parse_cluster(config.get("cluster"))
    task_type, task_index = _parse_task(config.get("task"), cluster)
    rpc_layer = config.get("rpc_layer", "grpc")
    if not isinstance(rpc_layer, str) or not rpc_layer:
        raise TFConfigError("rpc_layer", f"must be a non-empty string such as 'grpc', got {rpc_layer!r}")
    return ClusterInfo(cluster=cluster, task_type=task_type, task_index=task_index, rpc_layer=rpc_layer)


def _parse_cluster(cluster: Any) -> dict[str, tuple[str, ...]]:
    if cluster is None:
        raise TFConfigError("cluster", 'is missing; expected e.g. {"worker": ["host0:2222", "host1:2222"]}')
    if not isinstance(cluster, Mapping) or not cluster:
        raise TFConfigError("cluster", f"must be a non-empty object mapping job names to address lists, got {cluster!r}")
    parsed: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for job in sorted(cluster, key=lambda j: JOB_TYPES.index(j) if j in JOB_TYPES else len(JOB_TYPES)):
        tasks = cluster[job]
        if job not in JOB_TYPES:
            raise TFConfigError(f"cluster.{job}", f"unknown job name; valid job names: {', '.join(JOB_TYPES)}")
        if not isinstance(tasks, list) or not tasks:
            raise TFConfigError(f"cluster.{job}", f"must be a non-empty list of 'host:port' strings, got {tasks!r}")
        if job in SINGLE_TASK_JOBS and len(tasks) > 1:
            raise TFConfigError(f"cluster.{job}", f"may hold at most one task, got {len(tasks)}")
        for i, address in enumerate(tasks):
            _check_address(f"cluster.{job}[{i}]", address)
            if address in seen:
                raise TFConfigError(f"cluster.{job}[{i}]", f"address {address!r} is already used by {seen[address]}")
            seen[address] = f"{job}:{i}"
        parsed[job] = tuple(tasks)
    if "worker" not in parsed and "chief" not in parsed:
        raise TFConfigError("cluster", "needs a 'worker' or 'chief' job; got only " + ", ".join(parsed))
    if "ps" in parsed and ("chief" not in parsed or "worker" not in parsed):
        raise TFConfigError("cluster.ps", "a cluster with parameter servers needs a 'chief' task (the coordinator "
                                          "that runs the training loop) and at least one 'worker'")
    return parsed


def _check_address(field: str, address: Any) -> None:
    if not isinstance(address, str):
        raise TFConfigError(field, f"must be a 'host:port' string, got {address!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TFConfigError(field, f"{address!r} is not 'host:port' with a port in 1..65535")


def _parse_task(task: Any, cluster: Mapping[str, tuple[str, ...]]) -> tuple[str, int]:
    if task is None:
        raise TFConfigError("task", 'is missing; expected e.g. {"type": "worker", "index": 0}')
    if not isinstance(task, Mapping):
        raise TFConfigError("task", f'must be an object like {{"type": "worker", "index": 0}}, got {task!r}')
    task_type = task.get("type")
    if task_type is None:
        raise TFConfigError("task.type", f"is missing; valid types here: {', '.join(cluster)}")
    if not isinstance(task_type, str) or task_type not in JOB_TYPES:
        raise TFConfigError("task.type", f"{task_type!r} is not valid; choose one of: {', '.join(JOB_TYPES)}")
    index = task.get("index", None)
    if index is None:
        raise TFConfigError("task.index", "is missing; expected a task number such as 0")
    if isinstance(index, str) and index.isdigit():  # some launchers write the index as a string
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool):
        raise TFConfigError("task.index", f"must be an integer, got {index!r}")
    if task_type == "evaluator" and task_type not in cluster:
        # TensorFlow's convention: the evaluator is not part of the training cluster.
        if index != 0:
            raise TFConfigError("task.index", f"{index} is out of range: there is one evaluator (valid: 0)")
        return task_type, index
    if task_type not in cluster:
        raise TFConfigError("task.type", f"{task_type!r} has no tasks in cluster; valid types here: {', '.join(cluster)}")
    count = len(cluster[task_type])
    if not 0 <= index < count:
        raise TFConfigError("task.index", f"{index} is out of range: cluster.{task_type} has {count} "
                                          f"task{'s' if count != 1 else ''} (valid: 0..{count - 1})")
    return task_type, index


# ---------------------------------------------------------------------------
# Building TF_CONFIG for a local cluster


def local_cluster(workers: int, ps: int = 0, ports: Sequence[int] = (), host: str = "127.0.0.1"
                  ) -> dict[str, list[str]]:
    """The cluster dict of a local cluster: ``workers`` workers and ``ps`` parameter servers,
    plus a chief when ``ps > 0`` (it coordinates; see :func:`local_tf_configs`).

    ``ports`` holds one port per task in the order chief, workers, ps.

    >>> local_cluster(2, ports=[7001, 7002])
    {'worker': ['127.0.0.1:7001', '127.0.0.1:7002']}
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if ps < 0:
        raise ValueError(f"ps must be >= 0, got {ps}")
    needed = workers + ps + (1 if ps else 0)
    if len(ports) != needed:
        raise ValueError(f"need {needed} ports (chief + workers + ps), got {len(ports)}")
    addresses = iter(f"{host}:{port}" for port in ports)
    cluster: dict[str, list[str]] = {}
    if ps:
        cluster["chief"] = [next(addresses)]
    cluster["worker"] = [next(addresses) for _ in range(workers)]
    if ps:
        cluster["ps"] = [next(addresses) for _ in range(ps)]
    return cluster


def local_tf_configs(workers: int, ps: int = 0, ports: Sequence[int] = (), host: str = "127.0.0.1"
                     ) -> list[tuple[str, dict[str, Any]]]:
    """``(task name, TF_CONFIG dict)`` for every task of a local cluster.

    Topology: without parameter servers, ``workers`` peers run the same training
    loop (MultiWorkerMirroredStrategy) and ``worker:0`` is the chief. With ``ps > 0``
    a ``chief`` task is added: it is the coordinator that runs the training loop
    (ParameterServerStrategy + ClusterCoordinator), while the worker and ps tasks run
    ``tf.distribute.Server`` and execute what the chief sends them.

    >>> name, cfg = local_tf_configs(1, ports=[7001])[0]
    >>> name, cfg["task"]
    ('worker:0', {'type': 'worker', 'index': 0})
    """
    cluster = local_cluster(workers, ps, ports, host)
    return [(f"{job}:{i}", {"cluster": cluster, "task": {"type": job, "index": i}})
            for job, tasks in cluster.items() for i in range(len(tasks))]
