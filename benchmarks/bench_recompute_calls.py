"""Build and step time under ``parallel.recompute`` with the stages traced once and called per
micro-batch (:mod:`phalanx.parallel.stage_calls`) against every stage traced inline for every
micro-batch (the engine's ``stage_calls=False``, what it ran under recomputation before).

The model is bench_plan_layouts.py's GPT (8 layers, d_model 256, 8 heads, ffn 1024, seq_len
128, vocab 256, global batch 16, float32) on the engine ``phalanx train`` builds. Each layout
runs in a fresh process per variant, the variants alternating (inline, called, inline, called
... over ``--rounds`` rounds), since a shared machine's load moves between runs: compare the
two variants of a layout within one round. Recorded in wall seconds, as bench_plan_layouts.py
records them: construct, trace, first run, first step (their sum), the second step and the
median of ``--later`` more steps; "stages" says how many stage functions were traced and
how many stages ran inline (once per micro-batch of the step).

Run by hand (tens of minutes on 2 cores):

    .venv/bin/python benchmarks/bench_recompute_calls.py
    .venv/bin/python benchmarks/bench_recompute_calls.py --only 0,2 --rounds 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as the phalanx command does (ARCHITECTURE.md)

LAYOUTS = [  # (name, config keys)
    ("pp2 m4 1f1b, recompute full", ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=4",
                                     "parallel.recompute=full"]),
    ("pp2 m4 1f1b, recompute selective", ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=4",
                                          "parallel.recompute=selective"]),
    ("pp1 grad_accum 4, recompute full", ["parallel.devices=cpu:1", "train.grad_accum=4",
                                          "parallel.recompute=full"]),
    ("pp1 grad_accum 4, recompute selective", ["parallel.devices=cpu:1", "train.grad_accum=4",
                                               "parallel.recompute=selective"]),
    ("tp2 x pp2 m4 1f1b, recompute selective", ["parallel.devices=cpu:4", "parallel.tp=2", "parallel.pp=2",
                                                "parallel.microbatches=4", "parallel.recompute=selective"]),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated layout indices (0-{len(LAYOUTS) - 1})")
    parser.add_argument("--rounds", type=int, default=1, help="times each variant runs (alternating)")
    parser.add_argument("--later", type=int, default=3, help="steps after the second, timed (median)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a process is stopped")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # JSON [keys, stage_calls, later]: run it here
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from bench_plan_layouts import run_one
    from machine_report import cpu_line, load, machine

    if args.one:
        keys, calls, later = json.loads(args.one)
        print(json.dumps(run_one(keys, stage_calls=calls, later=later)))
        return 0
    chosen = [int(i) for i in args.only.split(",") if i.strip()] or list(range(len(LAYOUTS)))
    bad = [str(i) for i in chosen if not 0 <= i < len(LAYOUTS)]
    if bad:
        parser.error(f"--only: unknown layout {', '.join(bad)}; layouts are 0..{len(LAYOUTS) - 1}")
    print(f"# Recomputation inline and as stage calls ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
          f"UTC)\n")
    print(cpu_line(machine()) + "\n")
    print("| layout | variant | stages | construct s | trace s | first run s | first step s | second step s | "
          "later step s | load after |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for _ in range(args.rounds):
        for i in chosen:
            name, keys = LAYOUTS[i]
            for calls in (False, True):
                variant = "called" if calls else "inline"
                try:
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one",
                                          json.dumps([keys, calls, args.later])],
                                         capture_output=True, text=True, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    print(f"| {name} | {variant} | stopped after {args.timeout:.0f} s | | | | | | | {load()} |",
                          flush=True)
                    continue
                if out.returncode:
                    tail = (out.stderr.strip().splitlines() or ["?"])[-1]
                    print(f"| {name} | {variant} | failed: {tail} | | | | | | | {load()} |", flush=True)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                stages = f"{r['stage_functions']} called, {r['inline_stages']} of {r['stages']} inline x {r['copies']}"
                later = f"{r['later_s']:.3f}" if r["later_s"] is not None else ""
                print(f"| {name} | {variant} | {stages} | {r['construct_s']:.1f} | {r['trace_s']:.1f} | "
                      f"{r['first_run_s']:.1f} | {r['first_s']:.1f} | {r['second_s']:.3f} | {later} | {load()} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
