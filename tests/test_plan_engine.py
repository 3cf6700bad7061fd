"""Planner = engine (issue 12 items 8, 9 and 6): what `phalanx plan` proposes, how it prices
memory and communication, the memory pre-check, and overrides anywhere among the flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from phalanx.config import ConfigError, load_config
from phalanx.parallel.mesh_engine import layer_costs
from phalanx.parallel.pipeline import partition
from phalanx.plan import cli
from phalanx.plan.arithmetic import ModelSpec
from phalanx.plan.engine_rules import plan_only_reasons, stage_bounds
from phalanx.plan.estimate import estimate
from phalanx.plan.hardware import get_hardware
from phalanx.plan.layout import Layout, stage_layers
from phalanx.plan.memory import stage_kinds
from phalanx.plan.precheck import check_fits
from phalanx.plan.search import search
from phalanx.plan.timing import dp_sync_bytes


def test_search_proposes_only_layouts_the_engine_runs(capsys):
    m = ModelSpec(layers=8, d_model=1024, heads=16, vocab=256, seq_len=128)
    res = search(m, get_hardware("a100-40gb"), devices=8, global_batch=16, top=20)
    assert res.candidates and res.plan_only
    for c in res.candidates:
        assert c.layout.zero in (0, 1, 2) and c.layout.schedule in ("gpipe", "1f1b", "interleaved")
        assert not plan_only_reasons(m, c.layout)
    for c in res.plan_only:                    # ZeRO-3 / zb: modelled, listed apart, labelled
        assert c.layout.zero == 3 or c.layout.schedule == "zb"
        assert res.plan_only_reasons(c)
    # even when a plan-only layout is faster, the best candidate is one the engine runs
    assert res.plan_only[0].tokens_per_s > res.candidates[0].tokens_per_s
    assert cli.main(["model.layers=8", "model.d_model=1024", "model.heads=16", "--devices", "8",
                     "--hardware", "a100-40gb", "--search", "--top", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(c["runs_on_engine"] for c in doc["candidates"])
    assert doc["plan_only"] and not any(c["runs_on_engine"] for c in doc["plan_only"])
    assert all(c["plan_only_reasons"] for c in doc["plan_only"])
    assert cli.main(["model.layers=8", "model.d_model=1024", "model.heads=16", "--devices", "8",
                     "--hardware", "a100-40gb", "--search", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "plan only (modelled, but the engine cannot run them" in out


def test_search_respects_engine_tp_rule_on_vocab():
    m = ModelSpec(layers=4, d_model=256, heads=8, vocab=250, seq_len=64)  # 250 % 4 != 0
    res = search(m, get_hardware("a100-40gb"), devices=4, global_batch=8, top=50)
    assert all(c.layout.tp in (1, 2) for c in res.candidates)
    assert any("model.vocab" in ex for ex in res.rejections.examples.values())


def test_stage_split_is_the_engines_flop_balanced_partition():
    m = ModelSpec(layers=12, d_model=128, heads=4, vocab=32768, seq_len=64)  # a heavy head
    cfg = load_config(None, ["model.layers=12", "model.d_model=128", "model.heads=4", "model.vocab=32768",
                             "model.seq_len=64"]).model
    costs, embed, head = layer_costs(cfg)
    for pp, v in ((2, 1), (4, 1), (2, 2)):
        expected = partition(costs, pp * v, embed, head)
        assert list(stage_bounds(m, pp, v)) == expected
        assert [a + b for a, b in stage_kinds(m, pp, v)] == [e - s for s, e in expected]
    # and that is not the equal split the planner used to assume
    assert [e - s for s, e in stage_bounds(m, 4)] != stage_layers(12, 4)


def test_dp_gradient_sync_priced_as_each_strategy_sums():
    G = 1000.0
    assert dp_sync_bytes(G, 8, 0, "one") == 7 * G            # add_n onto one device + read back
    assert dp_sync_bytes(G, 8, 0, "ring") == pytest.approx(2 * 7 / 8 * G)
    assert dp_sync_bytes(G, 8, 2, "one") == pytest.approx(2 * 7 / 8 * G)   # direct reduce-scatter + gather
    m = ModelSpec(layers=4, d_model=1024, heads=16, vocab=1024, seq_len=256)
    hw = get_hardware("a100-80gb")
    mesh = estimate(m, Layout(dp=8, micro_batch=1, reduction="one"), hw)
    ring = estimate(m, Layout(dp=8, micro_batch=1, reduction="ring"), hw)
    assert mesh.time.dp_comm_s == pytest.approx(ring.time.dp_comm_s * 4)   # 7 G vs 1.75 G


def test_plan_cli_strategy_picks_reduction_and_plan_only_values(capsys):
    assert cli.main(["parallel.dp=2", "--hardware", "a100-40gb", "--json", "parallel.strategy=multi_worker"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["reduction"] == "ring"
    assert cli.main(["parallel.dp=2", "--hardware", "a100-40gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["reduction"] == "one"
    assert cli.main(["parallel.dp=4", "parallel.zero=3", "--hardware", "a100-40gb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"]["zero"] == 3 and not doc["runs_on_engine"] and "ZeRO-3" in doc["plan_only_reasons"][0]


def test_plan_overrides_anywhere_and_one_name_per_knob(capsys):
    assert cli.main(["--devices", "4", "parallel.pp=2", "--hardware", "a100-80gb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["layout"]["dp"], doc["layout"]["pp"]) == (2, 2)           # dp filled the rest
    assert cli.main(["--hardware", "a100-80gb", "parallel.dp=2", "--json", "parallel.microbatches=2"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["microbatches"] == 2
    for gone in (["--zero", "1"], ["--schedule", "gpipe"], ["--global-batch", "8"]):
        with pytest.raises(SystemExit):                                   # the config key is the only name
            cli.main(gone + ["--hardware", "a100-80gb"])
    capsys.readouterr()
    # with --search, keys you set fix that dimension
    assert cli.main(["--devices", "8", "parallel.pp=2", "parallel.zero=1", "--hardware", "a100-40gb",
                     "--search", "--json", "model.layers=8", "model.d_model=512", "model.heads=8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["candidates"] and all(c["layout"]["pp"] == 2 and c["layout"]["zero"] == 1 for c in doc["candidates"])


def test_precheck_refuses_what_cannot_fit_with_the_figures():
    cfg = load_config(None, ["model.d_model=1048576"])
    with pytest.raises(ConfigError) as err:
        check_fits(cfg, host_memory_bytes=64 * 2**30)
    text = str(err.value)
    assert "does not fit in memory" in text and "GiB" in text and "64.0 GiB of available RAM" in text
    for key in ("model.d_model", "train.global_batch", "parallel.zero", "parallel.tp", "parallel.pp"):
        assert key in text
    check_fits(load_config(None, []), host_memory_bytes=64 * 2**30)           # the default fits
    # four logical CPUs share the host: four times the memory of one
    small = load_config(None, ["model.layers=8", "model.d_model=1024", "model.heads=8", "parallel.dp=4",
                               "parallel.devices=cpu:4"])
    check_fits(small, host_memory_bytes=64 * 2**30)
    with pytest.raises(ConfigError):
        check_fits(small, host_memory_bytes=2 * 2**30)
    # accelerators: each device against its own memory
    gpu = load_config(None, ["model.layers=8", "model.d_model=1024", "model.heads=8", "parallel.devices=gpu:1"])
    with pytest.raises(ConfigError, match="each of 1 GPU"):
        check_fits(gpu, device_memory_bytes=2**28, host_memory_bytes=64 * 2**30)


def _phalanx(*args, timeout=300, env=None):
    exe = os.path.join(os.path.dirname(sys.executable), "phalanx")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})})


def test_train_refuses_before_building_and_takes_overrides_anywhere(tmp_path):
    proc = _phalanx("train", f"run.dir={tmp_path / 'r'}", "--quiet", "model.d_model=1048576")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not fit in memory" in proc.stderr and "GiB" in proc.stderr
    assert "Traceback" not in proc.stderr and "OOM" not in proc.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.slow
def test_calibrate_reports_every_device_of_a_multi_device_layout(tmp_path):
    """Mechanism: per-device peaks reconstructed from the shared allocator's profile add up
    to its process-wide peak; figures of a tp2 run (recorded in the report)."""
    argv = [sys.executable, "-m", "phalanx.plan.cli", "model.layers=4", "model.d_model=256", "model.heads=4",
            "model.seq_len=128", "train.global_batch=8", "parallel.tp=2", "parallel.devices=cpu:2",
            "--hardware", "this-cpu", "--calibrate", "--calibrate-steps", "1", "--json"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", HOME=str(tmp_path))
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cal = json.loads(proc.stdout)["calibration"]
    devices = cal["devices"]
    assert [d["device"] for d in devices] == ["CPU:0", "CPU:1"]
    assert all(d["measured_bytes"] > 0 and d["predicted_bytes"] > 0 for d in devices)
    total = sum(d["measured_bytes"] for d in devices)
    assert 0.9 * cal["total_check"] <= total <= 1.25 * cal["total_check"]
    assert devices[0]["measured_bytes"] > devices[1]["measured_bytes"]   # device 0 also runs the backward
    assert all(abs(d["error"]) <= 0.15 for d in devices), devices
