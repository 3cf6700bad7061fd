"""Shared test helpers: a deterministic text corpus and tiny run configs."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import numpy as np

# Adam's epsilon for tests that compare weights after several Adam/AdamW steps across layouts,
# CPUs or implementations (Keras's default is 1e-7, phalanx's train.eps 1e-8). Adam divides a
# gradient by sqrt(v_hat) + eps, so a gradient error d moves a step by at most ~(1 + r) x lr x d / eps,
# r the largest |m_hat / sqrt(v_hat)| (Cauchy-Schwarz over the bias-corrected weights: 1.001 for
# the first few steps with betas 0.9 / 0.95-0.999). Summed in another order (replicas,
# micro-batches, shards, another CPU's kernels: AVX2, AVX512, AMX) a gradient differs by float32
# round-off, ~1e-7 absolute for these tiny models (a relative error only rescales Adam's step by
# the same fraction): with eps 1e-4 and lr 1e-3 that is < 2e-6 a step, so a few steps stay inside
# atol 1e-5 on any CPU. With a tiny eps an element whose gradient is itself near round-off (a sum
# that cancels, such as an attention key bias, which softmax ignores) turns that round-off into a
# step of up to lr in either direction: up to 2 x lr apart per step (an AMX machine moved one
# element of 2,048 by 1.2e-5 in three steps while every layout agreed with the others). Gradients
# of ordinary elements (~1e-3-1e-2) stay far above 1e-4, so the runs are still Adam's.
ADAM_EPS = 1e-4

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


def ghost_batches(inner, chunks: int, average_added_losses: bool = False, replicas: int = 1):
    """The oracle of phalanx's micro-batch semantics, as a Keras model for Keras's own ``fit``:
    each batch is cut into ``chunks`` equal pieces, in order, and ``inner`` runs on each
    (BatchNorm: its own statistics per piece; an MoE layer: its capacity and losses per piece).
    The pieces are ``replicas`` equal groups of consecutive pieces (data replicas): within a
    group the moving averages are updated once per piece in order; every group starts from the
    step's starting state, and the groups' floating-point state is averaged after the step, as
    MirroredStrategy does (a variable created with aggregation="only_first_replica" takes the
    first group's value; an MoE step total adds every group's additions). With ``average_added_losses`` the
    losses the layers add (one per piece) are averaged, as phalanx averages every micro-batch's
    whole loss."""
    import keras
    import tensorflow as tf

    from phalanx.layers.moe import is_step_total

    class Ghost(keras.Model):
        def __init__(self):
            super().__init__()
            self.inner, self.chunks = inner, chunks

        def call(self, x, training=False):
            pieces = keras.ops.split(x, self.chunks, axis=0)
            if not training or replicas == 1:
                return keras.ops.concatenate([self.inner(p, training=training) for p in pieces], axis=0)
            state = [v for v in self.inner.non_trainable_variables if "float" in str(v.dtype)]
            start = [tf.identity(v.value) for v in state]
            per, outputs, ends = chunks // replicas, [], []
            for r in range(replicas):
                for v, value in zip(state, start):
                    v.assign(value)
                outputs += [self.inner(p, training=training) for p in pieces[r * per:(r + 1) * per]]
                ends.append([tf.identity(v.value) for v in state])
            for k, v in enumerate(state):
                values = [end[k] for end in ends]
                if is_step_total(v):  # an MoE total: every replica's additions
                    v.assign(start[k] + tf.add_n([value - start[k] for value in values]))
                elif v.aggregation == "only_first_replica":  # Keras's own rule for such a variable
                    v.assign(values[0])
                else:
                    v.assign(tf.add_n(values) / float(replicas))
            return keras.ops.concatenate(outputs, axis=0)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            if not average_added_losses:
                return super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return self._compile_loss(y, y_pred, sample_weight) + keras.ops.sum(self.losses) / self.chunks

    return Ghost()


def numpy_peaks(fn, runs: int = 3) -> list[tuple[int, int]]:
    """``(peak, held)`` NumPy/Python bytes (tracemalloc) of each of ``runs`` measured calls of
    ``fn()``, after one unmeasured call (lazy imports, caches and first-call tracing are not the
    code path's memory), each measured after ``gc.collect()``: the peak during the call, and
    what is still allocated once it returned (its result kept, garbage collected).

    Two things move the peak from call to call, never the code path's own need:

    * a ``tf.Variable`` on a CPU device assigned a NumPy array may keep that array's buffer as
      its storage (TensorFlow wraps an aligned array without a copy; checked: only arrays whose
      data was 64-byte aligned were kept); malloc hands out an aligned buffer or not by the
      heap's history, so which variables keep theirs changes call by call and with the tests
      run before. Their bytes then count in the peak (and in ``held``) as if the call still
      needed them, though they are the variables' own state (one restore's peak 2.1 MB above
      its transient in one run; another's held bytes 0.23-2.3 MB);
    * tracemalloc counts every thread's and every finalizer's allocations in its window (once
      +256 KiB, one tp4 shard, on one of six identical calls).

    So a bound on what the code path needs takes the least transient (``peak - held``) of the
    calls: kept buffers count in both, or (when kept after the peak) lower it, never raise it.
    A check that the path holds at least something takes the peak, which kept buffers only
    raise (:func:`peak_numpy_bytes`)."""
    fn()
    out = []
    for _ in range(runs):
        gc.collect()
        tracemalloc.start()
        try:
            result = fn()
            peak = tracemalloc.get_traced_memory()[1]
            gc.collect()
            held = tracemalloc.get_traced_memory()[0]
            out.append((peak, held))
        finally:
            tracemalloc.stop()
            result = None
    return out


def peak_numpy_bytes(fn, runs: int = 3, transient: bool = False) -> int:
    """The least NumPy/Python peak (tracemalloc) of ``runs`` measured calls of ``fn()``
    (:func:`numpy_peaks`); with ``transient``, the least ``peak - held``: what the code path
    needed beyond what its result (e.g. variables that kept a NumPy buffer) still holds, the
    quantity to bound from above."""
    return min(peak - held if transient else peak for peak, held in numpy_peaks(fn, runs))


def assert_same_run(got, want, rtol: float, atol: float) -> None:
    """Two runs ``(losses, {weight name: array})`` agree: the losses to ``rtol``, every weight to
    ``rtol`` and ``atol`` (the caller says why those bounds)."""
    (losses, weights), (ref_losses, ref_weights) = got, want
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    assert set(weights) == set(ref_weights)
    for name, w in weights.items():
        np.testing.assert_allclose(w, ref_weights[name], rtol=rtol, atol=atol, err_msg=name)
