"""Reference GPT benchmark: phalanx against keras-hub's GPT2CausalLM, in one run.

The reference GPT (issue 2, item 12): 12 layers, d_model 768, 12 heads, ffn 3072,
vocab 8192, seq_len 512, batch 8, AdamW. For each precision policy it builds

* phalanx: the engine ``phalanx train`` builds for one device
  (:func:`phalanx.engines.factory.build_engine` with :class:`phalanx.engines.task.GPTTask`:
  the step the trainer runs), and
* the peer a user would otherwise pick: keras-hub ``GPT2CausalLM`` (same shapes,
  random init, ``preprocessor=None``, dropout 0) trained with ``model.fit`` and
  Keras AdamW, under the same dtype policy,

* the matmul-only ceiling: every dense and attention matmul of the step, forward and
  backward (the same shapes, dtype and transposes as the gradient tape produces for
  phalanx's step, :func:`step_matmuls`), and nothing else, each timed alone on
  ``tf.Variable`` operands with its result read back (:class:`MatmulTimer`), summed. A
  step cannot be faster; phalanx's tokens/s over the ceiling's is the share of the step
  spent in matmuls,
* the same matmuls the way the step runs them (:class:`StepMatmulsRunner`): all in one
  traced function, each instance on its own operands, inputs changing every call, one call
  per step (timed alone, each product pays set-up the step does not, so on fast-matmul
  CPUs the ceiling above can be slower than the step's own matmuls),

then times them in alternating rounds (the order flips every round) on the same
synthetic random token batch, so all see the same machine load. The numbers
reported are medians over the measured steps; the ratios are what to trust on a
shared machine. MFU = 6 x params x tokens (+ attention) / step time / the measured
matmul peak of the same compute dtype (one 2048-cubed matmul, :func:`matmul_peak`).
The output records the CPU model and flags, TensorFlow's oneDNN setting (one process:
the same for every contender), the date and the load average.

The peer is optional (``--no-peer``). Install it next to phalanx without its
tensorflow-text dependency, which would pull the CUDA TensorFlow wheel::

    pip install --no-deps keras-hub && pip install regex

Usage::

    python benchmarks/bench_gpt.py                       # full run, writes benchmarks/results/gpt.md
    python benchmarks/bench_gpt.py --rounds 2 --steps 2  # quicker
    python benchmarks/bench_gpt.py --layers 2 --no-peer --output -   # a smoke run
    git worktree add --detach /tmp/old <commit>          # an older phalanx beside this one, same rounds
    python benchmarks/bench_gpt.py --baseline-src /tmp/old/src --no-ceiling   # (benchmarks/baseline_gpt.py)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _onednn_from_argv(argv: list[str]) -> str:
    """``--onednn`` must act before TensorFlow is imported, so it is read here first."""
    for i, arg in enumerate(argv):
        if arg.startswith("--onednn="):
            return arg.split("=", 1)[1]
        if arg == "--onednn" and i + 1 < len(argv):
            return argv[i + 1]
    return "default"


ONEDNN = _onednn_from_argv(sys.argv[1:])
if ONEDNN in ("on", "off"):
    # TensorFlow turns oneDNN on by default only on CPUs with AVX512-VNNI/BF16 or AMX;
    # elsewhere (e.g. AVX2-only CPUs) it stays off unless asked for. Both contenders
    # run in this process, so both get the same setting.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if ONEDNN == "on" else "0"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from phalanx.config import Config, ConfigError, validate  # noqa: E402
from phalanx.precision import describe as describe_precision  # noqa: E402
from phalanx.engines.factory import build_engine  # noqa: E402
from phalanx.core.costs import gpt_training_flops_per_token
from phalanx.engines.task import GPTTask  # noqa: E402

import baseline_gpt  # noqa: E402  (benchmarks/: this script's directory is on sys.path)

POLICIES = ("float32", "mixed_bfloat16")
COMPUTE_DTYPE = {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}
RESULTS = Path(__file__).resolve().parent / "results" / "gpt.md"


@dataclass
class Timings:
    """Per-step wall times (seconds) of one contender, by round."""

    name: str
    rounds: list[list[float]] = field(default_factory=list)
    cpu_rounds: list[list[float]] = field(default_factory=list)  # process CPU seconds per step
    detail: list = field(default_factory=list)  # the ceiling's (StepMatmul, median seconds per call)
    first_step: float = float("nan")  # seconds to build the contender and run its first (tracing) step
    peak_rss_gb: float = float("nan")  # a contender in its own process: that process's peak resident memory

    def all(self) -> list[float]:
        return [t for r in self.rounds for t in r]

    def median(self) -> float:
        return statistics.median(self.all())


# ---------------------------------------------------------------------------
# Contenders


class PhalanxRunner:
    """The phalanx training step on one device, exactly as the trainer drives it."""

    def __init__(self, model_cfg: dict, batch: int, policy: str, lr: float, batch_data: np.ndarray,
                 attention: str = "plain"):
        self.cfg = Config().replace(model={**model_cfg, "attention": attention},
                                    train={"global_batch": batch, "lr": lr, "warmup": 0},
                                    precision={"policy": policy}, parallel={"devices": "cpu:1"})
        self.engine = build_engine(self.cfg, GPTTask(self.cfg.model, policy))
        self.batch = tf.constant(batch_data, tf.int32)
        self.last_loss = float("nan")

    def run(self, steps: int) -> list[float]:
        times, cpu = [], []
        for _ in range(steps):
            start, cpu0 = time.perf_counter(), time.process_time()
            out = self.engine.train_step(self.batch)
            self.last_loss = float(out["loss"])  # waits for the step
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu0)
        return times, cpu


class PeerRunner:
    """keras-hub GPT2CausalLM trained with ``model.fit`` (Keras AdamW), timed per batch."""

    def __init__(self, model_cfg: dict, batch: int, policy: str, lr: float, batch_data: np.ndarray):
        import keras
        import keras_hub

        self.keras = keras
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=model_cfg["vocab"], num_layers=model_cfg["layers"], num_heads=model_cfg["heads"],
            hidden_dim=model_cfg["d_model"], intermediate_dim=model_cfg["ffn"], dropout=0.0,
            max_sequence_length=model_cfg["seq_len"], dtype=policy)
        self.model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        # No accuracy metric: the peer does the least work a user could ask of it.
        self.model.compile(optimizer=keras.optimizers.AdamW(learning_rate=lr, weight_decay=0.1),
                           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           weighted_metrics=[])
        x = {"token_ids": batch_data[:, :-1], "padding_mask": np.ones_like(batch_data[:, :-1], dtype=bool)}
        self.data = tf.data.Dataset.from_tensors((x, batch_data[:, 1:])).repeat()
        self.last_loss = float("nan")

    def run(self, steps: int) -> list[float]:
        times: list[float] = []
        cpu: list[float] = []
        keras = self.keras
        runner = self

        class StepTimer(keras.callbacks.Callback):
            # model.fit calls the compiled train function between these two hooks;
            # on CPU that call returns when the step is done.
            def on_train_batch_begin(self, batch, logs=None):
                self.start, self.cpu0 = time.perf_counter(), time.process_time()

            def on_train_batch_end(self, batch, logs=None):
                times.append(time.perf_counter() - self.start)
                cpu.append(time.process_time() - self.cpu0)
                if logs and "loss" in logs:
                    runner.last_loss = float(logs["loss"])

        self.model.fit(self.data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[StepTimer()])
        return times, cpu


@dataclass(frozen=True)
class StepMatmul:
    """One matmul of the training step, ``count`` times per step: ``a @ b`` with the
    transposes TensorFlow's gradient uses (``a``/``b`` are the operand shapes as stored)."""

    name: str
    a: tuple
    b: tuple
    transpose_a: bool = False
    transpose_b: bool = False
    count: int = 1

    def flops(self) -> float:
        """2 m k n per matrix product, times the batch dims."""
        m, k = (self.a[-1], self.a[-2]) if self.transpose_a else (self.a[-2], self.a[-1])
        n = self.b[-2] if self.transpose_b else self.b[-1]
        return 2.0 * float(np.prod(self.a[:-2], dtype=np.float64)) * m * k * n

    def describe(self) -> str:
        shape = lambda s, t: "x".join(map(str, s)) + ("^T" if t else "")  # noqa: E731
        return f"{shape(self.a, self.transpose_a)} @ {shape(self.b, self.transpose_b)}"


def step_matmuls(model_cfg: dict, batch: int) -> list[StepMatmul]:
    """Every dense and attention matmul of one training step of the reference GPT, forward
    and backward, as phalanx's one-device step runs them (``phalanx.models.transformer.gpt``:
    separate query, key and value projections ``[d, d]`` — the Keras layers' weights —, heads
    as ``[b, h, t, hd]`` batch matmuls, tied head ``x @ E^T``).

    Per dense layer ``y = x @ W``: the forward, ``dx = dy @ W^T`` and ``dW = x^T @ dy``.
    Per attention: ``s = q @ k^T`` (backward ``dq = ds @ k``, ``dk = ds^T @ q``) and
    ``o = p @ v`` (backward ``dp = do @ v^T``, ``dv = p^T @ do``).
    """
    d, f, h, t, v, layers = (model_cfg[k] for k in ("d_model", "ffn", "heads", "seq_len", "vocab", "layers"))
    n, hd = batch * t, d // h
    out = []
    # (name, d_in, d_out, how many per block): query, key and value are three d x d matmuls
    for name, din, dout, per_block in (("q/k/v", d, d, 3), ("attn out", d, d, 1), ("mlp fc", d, f, 1),
                                       ("mlp proj", f, d, 1)):
        count = per_block * layers
        out += [StepMatmul(f"{name} forward", (n, din), (din, dout), count=count),
                StepMatmul(f"{name} dx", (n, dout), (din, dout), transpose_b=True, count=count),
                StepMatmul(f"{name} dW", (n, din), (n, dout), transpose_a=True, count=count)]
    heads, square = (batch, h, t, hd), (batch, h, t, t)
    out += [StepMatmul("scores q k^T", heads, heads, transpose_b=True, count=layers),
            StepMatmul("scores dq", square, heads, count=layers),
            StepMatmul("scores dk", square, heads, transpose_a=True, count=layers),
            StepMatmul("probs @ v", square, heads, count=layers),
            StepMatmul("probs @ v dp", heads, heads, transpose_b=True, count=layers),
            StepMatmul("probs @ v dv", square, heads, transpose_a=True, count=layers),
            StepMatmul("head forward", (n, d), (v, d), transpose_b=True),
            StepMatmul("head dx", (n, v), (v, d)),
            StepMatmul("head dE", (n, v), (n, d), transpose_a=True)]
    return out


class MatmulTimer:
    """Times matmuls one at a time, so that nothing but the matmul is measured and nothing
    of it is skipped.

    Each matmul shape gets its own ``tf.function`` holding that one matmul; its operands are
    ``tf.Variable`` s (read at run time: no constant folding), ``copies`` different random
    sets rotated call by call (the step's layers each have their own activations and
    weights: one set reused would sit in the CPU's cache), and every call reduces a corner
    of the product to a float32 scalar that is read back to Python, so each call waits for
    its matmul to finish. One matmul per function: two identical matmuls in one graph would
    be merged by Grappler's common-subexpression elimination (the flaw of the first ceiling,
    which timed ``q @ k^T`` and ``p @ v`` twice in one function).
    """

    def __init__(self, dtype, copies: int = 3, seed: int = 0):
        self.dtype, self.copies = tf.as_dtype(dtype), copies
        self._operands: dict = {}
        self._fns: dict = {}
        self._rng = tf.random.Generator.from_seed(seed)

    def _operand(self, shape: tuple, copy: int) -> tf.Variable:
        key = (tuple(shape), copy)
        if key not in self._operands:
            # operands of one shape are shared between matmuls, as the step's activations are
            self._operands[key] = tf.Variable(tf.cast(self._rng.normal(shape, stddev=0.5), self.dtype),
                                              trainable=False)
        return self._operands[key]

    def _fn(self, mm: StepMatmul):
        key = (mm.transpose_a, mm.transpose_b)
        if key not in self._fns:
            ta, tb = key

            @tf.function
            def run(a, b):
                y = tf.matmul(a, b, transpose_a=ta, transpose_b=tb)
                return tf.reduce_sum(tf.cast(y[..., :1, :1], tf.float32))

            self._fns[key] = run
        return self._fns[key]

    def time_call(self, mm: StepMatmul, copy: int = 0) -> float:
        """Wall seconds of one call of ``mm`` on operand set ``copy``, result read back."""
        a, b = self._operand(mm.a, copy % self.copies), self._operand(mm.b, (copy + 1) % self.copies)
        fn = self._fn(mm)
        start = time.perf_counter()
        value = float(fn(a, b))  # float(): waits for the matmul and copies the scalar back
        elapsed = time.perf_counter() - start
        if not np.isfinite(value):
            raise RuntimeError(f"matmul {mm.name} gave {value}: the timed work is not real")
        return elapsed

    def peak(self, size: int = 2048, seconds: float = 1.5) -> float:
        """FLOP/s of a ``size``-cubed matmul timed as above: the best call (warm-up excluded)."""
        mm = StepMatmul("square", (size, size), (size, size))
        self.time_call(mm)  # trace + warm up
        best, start, i = float("inf"), time.perf_counter(), 0
        while time.perf_counter() - start < seconds or i < 3:
            best = min(best, self.time_call(mm, i))
            i += 1
        return mm.flops() / best


class CeilingRunner:
    """Every dense and attention matmul of one training step (:func:`step_matmuls`),
    forward and backward, each timed alone by :class:`MatmulTimer` in the step's compute
    dtype; a ceiling "step" runs each of them as many times as the step does and its time
    is the sum of the matmuls' times (the gaps between calls are not counted). A step cannot
    be faster: phalanx's tokens/s over the ceiling's is the share of the step in matmuls.
    """

    def __init__(self, model_cfg: dict, batch: int, policy: str, lr: float, batch_data: np.ndarray):
        self.matmuls = step_matmuls(model_cfg, batch)
        self.timer = MatmulTimer(COMPUTE_DTYPE[policy])
        self.per_matmul: dict[str, list[float]] = {mm.name: [] for mm in self.matmuls}  # seconds per call
        self.last_loss = float("nan")

    def run(self, steps: int):
        times, cpu = [], []
        for _ in range(steps):
            total, cpu0 = 0.0, time.process_time()
            for mm in self.matmuls:
                for i in range(mm.count):
                    t = self.timer.time_call(mm, i)
                    self.per_matmul[mm.name].append(t)
                    total += t
            times.append(total)
            cpu.append(time.process_time() - cpu0)
        return times, cpu

    def breakdown(self) -> list[tuple[StepMatmul, float]]:
        """(matmul, median seconds per call) over every call so far but each matmul's first
        ``count`` (the warm-up step's)."""
        return [(mm, statistics.median(self.per_matmul[mm.name][mm.count:] or self.per_matmul[mm.name]))
                for mm in self.matmuls]


class StepMatmulsRunner:
    """The matmul-only time of a step measured the way the step runs its products: every
    matmul of :func:`step_matmuls`, each as many times as the step runs it, in ONE
    ``tf.function`` (one graph, one call per step: no per-matmul dispatch or read-back), one
    product after the other as the step's chain of layers runs them, on inputs that change
    every call.

    The operands are the function's arguments (never constants to fold), a few random tensors
    per shape; every instance of a matmul gets its own pair of them (Grappler merges identical
    products of one graph), and call ``k`` rotates each shape's tensors, so no product sees the
    inputs it saw the call before. Each product's corner is summed into the result (nothing is
    pruned) and read back once per call. Unlike :class:`CeilingRunner` (each product timed
    alone, paying set-up the step does not), this is no upper bound: it is what the step's own
    matmuls cost when nothing else runs, to set beside the step's matmul time in a profile.
    """

    def __init__(self, model_cfg: dict, batch: int, policy: str, lr: float = 0.0, batch_data=None):
        import math
        from collections import defaultdict

        self.matmuls = step_matmuls(model_cfg, batch)
        dtype = tf.as_dtype(COMPUTE_DTYPE[policy])
        # instances per kind of product (shapes and transposes): each needs its own operand pair
        kinds: dict = defaultdict(int)
        for mm in self.matmuls:
            kinds[(mm.a, mm.b, mm.transpose_a, mm.transpose_b)] += mm.count
        copies: dict = defaultdict(int)  # tensors per shape: k x k distinct pairs cover k^2 instances
        for (a, b, _, _), n in kinds.items():
            k = math.ceil(math.sqrt(n))
            copies[a], copies[b] = max(copies[a], k), max(copies[b], k)
        self.shapes = sorted(copies)
        rng = tf.random.Generator.from_seed(0)
        self.tensors = {s: [tf.cast(rng.normal(s, stddev=0.5), dtype) for _ in range(copies[s])] for s in self.shapes}
        slots = []  # (argument index of a, argument index of b, transpose_a, transpose_b)
        first = {}
        i = 0
        for s in self.shapes:
            first[s], i = i, i + copies[s]
        for (a, b, ta, tb), n in kinds.items():
            pairs = [(x, y) for x in range(copies[a]) for y in range(copies[b]) if a != b or x != y]
            pairs += [(x, x) for x in range(copies[a])] if a == b else []
            slots += [(first[a] + x, first[b] + y, ta, tb) for x, y in pairs[:n]]
        if len(set(slots)) != sum(kinds.values()):
            raise RuntimeError("two instances of one product share operands: Grappler would merge them")

        @tf.function
        def step(*args):
            acc, previous = tf.zeros([], tf.float32), []
            for ia, ib, ta, tb in slots:
                # one after the other, as the step's chain of layers runs them (independent
                # products run side by side would share the cores and each take longer)
                with tf.control_dependencies(previous):
                    y = tf.matmul(args[ia], args[ib], transpose_a=ta, transpose_b=tb)
                previous = [y]
                acc += tf.reduce_sum(tf.cast(y[..., :1, :1], tf.float32))
            return acc

        self._step, self._calls = step, 0
        self.flops = sum(mm.flops() * mm.count for mm in self.matmuls)
        self.last_loss = float("nan")  # (no loss: the column shows the products' checksum's finiteness)

    def _args(self) -> list:
        k, out = self._calls, []
        for s in self.shapes:  # rotate each shape's tensors: call k's pairs are not call k-1's
            ts = self.tensors[s]
            out += ts[k % len(ts):] + ts[:k % len(ts)]
        return out

    def run(self, steps: int):
        times, cpu = [], []
        for _ in range(steps):
            args = self._args()
            self._calls += 1
            start, cpu0 = time.perf_counter(), time.process_time()
            value = float(self._step(*args))  # float(): waits for every product
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu0)
            if not np.isfinite(value):
                raise RuntimeError(f"the step's matmuls gave {value}: the timed work is not real")
        return times, cpu


# ---------------------------------------------------------------------------
# Measurement


def matmul_peak(policy: str) -> float:
    """The same-dtype matmul peak: a 2048-cubed matmul timed alone by :class:`MatmulTimer`.

    (Not :func:`phalanx.plan.hardware.measure_matmul_peak`: its probe puts four identical
    matmuls in one graph, which Grappler merges into one, and reported 4x the real rate.)
    """
    return MatmulTimer(COMPUTE_DTYPE[policy]).peak()


def load_average() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def measure_policy(policy: str, args, model_cfg: dict, batch_data: np.ndarray, log) -> dict[str, Timings]:
    contenders = {"phalanx": PhalanxRunner}
    for core in args.attention[1:]:  # the other attention cores, alternating with the first
        contenders[f"phalanx attention={core}"] = functools.partial(PhalanxRunner, attention=core)
    if args.baseline_src:  # another checkout's step, in its own process (benchmarks/baseline_gpt.py)
        contenders["baseline"] = functools.partial(baseline_gpt.BaselineRunner, src=args.baseline_src,
                                                   max_rss_gb=args.baseline_max_rss_gb)
    if not args.no_peer:
        contenders["keras-hub"] = PeerRunner
    if not args.no_ceiling:
        contenders["ceiling"] = CeilingRunner
        contenders["one-graph"] = StepMatmulsRunner  # the step's matmuls as the step runs them
    runners, timings = {}, {}
    for name, cls in contenders.items():
        start = time.perf_counter()
        runners[name] = (functools.partial(cls, attention=args.attention[0]) if name == "phalanx" else cls)(
            model_cfg, args.batch, policy, args.lr, batch_data)
        built = time.perf_counter() - start - getattr(runners[name], "startup_seconds", 0.0)
        warm, _ = runners[name].run(args.warmup)  # the first step traces the graph
        log(f"  {policy:15s} {name:10s} built + {args.warmup} warm-up steps in "
            f"{time.perf_counter() - start:.0f}s (last {warm[-1]:.2f}s/step)")
        timings[name] = Timings(name, first_step=built + warm[0])
    names = list(runners)
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            t, cpu = runners[name].run(args.steps)
            timings[name].rounds.append(t)
            timings[name].cpu_rounds.append(cpu)
            log(f"  {policy:15s} round {r + 1}/{args.rounds} {name:10s} "
                f"{' '.join(f'{x:.2f}' for x in t)} s/step  loss {runners[name].last_loss:.3f}  "
                f"load {load_average()}")
    if "ceiling" in runners:
        timings["ceiling"].detail = runners["ceiling"].breakdown()
    for name, runner in runners.items():
        getattr(runner, "close", lambda: None)()  # a worker process frees its memory before the next policy
        timings[name].peak_rss_gb = getattr(runner, "peak_rss_gb", float("nan"))
    del runners
    return timings


def round_ratios(a: Timings, b: Timings, cpu: bool = False) -> list[float]:
    """Per-round speed ratio a/b (median step time of b over that of a): same-load pairs.

    ``cpu=True`` compares process CPU seconds per step instead of wall time: less
    sensitive to other users of a shared machine (they take cores, not our CPU time).
    """
    ra, rb = (a.cpu_rounds, b.cpu_rounds) if cpu else (a.rounds, b.rounds)
    return [statistics.median(tb) / statistics.median(ta) for ta, tb in zip(ra, rb)]


def cpu_flags() -> list[str]:
    """The CPU's feature flags that matter for these numbers (from /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((ln.split(":", 1)[1].split() for ln in fh if ln.startswith(("flags", "Features"))), [])
    except OSError:
        flags = []
    return [f for f in flags if f.startswith(("avx512", "amx", "avx_vnni", "avx2", "fma", "bf16", "sve"))]


def onednn_state() -> str:
    """TensorFlow's oneDNN setting in this process (every contender runs in it)."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        on = _pywrap_util_port.IsMklEnabled()
    except (ImportError, AttributeError):
        on = None
    env = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")
    return f"oneDNN {'on' if on else 'off' if on is not None else '?'} (TF_ENABLE_ONEDNN_OPTS={env})"


def build_table(results: dict, args, model_cfg: dict, peaks: dict, loads: list[str]) -> str:
    tokens = args.batch * model_cfg["seq_len"]
    cfg = Config().replace(model=model_cfg)
    flops_per_step = gpt_training_flops_per_token(cfg.model) * tokens
    import keras

    from phalanx.plan.hardware import cpu_model
    cpu = cpu_model()
    try:
        import keras_hub
        peer_version = f", keras-hub {keras_hub.__version__}"
    except ImportError:
        peer_version = ""
    when = datetime.datetime.now().isoformat(timespec="minutes")
    shape = (f"{model_cfg['layers']} layers, d_model {model_cfg['d_model']}, {model_cfg['heads']} heads, "
             f"ffn {model_cfg['ffn']}, vocab {model_cfg['vocab']}, seq_len {model_cfg['seq_len']}, "
             f"batch {args.batch}, AdamW")
    lines = [
        f"GPT training throughput ({shape}); {args.rounds} alternating rounds x {args.steps} steps after "
        f"{args.warmup} warm-up steps, medians.",
        "",
        f"- date {when}; machine: {cpu}, {os.cpu_count()} cores; CPU flags: {' '.join(cpu_flags())}",
        f"- every system in this one process: TensorFlow {tf.__version__}, {onednn_state()}, "
        f"inter/intra-op threads {tf.config.threading.get_inter_op_parallelism_threads() or 'default'}/"
        f"{tf.config.threading.get_intra_op_parallelism_threads() or 'default'}; Keras {keras.__version__}"
        f"{peer_version}",
        f"- load average (1/5/15 min) before: {loads[0]}; after each policy: {', '.join(loads[1:])}",
        f"- phalanx: model.attention={args.attention[0]}",
        f"- phalanx's default (precision.policy=auto) on this machine: {describe_precision(Config())}",
        "",
        "| dtype | phalanx tokens/s | phalanx MFU | matmul peak GFLOP/s | matmul-only ceiling tokens/s | "
        "phalanx / ceiling | keras-hub tokens/s | keras-hub MFU | phalanx / keras-hub | same, by CPU time | "
        "vs phalanx float32 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    own_fp32 = results.get("float32", {}).get("phalanx")
    for policy, timings in results.items():
        ours = timings["phalanx"]
        peak = peaks[policy]
        tps = tokens / ours.median()
        mfu = flops_per_step / ours.median() / peak
        peer = timings.get("keras-hub")
        if peer is not None:
            peer_tps = f"{tokens / peer.median():.0f}"
            peer_mfu = f"{flops_per_step / peer.median() / peak:.1%}"
            ratio = f"{statistics.median(round_ratios(ours, peer)):.2f}x"
            cpu_ratio = f"{statistics.median(round_ratios(ours, peer, cpu=True)):.2f}x"
        else:
            peer_tps = peer_mfu = ratio = cpu_ratio = "n/a"
        ceiling = timings.get("ceiling")
        if ceiling is not None:
            ceil_tps = f"{tokens / ceiling.median():.0f}"
            # phalanx's speed over the ceiling's, same-round pairs (<= 1)
            of_ceiling = f"{statistics.median(round_ratios(ours, ceiling)):.2f}"
        else:
            ceil_tps = of_ceiling = "n/a"
        if own_fp32 is not None and policy != "float32":
            # Different phases of the run: a ratio of medians, not of same-load pairs.
            own = f"{own_fp32.median() / ours.median():.2f}x"
        else:
            own = "1.00x" if policy == "float32" else "n/a"
        lines.append(f"| {policy} | {tps:.0f} | {mfu:.1%} | {peak / 1e9:.0f} | {ceil_tps} | {of_ceiling} | "
                     f"{peer_tps} | {peer_mfu} | {ratio} | {cpu_ratio} | {own} |")
    extra = [(policy, name, t) for policy, timings in results.items() for name, t in timings.items()
             if name.startswith("phalanx attention=")]
    if extra:
        lines += ["", f"Attention cores ('phalanx' above is model.attention={args.attention[0]}), timed in the same "
                  f"alternating rounds:", "",
                  "| dtype | contender | tokens/s | speed vs 'phalanx' (same-round ratio) | by CPU time |",
                  "|---|---|---|---|---|"]
        for policy, name, t in extra:
            ours = results[policy]["phalanx"]
            lines.append(f"| {policy} | {name} | {tokens / t.median():.0f} | "
                         f"{statistics.median(round_ratios(t, ours)):.3f}x | "
                         f"{statistics.median(round_ratios(t, ours, cpu=True)):.3f}x |")
    lines += ["", "phalanx / keras-hub and phalanx / ceiling are medians over rounds of same-round speed ratios; "
              "targets: phalanx >= 1.10x keras-hub in float32 and >= 1.30x in mixed_bfloat16, "
              "mixed_bfloat16 >= 0.85 of the matmul-only ceiling. Matmul peak: one 2048^3 matmul, best call; "
              "ceiling: every matmul of the step timed alone (below), summed."]
    for policy, timings in results.items():
        ceiling = timings.get("ceiling")
        if ceiling is None or not ceiling.detail:
            continue
        total_flops = sum(mm.flops() * mm.count for mm, _ in ceiling.detail)
        total_time = sum(sec * mm.count for mm, sec in ceiling.detail)
        lines += ["", f"Matmul-only ceiling, {policy} (operands {COMPUTE_DTYPE[policy]}): {len(ceiling.detail)} "
                  f"matmul shapes, {total_flops / 1e9:.0f} GFLOP per step (the cost model's "
                  f"{flops_per_step / 1e9:.0f}), {total_time:.2f} s per step at the median call, "
                  f"{total_flops / total_time / 1e9:.0f} GFLOP/s overall.", "",
                  "| matmul | operands | per step | ms per call | GFLOP/s | share of ceiling |",
                  "|---|---|---|---|---|---|"]
        for mm, sec in ceiling.detail:
            lines.append(f"| {mm.name} | {mm.describe()} | {mm.count} | {sec * 1e3:.1f} | "
                         f"{mm.flops() / sec / 1e9:.0f} | {sec * mm.count / total_time:.1%} |")
    if args.baseline_src:
        lines += baseline_gpt.table(results, tokens, round_ratios,
                                    f"phalanx {baseline_gpt.describe(args.baseline_src)}")
    rows = [(policy, timings["one-graph"], timings["phalanx"]) for policy, timings in results.items()
            if "one-graph" in timings]
    if rows:
        lines += ["", "The step's matmuls in one traced function (:class:`StepMatmulsRunner`: the same products, "
                  "each instance on its own operands, inputs changing every call, one call per step), beside "
                  "the step. Set it beside the step's own matmul time in `benchmarks/profile_gpt.py`'s "
                  "profile; unlike the ceiling above it pays no per-product set-up.", "",
                  "| dtype | matmuls in one function, s per step | tokens/s | GFLOP/s | phalanx step s | "
                  "phalanx / it |", "|---|---|---|---|---|---|"]
        for policy, graph, ours in rows:
            flops = sum(mm.flops() * mm.count for mm in step_matmuls(model_cfg, args.batch))
            lines.append(f"| {policy} | {graph.median():.3f} | {tokens / graph.median():.0f} | "
                         f"{flops / graph.median() / 1e9:.0f} | {ours.median():.3f} | "
                         f"{statistics.median(round_ratios(ours, graph)):.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated precision policies (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per contender per round")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per contender (the first traces)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", default="plain",
                   help="comma-separated model.attention cores: the first is 'phalanx', the others extra "
                        "contenders timed in the same alternating rounds (default: %(default)s)")
    p.add_argument(baseline_gpt.OPTION, default=None, metavar="SRC",
                   help="also time the step of the phalanx checkout whose src/ directory is SRC (e.g. an older "
                        "commit's `git worktree add --detach`), in its own process, in the same rounds")
    p.add_argument("--baseline-max-rss-gb", type=float, default=10.0,
                   help="stop the baseline's process if its resident memory passes this (default: %(default)s)")
    p.add_argument("--no-peer", action="store_true", help="time phalanx only (keras-hub not needed)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the matmul-only ceiling")
    p.add_argument("--onednn", choices=("default", "on", "off"), default="default",
                   help="TF_ENABLE_ONEDNN_OPTS for both contenders (default: TensorFlow's choice for this CPU)")
    p.add_argument("--output", default=str(RESULTS), help="markdown file to write, '-' for none")
    p.add_argument("--append", action="store_true", help="append the table to --output instead of replacing it")
    args = p.parse_args(argv)
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.attention = [x.strip() for x in args.attention.split(",") if x.strip()]
    from phalanx.config import ATTENTION
    for core in args.attention:
        if core not in ATTENTION:
            p.error(f"--attention: unknown core {core!r}; valid: {', '.join(ATTENTION)}")
    if args.baseline_max_rss_gb <= 0:
        p.error(f"--baseline-max-rss-gb: must be > 0, got {args.baseline_max_rss_gb}")
    if args.baseline_src is not None:
        try:
            args.baseline_src = baseline_gpt.check_src(args.baseline_src)
        except ValueError as exc:
            p.error(str(exc))
    for pol in args.policies:
        if pol not in COMPUTE_DTYPE:
            p.error(f"--policies: unknown policy {pol!r}; valid: {', '.join(COMPUTE_DTYPE)}")
    for key in ("rounds", "steps", "warmup", "layers", "batch"):
        if getattr(args, key) < 1:
            p.error(f"--{key}: must be >= 1, got {getattr(args, key)}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.no_peer:
        try:
            import keras_hub  # noqa: F401
        except ImportError as exc:
            print(f"error: keras-hub is not importable ({exc}); install it with "
                  f"`pip install --no-deps keras-hub && pip install regex`, or pass --no-peer",
                  file=sys.stderr)
            return 2
    model_cfg = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "ffn": args.ffn,
                 "vocab": args.vocab, "seq_len": args.seq_len}
    try:
        validate(Config().replace(model=model_cfg, train={"global_batch": args.batch}))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    batch_data = np.random.default_rng(args.seed).integers(
        0, args.vocab, size=[args.batch, args.seq_len + 1]).astype(np.int32)

    def log(msg):
        print(msg, flush=True)

    log(f"load average before: {load_average()}")
    loads_before = load_average()
    peaks = {pol: matmul_peak(pol) for pol in args.policies}
    log("matmul peaks: " + ", ".join(f"{COMPUTE_DTYPE[p]} {v / 1e9:.0f} GFLOP/s" for p, v in peaks.items()))
    results, loads = {}, [loads_before]
    for policy in args.policies:
        results[policy] = measure_policy(policy, args, model_cfg, batch_data, log)
        loads.append(f"{policy} {load_average()}")
    table = build_table(results, args, model_cfg, peaks, loads)
    print()
    print(table)
    if args.output != "-":
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        previous = out.read_text() if out.is_file() and args.append else "# GPT benchmark\n\n"
        out.write_text(previous + f"Written by `python benchmarks/bench_gpt.py {' '.join(sys.argv[1:])}`.\n\n"
                       + table + "\n")
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
