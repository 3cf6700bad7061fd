"""Parallel overhead, pipeline bubble and memory of the mesh engine on logical CPUs.

Run by hand (it takes minutes: every layout is traced once):

    .venv/bin/python benchmarks/bench_parallel.py            # all layouts, markdown to stdout
    .venv/bin/python benchmarks/bench_parallel.py --quick    # a smaller model, fewer steps

On ``cpu:8`` all logical devices share the host's cores (ARCHITECTURE.md), so a layout
cannot be faster than one device: the figure of merit is the step time of the layout
divided by the single-device step time of the same model and global batch (1.0 is
ideal). The pipeline bubble is measured from a profiler trace of one step (the span of
each executed action, per rank) and printed beside the ideal ``(p-1)/(v*m+p-1)``.
Memory: the process's peak bytes during a step (``get_memory_info``; logical CPUs share
one allocator, so it is the sum over devices), and the optimizer-state bytes each
device holds (exact, from the variables) with and without ZeRO-1.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# get_memory_info on the CPU reports only with the BFC allocator, chosen before TF starts.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, 3 timed steps")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per layout (median reported)")
    ap.add_argument("--only", default="", help="comma-separated layout names to run")
    args = ap.parse_args(argv)

    from phalanx.mesh import configure_logical_cpus

    devices = configure_logical_cpus(8)
    import numpy as np
    import tensorflow as tf

    from phalanx.config import Config
    from phalanx.mesh import Mesh
    from phalanx.engines.mesh import MeshEngine
    from phalanx.parallel.trace import measured_bubble, profile_actions
    from phalanx.parallel.schedules import bubble_formula
    from phalanx.engines.strategy import StrategyEngine
    from phalanx.engines.task import GPTTask

    model = (dict(layers=8, d_model=128, heads=8, ffn=512, vocab=256, seq_len=64) if args.quick else
             dict(layers=8, d_model=256, heads=8, ffn=1024, vocab=256, seq_len=128))
    gb = 16
    steps = 3 if args.quick else args.steps
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, size=(gb, model["seq_len"] + 1)).astype(np.int32)

    layouts = [  # name, dp, tp, pp, extra
        ("mesh 1 device", 1, 1, 1, {}),
        ("dp2", 2, 1, 1, {}),
        ("tp2", 1, 2, 1, {}),
        ("tp4", 1, 4, 1, {}),
        ("pp2 gpipe m4", 1, 1, 2, {"schedule": "gpipe", "microbatches": 4}),
        ("pp2 1f1b m4", 1, 1, 2, {"schedule": "1f1b", "microbatches": 4}),
        ("pp4 gpipe m8", 1, 1, 4, {"schedule": "gpipe", "microbatches": 8}),
        ("pp4 1f1b m8", 1, 1, 4, {"schedule": "1f1b", "microbatches": 8}),
        ("pp4 interleaved v2 m8", 1, 1, 4, {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 8}),
        ("dp2-tp2-pp2 1f1b m4", 2, 2, 2, {"schedule": "1f1b", "microbatches": 4}),
        ("recompute full", 1, 1, 1, {"recompute": "full"}),
        ("recompute selective", 1, 1, 1, {"recompute": "selective"}),
        ("dp2 zero1", 2, 1, 1, {"zero": 1}),
        ("dp4 zero0", 4, 1, 1, {}),
        ("dp4 zero1", 4, 1, 1, {"zero": 1}),
    ]
    if args.only:
        wanted = {s.strip() for s in args.only.split(",")}
        layouts = [row for row in layouts if row[0] in wanted]

    def cfg_for(dp=1, tp=1, pp=1, **extra):
        return Config().replace(model=model, train={"global_batch": gb, "warmup": 1},
                                parallel={"dp": dp, "tp": tp, "pp": pp, **extra})

    def time_steps(engine) -> tuple[float, int]:
        engine.train_step(batch)
        engine.train_step(batch)
        times = []
        tf.config.experimental.reset_memory_stats("CPU:0")
        for _ in range(steps):
            t0 = time.perf_counter()
            out = engine.train_step(batch)
            float(out["loss"])
            times.append(time.perf_counter() - t0)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        return statistics.median(times), peak

    t0 = time.perf_counter()
    cfg = cfg_for()
    base_time, base_peak = time_steps(StrategyEngine(cfg, GPTTask(cfg.model)))
    print(f"single device (StrategyEngine): {base_time * 1000:.1f} ms/step, peak {base_peak / 2**20:.1f} MiB",
          file=sys.stderr)

    rows = []
    for name, dp, tp, pp, extra in layouts:
        cfg = cfg_for(dp, tp, pp, **extra)
        mesh = Mesh.from_devices(devices[: dp * tp * pp], dp, pp, tp)
        engine = MeshEngine(cfg, mesh, GPTTask(cfg.model))
        step, peak = time_steps(engine)
        bubble = ideal = None
        if pp > 1:
            with tempfile.TemporaryDirectory() as logdir:
                tf.profiler.experimental.start(logdir)
                engine.train_step(batch)
                tf.profiler.experimental.stop()
                bubble = measured_bubble(profile_actions(logdir), pp)
            ideal = bubble_formula(pp, engine.microbatches, engine.schedule.virtual_stages)
        state = engine.optimizer.state_bytes_per_device()
        rows.append((name, step / base_time, step, bubble, ideal, peak, max(state.values())))
        print(f"{name}: {step * 1000:.1f} ms/step", file=sys.stderr)
        del engine

    print(f"\nMesh engine on {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"TF {tf.__version__}, {time.strftime('%Y-%m-%d')}; GPT layers={model['layers']} "
          f"d_model={model['d_model']} heads={model['heads']} ffn={model['ffn']} seq={model['seq_len']}, "
          f"global batch {gb}, float32; median of {steps} steps; single device "
          f"{base_time * 1000:.0f} ms/step, peak {base_peak / 2**20:.0f} MiB.\n")
    print("| layout | step time / single device | ms/step | bubble measured | bubble (p-1)/(vm+p-1) "
          "| peak MiB (all devices) | optimizer state MiB, largest device |")
    print("|---|---|---|---|---|---|---|")
    for name, ratio, step, bubble, ideal, peak, state in rows:
        b = f"{bubble:.2f}" if bubble is not None else "-"
        i = f"{ideal:.2f}" if ideal is not None else "-"
        print(f"| {name} | {ratio:.2f} | {step * 1000:.0f} | {b} | {i} | {peak / 2**20:.0f} | {state / 2**20:.2f} |")
    print(f"\n(total benchmark time {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
