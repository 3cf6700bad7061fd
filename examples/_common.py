"""What the recipes share: the layouts, the command line and the 8x8 digits.

Nothing here imports TensorFlow or Keras: a recipe parses its arguments, calls
``phalanx.init`` with the layout's overrides, and only then touches Keras. That order
is the point — TensorFlow fixes its devices the first time anything touches it, so
``phalanx.init`` must come first to split the CPU into the logical devices a layout needs.

A layout is nothing but phalanx config overrides (the same ``key=value`` strings the
``phalanx`` command takes):

=========  =====================================================================
``one``    (none: one device)
``dp2``    ``parallel.devices=cpu:2 parallel.dp=2``
``pp2``    ``parallel.devices=cpu:2 parallel.pp=2 parallel.microbatches=2``
``dp2pp2`` ``parallel.devices=cpu:4 parallel.dp=2 parallel.pp=2 parallel.microbatches=2``
=========  =====================================================================

Every layout splits a batch into at most dp x microbatches = 4 equal parts, so the
recipes use batch sizes and training-set sizes that are multiples of 4: no batch is
skipped on any layout.
"""

from __future__ import annotations

import argparse
import sys

LAYOUTS: dict[str, tuple[str, ...]] = {
    "one": (),
    "dp2": ("parallel.devices=cpu:2", "parallel.dp=2"),
    "pp2": ("parallel.devices=cpu:2", "parallel.pp=2", "parallel.microbatches=2"),
    "dp2pp2": ("parallel.devices=cpu:4", "parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2"),
}
#: Every layout's batches split into at most this many equal parts (dp x microbatches).
SPLIT = 4


def layout_help() -> str:
    return "; ".join(f"{name} = {' '.join(o) or '(one device, no overrides)'}" for name, o in LAYOUTS.items())


def parse_args(description: str, *, epochs: int, batch_size: int, extra=None) -> argparse.Namespace:
    """The recipes' common command line; ``extra(parser)`` adds a recipe's own flags."""
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"layouts: {layout_help()}")
    parser.add_argument("--layout", default="one", metavar="|".join(LAYOUTS),
                        help="where to train (default: one); see the layouts below")
    parser.add_argument("--epochs", type=int, default=epochs, help=f"passes over the training set (default: {epochs})")
    parser.add_argument("--batch-size", type=int, default=batch_size,
                        help=f"global batch, a multiple of {SPLIT} (default: {batch_size})")
    parser.add_argument("--run-dir", default=None,
                        help="phalanx run directory (checkpoints, metrics.jsonl); default: a new runs/fit-<time>. "
                             "Fitting into a run dir that already holds this model resumes it")
    parser.add_argument("--max-samples", type=int, default=None,
                        help="use at most this many training (and held-out) samples: a quick smoke run")
    parser.add_argument("--seed", type=int, default=0, help="weights' initial seed (default: 0)")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2,
                        help="Keras verbosity of fit (default: 2, one line per epoch)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra phalanx config override, e.g. --set precision.policy=mixed_bfloat16")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if args.layout not in LAYOUTS:
        parser.error(f"unknown layout {args.layout!r}; choose one of: {layout_help()}")
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.batch_size % SPLIT:
        parser.error(f"--batch-size {args.batch_size} is not a multiple of {SPLIT}: the layouts split every batch "
                     f"into up to {SPLIT} equal parts")
    if args.max_samples is not None and args.max_samples < args.batch_size:
        parser.error(f"--max-samples {args.max_samples} is smaller than one batch ({args.batch_size})")
    return args


def overrides(args: argparse.Namespace) -> list[str]:
    """The phalanx config overrides of ``args``: the layout's, the run dir, any ``--set``."""
    out = list(LAYOUTS[args.layout])
    if args.run_dir:
        out.append(f"run.dir={args.run_dir}")
    return out + list(args.set)


def trim(n: int, args: argparse.Namespace) -> int:
    """How many training samples to use: at most ``--max-samples``, a multiple of the
    batch size (so every batch is full, and splits evenly on every layout)."""
    if args.max_samples is not None:
        n = min(n, args.max_samples)
    return n - n % args.batch_size


def digits(args: argparse.Namespace, *, images: bool = False):
    """The 8x8 handwritten digits bundled with scikit-learn (1,797 images, no download).

    A fixed stratified split: 1,440 images to train on (a multiple of 4) and 357
    held out. Pixels scaled to [0, 1]. Returns ``(x_train, y_train), (x_test, y_test)``
    with x of shape ``[n, 64]`` (or ``[n, 8, 8]`` with ``images=True``) float32, y int32.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, train_size=1440, stratify=y, random_state=0)
    n = trim(len(x_train), args)
    x_train, y_train = x_train[:n], y_train[:n]
    if args.max_samples is not None:
        x_test, y_test = x_test[:args.max_samples], y_test[:args.max_samples]
    if images:
        x_train, x_test = x_train.reshape(-1, 8, 8), x_test.reshape(-1, 8, 8)
    return (x_train, y_train), (x_test, y_test)


def digits_cnn():
    """The recipes' digits convnet (Conv2D/BatchNorm/ReLU x3, MaxPooling x2, Flatten, Dropout
    0.3, Dense 10), compiled with Adam 2e-3 and accuracy. Keras is imported here, so call it
    after ``phalanx.init``; the benchmarks use the same model."""
    import keras

    def conv_block(x, filters):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        return keras.layers.Activation("relu")(x)

    inputs = keras.Input((8, 8, 1))
    x = conv_block(inputs, 32)
    x = conv_block(x, 32)
    x = keras.layers.MaxPooling2D(2)(x)          # 4x4
    x = conv_block(x, 64)
    x = keras.layers.MaxPooling2D(2)(x)          # 2x2
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.3)(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    model = keras.Model(inputs, outputs, name="digits_cnn")
    model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


def say(text: str) -> None:
    print(text, flush=True)


def fail(text: str) -> None:
    print(f"error: {text}", file=sys.stderr, flush=True)
    sys.exit(2)
