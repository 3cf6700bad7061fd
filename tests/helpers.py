"""Shared test helpers: a deterministic text corpus and tiny run configs."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import numpy as np

TINY_MODEL = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=64", "model.seq_len=32"]


def write_corpus(directory: Path, files: int = 4, lines: int = 400, seed: int = 0) -> str:
    """Deterministic Python-like text files; returns a glob for ``data.source``."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "value", "items", "count", "total", "index", "name"]
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        out = []
        for i in range(lines):
            a, b = rng.choice(words, 2)
            out.append(f"def {a}_{i}({b}):\n    return {b} * {int(rng.integers(1, 99))} + len({a!r})\n")
        (directory / f"part{f}.py").write_text("".join(out))
    return str(directory / "*.py")


def tiny_overrides(tmp_path: Path, corpus: str, run: str = "run", **extra) -> list[str]:
    items = TINY_MODEL + [
        f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / run}",
        "train.global_batch=8", "train.warmup=2", "train.log_every=1", "train.eval_every=0",
        "data.val_fraction=0.1",
    ]
    return items + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]


def ghost_batches(inner, chunks: int, average_added_losses: bool = False):
    """The oracle of phalanx's micro-batch semantics, as a Keras model for Keras's own ``fit``:
    each batch is cut into ``chunks`` equal pieces, in order, and ``inner`` runs on each
    (BatchNorm: its own statistics per piece, moving averages updated once per piece in
    order; an MoE layer: its capacity and losses per piece). With
    ``average_added_losses`` the losses the layers add (one per piece) are averaged, as
    phalanx averages every micro-batch's whole loss."""
    import keras

    class Ghost(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner, self.chunks = inner, chunks

        def call(self, x, training=False):
            pieces = [self.inner(p, training=training) for p in keras.ops.split(x, self.chunks, axis=0)]
            return keras.ops.concatenate(pieces, axis=0)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            if not average_added_losses:
                return super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return self._compile_loss(y, y_pred, sample_weight) + keras.ops.sum(self.losses) / self.chunks

    return Ghost()


def peak_numpy_bytes(fn, runs: int = 3, transient: bool = False) -> int:
    """The NumPy/Python peak (tracemalloc) of ``fn()``: run once unmeasured first (lazy imports,
    caches and first-call tracing are not the code path's memory), then the least of ``runs``
    measured calls, each after ``gc.collect()``. tracemalloc counts every thread's and every
    finalizer's allocations in its window; a one-off extra (seen once: +256 KiB, one tp4 shard,
    on one of six identical calls in one process) is noise, the code path's own peak repeats.

    ``transient``: the peak minus what ``fn()``'s result still holds when it returns. A
    ``tf.Variable`` made on a CPU device from a NumPy array may keep that array's buffer as its
    own (TensorFlow aliases buffers that happen to be aligned, e.g. large page-aligned ones), so
    the bytes of variables an engine made count in the peak or not, call by call; what the code
    path needs beyond what it made is the same either way."""
    fn()
    peaks = []
    for _ in range(runs):
        gc.collect()
        tracemalloc.start()
        try:
            result = fn()
            held, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - held if transient else peak)
        finally:
            tracemalloc.stop()
            result = None
    return min(peaks)
