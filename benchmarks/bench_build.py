"""Step build time of the built-in GPT: the first step (engine construction, tracing, the
step itself) and the later steps, on the engine ``phalanx train`` builds (the Keras-model
engine, :class:`~phalanx.engines.keras_gpt.KerasGPTEngine`). The "before" figures of the
mesh engine it replaced are in docs/benchmarks.md (that engine is deleted).

Run by hand (minutes):

    .venv/bin/python benchmarks/bench_build.py                      # the four cases
    .venv/bin/python benchmarks/bench_build.py --cases 0,1 --steps 3

The cases (a d_model 64 GPT, 4 heads, ffn 256, vocab 256, seq_len 32, 2 rows per
micro-batch, float32, on 8 logical CPUs): 4 layers pp2 with 2 micro-batches; 4 layers pp2
with 8; 16 layers tp2 x pp2 with 8; 32 layers tp2 x pp4 with 16 (1F1B). Every case runs in
a fresh process (nothing traced is shared). Times are wall seconds: on a machine loaded by
others, compare cases within one run, not with another run's figures. The table starts with
the CPU model, the date and the load averages.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as the phalanx command does (ARCHITECTURE.md)
os.environ.setdefault("PHALANX_AUTO_PRECISION", "float32")

CASES = [  # layers, tp, pp, micro-batches
    (4, 1, 2, 2),
    (4, 1, 2, 8),
    (16, 2, 2, 8),
    (32, 2, 4, 16),
]
def _one(case: int, steps: int) -> dict:
    """In this process: build the engine for case ``case``, time the first and later steps."""
    import tensorflow as tf

    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 8)
    import numpy as np

    from phalanx.config import Config
    from phalanx.engines.factory import make_engine
    from phalanx.engines.task import GPTTask
    from phalanx.mesh import Mesh

    layers, tp, pp, micro = CASES[case]
    cfg = Config().replace(model={"layers": layers, "d_model": 64, "heads": 4, "ffn": 256, "vocab": 256,
                                  "seq_len": 32},
                           precision={"policy": "float32"},
                           train={"global_batch": 2 * micro, "warmup": 1, "steps": 100},
                           parallel={"tp": tp, "pp": pp, "microbatches": micro, "schedule": "1f1b"})
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][: tp * pp]
    mesh = Mesh.from_devices(devices, 1, pp, tp)
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, (2 * micro, 33)).astype(np.int32) for _ in range(steps + 1)]
    start = time.perf_counter()
    built = make_engine(GPTTask(cfg.model), mesh, cfg)  # the engine phalanx train builds (engines/factory.py)
    construct = time.perf_counter() - start
    float(built.train_step(data[0])["loss"])
    first = time.perf_counter() - start
    times = []
    for batch in data[1:]:
        t = time.perf_counter()
        float(built.train_step(batch)["loss"])
        times.append(time.perf_counter() - t)
    times.sort()
    return {"construct_s": construct, "first_s": first, "step_s": times[len(times) // 2]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                        help="comma-separated case indices (0-3)")
    parser.add_argument("--steps", type=int, default=3, help="later steps timed (median)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a case index: run it in this process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(_one(int(args.one), args.steps)))
        return 0
    cases = [int(c) for c in args.cases.split(",")]
    bad = [str(c) for c in cases if not 0 <= c < len(CASES)]
    if bad:
        parser.error(f"unknown case {bad}: cases are 0..{len(CASES) - 1}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine_report import cpu_line, load

    print(f"# Build time of the built-in GPT ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n")
    print(cpu_line() + "\n")
    print("| case | construct s | first step s | later step s | load |")
    print("|---|---|---|---|---|")
    for case in cases:
        layers, tp, pp, micro = CASES[case]
        name = f"{layers} layers tp{tp} x pp{pp}, {micro} micro-batches"
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", str(case),
                              "--steps", str(args.steps)], capture_output=True, text=True)
        if out.returncode:
            print(f"| {name} | failed: {out.stderr.strip().splitlines()[-1:]} | | | |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['construct_s']:.1f} | {r['first_s']:.1f} | {r['step_s']:.3f} | {load()} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
