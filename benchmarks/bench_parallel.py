"""Parallel overhead, pipeline bubble and memory of the engine ``phalanx train`` builds for
each layout (engines/factory.py: the Keras-model engine) on logical CPUs.

Run by hand (it takes minutes: every layout is traced once):

    .venv/bin/python benchmarks/bench_parallel.py            # all layouts, markdown to stdout
    .venv/bin/python benchmarks/bench_parallel.py --quick    # a smaller model, fewer steps
    .venv/bin/python benchmarks/bench_parallel.py --output benchmarks/results/parallel_<date>.md

On ``cpu:8`` all logical devices share the host's cores (ARCHITECTURE.md), so a layout
cannot be faster than one device: the figure of merit is the step time of the layout
divided by the one-device step time of the same model, global batch and precision (1.0
is ideal), the one-device step being the same factory's for ``parallel.dp=1``. It is timed
next to every layout, one step each in turn (the machine's load changes during a run of
minutes). Every engine runs ``--policy`` (default float32): comparing a bfloat16 step with a
float32 one measures the precision, not the layout (precision.policy=auto is bfloat16 on a
CPU with bfloat16 units, so it is pinned here).

The pipeline bubble is measured from a profiler trace of one step (the span of each
executed action, per rank) and printed beside the ideal ``(p-1)/(v*m+p-1)``; on shared
cores a rank also waits for the other ranks' ops, so it is far above the ideal.
"CPU time x one device": the process's CPU seconds per step (all threads, medians) over the
one-device engine's. On a loaded machine (other processes on the same cores) the wall
ratios favour the layouts with more runnable threads, which get a larger share of the cores;
CPU time is steadier there, but it also counts the thread pools' spin-waiting, so on a quiet
machine the wall ratio is the figure.
Memory: the process's peak bytes during one step of the layout alone, less what was
allocated before the layout's engine was built (``get_memory_info``; logical CPUs share
one allocator, so it is the sum over devices), and the optimizer-state bytes the most loaded
device holds (exact, from the optimizer's slot variables) with and without ZeRO-1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# get_memory_info on the CPU reports only with the BFC allocator, chosen before TF starts.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# as the phalanx command does (oneDNN is off by default on AVX2-only CPUs; ARCHITECTURE.md)
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

LAYOUTS = [  # name, dp, tp, pp, extra (parallel.* keys; "stage_calls": False runs every stage inline)
    ("dp2", 2, 1, 1, {}),
    ("tp2", 1, 2, 1, {}),
    ("tp4", 1, 4, 1, {}),
    ("pp2 gpipe m4", 1, 1, 2, {"schedule": "gpipe", "microbatches": 4}),
    ("pp2 1f1b m4", 1, 1, 2, {"schedule": "1f1b", "microbatches": 4}),
    ("pp4 gpipe m8", 1, 1, 4, {"schedule": "gpipe", "microbatches": 8}),
    ("pp4 1f1b m8", 1, 1, 4, {"schedule": "1f1b", "microbatches": 8}),
    ("pp4 interleaved v2 m8", 1, 1, 4, {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 8}),
    ("dp2-tp2", 2, 2, 1, {}),
    ("dp2-tp2-pp2 1f1b m4", 2, 2, 2, {"schedule": "1f1b", "microbatches": 4}),
    # the same with every stage inline per micro-batch (KerasModelEngine's stage_calls=False)
    ("dp2-tp2-pp2 1f1b m4 inline", 2, 2, 2, {"schedule": "1f1b", "microbatches": 4, "stage_calls": False}),
    ("pp4 1f1b m8 inline", 1, 1, 4, {"schedule": "1f1b", "microbatches": 8, "stage_calls": False}),
    ("recompute full", 1, 1, 1, {"recompute": "full"}),
    ("recompute selective", 1, 1, 1, {"recompute": "selective"}),
    ("dp2 zero1", 2, 1, 1, {"zero": 1}),
    ("dp4 zero0", 4, 1, 1, {}),
    ("dp4 zero1", 4, 1, 1, {"zero": 1}),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, 3 timed steps")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout (median reported)")
    ap.add_argument("--only", default="", help="comma-separated layout names to run")
    ap.add_argument("--policy", default="float32", choices=("float32", "mixed_bfloat16", "mixed_float16"),
                    help="precision.policy of every engine (default float32)")
    ap.add_argument("--output", default="", help="also write the markdown table to this file")
    ap.add_argument("--inter-op", type=int, default=0,
                    help="inter_op_parallelism_threads (default 0: what configure_logical_cpus picks)")
    args = ap.parse_args(argv)

    from phalanx.mesh import configure_logical_cpus

    if args.inter_op:
        import tensorflow as tf

        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)

    devices = configure_logical_cpus(8)
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine_report import load, machine

    from phalanx.config import Config
    from phalanx.engines.factory import make_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.task import GPTTask
    from phalanx.mesh import Mesh
    from phalanx.parallel.schedules import bubble_formula
    from phalanx.parallel.trace import measured_bubble, profile_actions

    model = (dict(layers=8, d_model=128, heads=8, ffn=512, vocab=256, seq_len=64) if args.quick else
             dict(layers=8, d_model=256, heads=8, ffn=1024, vocab=256, seq_len=128))
    gb = 16
    steps = 3 if args.quick else args.steps
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, size=(gb, model["seq_len"] + 1)).astype(np.int32)
    layouts = LAYOUTS
    if args.only:
        wanted = {s.strip() for s in args.only.split(",")}
        unknown = wanted - {row[0] for row in LAYOUTS}
        if unknown:
            ap.error(f"--only: unknown layouts {sorted(unknown)}; valid: {[row[0] for row in LAYOUTS]}")
        layouts = [row for row in LAYOUTS if row[0] in wanted]

    def cfg_for(dp=1, tp=1, pp=1, **extra):
        return Config().replace(model=model, train={"global_batch": gb, "warmup": 1},
                                precision={"policy": args.policy}, parallel={"dp": dp, "tp": tp, "pp": pp, **extra})

    def build(cfg, dp=1, tp=1, pp=1, stage_calls=True):
        """The engine phalanx train builds for the layout (engines/factory.py); with
        ``stage_calls=False`` its stages run inline for every micro-batch."""
        task, mesh = GPTTask(cfg.model, args.policy, cfg.train.seed), Mesh.from_devices(devices[: dp * tp * pp], dp, pp, tp)
        return make_engine(task, mesh, cfg) if stage_calls else KerasGPTEngine(cfg, task, mesh, stage_calls=False)

    def step_time(engine) -> tuple[float, float]:
        """Wall and process CPU seconds of one step."""
        t0, c0 = time.perf_counter(), time.process_time()
        float(engine.train_step(batch)["loss"])
        return time.perf_counter() - t0, time.process_time() - c0

    def in_use() -> int:
        return tf.config.experimental.get_memory_info("CPU:0")["current"]

    def peak_of_step(engine, before: int) -> int:
        tf.config.experimental.reset_memory_stats("CPU:0")
        float(engine.train_step(batch)["loss"])
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before

    def optimizer_state_bytes(engine) -> int:
        """The most loaded device's optimizer-state bytes: every slot variable of the engine's
        optimizers (the Keras-model engine's ZeRO slices and the whole moments), by device."""
        slots = {}
        for opt in {id(o): o for o in (engine.optimizer, getattr(engine.engine, "optimizer", None)) if o}.values():
            for v in opt.m + opt.v:
                slots[id(v)] = v.value if hasattr(v, "value") else v
        per_device: dict[str, int] = {}
        for v in slots.values():
            per_device[v.device] = per_device.get(v.device, 0) + v.shape.num_elements() * v.dtype.size
        return max(per_device.values())

    t_start, load_start = time.perf_counter(), load()
    info = machine()
    cfg = cfg_for()
    before = in_use()
    one = build(cfg)
    for _ in range(2):
        step_time(one)
    one_peak = peak_of_step(one, before)

    rows, all_one = [], []
    for name, dp, tp, pp, extra in layouts:
        extra = dict(extra)
        stage_calls = extra.pop("stage_calls", True)
        cfg = cfg_for(dp, tp, pp, **extra)
        before = in_use()
        engine = build(cfg, dp, tp, pp, stage_calls)
        for _ in range(2):
            step_time(engine)
        peak = peak_of_step(engine, before)
        # the layout and the one-device engine, one step each in turn (order rotated)
        times = {"layout": [], "one": []}
        cpu = {"layout": [], "one": []}
        engines = [("one", one), ("layout", engine)]
        for r in range(steps):
            for key, e in engines[r % len(engines):] + engines[:r % len(engines)]:
                wall, used = step_time(e)
                times[key].append(wall)
                cpu[key].append(used)
        step, s_one = (statistics.median(times[k]) for k in ("layout", "one"))
        step_cpu = statistics.median(cpu["layout"]) / statistics.median(cpu["one"])
        all_one += times["one"]
        bubble = ideal = None
        if pp > 1:
            with tempfile.TemporaryDirectory() as logdir:
                tf.profiler.experimental.start(logdir)
                engine.train_step(batch)
                tf.profiler.experimental.stop()
                bubble = measured_bubble(profile_actions(logdir), pp)
            ideal = bubble_formula(pp, cfg.parallel.microbatches, cfg.parallel.virtual_stages)
        rows.append((name, type(engine).__name__, step / s_one, step, step_cpu, bubble, ideal, peak,
                     optimizer_state_bytes(engine)))
        print(f"{name}: {step * 1000:.1f} ms/step (one device {s_one * 1000:.1f}), load {load()}", file=sys.stderr)
        del engine

    lines = [
        f"GPT layers={model['layers']} d_model={model['d_model']} heads={model['heads']} ffn={model['ffn']} "
        f"seq={model['seq_len']}, global batch {gb}, {args.policy}, logical cpu:8 on the same cores; "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}; median of {steps} steps per layout, each layout's steps "
        f"interleaved with the one-device engine's.",
        "",
        f"Machine: {info['model']}, {info['cores']} cores, flags {info['flags']}; TF {info['tf']}, "
        f"Keras {info['keras']}; TF_ENABLE_ONEDNN_OPTS={info['onednn']}; threads {info['threads']}; "
        f"load (1/5/15 min) {load_start} at the start, {load()} at the end.",
        "",
        f"One device ({type(one).__name__}), median over the run: {statistics.median(all_one) * 1000:.0f} ms/step "
        f"(peak {one_peak / 2**20:.0f} MiB).",
        "",
        "| layout | engine | x one device | ms/step | CPU time x one device | bubble measured | bubble "
        "(p-1)/(vm+p-1) | peak MiB (all devices) | optimizer state MiB, largest device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, kind, over, step, step_cpu, bubble, ideal, peak, state in rows:
        b = f"{bubble:.2f}" if bubble is not None else "-"
        i = f"{ideal:.2f}" if ideal is not None else "-"
        lines.append(f"| {name} | {kind} | {over:.2f} | {step * 1000:.0f} | {step_cpu:.2f} "
                     f"| {b} | {i} | {peak / 2**20:.0f} | {state / 2**20:.2f} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(f"# benchmarks/bench_parallel.py, {time.strftime('%Y-%m-%d')}\n\n" + text)
    print(f"(total benchmark time {time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
