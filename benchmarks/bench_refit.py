"""A model fitted twice on the same layout, then evaluated and predicted twice: each call's wall time.

The model is a keras-hub ``GPT2CausalLM`` (``preprocessor=None``) with a small random GPT-2
config: ``--layers`` layers (default 8), hidden 64, 4 heads, intermediate 256, vocabulary 256,
sequence 32, dropout 0, Adam 1e-3, ``SparseCategoricalCrossentropy(from_logits=True)``; 48 random
token sequences, batch 16 (3 steps an epoch), one epoch per call. Each layout runs in a fresh
process on 8 logical CPUs; both calls fit the same model object, each into its own run directory.
The first call builds the engine (the model cut, split and placed) and traces its step; the second
reuses them when nothing they were built from changed (docs/keras.md, "Fitting again"): the
table gives both calls' wall seconds, the engines built and the traces of the training step.
Then ``phalanx.evaluate`` and ``phalanx.predict`` run twice each on the fitted model (its 48 rows in batches of 32, the
same layout): the first of each traces its step on the fit's engine, the second runs it (a second
table: seconds, engines built in all after each call, the step's traces).
The table starts with the CPU model, the date and the load averages (a machine shared with other
work inflates every figure).

Run by hand (minutes):

    .venv/bin/python benchmarks/bench_refit.py
    .venv/bin/python benchmarks/bench_refit.py --layers 32 --layouts "tp2 x pp4 m16"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as the phalanx command does (ARCHITECTURE.md)

LAYOUTS = {  # name -> overrides
    "pp2 m4": ["parallel.pp=2", "parallel.microbatches=4"],
    "tp2 x pp2 m4": ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=4"],
    "tp2 x pp4 m16": ["parallel.tp=2", "parallel.pp=4", "parallel.microbatches=16"],
}
ROWS, BATCH, SEQ, VOCAB = 48, 16, 32, 256


def run_one(name: str, layers: int) -> dict:
    """In this process: two one-epoch fits of one model on layout ``name``."""
    import phalanx

    cfg = phalanx.init("parallel.devices=cpu:8", *LAYOUTS[name])
    import keras
    import keras_hub
    import numpy as np

    from phalanx.train import keras_api

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=layers, num_heads=4, hidden_dim=64,
                                             intermediate_dim=256, max_sequence_length=SEQ, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = np.random.default_rng(0).integers(0, VOCAB, (ROWS, SEQ + 1)).astype("int32")
    x, y = {"token_ids": ids[:, :-1], "padding_mask": np.ones((ROWS, SEQ), "bool")}, ids[:, 1:]
    builds = [0]
    real = keras_api.KerasModelEngine

    def counted(*args, **kwargs):
        builds[0] += 1
        return real(*args, **kwargs)

    keras_api.KerasModelEngine = counted
    out = {"fit_s": [], "builds": [], "traces": [], "loss": [], "evaluate_s": [], "predict_s": [],
           "evaluate_builds": [], "predict_builds": [], "evaluate_traces": [], "predict_traces": []}
    for call in range(2):
        start = time.perf_counter()
        history = phalanx.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, config=cfg,
                              overrides=[f"run.dir={tempfile.mkdtemp()}"])
        out["fit_s"].append(time.perf_counter() - start)
        out["builds"].append(builds[0])
        out["traces"].append(model.__dict__[keras_api._FIT_ENGINE][1]._train_fn.experimental_get_tracing_count())
        out["loss"].append(history.history["loss"][-1])
    for name, call in (("evaluate", lambda: phalanx.evaluate(model, x, y, batch_size=32, verbose=0, config=cfg)),
                       ("predict", lambda: phalanx.predict(model, x, batch_size=32, verbose=0, config=cfg))):
        for _ in range(2):
            start = time.perf_counter()
            call()
            out[f"{name}_s"].append(time.perf_counter() - start)
            out[f"{name}_builds"].append(builds[0])
            traced = getattr(keras_api, "kept_engines", lambda m: {})(model)  # (None: a phalanx without the hook)
            fn = f"_{'test' if name == 'evaluate' else 'predict'}_fn"
            out[f"{name}_traces"].append(sum(getattr(e, fn).experimental_get_tracing_count() for e in traced.values())
                                         if traced else None)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="GPT-2 layers (default 8)")
    parser.add_argument("--layouts", default="pp2 m4,tp2 x pp2 m4",
                        help=f"comma-separated layouts, of {sorted(LAYOUTS)} (default: the first two)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a layout name: run it in this process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.layers)))
        return 0
    names = [n.strip() for n in args.layouts.split(",")]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        parser.error(f"--layouts: unknown {bad}; choose from {sorted(LAYOUTS)}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from machine_report import cpu_line, load, machine

    info = machine()
    print(f"# phalanx.fit twice on one model ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n")
    print(f"keras-hub GPT-2, {args.layers} layers, hidden 64, 4 heads, intermediate 256, vocab {VOCAB}, seq {SEQ}; "
          f"{ROWS} rows, batch {BATCH}, one epoch ({ROWS // BATCH} steps) per call, 8 logical CPUs.\n")
    print(cpu_line(info) + "\n")
    print("| layout | first fit s | second fit s | engines built (after 1st, 2nd) | step traces | losses | load after |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for name in names:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name, "--layers", str(args.layers)],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"| {name} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1]} | | | | | {load()} |")
            continue
        r = results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['fit_s'][0]:.1f} | {r['fit_s'][1]:.1f} | {r['builds'][0]}, {r['builds'][1]} | "
              f"{r['traces'][0]}, {r['traces'][1]} | {r['loss'][0]:.4f}, {r['loss'][1]:.4f} | {load()} |", flush=True)
    print("\nThen, on the fitted model (48 rows, batch 32):\n")
    print("| layout | call | first s | second s | engines built in all (after 1st, 2nd) | step traces |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        for call in ("evaluate", "predict"):
            s, b, t = r[f"{call}_s"], r[f"{call}_builds"], r[f"{call}_traces"]
            print(f"| {name} | {call} | {s[0]:.1f} | {s[1]:.1f} | {b[0]}, {b[1]} | "
                  f"{'n/a' if t[0] is None else f'{t[0]}, {t[1]}'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
