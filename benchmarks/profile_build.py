"""Where the first step of the built-in GPT's training goes: engine construction, Python
tracing of the step (``get_concrete_function``: the stage functions and the glue graph that
calls them), and the first run of the traced step (TensorFlow's graph optimisation,
placement and partitioning, XLA compilation of the fused kernels, the step itself).

Run by hand, one case of :mod:`bench_build` per process (minutes for the larger cases):

    .venv/bin/python benchmarks/profile_build.py 2          # 16 layers tp2 x pp2, 8 micro-batches
    .venv/bin/python benchmarks/profile_build.py 3 --cprofile /tmp/trace.prof

Prints one JSON line: seconds per phase, the glue graph's op count and its op types by count,
the functions in its library, and the peak resident memory.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("PHALANX_AUTO_PRECISION", "float32")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_build import CASES  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", type=int, help=f"a case of bench_build.py (0..{len(CASES) - 1})")
    parser.add_argument("--cprofile", help="write a cProfile of the trace to this file")
    args = parser.parse_args(argv)
    if not 0 <= args.case < len(CASES):
        parser.error(f"case: 0..{len(CASES) - 1}, not {args.case}")
    import numpy as np
    import tensorflow as tf

    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 8)
    from phalanx.config import Config
    from phalanx.engines.factory import make_engine
    from phalanx.engines.task import GPTTask
    from phalanx.mesh import Mesh

    layers, tp, pp, micro = CASES[args.case]
    cfg = Config().replace(model={"layers": layers, "d_model": 64, "heads": 4, "ffn": 256, "vocab": 256,
                                  "seq_len": 32},
                           precision={"policy": "float32"},
                           train={"global_batch": 2 * micro, "warmup": 1, "steps": 100},
                           parallel={"tp": tp, "pp": pp, "microbatches": micro, "schedule": "1f1b"})
    mesh = Mesh.from_devices([d.name for d in tf.config.list_logical_devices("CPU")][: tp * pp], 1, pp, tp)
    batch = np.random.default_rng(0).integers(0, 256, (2 * micro, 33)).astype(np.int32)
    out = {"case": list(CASES[args.case])}
    t = time.perf_counter()
    built = make_engine(GPTTask(cfg.model), mesh, cfg)
    out["construct_s"] = time.perf_counter() - t
    built._sync()
    inner = built.engine
    from phalanx.engines.keras_model import _as_tensors
    tensors = _as_tensors(built._xy(batch))
    t = time.perf_counter()
    if args.cprofile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    concrete = inner._train_fn.get_concrete_function(*tensors)
    if args.cprofile:
        prof.disable()
        prof.dump_stats(args.cprofile)
    out["trace_s"] = time.perf_counter() - t
    ops = concrete.graph.get_operations()
    out["glue_ops"] = len(ops)
    out["glue_op_types"] = collections.Counter(op.type for op in ops).most_common(12)
    out["library_functions"] = len(concrete.graph._functions)
    out["stage_functions_traced"] = getattr(inner.stage_calls, "traced", None)
    t = time.perf_counter()
    float(built.train_step(batch)["loss"])
    out["first_run_s"] = time.perf_counter() - t
    t = time.perf_counter()
    float(built.train_step(batch)["loss"])
    out["second_step_s"] = time.perf_counter() - t
    out["first_step_s"] = out["construct_s"] + out["trace_s"] + out["first_run_s"]
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
