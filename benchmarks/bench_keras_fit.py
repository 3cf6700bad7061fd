"""Step-time overhead of ``phalanx.fit`` over Keras's own ``model.fit`` (issue 9, "Done when").

The model is the digits convnet of ``examples/digits_cnn.py`` (Conv2D + BatchNorm +
ReLU blocks, MaxPooling, Flatten, Dropout, Dense softmax; Adam 2e-3, sparse categorical
cross-entropy, accuracy) on the 8x8 digits bundled with scikit-learn (1,440 training
images, batch 32: 45 steps an epoch). A small model on purpose: its step is a few
milliseconds, so any per-step Python overhead of the loop shows.

Contenders, all in this one process (so they share the oneDNN setting, the thread pools
and the machine's load):

* ``keras``: ``model.fit(x, y, batch_size=32, epochs=E, verbose=0)`` on one device;
* ``phalanx``: ``phalanx.fit(model, x, y, batch_size=32, epochs=E, config=..., verbose=0)``
  on one device (the default layout), same model, optimizer, batch size and data;
* extra rows, ``phalanx dp2`` (``parallel.dp=2``) and ``phalanx pp2`` (``parallel.pp=2
  parallel.microbatches=2``) on the process's 2 logical CPUs. Logical CPUs share the same
  2 cores, so these rows measure the overhead of the layout, not a speed-up.

Every contender has its own model (same seed, same initial weights). Each round calls
every contender's fit once with ``--epochs`` epochs, in an order that rotates every
round; the first epoch of every call (tracing, building) is discarded. Time per step =
(``on_epoch_end`` - ``on_epoch_begin``) / steps, from a callback both fits run; it holds
the whole loop (batch slicing, the step, metric reads, callbacks) but not phalanx's
end-of-epoch checkpoint, which is reported separately as the whole-call time per epoch.
Reported: the median over all measured epochs, and the ratio to Keras's median.

Usage::

    python benchmarks/bench_keras_fit.py                   # rewrites benchmarks/results/keras_fit.md
                                                           # (keep its hand-written notes section)
    python benchmarks/bench_keras_fit.py --rounds 1 --epochs 2 --output -   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = Path(__file__).resolve().parent / "results" / "keras_fit.md"
BATCH = 32
TRAIN = 1440


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per fit call; the first is discarded (default: 4)")
    parser.add_argument("--onednn", choices=("on", "off", "default"), default="on",
                        help="TF_ENABLE_ONEDNN_OPTS for every contender (default: on, as the phalanx command sets it)")
    parser.add_argument("--no-parallel", action="store_true", help="skip the dp2 / pp2 rows (one logical device)")
    parser.add_argument("--output", default=str(RESULTS), help=f"markdown file to write, or - (default: {RESULTS})")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be >= 2: the first epoch of every call is discarded")
    return args


ARGS = parse_args()
if ARGS.onednn != "default":
    # Must be set before TensorFlow is imported; both contenders live in this process.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if ARGS.onednn == "on" else "0"

import phalanx  # noqa: E402

# Devices first: 2 logical CPUs for the dp2 / pp2 rows (one-device runs use the first).
INIT = () if ARGS.no_parallel else ("parallel.devices=cpu:2", "parallel.dp=2")
phalanx.init(*INIT)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from machine_report import load, machine  # noqa: E402


def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = data.target.astype(np.int32)
    x_train, _, y_train, _ = train_test_split(x, y, train_size=TRAIN, stratify=y, random_state=0)
    return x_train, y_train


def cnn(seed: int = 0) -> keras.Model:
    """The model of examples/digits_cnn.py (one definition, in examples/_common.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from _common import digits_cnn

    keras.utils.set_random_seed(seed)
    return digits_cnn()


class EpochTimer(keras.callbacks.Callback):
    """Wall time and step count of every epoch, and the gaps between epochs."""

    def __init__(self):
        super().__init__()
        self.epochs: list[tuple[float, int]] = []
        self.gaps: list[float] = []  # on_epoch_end -> next on_epoch_begin (or on_train_end)
        self.begin = self.end = self._last_end = None

    def on_train_begin(self, logs=None):
        self.begin = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._steps = time.perf_counter(), 0
        if self._last_end is not None:
            self.gaps.append(self._start - self._last_end)

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self._last_end = time.perf_counter()
        self.epochs.append((self._last_end - self._start, self._steps))

    def on_train_end(self, logs=None):
        self.end = time.perf_counter()
        self.gaps.append(self.end - self._last_end)


class Contender:
    def __init__(self, name: str, layout: tuple[str, ...], x, y, workdir: Path):
        self.name, self.layout, self.x, self.y, self.workdir = name, layout, x, y, workdir
        self.model = cnn()
        self.step_times: list[float] = []   # seconds per step, one per measured epoch
        self.round_medians: list[float] = []  # median seconds per step of each fit call (round)
        self.call_times: list[float] = []   # whole fit call / epochs (first call-epoch included), per call
        self.setup: list[float] = []        # fit called -> on_train_begin, per call
        self.first: list[float] = []        # the first epoch's extra time over a measured epoch, per call
        self.gaps: list[float] = []         # between epochs (phalanx: the checkpoint), per epoch
        self.after: list[float] = []        # on_train_end -> fit returns, per call
        self.calls = 0

    def fit(self, epochs: int) -> None:
        timer = EpochTimer()
        start = time.perf_counter()
        if self.name == "keras":
            self.model.fit(self.x, self.y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=[timer])
        else:
            self.calls += 1
            run_dir = self.workdir / f"{self.name.replace(' ', '-')}-{self.calls}"
            phalanx.fit(self.model, self.x, self.y, batch_size=BATCH, epochs=epochs, callbacks=[timer], verbose=0,
                        overrides=(*self.layout, f"run.dir={run_dir}"))
        done = time.perf_counter()
        self.call_times.append((done - start) / epochs)
        assert len(timer.epochs) == epochs, (self.name, timer.epochs)
        for seconds, steps in timer.epochs[1:]:  # the first epoch traces and builds: discarded
            self.step_times.append(seconds / steps)
        self.round_medians.append(statistics.median(seconds / steps for seconds, steps in timer.epochs[1:]))
        self.setup.append(timer.begin - start)
        self.first.append(timer.epochs[0][0] - statistics.median(s for s, _ in timer.epochs[1:]))
        self.gaps.extend(timer.gaps)
        self.after.append(done - timer.end)

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)




def main() -> None:
    x, y = digits()
    info = machine()
    load_before = load()
    with tempfile.TemporaryDirectory(prefix="bench_keras_fit_") as tmp:
        workdir = Path(tmp)
        contenders = [Contender("keras", (), x, y, workdir), Contender("phalanx", (), x, y, workdir)]
        if not ARGS.no_parallel:
            contenders += [Contender("phalanx dp2", ("parallel.devices=cpu:2", "parallel.dp=2"), x, y, workdir),
                           Contender("phalanx pp2", ("parallel.devices=cpu:2", "parallel.pp=2",
                                                     "parallel.microbatches=2"), x, y, workdir)]
        started = time.perf_counter()
        for r in range(ARGS.rounds):
            order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
            for c in order:
                c.fit(ARGS.epochs)
            print(f"round {r + 1}/{ARGS.rounds}: " + ", ".join(f"{c.name} {1e3 * statistics.median(c.step_times[-(ARGS.epochs - 1):]):.2f} ms"
                                                             for c in contenders), file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - started
    load_after = load()
    report(contenders, info, load_before, load_after, elapsed)


def report(contenders, info, load_before, load_after, elapsed) -> None:
    keras_c = contenders[0]
    today = datetime.date.today().isoformat()
    measured = ARGS.rounds * (ARGS.epochs - 1)
    lines = [
        "# phalanx.fit vs Keras model.fit: step-time overhead",
        "",
        f"Written by `python benchmarks/bench_keras_fit.py --rounds {ARGS.rounds} --epochs {ARGS.epochs} "
        f"--onednn {ARGS.onednn}{' --no-parallel' if ARGS.no_parallel else ''}` on {today}.",
        "",
        f"Model: the digits CNN of `examples/digits_cnn.py` (Conv2D/BatchNorm/ReLU x3, MaxPooling x2, Flatten, "
        f"Dropout 0.3, Dense 10; {keras_c.model.count_params():,} parameters), Adam 2e-3, sparse categorical "
        f"cross-entropy + accuracy, {TRAIN} images of 8x8, batch {BATCH} ({TRAIN // BATCH} steps an epoch). "
        f"{ARGS.rounds} rounds (order rotating) x {ARGS.epochs} epochs per fit call, the first epoch of every call "
        f"discarded: {measured} measured epochs per contender, medians.",
        "",
        f"Machine: {info['model']}, {info['cores']} cores ({info['flags']}); TensorFlow {info['tf']}, "
        f"Keras {info['keras']}; TF_ENABLE_ONEDNN_OPTS={info['onednn']}; load average (1/5/15 min) "
        f"{load_before} before, {load_after} after; {elapsed:.0f} s.",
        "",
        "| contender | layout | median ms / step | min ms / step | vs Keras step | with the between-epoch work, "
        "ms / step | vs Keras, same | same-round ratio to Keras, median (min-max) | whole fit call, ms / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    steps = TRAIN // BATCH

    def with_gaps(c):
        return c.median + statistics.median(c.gaps) / steps

    def round_ratio(c):
        ratios = [a / b for a, b in zip(c.round_medians, keras_c.round_medians)]
        return f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    for c in contenders:
        layout = " ".join(c.layout) or "one device"
        whole = statistics.median(c.call_times) / steps * 1e3
        lines.append(f"| {c.name} | {layout} | {1e3 * c.median:.2f} | {1e3 * min(c.step_times):.2f} | "
                     f"{c.median / keras_c.median:.3f}x | {1e3 * with_gaps(c):.2f} | "
                     f"{with_gaps(c) / with_gaps(keras_c):.3f}x | {round_ratio(c)} | {whole:.2f} |")
    lines += [
        "",
        "Fixed costs of a fit call (medians, ms): set-up = from calling fit to `on_train_begin`; first epoch = "
        "its extra time over a measured epoch (tracing); between epochs = `on_epoch_end` to the next "
        "`on_epoch_begin` or `on_train_end` (phalanx writes its checkpoint and metrics row there); after = "
        "`on_train_end` to fit returning.",
        "",
        "| contender | set-up | first epoch | between epochs | after |",
        "|---|---|---|---|---|",
        *[f"| {c.name} | {1e3 * statistics.median(c.setup):.0f} | {1e3 * statistics.median(c.first):.0f} | "
          f"{1e3 * statistics.median(c.gaps):.1f} | {1e3 * statistics.median(c.after):.1f} |" for c in contenders],
        "",
        f"Target (issue 9): phalanx / Keras <= 1.10x on one device: "
        f"**{contenders[1].median / keras_c.median:.3f}x**.",
        "",
        "\"whole fit call\" is a fit call's wall time / (epochs x steps): it includes the first epoch's tracing, "
        "and for phalanx the engine's set-up and the checkpoint written at the end of every epoch.",
        "",
    ]
    text = "\n".join(lines)
    if ARGS.output == "-":
        print(text)
    else:
        Path(ARGS.output).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.output).write_text(text)
        print(text)
        print(f"wrote {ARGS.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
