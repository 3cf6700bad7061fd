"""Export benchmark: size, held-out quality and speed of every quantization, for the demo GPT
and the recipes' digits CNN. Run by hand (never in CI):

    make demo                                 # trains runs/demo (a few minutes)
    .venv/bin/python benchmarks/bench_export.py [--run runs/demo] [--out benchmarks/results/export.md]

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


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def smaller(sizes: dict, quantize: str) -> str:
    return "(float32)" if quantize == "none" else f"{sizes['ratio']:.2f}x smaller"


def gpt_rows(run_dir: str, eval_batches: int | None, workdir: Path) -> list[str]:
    from phalanx.export.api import export_run
    lines = ["| format | quantize | size | vs float32 file | held-out loss | perplexity | ppl change | "
             "top-1 agreement | tokens/s | tokens/s / float32 Keras |", "|---" * 10 + "|"]
    for fmt, quantize in ROWS:
        print(f"GPT {fmt} {quantize} ...", file=sys.stderr, flush=True)
        rep = export_run(run_dir, fmt, quantize, output=workdir / f"gpt-{fmt}-{quantize}", eval_batches=eval_batches,
                         quiet=True, print_table=False)
        q, s = rep["quality"], rep["size_bytes"]
        f, e = q["float"], q["exported"]
        lines.append(f"| {fmt} | {quantize} | {mib(s['exported'])} | {smaller(s, quantize)} | {e['loss']:.4f} | "
                     f"{e['perplexity']:.3f} | {100 * (e['perplexity'] / f['perplexity'] - 1):+.2f}% | "
                     f"{100 * q['agreement']['top1']:.1f}% | {e['tokens_per_s']:,.0f} | "
                     f"{e['tokens_per_s'] / f['tokens_per_s']:.2f}x |")
        float_line = (f"float32 Keras model (in process): held-out loss {f['loss']:.4f}, perplexity "
                      f"{f['perplexity']:.3f}, {q['batches']} batches")
    return lines + ["", float_line]


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

    def conv_block(h, filters):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        return keras.layers.Activation("relu")(h)

    inputs = keras.Input((8, 8, 1))
    h = conv_block(inputs, 32)
    h = conv_block(h, 32)
    h = keras.layers.MaxPooling2D(2)(h)
    h = conv_block(h, 64)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(0.3)(h)
    outputs = keras.layers.Dense(10, activation="softmax")(h)
    model = keras.Model(inputs, outputs, name="digits_cnn")
    model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="sparse_categorical_crossentropy")
    model.fit(x_train, y_train, batch_size=32, epochs=epochs, verbose=0)
    return model, (x_train, y_train), (x_test, y_test)


def cnn_rows(epochs: int, workdir: Path) -> list[str]:
    import phalanx
    model, (x_train, _), (x_test, y_test) = train_cnn(epochs)
    lines = ["| format | quantize | size | vs float32 file | held-out accuracy | accuracy change | "
             "top-1 agreement | images/s | images/s / float32 Keras |", "|---" * 9 + "|"]
    for fmt, quantize in ROWS:
        print(f"CNN {fmt} {quantize} ...", file=sys.stderr, flush=True)
        rep = phalanx.export(model, workdir / f"cnn-{fmt}-{quantize}", format=fmt, quantize=quantize,
                             calibration_data=x_train, eval_data=(x_test, y_test), batch_size=32, quiet=True,
                             print_table=False)
        q, s = rep["quality"], rep["size_bytes"]
        f, e = q["float"], q["exported"]
        lines.append(f"| {fmt} | {quantize} | {s['exported'] / 1024:.1f} KiB | {smaller(s, quantize)} | "
                     f"{e['accuracy']:.4f} | {100 * (e['accuracy'] - f['accuracy']):+.2f} pts | "
                     f"{100 * q['agreement']['top1']:.1f}% | {e['examples_per_s']:,.0f} | "
                     f"{e['examples_per_s'] / f['examples_per_s']:.2f}x |")
        float_line = f"float32 Keras model (in process): held-out accuracy {f['accuracy']:.4f} on {len(x_test)} images"
    return lines + ["", float_line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/demo", help="a trained run directory (default runs/demo)")
    parser.add_argument("--out", default="benchmarks/results/export.md")
    parser.add_argument("--eval-batches", type=int, default=None, help="default: the run's train.eval_batches")
    parser.add_argument("--cnn-epochs", type=int, default=15)
    parser.add_argument("--skip-gpt", action="store_true")
    parser.add_argument("--skip-cnn", action="store_true")
    ns = parser.parse_args()
    if not ns.skip_gpt:
        from phalanx import checkpoint
        if checkpoint.latest(Path(ns.run) / "checkpoints") is None:
            print(f"error: {ns.run} has no checkpoint; run `make demo` first (or pass --run)", file=sys.stderr)
            return 2
    t0 = time.time()
    doc = [f"# Export: size, quality and speed by quantization", "",
           f"Measured {time.strftime('%Y-%m-%d')} by `benchmarks/bench_export.py` on {cpu_name()}, "
           f"{os.cpu_count()} cores, TensorFlow/LiteRT CPU kernels (XNNPACK in LiteRT). Each row: the artifact in its "
           f"own runtime beside the float32 Keras model on the same held-out batches in the same run.", ""]
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        if not ns.skip_gpt:
            doc += [f"## Demo GPT (`{ns.run}`: 4 layers, d_model 256, vocab 256, seq_len 128; stdlib held-out split)",
                    ""] + gpt_rows(ns.run, ns.eval_batches, Path(tmp)) + [""]
        if not ns.skip_cnn:
            doc += [f"## Digits CNN (examples/digits_cnn.py's model, {ns.cnn_epochs} epochs of Keras fit; "
                    f"357 held-out 8x8 digits)", ""] + cnn_rows(ns.cnn_epochs, Path(tmp)) + [""]
    doc += [f"Total {time.time() - t0:.0f} s. float16/int8 are LiteRT converter modes (from the float model); "
            f"keras int8-dynamic / int4-weight are Keras's `model.quantize` (Dense/Embedding layers only: the "
            f"CNN's convolutions stay float there)."]
    text = "\n".join(doc) + "\n"
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
