"""Per-op breakdown of one phalanx training step of the reference GPT (issue 14, item 1).

Builds the step the trainer runs (the engine ``phalanx train`` builds for one device,
:func:`phalanx.engines.factory.build_engine` with :class:`phalanx.engines.task.GPTTask`, AdamW) with the shapes of
``benchmarks/bench_gpt.py``, runs warm-up steps, times a few steps, then records one
step with the TensorFlow profiler and sums the executed ops' times by category:

* ``matmul`` (dense and attention, forward and backward), ``casts``, ``softmax``,
  ``layer_norm``, ``gelu``, ``bias`` (BiasAdd / BiasAddGrad outside fused kernels),
  ``loss head`` (the float32 softmax-cross-entropy and its casts; the head matmul is in
  ``matmul``), ``adamw`` (the update, its clip factor and skip logic),
  ``grad norm``, ``copies/layout`` (transposes, concat/split, reshapes, identities),
  ``residual/grad sums`` (AddV2 / AddN outside the above) and ``other``.

Ops are named by the ``tf.name_scope`` they run under (``gpt_ops`` and ``optim`` open one
per piece), and a backward op carries its forward op's scope. By default the profiled
step runs with ``inter_op_parallelism_threads=1`` so that no two ops overlap and the op
times add up to the step (with TensorFlow's default two inter-op threads on 2 cores, two
ops share the cores and each one's duration is inflated); the timed steps before it use
the same threading, and the file records both.

Beside the step's matmul time the file gives the same products run alone the way the step
runs them: every matmul of the step in one traced function, inputs changing every call
(``benchmarks/bench_gpt.py``'s ``StepMatmulsRunner``), timed with the same threading.

Usage::

    python benchmarks/profile_gpt.py --policy mixed_bfloat16            # writes benchmarks/results/profile_gpt.md
    python benchmarks/profile_gpt.py --policy float32 --append
    python benchmarks/profile_gpt.py --layers 2 --output -              # a smoke run
    python benchmarks/profile_gpt.py --attention plain,blocked          # both attention cores, one run

With several ``--attention`` cores (``model.attention``), one engine per core is built and
warmed up, their timed steps alternate (the order flips every step, so both see the same
load) and each is profiled; one section per core.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

RESULTS = Path(__file__).resolve().parent / "results" / "profile_gpt.md"

MATMUL_TYPES = ("MatMul", "BatchMatMul", "_MklMatMul", "_MklBatchMatMul", "_FusedMatMul", "_MklFusedMatMul",
                "_MklNativeFusedMatMul", "_MklNativeMatMul", "_MklFusedBatchMatMul", "Einsum")
COPY_TYPES = ("Transpose", "_MklTranspose", "ConcatV2", "Split", "SplitV", "Reshape", "Identity", "Slice",
              "StridedSlice", "StridedSliceGrad", "Pad", "Tile", "_Send", "_Recv", "Pack", "Unpack")


def categorize(name: str, op_type: str) -> str:
    """The breakdown category of one executed op (``name`` without the ``:type`` suffix)."""
    scope = name.split("gradient_tape/", 1)[-1]
    if op_type.startswith("XLA:"):  # a fused kernel, named by its XLA module
        kernel = op_type[4:]
        for key, cat in (("layer_norm", "layer_norm"), ("gelu", "gelu"), ("softmax", "softmax"), ("row_dot", "softmax"),
                         ("cross_entropy", "loss head"), ("adamw", "adamw")):
            if key in kernel:
                return cat
        return "other"
    if op_type.startswith(MATMUL_TYPES):
        return "matmul"
    if ("/softmax" in scope or "blocked_attention" in scope) and "CrossEntropy" not in op_type:
        return "softmax"
    # (the engine's skip-on-overflow selects sat at the top level before issue 14)
    if "adamw" in scope or op_type.startswith("ResourceApply") or (
            "/" not in name and op_type in ("SelectV2", "AssignVariableOp", "AssignSubVariableOp")):
        return "adamw"
    if "global_norm" in scope or op_type == "L2Loss":
        return "grad norm"
    if "/gelu" in scope or scope.startswith("gelu"):
        return "gelu"
    if "/softmax" in scope or "Softmax" in op_type and "CrossEntropy" not in op_type:
        return "softmax"
    if "layer_norm" in scope:
        return "layer_norm"
    if "cross_entropy" in scope or "CrossEntropy" in op_type:
        return "loss head"
    if op_type == "Cast":
        return "casts"
    if op_type in ("BiasAdd", "BiasAddGrad"):
        return "bias"
    if op_type.startswith(COPY_TYPES):
        return "copies/layout"
    if op_type in ("AddV2", "AddN", "Add", "UnsortedSegmentSum"):
        return "residual/grad sums"
    if op_type in ("ReadVariableOp", "VarHandleOp", "NoOp", "Const"):
        return "variable reads"
    return "other"


def read_trace(logdir: str) -> dict[tuple[str, str], float]:
    """(op name, op type) -> summed duration in ms over the compute threads of the newest trace.

    TensorFlow ops are events ``<name>:<type>``. An XLA-compiled function (the fused
    kernels of ``gpt_ops``) runs asynchronously: its time is the
    ``CpuExecutable::ExecuteAsyncOnStream`` events, attributed to the op that launched it
    (the last ``ExecutorState::ProcessAsync::Start`` on that thread) with type
    ``XLA:<function>`` (from the ``hlo_module`` of the fusions inside it).
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir}")
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as fh:
        space.ParseFromString(fh.read())
    out: dict[tuple[str, str], float] = collections.Counter()
    for plane in space.planes:
        stat_names = plane.stat_metadata

        def stats(event):
            values = {}
            for st in event.stats:
                key = stat_names[st.metadata_id].name
                values[key] = stat_names[st.ref_value].name if st.HasField("ref_value") else st.str_value
            return values

        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            launcher, executable = "xla", None  # [op name, start, end, module]
            for event in sorted(line.events, key=lambda e: e.offset_ps):
                full = plane.event_metadata[event.metadata_id].name
                if full == "ExecutorState::ProcessAsync::Start":
                    launcher = stats(event).get("name") or launcher
                    continue
                if full == "CpuExecutable::ExecuteAsyncOnStream":
                    if executable is not None:
                        out[(executable[0], "XLA:" + executable[3])] += (executable[2] - executable[1]) / 1e9
                    executable = [launcher, event.offset_ps, event.offset_ps + event.duration_ps, "?"]
                    continue
                if executable is not None and event.offset_ps <= executable[2]:  # inside the XLA kernel
                    module = stats(event).get("hlo_module") if executable[3] == "?" else None
                    if module:
                        match = re.search(r"inference_+(\w+?)_\d+_", module)
                        executable[3] = match.group(1) if match else module
                    continue
                name, sep, op_type = full.rpartition(":")
                if not sep or name.startswith("ExecutorState") or "::" in full:
                    continue
                out[(name, op_type)] += event.duration_ps / 1e9
            if executable is not None:
                out[(executable[0], "XLA:" + executable[3])] += (executable[2] - executable[1]) / 1e9
    return out


def generic(name: str) -> str:
    """Op name with layer indices and TensorFlow's uniquifying suffixes folded away."""
    name = re.sub(r"block_\d+", "block_N", name)
    return re.sub(r"_\d+(?=/|$)", "", name)


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="mixed_bfloat16", choices=("float32", "mixed_bfloat16", "mixed_float16"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps before the profiled one")
    p.add_argument("--inter-op", type=int, default=1,
                   help="inter_op_parallelism_threads (default 1: ops do not overlap; 0: TensorFlow's default)")
    p.add_argument("--top", type=int, default=25, help="individual ops listed")
    p.add_argument("--label", default="", help="a note for the heading (e.g. 'before' / 'after')")
    p.add_argument("--attention", default="plain",
                   help="comma-separated model.attention cores, timed alternately in one run (default: %(default)s)")
    p.add_argument("--output", default=str(RESULTS), help="markdown file, '-' for stdout only")
    p.add_argument("--append", action="store_true")
    args = p.parse_args(argv)

    import numpy as np
    import tensorflow as tf

    if args.inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    from phalanx.config import Config, validate
    from phalanx.plan.hardware import cpu_model
    from phalanx.engines.factory import build_engine
    from phalanx.engines.task import GPTTask

    cores = [c.strip() for c in args.attention.split(",") if c.strip()]
    model = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "ffn": args.ffn,
             "vocab": args.vocab, "seq_len": args.seq_len}
    engines = {}
    for core in cores:
        cfg = Config().replace(model={**model, "attention": core},
                               train={"global_batch": args.batch, "lr": 1e-4, "warmup": 0},
                               precision={"policy": args.policy}, parallel={"devices": "cpu:1"})
        validate(cfg)
        engines[core] = build_engine(cfg, GPTTask(cfg.model, args.policy))
    batch = tf.constant(np.random.default_rng(0).integers(0, args.vocab, [args.batch, args.seq_len + 1]), tf.int32)
    load_before = os.getloadavg()
    for engine in engines.values():
        for _ in range(args.warmup):
            float(engine.train_step(batch)["loss"])
    times = {core: [] for core in cores}
    for i in range(args.steps):
        for core in (cores if i % 2 == 0 else cores[::-1]):
            start = time.perf_counter()
            float(engines[core].train_step(batch)["loss"])
            times[core].append(time.perf_counter() - start)
    profiled, ops = {}, {}
    for core in cores:
        with tempfile.TemporaryDirectory() as logdir:
            tf.profiler.experimental.start(logdir)
            start = time.perf_counter()
            float(engines[core].train_step(batch)["loss"])
            profiled[core] = time.perf_counter() - start
            tf.profiler.experimental.stop()
            ops[core] = read_trace(logdir)
    # The same products alone, the way the step runs them (one traced function, inputs changing
    # every call; benchmarks/bench_gpt.py StepMatmulsRunner), with the same threading: the
    # matmul time the step could have, beside the step's own matmul time below.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpt import StepMatmulsRunner

    matmuls = StepMatmulsRunner(model, args.batch, args.policy)
    matmuls.run(max(args.warmup, 1))  # trace + warm up
    alone_s = sorted(matmuls.run(args.steps)[0])[args.steps // 2]
    alone_flops = matmuls.flops
    del matmuls
    load_after = os.getloadavg()
    flags = cpu_flags()
    interesting = [f for f in flags if f.startswith(("avx512", "amx", "avx_vnni", "avx2", "fma"))]
    from phalanx.models.gpt import num_params

    tokens = args.batch * args.seq_len
    text = ""
    for core in cores:
        total = sum(ops[core].values())
        by_cat: dict[str, float] = collections.Counter()
        by_op: dict[tuple[str, str], float] = collections.Counter()
        for (name, op_type), ms in ops[core].items():
            by_cat[categorize(name, op_type)] += ms
            by_op[(generic(name), op_type)] += ms
        median = sorted(times[core])[len(times[core]) // 2]
        label = ", ".join(x for x in (f"model.attention={core}" if len(cores) > 1 or core != "plain" else "",
                                      args.label) if x)
        lines = [
            f"## {args.policy}{' — ' + label if label else ''}",
            "",
            f"- date {datetime.datetime.now().isoformat(timespec='minutes')}; CPU {cpu_model()}, {os.cpu_count()} "
            f"cores; flags: {' '.join(interesting)}",
            f"- TF {tf.__version__}, TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default')}, "
            f"inter_op_parallelism_threads={args.inter_op or 'default'}, intra-op default",
            f"- model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, ffn {args.ffn}, vocab "
            f"{args.vocab}, seq_len {args.seq_len}, batch {args.batch}; {num_params(cfg.model) / 1e6:.1f}M "
            f"parameters, AdamW" + (f"; cores timed alternately in one run: {', '.join(cores)}" if len(cores) > 1
                                    else ""),
            f"- load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in load_before)}, after "
            f"{'/'.join(f'{x:.1f}' for x in load_after)}",
            f"- timed steps {' '.join(f'{t:.2f}' for t in times[core])} s (median {median:.2f} s, "
            f"{tokens / median:.0f} tokens/s); profiled step {profiled[core]:.2f} s, op time summed "
            f"{total / 1000:.2f} s",
            "",
            f"- matmuls: {by_cat.get('matmul', 0.0):.0f} ms in the profiled step; the same products alone in one "
            f"traced function (inputs changing every call, median of {args.steps} calls): {alone_s * 1e3:.0f} ms, "
            f"{alone_flops / alone_s / 1e9:.0f} GFLOP/s ({tokens / alone_s:.0f} tokens/s if the step were only them)",
            "",
            "| category | ms | share of op time |",
            "|---|---|---|",
        ]
        for cat, ms in sorted(by_cat.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {cat} | {ms:.0f} | {ms / total:.1%} |")
        lines += ["", f"Top {args.top} ops (all layers summed):", "", "| op | type | category | ms | share |",
                  "|---|---|---|---|---|"]
        for (name, op_type), ms in sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]:
            lines.append(f"| `{name}` | {op_type} | {categorize(name, op_type)} | {ms:.0f} | {ms / total:.1%} |")
        section = "\n".join(lines) + "\n"
        print(section)
        summary = {"policy": args.policy, "attention": core, "label": args.label,
                   "date": datetime.datetime.now().isoformat(), "step_s": times[core],
                   "profiled_step_s": profiled[core], "op_ms": total, "categories_ms": dict(by_cat),
                   "load_before": load_before, "load_after": load_after, "inter_op": args.inter_op,
                   "matmuls_alone_ms": alone_s * 1e3}
        print(json.dumps(summary))
        text += section + "\n"
    if args.output != "-":
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        head = out.read_text() if (args.append and out.is_file()) else (
            "# Per-op breakdown of the reference GPT step\n\nWritten by `benchmarks/profile_gpt.py` "
            "(see its docstring for the categories).\n\n")
        out.write_text(head + f"`python benchmarks/profile_gpt.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
                       f"\n\n" + text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
