"""Export benchmark: size, held-out quality and speed of every quantization, for the demo GPT
and the recipes' digits CNN, and of the demo GPT trained with 50% unstructured and 2:4 pruning.
Run by hand (never in CI):

    make demo                                 # trains runs/demo (a few minutes)
    .venv/bin/python benchmarks/bench_export.py [--run runs/demo] [--out benchmarks/results/export.md]
                                              [--prune-runs DIR] [--skip-pruned]

The pruned GPTs are `configs/demo.yaml` (300 steps) with train.prune.target=0.5, start=50,
end=200, every=25 and pattern unstructured or 2:4, trained by `phalanx train` into a temporary
directory (or into --prune-runs DIR, reused when already trained: about 2-4 minutes each on 2
cores). Their rows use the same export and measurement as the dense rows; the dense float32
Keras model is the reference of their "ppl vs dense float32" column, and their own float32
model (pruned, stored densely) that of "top-1 agreement" and the speed ratio. The digits CNN
has no pruned rows: pruning is for the built-in GPT (phalanx.fit refuses train.prune.* keys).

For each (format, quantize) row the artifact is written by phalanx's export, loaded in its
own runtime (keras.saving.load_model / the ai-edge-litert interpreter) and scored on the
held-out data beside the float32 Keras model, on the same batches in the same process: the
demo GPT on `train.eval_batches` validation batches of the standard library corpus, the CNN
on scikit-learn's 357 held-out 8x8 digits. Speeds are tokens/s (GPT, batches of 16 x 128) and
images/s (CNN, batches of 32) with the machine's cores; they swing with load, the ratio to the
float32 Keras model measured in the same row is the comparable figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as the phalanx command does

ROWS = [("litert", "none"), ("litert", "float16"), ("litert", "int8-dynamic"), ("litert", "int8"),
        ("keras", "none"), ("keras", "int8-dynamic"), ("keras", "int4-weight")]
ROOT = Path(__file__).resolve().parents[1]
# (label, train.prune.pattern) of the pruned demo GPTs, all at train.prune.target=0.5
PRUNED = [("50% unstructured", "unstructured"), ("2:4", "2:4")]
PRUNE_KEYS = ["train.prune.target=0.5", "train.prune.start=50", "train.prune.end=200", "train.prune.every=25"]
PRUNED_ROWS = [("keras", "none"), ("litert", "none"), ("litert", "int8-dynamic")]
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags:")), [])
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FLAGS)


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def runtime_settings() -> str:
    import keras
    import tensorflow as tf
    try:
        from importlib.metadata import version
        litert = version("ai-edge-litert")
    except Exception:  # noqa: BLE001
        litert = "?"
    th = tf.config.threading
    return (f"TensorFlow {tf.__version__}, Keras {keras.__version__}, ai-edge-litert {litert}; "
            f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS')}, intra-op threads "
            f"{th.get_intra_op_parallelism_threads() or 'default'}, inter-op "
            f"{th.get_inter_op_parallelism_threads() or 'default'}")


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def smaller(sizes: dict, quantize: str) -> str:
    return "(float32)" if quantize == "none" else f"{sizes['ratio']:.2f}x smaller"


GPT_HEADER = ["| model | format | quantize | sparsity | size | gzip'd | vs float32 file | held-out loss | "
              "perplexity | ppl vs dense float32 | top-1 agreement | tokens/s | tokens/s / float32 Keras |",
              "|---" * 13 + "|"]


def gpt_rows(run_dir, label: str, rows, eval_batches: int | None, workdir: Path,
             dense_float: dict | None = None) -> tuple[list[str], dict]:
    """One table row per (format, quantize) export of ``run_dir``'s checkpoint; returns the rows and
    the run's own float32 Keras metrics. ``dense_float``: the dense model's (default: this run's)."""
    from phalanx.export.api import export_run
    lines, own_float, tag = [], None, label.replace(" ", "-").replace(":", "of").replace("%", "")
    for fmt, quantize in rows:
        print(f"GPT {label} {fmt} {quantize} ... (load {load()})", file=sys.stderr, flush=True)
        rep = export_run(run_dir, fmt, quantize, output=workdir / f"gpt-{tag}-{fmt}-{quantize}",
                         eval_batches=eval_batches, quiet=True, print_table=False)
        q, s = rep["quality"], rep["size_bytes"]
        f, e = q["float"], q["exported"]
        own_float = own_float or f
        ref = dense_float or own_float
        sparsity = rep.get("sparsity")
        gz = s.get("exported_compressed")
        lines.append(f"| {label} | {fmt} | {quantize} | {'0%' if sparsity is None else f'{100 * sparsity:.1f}%'} | "
                     f"{mib(s['exported'])} | {mib(gz) if gz else '-'} | {smaller(s, quantize)} | {e['loss']:.4f} | "
                     f"{e['perplexity']:.3f} | {100 * (e['perplexity'] / ref['perplexity'] - 1):+.2f}% | "
                     f"{100 * q['agreement']['top1']:.1f}% | {e['tokens_per_s']:,.0f} | "
                     f"{e['tokens_per_s'] / f['tokens_per_s']:.2f}x |")
        batches = q["batches"]
    float_line = (f"float32 Keras model of the {label} run (in process): held-out loss {own_float['loss']:.4f}, "
                  f"perplexity {own_float['perplexity']:.3f}, {batches} batches")
    return lines, {**own_float, "line": float_line}


def train_pruned(pattern: str, run_dir: Path) -> tuple[Path, str]:
    """``configs/demo.yaml`` with ``train.prune.*`` (PRUNE_KEYS, ``pattern``) trained by ``phalanx
    train`` into ``run_dir``; kept as is if it already holds the final step's checkpoint."""
    from phalanx import checkpoint
    latest = checkpoint.latest(run_dir / "checkpoints")
    if latest is not None and Path(latest).name.endswith("300"):
        return run_dir, f"reused {run_dir}"
    phalanx = Path(sys.executable).with_name("phalanx")
    cmd = [str(phalanx), "train", "--quiet", str(ROOT / "configs/demo.yaml"), f"run.dir={run_dir}",
           f"train.prune.pattern={pattern}", *PRUNE_KEYS]
    print(f"training pruned GPT ({pattern}) into {run_dir} ... (load {load()})", file=sys.stderr, flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    seconds = time.time() - t0
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [m for m in logged if "eval_loss" in m]
    tail = f", final eval loss {last[-1]['eval_loss']:.4f}" if last else ""
    return run_dir, f"trained in {seconds:.0f} s{tail}"


def train_cnn(epochs: int):
    """The recipes' digits CNN (examples/digits_cnn.py), trained with Keras's own fit."""
    import keras
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = data.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, train_size=1440, stratify=y, random_state=0)
    keras.utils.set_random_seed(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from _common import digits_cnn  # the recipe's model: one definition

    model = digits_cnn()
    model.fit(x_train, y_train, batch_size=32, epochs=epochs, verbose=0)
    return model, (x_train, y_train), (x_test, y_test)


def cnn_rows(epochs: int, workdir: Path) -> list[str]:
    import phalanx
    model, (x_train, _), (x_test, y_test) = train_cnn(epochs)
    lines = ["| model | format | quantize | size | gzip'd | vs float32 file | held-out accuracy | accuracy change | "
             "top-1 agreement | images/s | images/s / float32 Keras |", "|---" * 11 + "|"]
    for fmt, quantize in ROWS:
        print(f"CNN {fmt} {quantize} ...", file=sys.stderr, flush=True)
        rep = phalanx.export(model, workdir / f"cnn-{fmt}-{quantize}", format=fmt, quantize=quantize,
                             calibration_data=x_train, eval_data=(x_test, y_test), batch_size=32, quiet=True,
                             print_table=False)
        q, s = rep["quality"], rep["size_bytes"]
        f, e = q["float"], q["exported"]
        gz = s.get("exported_compressed")
        lines.append(f"| dense | {fmt} | {quantize} | {s['exported'] / 1024:.1f} KiB | "
                     f"{f'{gz / 1024:.1f} KiB' if gz else '-'} | {smaller(s, quantize)} | "
                     f"{e['accuracy']:.4f} | {100 * (e['accuracy'] - f['accuracy']):+.2f} pts | "
                     f"{100 * q['agreement']['top1']:.1f}% | {e['examples_per_s']:,.0f} | "
                     f"{e['examples_per_s'] / f['examples_per_s']:.2f}x |")
        float_line = f"float32 Keras model (in process): held-out accuracy {f['accuracy']:.4f} on {len(x_test)} images"
    for label, _ in PRUNED:
        lines.append(f"| {label} | n/a | n/a |" + " n/a |" * 8)
    return lines + ["", float_line, "",
                    "n/a: the CNN cannot be pruned: train.prune.* is pruning during phalanx's training of the "
                    "built-in GPT, and phalanx.fit (a user's Keras model) refuses train.prune.* keys."]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/demo", help="a trained run directory (default runs/demo)")
    parser.add_argument("--out", default="benchmarks/results/export.md")
    parser.add_argument("--eval-batches", type=int, default=None, help="default: the run's train.eval_batches")
    parser.add_argument("--cnn-epochs", type=int, default=15)
    parser.add_argument("--skip-gpt", action="store_true")
    parser.add_argument("--skip-cnn", action="store_true")
    parser.add_argument("--skip-pruned", action="store_true", help="no pruned GPT rows (no training)")
    parser.add_argument("--prune-runs", default=None, help="train the pruned GPTs into DIR/<pattern> and reuse "
                                                           "them when trained (default: a temporary directory)")
    ns = parser.parse_args()
    if not ns.skip_gpt:
        from phalanx import checkpoint
        if checkpoint.latest(Path(ns.run) / "checkpoints") is None:
            print(f"error: {ns.run} has no checkpoint; run `make demo` first (or pass --run)", file=sys.stderr)
            return 2
    t0, load0 = time.time(), load()
    settings = runtime_settings()
    doc = ["# Export: size, quality and speed by quantization and pruning", "",
           f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} by `benchmarks/bench_export.py` on {cpu_name()} "
           f"({cpu_flags()}), {os.cpu_count()} cores, TensorFlow/LiteRT CPU kernels (XNNPACK in LiteRT); "
           f"{settings}. Each row: the artifact in its own runtime beside the float32 Keras model on the same "
           f"held-out batches in the same run.", ""]
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        if not ns.skip_gpt:
            lines, dense = gpt_rows(ns.run, "dense", ROWS, ns.eval_batches, Path(tmp))
            float_lines, trained = [dense["line"]], []
            if not ns.skip_pruned:
                base = Path(ns.prune_runs) if ns.prune_runs else Path(tmp) / "runs"
                for label, pattern in PRUNED:
                    run_dir, how = train_pruned(pattern, base / pattern.replace(":", "of"))
                    trained.append(f"{label}: {how}")
                    more, own = gpt_rows(run_dir, label, PRUNED_ROWS, ns.eval_batches, Path(tmp), dense)
                    lines += more
                    float_lines.append(own["line"])
            doc += [f"## Demo GPT (`{ns.run}`: 4 layers, d_model 256, vocab 256, seq_len 128; stdlib held-out split)",
                    ""] + GPT_HEADER + lines + [""] + [x + "  " for x in float_lines[:-1]] + float_lines[-1:] + [""]
            if trained:
                doc += [f"Pruned rows: `configs/demo.yaml` (300 steps, same seed and data as the dense run) with "
                        f"{', '.join(PRUNE_KEYS)} and train.prune.pattern unstructured / 2:4 ({'; '.join(trained)}). "
                        f"Sparsity is the share of exact zeros in the pruned matmul kernels (embeddings, biases, "
                        f"LayerNorms are dense). Every format stores the zeros densely: a pruned artifact has the "
                        f"dense one's size on disk, memory and speed, and only its gzip'd size shrinks. \"ppl vs "
                        f"dense float32\" compares with the dense float32 Keras model; top-1 agreement and the "
                        f"speed ratio compare with the row's own run's float32 Keras model. The runs' rows were measured one "
                        f"after the other under different load; a pruned run's float32 Keras model does exactly the "
                        f"dense model's matmuls, so compare speeds by the ratio column, not across runs' tokens/s.", ""]
        if not ns.skip_cnn:
            doc += [f"## Digits CNN (examples/digits_cnn.py's model, {ns.cnn_epochs} epochs of Keras fit; "
                    f"357 held-out 8x8 digits)", ""] + cnn_rows(ns.cnn_epochs, Path(tmp)) + [""]
    doc += [f"Total {time.time() - t0:.0f} s; load average (1/5/15 min) {load0} at the start, {load()} at the end "
            f"(2 shared cores: speeds swing with load, compare the ratios). float16/int8 are LiteRT converter "
            f"modes (from the float model); keras int8-dynamic / int4-weight are Keras's `model.quantize` "
            f"(Dense/Embedding layers only: the CNN's convolutions stay float there). gzip'd: the artifact "
            f"compressed with zlib level 6 (each file of a directory on its own)."]
    text = "\n".join(doc) + "\n"
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
