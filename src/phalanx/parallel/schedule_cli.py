"""``phalanx schedule``: print a pipeline schedule, its simulated bubble, and draw it.

Example:
    phalanx schedule --pp 4 --microbatches 8 --schedule 1f1b --png sched.png
    phalanx schedule --pp 4 --microbatches 8 --schedule interleaved --virtual-stages 2

    >>> main(["--pp", "2", "--microbatches", "2", "--schedule", "gpipe", "--no-chart"])
    gpipe  pp=2  microbatches=2
    rank 0 | F0 F1 B0 B1
    rank 1 | F0 F1 B0 B1
    <BLANKLINE>
    simulated bubble fraction  0.3333  (fwd 1, bwd 2, comm 0)
    formula (p-1)/(v*m+p-1)    0.3333
    peak in-flight per rank    [2, 2]
    0
"""

from __future__ import annotations

import argparse
import sys

from phalanx.parallel.schedules import SCHEDULE_NAMES, build_schedule, bubble_formula, draw_png, render_text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx schedule",
                                description="Print a pipeline schedule table, its simulated bubble and "
                                            "peak in-flight micro-batches; optionally draw a PNG timeline.")
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved only)")
    p.add_argument("--fwd-cost", type=float, default=1.0, help="forward time of one micro-batch on one rank")
    p.add_argument("--bwd-cost", type=float, default=2.0, help="backward time (B + W when split)")
    p.add_argument("--comm-cost", type=float, default=0.0, help="point-to-point transfer time between ranks")
    p.add_argument("--png", default=None, help="write the simulated timeline to this PNG file")
    p.add_argument("--no-chart", action="store_true", help="omit the character timeline")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # imported here so that `phalanx schedule --help` stays instant
    from phalanx.plan.simulator import render_timeline_text, simulate

    try:
        sched = build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
        timeline = simulate(sched, args.fwd_cost, args.bwd_cost, args.comm_cost)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(render_text(sched))
    if not args.no_chart:
        print()
        print(render_timeline_text(timeline))
    print()
    print(f"simulated bubble fraction  {timeline.bubble_fraction:.4f}  "
          f"(fwd {args.fwd_cost:g}, bwd {args.bwd_cost:g}, comm {args.comm_cost:g})")
    print(f"formula (p-1)/(v*m+p-1)    {bubble_formula(sched.pp, sched.microbatches, sched.virtual_stages):.4f}")
    print(f"peak in-flight per rank    {list(timeline.peak_in_flight)}")
    if args.png:
        draw_png(timeline, args.png)
        print(f"timeline written to {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
