"""``phalanx plan``: will the model fit, how to split it, how long it trains.

Reads the same configuration as ``phalanx train`` (a YAML file and ``section.key=value``
overrides, anywhere among the flags). Every knob of the training config has one name,
its key (``parallel.zero=1``, ``parallel.schedule=gpipe``, ``train.global_batch=64``);
flags are only for what the config does not have (device count and kind, hardware
overrides, sequence parallelism, output). A mixture of experts comes from ``model.experts``,
``model.top_k`` and ``model.moe_every``, expert parallelism from ``parallel.ep``. A value no
engine runs is accepted here to plan it, labelled *plan only*: ``parallel.schedule=zb``;
layouts the engines cannot run for the built-in GPT (e.g. ZeRO-3 across nodes) are planned and
labelled the same way. Memory is the engine's (:mod:`phalanx.plan.memory`: ``phalanx train``
runs the built-in GPT on the Keras-model engine for every layout but parameter servers, which
get a whole-variable figure). With ``--search``, the
parallel keys you set (dp, tp, pp, microbatches, zero, schedule, recompute,
virtual_stages, ep) fix that dimension; for a mixture of experts, ep is searched over the
divisors of dp and of ``model.experts``.

Examples:
    phalanx plan my.yaml --hardware this-cpu
    phalanx plan --devices 4 parallel.pp=2 --hardware a100-80gb      # dp fills the rest: 2
    phalanx plan model.layers=128 model.d_model=25600 model.heads=160 model.vocab=51200 \\
        model.seq_len=2048 --devices 3072 --hardware a100-80gb --tokens 450e9 --search --top 5
    phalanx plan my.yaml parallel.tp=2 parallel.devices=cpu:2 --calibrate
    phalanx plan model.layers=4 parallel.tp=2 parallel.pp=2 parallel.microbatches=2 parallel.devices=cpu:4 \\
        --keras --calibrate      # the GPT as a Keras model, trained as phalanx.fit trains it
    phalanx plan configs/demo.yaml model.experts=8 model.top_k=2 parallel.dp=4 parallel.ep=2 --hardware a100-80gb

    >>> main(["model.layers=2", "--hardware", "a100-40gb", "--json"])  # doctest: +ELLIPSIS
    {...
    0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from phalanx.config import ConfigError, load_config, parse_devices, parse_override, resolve_degrees, split_config_args
from phalanx.core.costs import ModelSpec, active_param_count, flops_per_token, param_count
from phalanx.plan.engine_rules import engine_schedules, engine_zero_stages
from phalanx.plan.estimate import estimate
from phalanx.plan.hardware import HARDWARE_NAMES, get_hardware
from phalanx.plan.keras_memory import keras_memory_per_device
from phalanx.plan.layout import Layout, expert_parallel_error
from phalanx.plan.memory import DEFAULT_OVERHEAD_FRACTION
from phalanx.plan.search import search
from phalanx.plan.timing import DEFAULT_UTILIZATION
from phalanx.train.calibrate import calibrate, calibrate_keras, prepare_devices

GiB = 2**30
# Values of config keys that the planner models but the engine does not run (plan only).
PLAN_ONLY_VALUES = {"parallel.schedule": ("zb",)}
SEARCH_KEYS = ("dp", "tp", "pp", "microbatches", "zero", "schedule", "recompute", "virtual_stages", "ep")


def _parser() -> argparse.ArgumentParser:

    p = argparse.ArgumentParser(prog="phalanx plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="a config file and/or section.key=value overrides, as for phalanx train, anywhere among the flags")
    p.add_argument("--devices", type=int, default=None,
                   help="devices in total (default: the N of parallel.devices=cpu:N/gpu:N, else dp x tp x pp); "
                        "without parallel.dp, dp fills the rest")
    p.add_argument("--hardware", default="this-cpu", choices=HARDWARE_NAMES)
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (preset default)")
    p.add_argument("--tokens", type=float, default=None, help="training tokens, for the days estimate")
    p.add_argument("--search", action="store_true",
                   help="search dp/tp/pp/microbatches/zero/recompute/schedule/ep (keys you set stay fixed); "
                        "with train.global_batch unset, one sequence per device")
    p.add_argument("--top", type=int, default=5, help="candidates shown by --search")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--calibrate", action="store_true",
                   help="run real training steps here (parallel.devices=cpu:N for N logical CPUs): "
                        "predicted vs measured peak memory per device, and step time")
    p.add_argument("--calibrate-steps", type=int, default=3)
    p.add_argument("--keras", action="store_true",
                   help="the model as phalanx.fit trains it: the GPT of the model.* keys as a Keras model "
                        "(phalanx.models.transformer.gpt) on the Keras-model engine with Keras's AdamW from train.*; "
                        "prints each device's predicted peak (phalanx.plan.keras_memory), and with --calibrate "
                        "measures it. For your own Keras model: phalanx.train.calibrate.calibrate_keras")
    g = p.add_argument_group("hardware and efficiency overrides")
    g.add_argument("--utilization", type=float, default=None,
                   help="achieved fraction of peak FLOP/s in compute (default 0.5)")
    g.add_argument("--peak-tflops", type=float, default=None)
    g.add_argument("--memory-gb", type=float, default=None, help="device memory in GiB")
    g.add_argument("--intra-node-gbps", type=float, default=None, help="GB/s per device inside a node")
    g.add_argument("--inter-node-gbps", type=float, default=None, help="GB/s per device between nodes")
    g.add_argument("--overhead-gb", type=float, default=None, help="fixed runtime overhead per device, GiB")
    g.add_argument("--overhead-fraction", type=float, default=None,
                   help="extra fraction of the other memory (fragmentation, temporaries; default 0.05)")
    g.add_argument("--dp-overlap", type=float, default=0.0,
                   help="fraction of the gradient all-reduce hidden behind the backward (default 0)")
    return p


def _explicit_keys(path: str | None, overrides: list[str]) -> set[str]:
    """Dotted keys the user set, in the file or on the command line."""
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if path:
        import yaml

        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, ValueError, yaml.YAMLError):
            raw = {}  # load_config reports it properly
        if isinstance(raw, dict):
            keys |= {f"{sec}.{k}" for sec, body in raw.items() if isinstance(body, dict) for k in body}
    return keys


def _split_plan_only(overrides: list[str]) -> tuple[list[str], dict[str, object]]:
    """Take out overrides whose value only the planner models (:data:`PLAN_ONLY_VALUES`)."""
    kept, plan_only = [], {}
    for item in overrides:
        key, value = parse_override(item)
        if value in PLAN_ONLY_VALUES.get(key, ()):
            plan_only[key] = value
        else:
            kept.append(item)
    return kept, plan_only


def main(argv: list[str] | None = None) -> int:
    # intermixed: overrides may stand before, between or after the flags
    args = _parser().parse_intermixed_args(argv)
    if args.calibrate:
        # TensorFlow keeps CPU allocator statistics only with its BFC allocator, chosen at
        # import time: set it before anything (the matmul probe included) imports TensorFlow.
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    try:
        return _run(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _devices(args, cfg, explicit: set[str], notes: list[str]) -> tuple[int, tuple[int, int, int]]:
    """Device count and (dp, pp, tp) for a single plan (degrees unused by --search)."""
    p = cfg.parallel
    kind, n = parse_devices(p.devices)
    devices = args.devices
    if devices is None and n:
        devices = n
    if devices is not None and devices < 1:
        raise ConfigError("--devices", f"must be >= 1, got {devices}")
    if devices is None:
        if -1 in (p.dp, p.tp, p.pp):
            raise ConfigError("--devices", "a degree is -1 (fill the rest): give --devices N or "
                                           "parallel.devices=cpu:N so it can be resolved")
        return p.dp * p.pp * p.tp, (p.dp, p.pp, p.tp)
    if args.devices is not None and n and n != args.devices:
        raise ConfigError("--devices", f"{args.devices} disagrees with parallel.devices={p.devices}; give one")
    if args.search:
        return devices, (max(p.dp, 1), max(p.pp, 1), max(p.tp, 1))
    if -1 not in (p.dp, p.tp, p.pp) and p.dp * p.tp * p.pp != devices:
        # dp, when the user did not set it, fills the devices (as parallel.dp=-1 would)
        if "parallel.dp" not in explicit:
            dp, pp, tp = resolve_degrees(cfg.replace(parallel={"dp": -1}), devices)
            notes.append(f"parallel.dp not set: dp={dp} fills {devices} devices")
            return devices, (dp, pp, tp)
    return devices, resolve_degrees(cfg, devices)


def _run(args: argparse.Namespace) -> int:

    path, overrides = split_config_args(args.args)
    overrides, plan_only = _split_plan_only(overrides)
    explicit = _explicit_keys(path, overrides) | set(plan_only)
    if ({"parallel.ep"} <= explicit and "parallel.dp" not in explicit
            and (args.search or args.devices is not None or "parallel.devices" in explicit)):
        # parallel.ep=N with dp unset: dp fills the devices (else the default dp=1 refuses any ep > 1)
        overrides = overrides + ["parallel.dp=-1"]
    cfg = load_config(path, overrides)
    p = cfg.parallel
    notes: list[str] = []
    devices, (dp, pp, tp) = _devices(args, cfg, explicit, notes)
    model = ModelSpec.from_config(cfg.model)
    keras_mem = None
    if args.keras:
        if args.search:
            raise ConfigError("--keras", "prints each device of one layout as phalanx.fit trains the GPT (Keras's "
                                         "AdamW); --search proposes layouts for phalanx train: drop one of them")
        # refuses, naming the key, what the Keras-engine memory model was not measured for
        # (--calibrate runs the stages inline under tp > 1, phalanx.train.calibrate: planned so)
        keras_mem = keras_memory_per_device(cfg.replace(parallel={"dp": dp, "pp": pp, "tp": tp}), optimizer="keras",
                                            calls=False if args.calibrate and tp > 1 else None)
    if args.calibrate and not args.search:

        prepare_devices(cfg)  # before the hardware probe runs a TensorFlow op
    hw = get_hardware(args.hardware, devices=devices, peak_tflops=args.peak_tflops, memory_gb=args.memory_gb,
                      devices_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_gbps,
                      inter_node_gbps=args.inter_node_gbps, overhead_gb=args.overhead_gb)
    util = DEFAULT_UTILIZATION if args.utilization is None else args.utilization
    ofrac = DEFAULT_OVERHEAD_FRACTION if args.overhead_fraction is None else args.overhead_fraction
    if not 0 <= ofrac < 10:
        raise ConfigError("--overhead-fraction", f"must be in [0, 10), got {ofrac}")
    policy = cfg.precision.policy
    zero = plan_only.get("parallel.zero", p.zero)
    schedule = plan_only.get("parallel.schedule", p.schedule)
    # Across workers the gradients are summed with a collective ring; in one process each
    # weight's sum is formed on one device.
    reduction = "ring" if p.strategy == "multi_worker" else "one"

    global_batch = cfg.train.global_batch
    if args.search and "train.global_batch" not in explicit and devices > global_batch:
        global_batch = devices
        notes.append(f"train.global_batch not set: assuming {global_batch} sequences per step (one per device); "
                     f"set train.global_batch=N")

    if args.search:
        fixed = {}
        for name in ("dp", "tp", "pp", "microbatches", "ep"):
            if f"parallel.{name}" in explicit and getattr(p, name) != -1:
                fixed[name] = getattr(p, name)
        if "ep" in fixed and (not model.experts or model.experts % fixed["ep"]):
            # (whether ep divides dp is checked for each dp the search tries)
            raise ConfigError("parallel.ep", expert_parallel_error(model.experts, fixed["ep"], fixed["ep"]))
        schedules = (schedule,) if "parallel.schedule" in explicit else engine_schedules() + ("zb",)
        zeros = (zero,) if "parallel.zero" in explicit else engine_zero_stages()
        recomputes = (p.recompute,) if "parallel.recompute" in explicit else ("none", "selective", "full")
        vs = (p.virtual_stages,) if "parallel.virtual_stages" in explicit else (2,)
        res = search(model, hw, devices, global_batch, policy=policy, top=args.top, tokens=args.tokens,
                     utilization=util, overhead_fraction=ofrac, dp_overlap=args.dp_overlap,
                     sequence_parallel=p.sequence_parallel, schedules=schedules, zero_stages=zeros,
                     recompute_modes=recomputes, virtual_stages=vs, fixed=fixed, reduction=reduction)
        if args.json:
            print(json.dumps({"devices": devices, "hardware": hw.name, "global_batch": global_batch,
                              "considered": res.considered, "candidates": [c.to_dict() for c in res.candidates],
                              "plan_only": [c.to_dict() for c in res.plan_only],
                              "rejections": res.rejections.to_dict(), "notes": notes}, indent=1))
        else:
            print(_model_header(model, policy))
            print(_hardware_line(hw, devices, util))
            for n in notes:
                print(f"note: {n}")
            print(_search_table(res, hw))
        return 0 if res.candidates else 1

    accum = cfg.train.grad_accum
    if global_batch % (dp * accum * p.microbatches):
        raise ConfigError("train.global_batch", f"{global_batch} is not divisible by dp x grad_accum x microbatches = "
                          f"{dp} x {accum} x {p.microbatches}")
    micro_batch = global_batch // (dp * accum * p.microbatches)
    layout = Layout(dp=dp, tp=tp, pp=pp, microbatches=p.microbatches, micro_batch=micro_batch, schedule=schedule,
                    virtual_stages=p.virtual_stages if schedule == "interleaved" else 1,
                    zero=zero, recompute=p.recompute,
                    sequence_parallel=p.sequence_parallel and tp > 1, policy=policy, accum=accum,
                    reduction=reduction, ep=p.ep, parameter_server=p.strategy == "parameter_server")
    plan = estimate(model, layout, hw, args.tokens, util, ofrac, args.dp_overlap)
    calibration = None
    if args.calibrate:
        if plan.plan_only:
            raise ConfigError("--calibrate", f"the engine cannot run this layout ({'; '.join(plan.plan_only)})")

        if args.keras:
            calibration = calibrate_keras(cfg, steps=args.calibrate_steps, plan=plan)
        else:
            calibration = calibrate(cfg, plan, steps=args.calibrate_steps)
    if args.json:
        doc = plan.to_dict()
        doc["notes"] = notes
        if keras_mem is not None:
            doc["keras_memory_per_device_bytes"] = [keras_mem[i].to_dict() for i in sorted(keras_mem)]
        if calibration is not None:
            doc["calibration"] = calibration
        print(json.dumps(doc, indent=1))
    else:
        print(_model_header(model, policy))
        print(_hardware_line(hw, devices, util))
        for n in notes:
            print(f"note: {n}")
        print(_plan_text(plan))
        if keras_mem is not None:
            print(_keras_text(keras_mem, tp, pp))
        if calibration is not None:
            print(_calibration_text(calibration))
    return 0


# ---------------------------------------------------------------------------
# Text output


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _model_header(m, policy: str) -> str:

    moe = (f", MoE {m.experts} experts top-{m.top_k} every {m.moe_every} layers "
           f"({_human(active_param_count(m))} active)") if m.experts else ""
    return (f"model: {_human(param_count(m))} parameters ({param_count(m):,}){moe}; {m.layers} layers, "
            f"d_model {m.d_model}, {m.heads} heads, ffn {m.ffn_dim}, vocab {m.vocab}, seq_len {m.seq_len}, "
            f"{'tied' if m.tie_embeddings else 'untied'} embeddings; {policy}\n"
            f"training FLOPs/token: {flops_per_token(m, 'none'):.3e} (no recompute), "
            f"{flops_per_token(m, 'selective'):.3e} (selective), {flops_per_token(m, 'full'):.3e} (full)")


def _hardware_line(hw, devices: int, util: float) -> str:
    peaks = ", ".join(f"{k} {v / 1e12:.3g}" for k, v in sorted(hw.peak.items()))
    return (f"hardware: {devices} x {hw.name} ({hw.memory_bytes / GiB:.1f} GiB, peak TFLOP/s {peaks}; "
            f"{hw.devices_per_node}/node, {hw.intra_node_bw / 1e9:.0f}/{hw.inter_node_bw / 1e9:.0f} GB/s "
            f"intra/inter); assumed utilisation {util:.2f} of peak")


def _plan_text(plan) -> str:
    mem, lay, t = plan.memory, plan.layout, plan.time
    cap = plan.hardware.memory_bytes
    rows = [("weights", mem.weights), ("gradients", mem.gradients), ("optimizer", mem.optimizer),
            ("activations", mem.activations), ("temporaries", mem.temporaries), ("overhead", mem.overhead)]
    lines = [f"layout: {lay.describe()}  (global batch {lay.global_batch} x {plan.model.seq_len} tokens)"
             + (f"\nPLAN ONLY: the engine cannot run {'; '.join(plan.plan_only)}" if plan.plan_only else "")
             + ("\nparameter servers: whole variables on every worker (their own engine)"
                if lay.parameter_server else ""),
             f"memory per device (pipeline rank {mem.rank}, {_human(mem.params)} params"
             + (f" of which {_human(mem.expert_params)} in experts ({plan.model.experts // lay.ep} of "
                f"{plan.model.experts} per MoE block{f', ep={lay.ep}' if lay.ep > 1 else ''})"
                if plan.model.experts else "")
             + f", {mem.in_flight} activation sets in flight):"]
    for name, v in rows:
        lines.append(f"  {name:<12} {v / GiB:10.2f} GiB")
    verdict = "fits" if plan.fits else f"does NOT fit (+{(mem.total / cap - 1) * 100:.1f}%)"
    lines.append(f"  {'total':<12} {mem.total / GiB:10.2f} GiB of {cap / GiB:.2f} GiB: {verdict}")
    a2a = ""
    if lay.ep > 1:
        a2a = (f", expert all-to-all {t.moe_comm_s:.3g} s for "
               f"{t.comm_bytes['moe_all_to_all'] / GiB:.3g} GiB per device")
    lines.append(f"time per step: {t.step_time_s:.4g} s  (pipeline {t.compute_s:.4g} s incl. bubble "
                 f"{t.bubble_fraction:.1%}, tp comm {t.tp_comm_s:.3g} s{a2a}, "
                 f"exposed dp comm {t.dp_comm_s:.3g} s)")
    days = f", {plan.days:.1f} days for {plan.tokens:.3g} tokens" if plan.days is not None else ""
    lines.append(f"throughput: {plan.tokens_per_s:,.0f} tokens/s, MFU {plan.mfu:.1%}{days}")
    return "\n".join(lines)


def _candidate_rows(plans, start: int = 1, ep: bool = False) -> list[str]:
    """Table rows; ``ep``: with an ep column (mixture-of-experts models)."""
    ep_head = f" {'ep':>3}" if ep else ""
    head = (f"{'#':>2} {'dp':>5}{ep_head} {'tp':>3} {'pp':>4} {'m':>5} {'accum':>5} {'b':>3} "
            f"{'schedule':<16} {'zero':>4} {'recompute':<9} {'mem GiB':>8} {'bubble':>7} {'step s':>9} "
            f"{'tokens/s':>12} {'MFU':>6} {'days':>8}")
    lines = [head]
    for i, c in enumerate(plans, start):
        lay = c.layout
        sched = lay.schedule + (f"(v={lay.virtual_stages})" if lay.virtual_stages > 1 else "")
        days = f"{c.days:8.1f}" if c.days is not None else f"{'-':>8}"
        ep_col = f" {lay.ep:>3}" if ep else ""
        lines.append(f"{i:>2} {lay.dp:>5}{ep_col} {lay.tp:>3}{'s' if lay.sequence_parallel else ' '}{lay.pp:>3} "
                     f"{lay.microbatches:>5} {lay.accum:>5} {lay.micro_batch:>3} {sched:<16} {lay.zero:>4} {lay.recompute:<9} "
                     f"{c.memory.total / GiB:8.1f} {c.time.bubble_fraction:7.1%} {c.time.step_time_s:9.3g} "
                     f"{c.tokens_per_s:12,.0f} {c.mfu:6.1%} {days}")
    return lines


def _search_table(res, hw) -> str:
    lines = [f"searched {res.considered} layouts; top {len(res.candidates)} the engine runs, by throughput:"]
    ep = bool((res.candidates or res.plan_only) and (res.candidates or res.plan_only)[0].model.experts)
    lines += _candidate_rows(res.candidates, ep=ep)
    if not res.candidates:
        lines.append("  no layout the engine runs fits: add devices, memory, or allow more ZeRO/recompute")
    if res.plan_only:
        lines.append("plan only (modelled, but the engine cannot run them; never proposed as best):")
        rows = _candidate_rows(res.plan_only, ep=ep)
        lines.append(rows[0] + "  why not runnable")
        for row, c in zip(rows[1:], res.plan_only):
            lines.append(f"{row}  {'; '.join(res.plan_only_reasons(c))}")
    lines.append("rejected:")
    lines += ["  " + ln for ln in res.rejections.lines()]
    return "\n".join(lines)


def _keras_text(mem: dict, tp: int, pp: int = 1) -> str:
    MiB = 2**20
    lines = ["memory per device on the Keras-model engine (phalanx.fit of phalanx.models.transformer.gpt, "
             "Keras AdamW; phalanx.plan.keras_memory):"]
    for i in sorted(mem):
        m = mem[i]
        lines.append(f"  device {i} (replica {i // (tp * pp)}, pipe {i // tp % pp}, tensor {i % tp}): "
                     f"{m.total / MiB:9.1f} MiB = weights "
                     f"{m.weights / MiB:.1f} + optimizer {m.optimizer / MiB:.1f} + gradients {m.gradients / MiB:.1f}"
                     f" + activations {m.activations / MiB:.1f} + temporaries {m.temporaries / MiB:.1f}")
    return "\n".join(lines)


def _calibration_text(cal: dict) -> str:
    if "error" in cal:
        return f"calibration: not run: {cal['error']}"
    MiB = 2**20
    lines = [f"calibration on this machine (median of {cal['steps']} profiled steps), peak memory per device "
             f"(bytes the tensors asked for):"]
    for d in cal["devices"]:
        pred = d["predicted_bytes"]
        err = f"({d['error']:+.1%})" if d["error"] is not None else ""
        spread = f", spread {d['measured_spread']:.1%}" if d.get("measured_spread") is not None else ""
        lines.append(f"  {d['device']:<8} predicted {pred / MiB if pred is not None else float('nan'):9.1f} MiB, "
                     f"measured {d['measured_bytes'] / MiB:9.1f} MiB {err}{spread}; allocator chunks "
                     f"{d.get('allocated_bytes', 0.0) / MiB:.1f} MiB")
    lines.append(f"  (all devices share one allocator here; its process-wide peak was "
                 f"{cal['total_check'] / MiB:.1f} MiB)")
    if "predicted_step_time_s" in cal:
        lines.append(f"  step time    predicted {cal['predicted_step_time_s']:.4g} s, measured "
                     f"{cal['measured_step_time_s']:.4g} s ({cal['step_time_error']:+.1%}); "
                     f"--utilization {cal['implied_utilization']:.3f} would match it")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
