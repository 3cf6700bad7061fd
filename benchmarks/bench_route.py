"""Step time of the built-in GPT on the engine ``phalanx train`` routes it to (the Keras-model
engine, :class:`~phalanx.engines.keras_gpt.KerasGPTEngine`) beside the engine that trained the
same layout before (tf.distribute's one-device / mirrored engine for one device and dp, the
GPT mesh engine for tp and pp), in ONE process: both engines are built, then their steps
alternate, so a neighbour's load falls on both alike. Later-step medians are comparable; the
first step of the engine built second profits from the process's warm caches, so first-step
(build) times are measured in separate processes by ``benchmarks/bench_build.py``.

Run by hand, one layout per process (a d_model 256 GPT, 4 layers, seq 128, batch 8, float32):

    .venv/bin/python benchmarks/bench_route.py one|dp2|tp2|pp2

It compares the two engines, so it goes when the older engines are deleted (its figures stay in
benchmarks/results as the record of the switch).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as the phalanx command does
os.environ.setdefault("PHALANX_AUTO_PRECISION", "float32")

LAYOUTS = {"one": [], "dp2": ["parallel.devices=cpu:2", "parallel.dp=2"],
           "tp2": ["parallel.devices=cpu:2", "parallel.tp=2"],
           "pp2": ["parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=4"]}
MODEL = ["model.layers=4", "model.d_model=256", "model.heads=4", "model.ffn=1024", "model.vocab=2048",
         "model.seq_len=128", "train.global_batch=8", "precision.policy=float32"]


def main(argv=None) -> int:
    layout = (argv or sys.argv[1:] or ["one"])[0]
    import numpy as np
    import tensorflow as tf

    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 4)
    from phalanx.cluster.strategies import local_strategy
    from phalanx.config import load_config
    from phalanx.engines.factory import build_engine, make_mesh_engine
    from phalanx.engines.keras_gpt import KerasGPTEngine
    from phalanx.engines.strategy import StrategyEngine
    from phalanx.engines.task import GPTTask
    from phalanx.mesh import build_mesh

    cfg = load_config(None, MODEL + LAYOUTS[layout])
    task = lambda: GPTTask(cfg.model, "float32", cfg.train.seed)  # noqa: E731
    new = build_engine(cfg, task())
    assert isinstance(new, KerasGPTEngine), type(new)
    if layout in ("one", "dp2"):
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][: cfg.parallel.dp]
        old = StrategyEngine(cfg, task(), local_strategy(devices))
    else:
        old = make_mesh_engine(cfg, build_mesh(cfg), task())
    batch = np.random.default_rng(0).integers(0, 2048, (8, 129)).astype("int32")
    for engine in (new, old):  # build and warm up
        float(engine.train_step(batch)["loss"])
    times: dict[str, list[float]] = {"keras": [], "old": []}
    for _ in range(12):
        for name, engine in (("keras", new), ("old", old)):
            start = time.perf_counter()
            float(engine.train_step(batch)["loss"])
            times[name].append(time.perf_counter() - start)
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(json.dumps({"layout": layout, "old engine": type(old).__name__, "keras step s": round(med["keras"], 4),
                      "old step s": round(med["old"], 4), "keras / old": round(med["keras"] / med["old"], 3),
                      "load": [round(x, 1) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
