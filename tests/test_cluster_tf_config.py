"""TF_CONFIG parsing, validation messages and local cluster layouts."""

import json

import pytest

from phalanx.cluster.tf_config import (ClusterInfo, TFConfigError, cluster_info_from_env, local_cluster,
                                       local_tf_configs, parse_tf_config)
from phalanx.config import ConfigError

TWO = {"worker": ["127.0.0.1:2000", "127.0.0.1:2001"]}
PS = {"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4", "h:5"]}


def tf_config(cluster=TWO, task_type="worker", index=0, **extra):
    return {"cluster": cluster, "task": {"type": task_type, "index": index}, **extra}


def test_worker_cluster_without_chief():
    info = parse_tf_config(json.dumps(tf_config(index=1)))
    assert (info.num_workers, info.num_ps, info.task_name, info.address) == (2, 0, "worker:1", "127.0.0.1:2001")
    assert not info.is_chief and info.is_distributed and not info.is_server_task
    assert parse_tf_config(tf_config(index=0)).is_chief  # worker 0 is the chief when there is no chief task


def test_parameter_server_cluster_roles():
    chief = parse_tf_config(tf_config(PS, "chief", 0))
    assert chief.is_chief and not chief.is_server_task
    assert (chief.num_workers, chief.num_ps) == (2, 2)  # the chief only coordinates
    for task_type, index in (("worker", 0), ("worker", 1), ("ps", 1)):
        info = parse_tf_config(tf_config(PS, task_type, index))
        assert info.is_server_task and not info.is_chief


def test_chief_without_ps_is_a_worker():
    info = parse_tf_config(tf_config({"chief": ["h:1"], "worker": ["h:2"]}, "worker", 0))
    assert info.num_workers == 2 and not info.is_chief and info.worker_index == 1
    assert parse_tf_config(tf_config({"chief": ["h:1"], "worker": ["h:2"]}, "chief", 0)).worker_index == 0


def test_index_as_string_and_rpc_layer():
    info = parse_tf_config({"cluster": TWO, "task": {"type": "worker", "index": "1"}, "rpc_layer": "grpc"})
    assert info.task_index == 1 and info.rpc_layer == "grpc"


def test_environment_variable():
    assert cluster_info_from_env({}) == ClusterInfo.single_process()
    assert cluster_info_from_env({"TF_CONFIG": "  "}).is_distributed is False
    info = cluster_info_from_env({"TF_CONFIG": json.dumps(tf_config(index=1))})
    assert info.task_name == "worker:1"
    single = ClusterInfo.single_process()
    assert (single.num_workers, single.is_chief, single.address) == (1, True, None)


@pytest.mark.parametrize("config, key, fragment", [
    ("{not json", "TF_CONFIG", "is not valid JSON"),
    ("[1, 2]", "TF_CONFIG", "must be a JSON object"),
    ({"task": {"type": "worker", "index": 0}}, "TF_CONFIG.cluster", "is missing"),
    (tf_config(cluster=[]), "TF_CONFIG.cluster", "must be a non-empty object"),
    (tf_config(cluster={"gpu": ["h:1"]}), "TF_CONFIG.cluster.gpu", "unknown job name; valid job names: chief, worker"),
    (tf_config(cluster={"worker": []}), "TF_CONFIG.cluster.worker", "non-empty list"),
    (tf_config(cluster={"worker": ["h:1"], "chief": ["h:2", "h:3"]}), "TF_CONFIG.cluster.chief", "at most one task"),
    (tf_config(cluster={"worker": ["localhost"]}), "TF_CONFIG.cluster.worker[0]", "is not 'host:port'"),
    (tf_config(cluster={"worker": ["h:70000"]}), "TF_CONFIG.cluster.worker[0]", "port in 1..65535"),
    (tf_config(cluster={"worker": [2222]}), "TF_CONFIG.cluster.worker[0]", "must be a 'host:port' string"),
    (tf_config(cluster={"worker": ["h:1", "h:1"]}), "TF_CONFIG.cluster.worker[1]", "already used by worker:0"),
    (tf_config(cluster={"ps": ["h:1"]}), "TF_CONFIG.cluster", "needs a 'worker' or 'chief' job"),
    (tf_config(cluster={"worker": ["h:1"], "ps": ["h:2"]}), "TF_CONFIG.cluster.ps", "needs a 'chief' task"),
    ({"cluster": TWO}, "TF_CONFIG.task", "is missing"),
    ({"cluster": TWO, "task": "worker"}, "TF_CONFIG.task", "must be an object"),
    ({"cluster": TWO, "task": {"index": 0}}, "TF_CONFIG.task.type", "is missing; valid types here: worker"),
    (tf_config(task_type="master"), "TF_CONFIG.task.type", "'master' is not valid; choose one of: chief"),
    (tf_config(task_type="chief"), "TF_CONFIG.task.type", "'chief' has no tasks in cluster"),
    ({"cluster": TWO, "task": {"type": "worker"}}, "TF_CONFIG.task.index", "is missing"),
    (tf_config(index=1.5), "TF_CONFIG.task.index", "must be an integer, got 1.5"),
    (tf_config(index=True), "TF_CONFIG.task.index", "must be an integer"),
    (tf_config(index=2), "TF_CONFIG.task.index", "2 is out of range: cluster.worker has 2 tasks (valid: 0..1)"),
    (tf_config(index=-1), "TF_CONFIG.task.index", "-1 is out of range"),
    (tf_config(task_type="evaluator", index=1), "TF_CONFIG.task.index", "one evaluator"),
    (tf_config(rpc_layer=""), "TF_CONFIG.rpc_layer", "non-empty string"),
    (tf_config(clusterr=1), "TF_CONFIG.clusterr", "unknown key; valid keys: cluster, task"),
])
def test_errors_name_the_field(config, key, fragment):
    with pytest.raises(TFConfigError) as err:
        parse_tf_config(config)
    assert err.value.key == key
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"{key}: ")
    assert isinstance(err.value, ConfigError)  # the CLI turns it into exit status 2


def test_environment_errors_propagate():
    with pytest.raises(TFConfigError, match="TF_CONFIG: is not valid JSON"):
        cluster_info_from_env({"TF_CONFIG": "{"})


def test_evaluator_outside_cluster():
    info = parse_tf_config(tf_config(task_type="evaluator", index=0))
    assert info.task_type == "evaluator" and not info.is_chief and info.address is None


def test_local_configs_parse_and_agree():
    configs = local_tf_configs(workers=3, ports=[7000, 7001, 7002])
    assert [name for name, _ in configs] == ["worker:0", "worker:1", "worker:2"]
    infos = [parse_tf_config(json.dumps(cfg)) for _, cfg in configs]
    assert all(i.cluster == infos[0].cluster for i in infos)
    assert [i.is_chief for i in infos] == [True, False, False]
    assert [i.address for i in infos] == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]


def test_local_parameter_server_topology():
    configs = local_tf_configs(workers=2, ps=1, ports=[7000, 7001, 7002, 7003])
    names = [name for name, _ in configs]
    assert names == ["chief:0", "worker:0", "worker:1", "ps:0"]
    infos = {name: parse_tf_config(cfg) for name, cfg in configs}
    assert infos["chief:0"].is_chief and infos["chief:0"].num_workers == 2
    assert [infos[n].is_server_task for n in names] == [False, True, True, True]


def test_local_cluster_arguments():
    assert local_cluster(1, ports=[9], host="10.0.0.1") == {"worker": ["10.0.0.1:9"]}
    with pytest.raises(ValueError, match="need 4 ports"):
        local_cluster(2, 1, ports=[1, 2, 3])
    with pytest.raises(ValueError, match="workers must be >= 1"):
        local_cluster(0, ports=[])
