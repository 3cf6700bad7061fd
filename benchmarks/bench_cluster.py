"""Data parallelism in one process vs across processes: tokens/s and the ratio.

Same model, same global batch, same steps, on this machine:

* ``local``: one process, ``parallel.dp=2 parallel.devices=cpu:2`` (MirroredStrategy
  over 2 logical CPUs of one process);
* ``multi_worker``: ``phalanx launch --workers 2 -- phalanx train
  parallel.strategy=multi_worker``: 2 processes with 1 device each, gradients
  all-reduced over gRPC on loopback (MultiWorkerMirroredStrategy, ring);
* with ``--all`` also ``parameter_server`` (chief + 2 workers + 1 ps; asynchronous
  steps, variables on the ps task).

The variants run in alternating rounds (the order flips every round) so that they see
the same machine load; each run's rate is the median ``tokens_per_s`` of its logged
windows after the first (compilation and collective set-up); the table gives the
median over rounds and the ratio to ``local``. On a machine whose cores are shared
(ARCHITECTURE.md: logical CPUs share the thread pools) the ratio, not the absolute
rate, is what to read.

Usage::

    .venv/bin/python benchmarks/bench_cluster.py                 # 2 rounds, markdown to stdout
    .venv/bin/python benchmarks/bench_cluster.py --rounds 3 --all
    .venv/bin/python benchmarks/bench_cluster.py --quick         # a smaller model, fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine_report import load, machine  # noqa: E402

PHALANX = [sys.executable, "-m", "phalanx.cli"]


def model_overrides(quick: bool) -> list[str]:
    if quick:
        return ["model.layers=2", "model.d_model=128", "model.heads=4", "model.ffn=512", "model.seq_len=64",
                "train.global_batch=16", "train.steps=30", "train.log_every=5"]
    return ["model.layers=4", "model.d_model=256", "model.heads=4", "model.ffn=1024", "model.seq_len=128",
            "train.global_batch=16", "train.steps=40", "train.log_every=5"]


def variants(include_ps: bool) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (launcher prefix, phalanx train overrides)."""
    launch = [*PHALANX, "launch", "--timeout", "1500", "--grace", "5"]
    out = {
        "local (1 process, dp=2 on cpu:2)": ([], ["parallel.dp=2", "parallel.devices=cpu:2"]),
        "multi_worker (2 processes x 1 device)": ([*launch, "--workers", "2", "--"],
                                                  ["parallel.strategy=multi_worker"]),
    }
    if include_ps:
        out["parameter_server (chief + 2 workers + 1 ps)"] = ([*launch, "--workers", "2", "--ps", "1", "--"],
                                                             ["parallel.strategy=parameter_server"])
    return out


def run_once(prefix: list[str], extra: list[str], common: list[str], work: Path, tag: str) -> float:
    run_dir = work / f"{tag}-{time.monotonic_ns()}"
    cmd = [*prefix, *PHALANX, "train", *common, *extra, f"run.dir={run_dir}", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{tag} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows[1:]]  # the first window holds compilation and set-up
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    parser.add_argument("--all", action="store_true", help="also parameter_server")
    ns = parser.parse_args(argv)
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load()
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-cluster-") as tmp:
        work = Path(tmp)
        common = [*model_overrides(ns.quick), "train.eval_every=0", "checkpoint.every=0", "data.max_bytes=2000000",
                  f"data.cache_dir={work / 'cache'}", "precision.policy=float32"]
        kinds = variants(ns.all)
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(ns.rounds):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for name in order:
                prefix, extra = kinds[name]
                rate = run_once(prefix, extra, common, work, f"r{r}")
                rates[name].append(rate)
                print(f"round {r + 1}: {name}: {rate:,.0f} tokens/s", file=sys.stderr, flush=True)
    base = statistics.median(next(iter(rates.values())))
    info = machine()
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1 (the phalanx command's default)")
    print(f"bench_cluster.py, {started}; machine: {info['model']}, {info['cores']} cores ({info['flags']}); "
          f"TensorFlow {info['tf']}, Keras {info['keras']}; every process: TF_ENABLE_ONEDNN_OPTS={onednn}, "
          f"TensorFlow's thread pools; load average (1/5/15 min) {load_before} at the start, {load()} at the end\n")
    print(f"model: {' '.join(model_overrides(ns.quick))}; float32; {ns.rounds} rounds\n")
    print("| run | tokens/s (median) | ratio to local | per round |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"| {name} | {med:,.0f} | {med / base:.2f} | {', '.join(f'{v:,.0f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
