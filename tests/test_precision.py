"""precision.policy=auto: what it resolves to on which hardware, and that every reader of
the config sees the resolved policy (the suite itself pins auto to float32, conftest.py)."""

import pytest

from phalanx import precision
from phalanx.config import Config, ConfigError, PrecisionConfig, load_config

NO_HW = {"gpus": [], "tpu": False, "onednn": "1", "env": {}}


@pytest.mark.parametrize("flags, policy, why", [
    ({"avx2", "fma"}, "float32", "no bfloat16 units"),
    ({"avx512f", "avx512_vnni"}, "float32", "no bfloat16 units"),  # AVX512 without BF16
    ({"avx512f", "avx512_bf16"}, "mixed_bfloat16", "CPU has avx512_bf16"),
    ({"amx_tile", "amx_bf16", "amx_int8"}, "mixed_bfloat16", "CPU has amx_bf16"),
])
def test_cpu_flags_decide(flags, policy, why):
    got, reason = precision.resolve_policy("auto", cpu_flags=flags, **NO_HW)
    assert got == policy and why in reason and reason.startswith("auto: ")


def test_bfloat16_cpu_without_onednn_stays_float32():
    policy, reason = precision.resolve_policy("auto", cpu_flags={"avx512_bf16"}, gpus=[], tpu=False, onednn="0",
                                              env={})
    assert policy == "float32" and "TF_ENABLE_ONEDNN_OPTS=0" in reason


def test_gpus_and_tpus():
    avx2 = {"avx2"}
    assert precision.resolve_policy("auto", cpu_flags=avx2, gpus=[(8, 0)], tpu=False, env={})[0] == "mixed_bfloat16"
    assert precision.resolve_policy("auto", cpu_flags=avx2, gpus=[(9, 0), (8, 6)], tpu=False,
                                    env={})[0] == "mixed_bfloat16"
    policy, reason = precision.resolve_policy("auto", cpu_flags={"avx512_bf16"}, gpus=[(7, 5)], tpu=False, env={})
    assert policy == "float32" and "7.5 < 8.0" in reason  # a Turing GPU runs it, not the CPU
    assert precision.resolve_policy("auto", cpu_flags=avx2, gpus=[], tpu=True, env={}) == ("mixed_bfloat16",
                                                                                             "auto: TPU")
    # parallel.devices=cpu:N runs on the CPU whatever GPUs the machine has
    assert precision.resolve_policy("auto", devices="cpu:4", cpu_flags=avx2, gpus=[(9, 0)], tpu=False,
                                    onednn="1", env={})[0] == "float32"


def test_explicit_policies_and_the_environment_pin():
    assert precision.resolve_policy("mixed_float16") == ("mixed_float16", "precision.policy=mixed_float16")
    assert precision.resolve_policy("auto", cpu_flags={"avx512_bf16"}, env={"PHALANX_AUTO_PRECISION": "float32"},
                                    gpus=[], tpu=False) == ("float32", "auto: PHALANX_AUTO_PRECISION=float32")
    with pytest.raises(ValueError, match="float16"):
        precision.resolve_policy("float16")


def test_config_default_is_auto_and_resolved_when_built(monkeypatch):
    assert PrecisionConfig().policy == "auto"
    monkeypatch.setenv("PHALANX_AUTO_PRECISION", "mixed_bfloat16")
    cfg = Config()
    assert cfg.precision.policy == "mixed_bfloat16"  # what every reader sees, never "auto"
    assert precision.describe(cfg) == "precision: mixed_bfloat16 (auto: PHALANX_AUTO_PRECISION=mixed_bfloat16)"
    assert precision.resolve_policy(cfg) == ("mixed_bfloat16", "auto: PHALANX_AUTO_PRECISION=mixed_bfloat16")
    # replace() keeps the choice and its reason; the saved config records the resolved policy
    later = cfg.replace(train={"steps": 5})
    assert precision.describe(later) == precision.describe(cfg)
    assert later.to_dict()["precision"]["policy"] == "mixed_bfloat16"
    explicit = load_config(None, ["precision.policy=float32"])
    assert precision.describe(explicit) == "precision: float32 (precision.policy=float32)"
    assert precision.describe(cfg.replace(precision={"policy": "float32"})) == \
        "precision: float32 (precision.policy=float32)"
    monkeypatch.setenv("PHALANX_AUTO_PRECISION", "float8")
    with pytest.raises(ConfigError, match="precision.policy"):
        load_config(None, [])


def test_the_suite_runs_auto_as_float32():
    # conftest.py pins it: existing tests compare against float32 oracles with float32 tolerances
    assert Config().precision.policy == "float32"
    assert load_config(None, []).precision.policy == "float32"
