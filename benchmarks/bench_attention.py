"""The attention core alone, plain against blocked (``model.attention``), forward + backward.

Times ``d(sum(o * g))/d(q, k, v)`` of the causal attention core in one ``tf.function`` per
core, on the reference GPT's per-layer shapes (``[batch, heads, T, head_dim]``), the cores
alternating call by call (the order flips every round) so both see the same machine load;
inputs change every call (three rotating sets). Reports medians of wall and process-CPU time
per call and the same-round ratios. ``plain`` is the built-in GPT's core
(:func:`phalanx.models.gpt_ops.causal_attention`: ``[T, T]`` scores, the oneDNN causal softmax,
the fused softmax backward); ``blocked`` is :func:`phalanx.layers.blocked_attention.causal_attention`.

Usage::

    python benchmarks/bench_attention.py --seq-lens 128,512 --policies float32,bfloat16
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from phalanx.layers import blocked_attention  # noqa: E402
from phalanx.models import gpt_ops  # noqa: E402


def core_step(fn):
    @tf.function
    def step(q, k, v, g):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            loss = tf.reduce_sum(tf.cast(fn(q, k, v), tf.float32) * g)
        grads = tape.gradient(loss, [q, k, v])
        return tf.add_n([tf.reduce_sum(tf.cast(x[..., :1, :1], tf.float32)) for x in grads])

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-lens", default="512")
    p.add_argument("--policies", default="float32,bfloat16", help="compute dtypes")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--output", default="-")
    args = p.parse_args(argv)
    cores = {"plain": gpt_ops.causal_attention, "blocked": blocked_attention.causal_attention}
    rng = np.random.default_rng(0)
    lines = [f"Attention core forward + backward, [batch {args.batch}, heads {args.heads}, T, head_dim "
             f"{args.head_dim}]; {args.rounds} alternating rounds; date {datetime.datetime.now():%Y-%m-%dT%H:%M}; "
             f"load before {'/'.join(f'{x:.1f}' for x in os.getloadavg())}; block {blocked_attention.BLOCK_SIZE}",
             "", "| dtype | T | plain ms | blocked ms | blocked speed (same-round wall) | by CPU time |",
             "|---|---|---|---|---|---|"]
    for dtype in [x for x in args.policies.split(",") if x]:
        for t in [int(x) for x in args.seq_lens.split(",") if x]:
            shape = [args.batch, args.heads, t, args.head_dim]
            sets = [[tf.constant(rng.normal(size=shape), dtype) for _ in range(3)] + [tf.constant(
                rng.normal(size=shape), tf.float32)] for _ in range(3)]
            steps = {name: core_step(fn) for name, fn in cores.items()}
            for step in steps.values():
                float(step(*sets[0]))  # trace + warm up
            wall = {name: [] for name in cores}
            cpu = {name: [] for name in cores}
            for r in range(args.rounds):
                for name in (list(cores) if r % 2 == 0 else list(cores)[::-1]):
                    start, cpu0 = time.perf_counter(), time.process_time()
                    float(steps[name](*sets[r % 3]))
                    wall[name].append(time.perf_counter() - start)
                    cpu[name].append(time.process_time() - cpu0)
            ratio = statistics.median(a / b for a, b in zip(wall["plain"], wall["blocked"]))
            cpu_ratio = statistics.median(a / b for a, b in zip(cpu["plain"], cpu["blocked"]))
            line = (f"| {dtype} | {t} | {statistics.median(wall['plain']) * 1e3:.1f} | "
                    f"{statistics.median(wall['blocked']) * 1e3:.1f} | {ratio:.2f}x | {cpu_ratio:.2f}x |")
            print(line, flush=True)
            lines.append(line)
    lines.append(f"\nload after {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output != "-":
        with open(args.output, "a") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
