"""``phalanx schedule``: print a pipeline schedule, its simulated bubble, and draw it.

The schedule is named by the same config keys ``phalanx train`` reads (one name per
knob): ``parallel.pp``, ``parallel.microbatches``, ``parallel.schedule``,
``parallel.virtual_stages``, given as ``key=value`` anywhere among the flags, or read
from the ``parallel`` section of a config file. ``parallel.schedule=zb`` is simulated
too, labelled plan only (the executor runs gpipe, 1f1b and interleaved). Flags are
for what is not config: costs, the PNG, the chart.

Example:
    phalanx schedule parallel.pp=4 parallel.microbatches=8 parallel.schedule=1f1b --png sched.png
    phalanx schedule --no-chart my.yaml parallel.schedule=interleaved parallel.virtual_stages=2

    >>> main(["parallel.pp=2", "--no-chart", "parallel.microbatches=2", "parallel.schedule=gpipe"])
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
from pathlib import Path

from phalanx.config import SCHEDULES, ConfigError, ParallelConfig, parse_override, split_config_args
from phalanx.parallel.schedules import SCHEDULE_NAMES, build_schedule, bubble_formula, render_text
from phalanx.plan.simulator import render_timeline_text, simulate

KEYS = {"parallel.pp": int, "parallel.microbatches": int, "parallel.schedule": str, "parallel.virtual_stages": int}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx schedule",
                                description="Print a pipeline schedule table, its simulated bubble and "
                                            "peak in-flight micro-batches; optionally draw a PNG timeline.",
                                epilog="keys: parallel.pp (default 2 here), parallel.microbatches (default 4 here), "
                                       f"parallel.schedule ({', '.join(SCHEDULE_NAMES)}; default "
                                       f"{ParallelConfig.schedule}), parallel.virtual_stages (interleaved only)")
    p.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [parallel.key=value ...]",
                   help="the schedule's config keys, anywhere among the flags")
    p.add_argument("--fwd-cost", type=float, default=1.0, help="forward time of one micro-batch on one rank")
    p.add_argument("--bwd-cost", type=float, default=2.0, help="backward time (B + W when split)")
    p.add_argument("--comm-cost", type=float, default=0.0, help="point-to-point transfer time between ranks")
    p.add_argument("--png", default=None, help="write the simulated timeline to this PNG file")
    p.add_argument("--no-chart", action="store_true", help="omit the character timeline")
    return p


def schedule_keys(args: list[str]) -> dict[str, object]:
    """The schedule's keys from ``[CONFIG.yaml] key=value ...`` (a file's ``parallel`` section first).

    Only the four schedule keys are read, so no whole training config has to be valid.

    >>> schedule_keys(["parallel.pp=4", "parallel.schedule=zb"])["parallel.schedule"]
    'zb'
    """
    path, overrides = split_config_args(args)
    values: dict[str, object] = {"parallel.pp": 2, "parallel.microbatches": 4,
                                 "parallel.schedule": ParallelConfig.schedule, "parallel.virtual_stages": 1}
    items: list[tuple[str, object]] = []
    if path is not None:
        import yaml

        if not Path(path).is_file():
            raise ConfigError("config", f"file {path!r} does not exist")
        raw = yaml.safe_load(Path(path).read_text()) or {}
        section = raw.get("parallel", {}) if isinstance(raw, dict) else {}
        items += [(f"parallel.{k}", v) for k, v in (section or {}).items() if f"parallel.{k}" in KEYS]
    items += [parse_override(o) for o in overrides]
    for key, value in items:
        if key not in KEYS:
            raise ConfigError(key, f"phalanx schedule reads only {', '.join(KEYS)}")
        typ = KEYS[key]
        if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        values[key] = str(value) if typ is str else value
    return values


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    try:
        keys = schedule_keys(args.args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    name, pp = keys["parallel.schedule"], keys["parallel.pp"]
    m, v = keys["parallel.microbatches"], keys["parallel.virtual_stages"]
    try:
        sched = build_schedule(name, pp, m, v)
        timeline = simulate(sched, args.fwd_cost, args.bwd_cost, args.comm_cost)
    except ValueError as err:
        text = str(err)
        key = next((k for k in ("microbatches", "virtual_stages", "pp", "schedule") if k in text), "schedule")
        print(f"error: parallel.{key}: {text}", file=sys.stderr)
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
    if name not in SCHEDULES:
        print(f"plan only: the executor runs {', '.join(SCHEDULES)}, not {name}")
    if args.png:
        # Deferred, not a cycle: matplotlib takes ~1 s to import (measured 1.26 s vs 0.08 s for
        # the schedule tables) and only --png needs it.
        from phalanx.parallel.schedule_plot import draw_png
        draw_png(timeline, args.png)
        print(f"timeline written to {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
