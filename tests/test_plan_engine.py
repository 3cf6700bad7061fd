"""Planner = engine (issue 12 items 8, 9 and 6): what `phalanx plan` proposes, how it prices
memory and communication, the memory pre-check, and overrides anywhere among the flags;
expert parallelism (issue 11 item 5): parallel.ep in memory, all-to-all time, search, labels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from phalanx.config import ConfigError, load_config
from phalanx.core.costs import layer_costs
from phalanx.parallel.partition import partition
from phalanx.commands import plan as cli
from phalanx.core.costs import ModelSpec, param_count
from phalanx.plan.engine_rules import plan_only_reasons, stage_bounds
from phalanx.plan.estimate import estimate
from phalanx.plan.hardware import get_hardware
from phalanx.plan.layout import Layout, stage_layers
from phalanx.plan.keras_memory import keras_devices
from phalanx.plan.memory import memory_per_device, stage_kinds
from phalanx.plan.precheck import check_fits
from phalanx.plan.search import search
from phalanx.plan.timing import all_to_all_bytes, dispatch_index_bytes, dp_sync_bytes, step_time


def test_search_proposes_only_layouts_the_engine_runs(capsys):
    m = ModelSpec(layers=8, d_model=1024, heads=16, vocab=256, seq_len=128)
    res = search(m, get_hardware("a100-40gb"), devices=8, global_batch=16, top=20)
    assert res.candidates and res.plan_only
    for c in res.candidates:
        assert c.layout.schedule in ("gpipe", "1f1b", "interleaved")
        assert c.layout.zero < 3 or (c.layout.schedule != "interleaved" and c.layout.devices <= 8)
        assert not plan_only_reasons(m, c.layout)
    for c in res.plan_only:                    # zb: modelled, listed apart, labelled
        assert c.layout.schedule == "zb" or (c.layout.zero == 3 and c.layout.schedule == "interleaved")
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
    assert doc["layout"]["zero"] == 3 and doc["runs_on_engine"]       # the Keras-model engine, one node
    assert cli.main(["parallel.dp=16", "parallel.zero=3", "--hardware", "a100-40gb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)                          # two nodes of 8: slices across workers
    assert doc["runs_on_engine"] and not doc["plan_only_reasons"]
    assert cli.main(["parallel.dp=4", "parallel.schedule=zb", "parallel.pp=2", "parallel.dp=2",
                     "parallel.microbatches=2", "--hardware", "a100-40gb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not doc["runs_on_engine"] and "zb" in doc["plan_only_reasons"][0]


def test_plan_overrides_anywhere_and_one_name_per_knob(capsys):
    assert cli.main(["--devices", "4", "parallel.pp=2", "--hardware", "a100-80gb", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["layout"]["dp"], doc["layout"]["pp"]) == (2, 2)           # dp filled the rest
    assert cli.main(["--hardware", "a100-80gb", "parallel.pp=2", "--json", "parallel.microbatches=2"]) == 0
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


CALIBRATE_LAYOUTS = {
    "dp2": ["parallel.dp=2", "parallel.devices=cpu:2"],
    "tp2": ["parallel.tp=2", "parallel.devices=cpu:2"],
    "pp2": ["parallel.pp=2", "parallel.devices=cpu:2"],
    "dp2xtp2xpp2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.devices=cpu:8"],
    # 4 micro-batches added into one gradient sum per rank, ZeRO-1 reading its piece only
    "dp2xtp2xpp2-m4-zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=4",
                             "parallel.zero=1", "parallel.devices=cpu:8"],
    # the gradient reduce-scattered into slices; the stages recomputed piece by piece
    "dp2-zero2": ["parallel.dp=2", "parallel.zero=2", "parallel.devices=cpu:2"],
    "pp2-recompute-full": ["parallel.pp=2", "parallel.microbatches=2", "parallel.recompute=full",
                           "parallel.devices=cpu:2"],
}


@pytest.mark.memory_peak
@pytest.mark.slow
@pytest.mark.parametrize("layout,policy", [(name, "float32") for name in sorted(CALIBRATE_LAYOUTS)]
                         + [(name, "mixed_bfloat16") for name in ("tp2", "pp2", "dp2xtp2xpp2")])
def test_calibrate_within_10_percent_on_every_device(tmp_path, layout, policy):
    """Issue 12 item 8: `phalanx plan --calibrate` on logical CPUs, each device's predicted peak
    within 10% of the allocator's record (median of 3 profiled steps after a warm-up, one
    inter-op thread); the process-wide peak get_memory_info reports lies between the largest
    device's peak and the sum of their allocator-chunk peaks, and every allocation was placed
    on a device.

    On the Keras-model engine (where phalanx train runs these layouts since 2026-11-27), one run
    each: dp2 +1.5/+2.2%, tp2 +3.3/+2.9%, pp2 mixed_bfloat16 +1.1/+5.8%, dp2 x tp2 x pp2 m4 ZeRO-1
    -2.8..+0.8%, dp2 x tp2 x pp2 mixed_bfloat16 +0.4..+6.2%, dp2 ZeRO-2 +1.2/+1.6%, pp2 with full
    recomputation +1.7/-3.7% (each about 48 s at load 7). pp2 with full recomputation as stage
    calls (2026-11-28, load 10): +8.4/+4.3% (the call's returned gradients counted beside the
    re-run block, which by then is partly freed)."""
    argv = [sys.executable, "-m", "phalanx.commands.plan", "model.layers=4", "model.d_model=256", "model.heads=4",
            "model.seq_len=128", "train.global_batch=8", f"precision.policy={policy}", *CALIBRATE_LAYOUTS[layout],
            "--hardware", "this-cpu", "--calibrate", "--calibrate-steps", "3", "--json"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", HOME=str(tmp_path))
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cal = json.loads(proc.stdout)["calibration"]
    devices = cal["devices"]
    n = 8 if layout.startswith("dp2xtp2xpp2") else 2
    assert [d["device"] for d in devices] == [f"CPU:{i}" for i in range(n)]
    assert all(d["measured_bytes"] > 0 and d["predicted_bytes"] > 0 for d in devices)
    # every allocation but a few found its device: the Keras-model engine's step left 48 bytes
    # no op claims in every layout measured on 2026-11-27; with traced stage calls (dp2), two
    # 256 KiB outputs of an input the graph optimiser split off a gradient sum at run time
    # (gradients/AddN_12/inputs_1), in no partition graph: 0.4% of a device. A stage call whose
    # body went unplaced would leave ~100 MB (measured before calls were named by scope).
    assert cal["unplaced_bytes"] <= 0.01 * min(d["measured_bytes"] for d in devices), cal["unplaced_bytes"]
    # devices peak at different moments: the process-wide peak (allocator chunks) lies between
    # the largest device's and the sum of all devices' chunk peaks. The process figure also counts
    # what was in use at the reset besides the variables (the batch, tensors the traced functions
    # keep), which no device's replay counts: it measured 0.79-0.86 of the sum at dp2 and on 8
    # devices, 0.97-1.07 at tp2 and pp2 (tp2 mixed_bfloat16 1.01, 1.025 and 1.072 in three runs:
    # the executor's order moves it) in 2026-11-26's runs, so 1.2 (1.1 left 2.5% of room). An
    # allocation the replay lost or gave no device still fails: unplaced_bytes above, and a
    # process peak 20% above what the devices hold.
    peaks = [d["measured_bytes"] for d in devices]
    chunks = [d["allocated_bytes"] for d in devices]
    print(f"calibrate {layout} {policy}: error per device", [round(d["error"], 4) for d in devices],
          "max peak / process peak / sum of chunks", max(peaks), cal["total_check"], sum(chunks))
    assert max(peaks) <= cal["total_check"] <= 1.2 * sum(chunks), (peaks, chunks, cal["total_check"])
    assert all(abs(d["error"]) <= 0.10 for d in devices), devices


# ---------------------------------------------------------------------------
# Expert parallelism (issue 11 item 5): parallel.ep in memory, time, search and plan-only labels

def _moe() -> ModelSpec:
    return ModelSpec(layers=4, d_model=64, heads=4, ffn=256, vocab=256, seq_len=32, experts=8, top_k=2, moe_every=2)


def test_ep_divides_the_expert_states_per_device():
    m = _moe()
    d, f, E = 64, 256, 8
    # hand computation from the parameter formula: each of the 2 MoE blocks holds E MLPs
    # ([d, f] + f and [f, d] + d); everything else (router [d, E] included) is dense
    experts_total = 2 * E * (2 * d * f + f + d)
    dense_twin = ModelSpec(layers=4, d_model=64, heads=4, ffn=256, vocab=256, seq_len=32)
    assert param_count(m) == param_count(dense_twin) + experts_total - 2 * (2 * d * f + f + d) + 2 * d * E
    # ep > 1 runs on the Keras-model engine (KerasGPTEngine): its memory model, per device
    mem = {ep: keras_devices(m, dp=4, ep=ep, optimizer="phalanx") for ep in (2, 4)}
    for ep in (2, 4):
        plan = memory_per_device(m, Layout(dp=4, ep=ep, policy="float32"), overhead_fraction=0)
        fullest = max(mem[ep].values(), key=lambda x: x.total)
        assert plan.total == pytest.approx(fullest.total, rel=1e-12)           # one definition
        assert plan.expert_params == pytest.approx(experts_total / ep)        # 1/ep of the experts
        assert all(x.expert_params == pytest.approx(experts_total / ep) for x in mem[ep].values())
        assert plan.params - plan.expert_params == pytest.approx(param_count(m) - experts_total)  # dense whole
        # AdamW's moments beside each weight: replica 0 holds the dense weights' and its shard's,
        # the rest of group 0 their shards' only, the other groups' replicas (copies) none
        for i, x in mem[ep].items():
            slotted = (param_count(m) - experts_total if i == 0 else 0) + (experts_total / ep if i < ep else 0)
            assert x.optimizer == pytest.approx(8 * slotted), i
            assert x.weights == pytest.approx(4 * (param_count(m) - experts_total + experts_total / ep))
    share = experts_total / 2 - experts_total / 4       # the expert params a device no longer holds at ep 4
    assert mem[2][0].weights - mem[4][0].weights == pytest.approx(4 * share)
    assert mem[2][0].optimizer - mem[4][0].optimizer == pytest.approx(8 * share)
    # ZeRO-1 with ep runs on the Keras-model engine: m and v of every variable cut into slices, an
    # expert shard's over the dp/ep groups that hold it, so each device's moments are 1/dp of the
    # experts whatever ep (every dimension divides here: no padding); the whole weights (and so their
    # difference) follow ep, and beside them the slices of the weights
    z1 = {ep: memory_per_device(m, Layout(dp=4, ep=ep, zero=1), overhead_fraction=0) for ep in (2, 4)}
    assert z1[2].optimizer == pytest.approx(z1[4].optimizer)
    assert z1[2].optimizer == pytest.approx(8 * (param_count(m) - experts_total + experts_total) / 4)
    assert z1[2].weights - z1[4].weights == pytest.approx(4 * (experts_total / 2 - experts_total / 4))


def test_all_to_all_bytes_and_time_hand_computed():
    m, hw = _moe(), get_hardware("a100-80gb")                  # 8 devices per node, 300 GB/s inside
    lay = Layout(dp=4, ep=4, microbatches=3, micro_batch=2, policy="mixed_bfloat16")
    one = (2 * 32) * 64 * 2 * 2 * (4 - 1) / 4                  # tokens x d x 2 bytes x top_k x (ep-1)/ep
    assert all_to_all_bytes(m, lay) == pytest.approx(one)
    index = (2 * 32) * 4 * 2 * (4 - 1) / 4                     # 2 experts per shard: each routed row's int32 expert
    assert dispatch_index_bytes(m, lay) == pytest.approx(index)
    t = step_time(m, lay, hw)
    per_step = (4 * one + index) * 2 * 3                       # dispatch + combine, fwd + bwd; 2 MoE blocks; m=3
    assert t.comm_bytes["moe_all_to_all"] == pytest.approx(per_step)
    assert t.moe_comm_s == pytest.approx(per_step / hw.intra_node_bw)
    base = step_time(m, replace(lay, ep=1), hw)
    assert base.moe_comm_s == 0 and base.comm_bytes["moe_all_to_all"] == 0
    assert t.compute_s - base.compute_s == pytest.approx(t.moe_comm_s)   # pp=1: on the critical path
    # full recomputation re-runs the forward's dispatch and combine: 6 per block
    full = step_time(m, replace(lay, recompute="full"), hw)
    assert full.comm_bytes["moe_all_to_all"] == pytest.approx((6 * one + 2 * index) * 2 * 3)
    # a dp group that leaves the node (tp x dp = 16 > 8) pays the inter-node link
    wide = step_time(m, Layout(dp=16, ep=2, micro_batch=2), hw)
    assert wide.moe_comm_s == pytest.approx((4 * (64 * 64 * 2 * 2 / 2) + 64 * 4 * 2 / 2) * 2 / hw.inter_node_bw)
    # one expert per shard: no index is sent
    assert dispatch_index_bytes(m, Layout(dp=8, ep=8)) == 0
    # expert gradients are summed over the dp/ep replicas holding the same experts only
    assert t.dp_comm_s < base.dp_comm_s


def test_ep_that_does_not_divide_dp_or_experts_is_refused(capsys):
    m, hw = _moe(), get_hardware("a100-80gb")
    with pytest.raises(ConfigError, match=r"parallel\.ep: 4 does not divide parallel\.dp=6"):
        Layout(dp=6, ep=4)
    with pytest.raises(ConfigError, match=r"parallel\.ep: 3 does not divide model\.experts=8"):
        estimate(m, Layout(dp=6, ep=3), hw)
    with pytest.raises(ConfigError, match=r"parallel\.ep: 2 needs a mixture-of-experts model"):
        estimate(ModelSpec(layers=2, d_model=64, heads=4, vocab=256, seq_len=32), Layout(dp=2, ep=2), hw)
    base = ["configs/demo.yaml", "model.experts=8", "--hardware", "a100-80gb"]
    for bad, text in ((["parallel.dp=6", "parallel.ep=3", "train.global_batch=12"], "does not divide model.experts=8"),
                      (["parallel.dp=4", "parallel.ep=3"], "does not divide parallel.dp=4"),
                      (["--devices", "8", "parallel.ep=3", "--search"], "does not divide model.experts=8")):
        assert cli.main(base + bad) == 2
        err = capsys.readouterr().err
        assert "parallel.ep" in err and text in err and "Traceback" not in err


def test_ep_layouts_of_the_builtin_gpt_run_as_dp_x_ep_within_a_node():
    m, hw = _moe(), get_hardware("a100-80gb")
    assert plan_only_reasons(m, Layout(dp=4)) == [] == plan_only_reasons(m, Layout(dp=4, ep=2))  # dp, dp x ep
    for knobs in ({"pp": 2}, {"tp": 2}, {"tp": 2, "pp": 2}):  # the ep engine runs them
        assert plan_only_reasons(m, Layout(dp=2, ep=2, **knobs)) == [], knobs
    assert plan_only_reasons(m, Layout(dp=2, ep=2, zero=1)) == []  # ZeRO-1 on the ep engine
    assert plan_only_reasons(m, Layout(dp=2, ep=2, zero=2)) == []  # ZeRO-2 on the ep engine
    assert plan_only_reasons(m, Layout(dp=2, ep=2, zero=3)) == []  # ZeRO-3: expert shards gathered from slices
    assert plan_only_reasons(m, Layout(dp=2, ep=2, recompute="full")) == []  # recompute on the ep engine
    # ep=1 with pp, ZeRO-2 or recompute runs on the same engine
    assert plan_only_reasons(m, Layout(dp=2, pp=2)) == []
    assert plan_only_reasons(m, Layout(dp=2, pp=2, recompute="full")) == []
    assert plan_only_reasons(m, Layout(dp=2, zero=2)) == []
    res = search(m, hw, devices=8, global_batch=32, top=50)
    assert res.candidates and not any("ZeRO" in r for c in res.plan_only if c.layout.ep > 1  # within a node: any stage
                                      for r in plan_only_reasons(m, c.layout, hw))
    assert any(c.layout.ep > 1 for c in res.candidates)
    dp_only = {"dp": 8, "tp": 1, "pp": 1}
    res = search(m, hw, devices=8, global_batch=32, top=50, fixed=dp_only)
    assert {c.layout.ep for c in res.candidates + res.plan_only} == {1, 2, 4, 8}  # divisors of dp=8 and of 8 experts
    six = search(m, hw, devices=6, global_batch=12, top=50, fixed={"dp": 6})
    assert {c.layout.ep for c in six.candidates + six.plan_only} == {1, 2}
    # two nodes (phalanx launch, multi_worker): each node shards the experts over its own 8 replicas and
    # the nodes are data parallel, so ep must divide 8; ep=16 would span nodes; ZeRO stays in one process
    two_nodes = search(m, hw, devices=16, global_batch=32, top=50, fixed={"dp": 16, "tp": 1, "pp": 1})
    assert {c.layout.ep for c in two_nodes.candidates} - {1} and \
        {c.layout.ep for c in two_nodes.candidates} <= {1, 2, 4, 8}
    assert all(c.layout.zero == 0 for c in two_nodes.candidates if c.layout.ep > 1)
    assert plan_only_reasons(m, Layout(dp=16, ep=8), hw) == []
    # tp4: a node holds 2 replicas, so ep4 would span two nodes
    assert any("across nodes" in r for r in plan_only_reasons(m, Layout(dp=4, tp=4, ep=4), hw))
    assert plan_only_reasons(m, Layout(dp=4, tp=4, ep=2), hw) == []
    assert any("ZeRO-1 with expert parallelism across nodes" in r
               for r in plan_only_reasons(m, Layout(dp=16, ep=2, zero=1), hw))
    (reason,) = plan_only_reasons(m, Layout(dp=16, ep=2, zero=3), hw)  # said once
    assert reason.startswith("ZeRO-3 with expert parallelism across nodes")


def test_the_moe_layouts_the_planner_runs_are_built(devices):
    """Every expert-parallel layout of one node that plan_only_reasons calls runnable (ep with
    tp, pp, ZeRO 1-3 and recomputation) is built by the engine phalanx train builds for a real
    GPTTask, and so is the MoE GPT without ep, recomputed."""
    from phalanx.engines.factory import build_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.task import GPTTask

    tiny = ["model.experts=4", "model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=32",
            "model.seq_len=8", "train.global_batch=4", "precision.policy=float32"]
    spec = ModelSpec(layers=2, d_model=32, heads=2, vocab=256, seq_len=8, experts=4)
    for knob, lay in (([], Layout(dp=2, ep=2)),
                      (["parallel.devices=cpu:4", "parallel.tp=2"], Layout(dp=2, tp=2, ep=2)),
                      (["parallel.devices=cpu:4", "parallel.pp=2"], Layout(dp=2, pp=2, ep=2)),
                      (["parallel.zero=1"], Layout(dp=2, ep=2, zero=1)),
                      (["parallel.zero=2"], Layout(dp=2, ep=2, zero=2)),
                      (["parallel.zero=3"], Layout(dp=2, ep=2, zero=3)),
                      (["parallel.recompute=full"], Layout(dp=2, ep=2, recompute="full"))):
        assert plan_only_reasons(spec, lay, get_hardware("a100-80gb")) == [], lay
        cfg = load_config(None, tiny + ["parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"] + knob)
        assert isinstance(build_engine(cfg, GPTTask(cfg.model)), KerasGPTEngine), knob
    cfg = load_config(None, tiny + ["parallel.recompute=full"])
    assert isinstance(build_engine(cfg, GPTTask(cfg.model)), KerasGPTEngine)
    assert plan_only_reasons(spec, Layout(recompute="full")) == []


def test_plan_cli_prints_ep_and_the_all_to_all(capsys):
    argv = ["configs/demo.yaml", "model.experts=8", "model.top_k=2", "parallel.dp=4", "parallel.ep=2",
            "--hardware", "a100-80gb"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "layout: dp=4 ep=2 tp=1" in out and "expert all-to-all" in out
    assert "PLAN ONLY" not in out and "4 of 8 per MoE block, ep=2" in out  # phalanx train runs dp x ep
    assert cli.main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"]["ep"] == 2 and doc["runs_on_engine"]
    # demo: 16 sequences of 128 over dp=4, float32, 4 MoE blocks (moe_every=1), 4 all-to-alls each
    one = 4 * 128 * 256 * 4 * 2 * (1 / 2)
    index = 4 * 128 * 4 * 2 * (1 / 2)                        # 4 experts per shard: the int32 expert of each row
    assert doc["time_breakdown"]["comm_bytes_per_device"]["moe_all_to_all"] == pytest.approx(4 * (4 * one + index))
    assert doc["time_breakdown"]["moe_comm_s"] > 0
    assert cli.main(["configs/demo.yaml", "model.experts=8", "--devices", "4", "--hardware", "a100-80gb",
                     "--search", "--top", "2", "parallel.dp=4", "parallel.recompute=none"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith(" #"))
    assert lines[header].split()[:3] == ["#", "dp", "ep"]
    assert lines[header + 1].split()[:3] == ["1", "4", "4"]  # dp x ep is proposed


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_all_to_all_bytes_are_what_the_ep_engine_sends(devices, policy):
    """The planner's expert all-to-all bytes against the tensors the engine's step sends between
    devices: the partition graphs of KerasGPTEngine's step (dp2 x ep2, one MoE block) list every
    cross-device edge; those of the MoE layer are, per device, four [rows, d_model] tensors in the
    compute dtype (the routed rows out and the experts' output of the other replica's rows back in
    the forward, the output's gradient out and the rows' gradient back in the backward), the int32
    expert index of each routed row, and statistics of at most one value per expert. top_k = experts
    makes the row count exact: every token goes to every expert, so each replica sends the other
    shard its tokens x experts / ep rows, as balanced routing assumes."""
    import numpy as np
    import tensorflow as tf

    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask
    from phalanx.train.calibrate import run_with_metadata

    cfg = load_config(None, ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=64",
                             "model.seq_len=16", "model.experts=4", "model.top_k=4", "model.moe_every=2",
                             "model.aux_loss_coef=0", "train.global_batch=8", f"precision.policy={policy}",
                             "parallel.devices=cpu:2", "parallel.dp=2", "parallel.ep=2"])
    engine = build_engine(cfg, GPTTask(cfg.model, policy, cfg.train.seed))
    batch = tf.constant(np.random.default_rng(0).integers(0, 256, (8, 17)), tf.int32)
    _, meta = run_with_metadata(lambda: engine.train_step(batch))  # this step's functions only
    (step,) = engine.engine._train_fn._list_all_concrete_functions_for_serialization()  # the traced step
    graph = step.graph
    d, e = cfg.model.d_model, {"float32": 4, "mixed_bfloat16": 2}[policy]
    compute = {"float32": tf.float32, "mixed_bfloat16": tf.bfloat16}[policy]
    rows = 4 * 16 * 4 // 2                        # a replica's tokens x experts / ep, to the other shard
    sent = {dev: [] for dev in ("CPU:0", "CPU:1")}
    for function in meta.function_graphs:
        for part in function.partition_graphs:
            for node in part.node:
                src = node.attr["send_device"].s.decode() if node.op == "_Send" else ""
                if not src or src == node.attr["recv_device"].s.decode() or "/moe" not in node.input[0]:
                    continue
                producer, _, index = node.input[0].partition(":")
                shape = graph.get_operation_by_name(producer).outputs[int(index or 0)].shape
                sent[src.rsplit("device:", 1)[-1]].append((tf.dtypes.as_dtype(node.attr["T"].type), shape,
                                                          producer))
    hw = get_hardware("a100-80gb")
    planned = step_time(ModelSpec.from_config(cfg.model), Layout(dp=2, ep=2, micro_batch=4, policy=policy),
                        hw).comm_bytes["moe_all_to_all"]
    for dev, tensors in sent.items():
        routed = [t for t in tensors if t[1].rank == 2 and t[1][0] is None]
        indices = [t for t in tensors if t[1].rank == 1 and t[1][0] is None]
        small = [t for t in tensors if t not in routed and t not in indices]
        assert len(routed) == 4 and all(t[0] == compute and t[1][1] == d for t in routed), (dev, tensors)
        assert len(indices) == 1 and indices[0][0] == tf.int32, (dev, tensors)
        # statistics (scalars, one value per expert) and the router's gradient, summed over the
        # data replicas with the other dense weights (not the all-to-all)
        assert all(t[1].num_elements() <= d * cfg.model.experts for t in small), (dev, small)
        measured = len(routed) * rows * d * e + rows * 4
        assert planned == pytest.approx(measured, rel=1e-12), dev
