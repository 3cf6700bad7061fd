"""Every layout the planner proposes, run: build time and the first two steps of each.

The model is bench_parallel.py's GPT (8 layers, d_model 256, 8 heads, ffn 1024, seq_len 128,
vocab 256, global batch 16, float32) on 8 logical CPUs. The layouts are what ``phalanx plan
--search --json`` proposes for it (``--top`` of them, default 5, the planner's own default;
``--hardware``, default ``this-cpu``). Each layout runs in a fresh process (nothing traced is
shared) on the engine ``phalanx train`` builds (:func:`phalanx.engines.factory.build_engine`,
the devices made by the layout's ``parallel.devices=cpu:8``), for two steps of a random batch.

A proposal becomes config keys as the planner counts them: its ``m`` micro-batches are
``parallel.microbatches`` with a pipeline (pp > 1) and ``train.grad_accum`` without one (the
planner's ``m`` covers both; ``parallel.microbatches`` needs pp > 1), its ``b`` follows from the
global batch.

Recorded per layout, in wall seconds: ``construct`` (the engine's constructor: the model built,
cut and placed), ``trace`` (Python tracing of the training step, ``get_concrete_function``),
``first run`` (the first call of the traced step: TensorFlow's graph optimisation, placement,
partitioning, the fused kernels' compilation and the step itself), ``first step`` (construct +
trace + first run: everything before the first loss) and ``second step``; the total is the
first two steps from nothing. The table starts with the CPU model, the date and the load
averages, and gives the load (1/5/15 min) after each layout: on a machine shared with other
work every figure is inflated by it, so compare layouts within one run. "stages": the stage
functions traced once and called per micro-batch (:mod:`phalanx.parallel.stage_calls`), and how
many of the model's stages are traced inline instead, once for each of the ``dp x grad_accum x
microbatches`` micro-batches of a step (the step's graph, and its build, grow with that count).

Run by hand (minutes; one layout process at a time):

    .venv/bin/python benchmarks/bench_plan_layouts.py                    # markdown to stdout
    .venv/bin/python benchmarks/bench_plan_layouts.py --output benchmarks/results/plan_layouts_<date>.md
    .venv/bin/python benchmarks/bench_plan_layouts.py --limit 120        # flag layouts over 120 s
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

MODEL = {"layers": 8, "d_model": 256, "heads": 8, "ffn": 1024, "seq_len": 128, "vocab": 256}
GLOBAL_BATCH, DEVICES = 16, 8


def plan_args(hardware: str, top: int) -> list[str]:
    """``phalanx plan`` arguments of the search."""
    return ([f"model.{k}={v}" for k, v in MODEL.items()] +
            [f"train.global_batch={GLOBAL_BATCH}", "precision.policy=float32", "--devices", str(DEVICES),
             "--hardware", hardware, "--search", "--top", str(top), "--json"])


def proposals(hardware: str, top: int) -> dict:
    """The planner's search document (``phalanx plan --search --json``), in a process of its own."""
    out = subprocess.run([sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())", "plan",
                          *plan_args(hardware, top)], capture_output=True, text=True)
    if out.returncode not in (0, 1):  # 1: nothing proposed
        raise SystemExit(f"phalanx plan failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout)


def overrides(layout: dict) -> list[str]:
    """The config keys of a proposed layout (a ``Layout.to_dict()``), as ``phalanx train`` takes them."""
    pp, m = layout["pp"], layout["microbatches"]
    keys = {"parallel.devices": f"cpu:{DEVICES}", "parallel.dp": layout["dp"], "parallel.tp": layout["tp"],
            "parallel.pp": pp, "parallel.zero": layout["zero"], "parallel.recompute": layout["recompute"],
            "parallel.sequence_parallel": str(bool(layout["sequence_parallel"])).lower(),
            "train.grad_accum": layout["grad_accum"] * (1 if pp > 1 else m)}
    if pp > 1:
        keys.update({"parallel.microbatches": m, "parallel.schedule": layout["schedule"]})
        if layout["schedule"] == "interleaved":
            keys["parallel.virtual_stages"] = layout["virtual_stages"]
    if layout.get("ep", 1) > 1:
        keys["parallel.ep"] = layout["ep"]
    return [f"{k}={v}" for k, v in keys.items()]


def describe(layout: dict) -> str:
    sched = layout["schedule"] if layout["pp"] > 1 else ""
    if layout["pp"] > 1 and layout["schedule"] == "interleaved":
        sched += f" v{layout['virtual_stages']}"
    parts = [f"dp{layout['dp']}", f"tp{layout['tp']}{'+sp' if layout['sequence_parallel'] else ''}",
             f"pp{layout['pp']}", f"m{layout['microbatches']}", f"b{layout['micro_batch']}", sched,
             f"zero{layout['zero']}", f"recompute {layout['recompute']}"]
    return " ".join(p for p in parts if p)


def run_one(keys: list[str], stage_calls: bool = True, later: int = 0) -> dict:
    """In this process: build the engine ``phalanx train`` builds for ``keys``, time two steps
    (and the median of ``later`` more, ``later_s``). ``stage_calls=False``: the same engine with
    every stage traced inline (``KerasModelEngine``'s ``stage_calls``), as a "before" figure."""
    import numpy as np

    from phalanx.config import load_config
    from phalanx.engines.factory import build_engine, build_mesh, refuse_before_build
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.keras_model import _as_tensors
    from phalanx.engines.task import GPTTask

    model_keys = [f"model.{k}={v}" for k, v in MODEL.items()]
    cfg = load_config(None, model_keys + [f"train.global_batch={GLOBAL_BATCH}", "train.warmup=1",
                                          "precision.policy=float32"] + keys)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, MODEL["vocab"], (GLOBAL_BATCH, MODEL["seq_len"] + 1)).astype(np.int32)
               for _ in range(2 + later)]
    start = time.perf_counter()
    task = GPTTask(cfg.model, cfg.precision.policy, cfg.train.seed)
    if stage_calls:
        engine = build_engine(cfg, task)
    else:
        refuse_before_build(cfg, task)
        engine = KerasGPTEngine(cfg, task, build_mesh(cfg), stage_calls=False)
    construct = time.perf_counter() - start
    t = time.perf_counter()
    # the step's trace alone (the call below then runs this concrete function)
    engine.engine._train_fn.get_concrete_function(*_as_tensors(engine._xy(batches[0])))
    trace = time.perf_counter() - t
    t = time.perf_counter()
    first_loss = float(engine.train_step(batches[0])["loss"])
    first_run = time.perf_counter() - t
    t = time.perf_counter()
    second_loss = float(engine.train_step(batches[1])["loss"])
    second = time.perf_counter() - t
    times = []
    for batch in batches[2:]:
        t = time.perf_counter()
        float(engine.train_step(batch)["loss"])
        times.append(time.perf_counter() - t)
    inner = engine.engine  # the Keras-model engine under the built-in GPT's
    calls = inner.stage_calls
    # micro-batches (times replicas) each stage is traced for inline rather than called
    inline = [s for s in range(len(inner.stages))
              if calls is None or (inner.mesh.tp > 1 and s == len(inner.stages) - 1 and inner.vocab_loss)
              or any(key[1] == s for key in calls.inline)]
    return {"engine": type(engine).__name__, "stage_functions": calls.traced if calls is not None else 0,
            "inline_stages": len(inline), "stages": len(inner.stages),
            "copies": inner.dp * inner.accum * inner.microbatches, "construct_s": construct, "trace_s": trace, "first_run_s": first_run,
            "first_s": construct + trace + first_run, "second_s": second,
            "later_s": sorted(times)[len(times) // 2] if times else None, "losses": [first_loss, second_loss]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=5, help="proposals the planner returns (phalanx plan's --top)")
    parser.add_argument("--hardware", default="this-cpu", help="phalanx plan's --hardware (default this-cpu)")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds the first two steps should stay under")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a layout's process is stopped")
    parser.add_argument("--only", default="", help="comma-separated proposal numbers to run (default: all)")
    parser.add_argument("--output", default="", help="also write the markdown to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # JSON list of config keys: run that layout here
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine_report import cpu_line, load, machine

    lines = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    doc = proposals(args.hardware, args.top)
    info = machine()
    say(f"# The planner's proposals, run ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n")
    say(f"GPT {MODEL['layers']} layers, d_model {MODEL['d_model']}, {MODEL['heads']} heads, ffn {MODEL['ffn']}, "
        f"seq_len {MODEL['seq_len']}, vocab {MODEL['vocab']}, global batch {GLOBAL_BATCH}, float32, on "
        f"{DEVICES} logical CPUs. Proposals: `phalanx plan {' '.join(plan_args(args.hardware, args.top))}` "
        f"({doc['considered']} layouts searched, {len(doc['candidates'])} proposed).\n")
    say(cpu_line(info) + "\n")
    say(f"| # | layout (planner) | config keys | stages | construct s | trace s | first run s | first step s | "
        f"second step s | total s | under {args.limit:.0f} s | load after |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|")
    over = 0
    only = {int(i) for i in args.only.split(",") if i.strip()}
    for i, cand in enumerate(doc["candidates"], 1):
        if only and i not in only:
            continue
        layout = cand["layout"]
        keys = overrides(layout)
        shown = " ".join(k for k in keys if not k.startswith("parallel.devices"))
        start = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(keys)],
                                 capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            over += 1
            say(f"| {i} | {describe(layout)} | `{shown}` | stopped after {args.timeout:.0f} s | | | | | | | no | "
                f"{load()} |")
            continue
        if out.returncode:
            over += 1
            tail = (out.stderr.strip().splitlines() or ["?"])[-1]
            say(f"| {i} | {describe(layout)} | `{shown}` | failed: {tail} | | | | | | | no | {load()} |")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        total = r["first_s"] + r["second_s"]
        ok = total < args.limit
        over += not ok
        traced = (f"{r['stage_functions']} called, {r['inline_stages']} of {r['stages']} inline x "
                  f"{r['copies']}")
        say(f"| {i} | {describe(layout)} | `{shown}` | {traced} | {r['construct_s']:.1f} | {r['trace_s']:.1f} | "
            f"{r['first_run_s']:.1f} | {r['first_s']:.1f} | {r['second_s']:.2f} | {total:.1f} | "
            f"{'yes' if ok else 'no'} | {load()} |")
        print(f"  ({describe(layout)}: process {time.perf_counter() - start:.0f} s, losses {r['losses']})",
              file=sys.stderr, flush=True)
    say()
    ran = len(only & set(range(1, len(doc["candidates"]) + 1))) if only else len(doc["candidates"])
    say(f"{ran - over} of {ran} proposals run finished two steps in under "
        f"{args.limit:.0f} s (construct + trace + first run + second step).")
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
