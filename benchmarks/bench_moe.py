"""An 8-expert top-2 mixture-of-experts GPT against the dense GPT with the same active
parameters per token, and expert parallelism's step time (issue 11, item 6).

Both models are Keras Functional models written here from Keras layers and
``phalanx.layers.MoE``: byte tokens (vocabulary 256), a token embedding plus a learned
position embedding, ``--layers`` pre-LayerNorm blocks (LayerNorm -> causal
``MultiHeadAttention`` -> residual; LayerNorm -> feed-forward -> residual), a final
LayerNorm and an untied Dense head. The feed-forward is

* dense: ``Dense(ffn, gelu) -> Dense(d_model)``, ``ffn = 4 x d_model``;
* MoE (every block): ``MoE(experts=8, hidden_dim=ffn / top_k, top_k=2)`` — each token runs
  2 experts of width ffn / 2, so it meets the same expert weights (2 x 2 x d x ffn/2 = 2 x d
  x ffn) and the same matmul FLOPs as the dense MLP. The MoE adds, per block and token, the
  router (d x 8) and a second output bias (d): +1,152 active parameters per block at d=128
  (the table gives both counts). It holds 4x the dense MLP's weights in total.

Capacity factor ``--capacity`` (default 1.25, as Switch/GShard train), balancing loss 0.01.
Both train with the same AdamW (``--lr`` peak, linear warm-up over the first 10% of steps,
cosine decay to 10%, weight decay 0.01, global-norm clip 1.0) on the same batches of the
same data: the Python standard library's ``*.py`` files (``phalanx.data.corpus``), cut into
non-overlapping windows of seq + 1 bytes; every 10th file is held out. The data is read in
order and every training sequence is seen once.

Part 1, dense vs MoE trained with ``phalanx.fit`` on one device (the default layout):
``--rounds`` rounds, each one ``phalanx.fit`` call per model training the next ``--steps``
batches (the call resumes the model's run directory; the order alternates every round).
Loss after the same tokens: the mean training cross-entropy of the last call (batches neither
model had seen; a compiled metric, so without the MoE's balancing loss, which the minimised
loss also holds) and the held-out cross-entropy at the end (``phalanx.evaluate``, ``--eval``
sequences of the held-out files). ms / step as run: the median time between the ends of consecutive steps
(a call's first step, which traces, is not timed), callbacks and metric reads included.

Part 2, step time interleaved (the figures to compare on a shared machine): the two
contenders of a pair each get the :class:`~phalanx.engines.keras_model.KerasModelEngine`
that ``phalanx.fit`` builds for their layout, and run ``--pair-steps`` steps in turns
(A B, B A, A B, ...: the same load falls on both) after one untimed turn, each step followed
by the metric read (and for an MoE model the MoE statistics read) that ``phalanx.fit`` does.
Reported: each contender's median and the median of the per-turn ratios. Pairs:

* dense vs MoE, one device;
* ep2 over ep1: the MoE GPT on ``parallel.devices=cpu:2 parallel.dp=2`` with ``parallel.ep=1``
  (each replica holds all 8 experts) and ``parallel.ep=2`` (replica j holds experts
  4j..4j+3; the other replica's tokens travel to it and back). Both logical CPUs share
  the same 2 cores: this measures expert parallelism's cost, not a speed-up.

Usage::

    python benchmarks/bench_moe.py                      # writes benchmarks/results/moe_<date>.md
    python benchmarks/bench_moe.py --rounds 2 --steps 5 --pair-steps 4 --eval 32 --output -   # smoke run
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

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (default: 16)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity", type=float, default=1.25, help="MoE capacity factor (0: no dropping)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rounds", type=int, default=2, help="part 1: fit calls per model (default: 2)")
    parser.add_argument("--steps", type=int, default=100, help="part 1: steps per fit call (default: 100)")
    parser.add_argument("--eval", type=int, default=256, help="held-out sequences (default: 256)")
    parser.add_argument("--pair-steps", type=int, default=30,
                        help="part 2: timed steps per contender, in turns (default: 30)")
    parser.add_argument("--onednn", choices=("on", "off", "default"), default="on",
                        help="TF_ENABLE_ONEDNN_OPTS (default: on, as the phalanx command sets it)")
    parser.add_argument("--output", default=None,
                        help="markdown file to write, or - (default: benchmarks/results/moe_<date>.md)")
    args = parser.parse_args()
    if args.steps < 2 or args.pair_steps < 2:
        parser.error("--steps and --pair-steps must be >= 2")
    if args.d_model * 4 % args.top_k:
        parser.error("4 x d_model must be divisible by top_k")
    return args


ARGS = parse_args()
if ARGS.onednn != "default":
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if ARGS.onednn == "on" else "0"

import phalanx  # noqa: E402

LAYOUT2 = ("parallel.devices=cpu:2", "parallel.dp=2")
phalanx.init(*LAYOUT2)  # 2 logical CPUs for part 2; part 1 runs on the first

import keras  # noqa: E402
import numpy as np  # noqa: E402
from machine_report import load, machine  # noqa: E402
from keras import ops  # noqa: E402

from phalanx.config import load_config  # noqa: E402
from phalanx.data.corpus import stdlib_files  # noqa: E402
from phalanx.engines.keras_model import KerasModelEngine  # noqa: E402
from phalanx.layers import MoE  # noqa: E402
from phalanx.mesh import build_mesh  # noqa: E402
from phalanx.train.moe_stats import MoEStats  # noqa: E402
from phalanx.train.progress import read_metrics  # noqa: E402

FFN = 4 * ARGS.d_model


# -- data ----------------------------------------------------------------------------------------


def sequences(files: list[Path], count: int) -> np.ndarray:
    """``count`` non-overlapping windows of seq + 1 bytes, files in order."""
    rows, have, n = [], 0, ARGS.seq + 1
    for path in files:
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        if len(data) >= n:
            rows.append(data[:len(data) // n * n].reshape(-1, n))
            have += len(rows[-1])
        if have >= count:
            break
    if have < count:
        raise SystemExit(f"the standard library holds only {have} sequences of {n} bytes; {count} needed")
    return np.concatenate(rows)[:count].astype(np.int32)


# -- models --------------------------------------------------------------------------------------


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position."""

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.length, input_shape[-1]), name="table",
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + ops.cast(self.table[None, :ops.shape(x)[1]], x.dtype)


def gpt(moe: bool, ep: int = 1, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    d = ARGS.d_model
    tokens = keras.Input((ARGS.seq,), dtype="int32")
    x = keras.layers.Embedding(256, d, name="embed")(tokens)
    x = PositionEmbedding(ARGS.seq, name="positions")(x)
    for b in range(ARGS.layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"b{b}_ln1")(x)
        h = keras.layers.MultiHeadAttention(ARGS.heads, d // ARGS.heads, name=f"b{b}_attn")(h, h, use_causal_mask=True)
        x = keras.layers.Add(name=f"b{b}_res1")([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"b{b}_ln2")(x)
        if moe:
            h = MoE(ARGS.experts, FFN // ARGS.top_k, top_k=ARGS.top_k, capacity_factor=ARGS.capacity,
                    aux_loss_coef=0.01, ep=ep, name=f"b{b}_moe")(h)
        else:
            h = keras.layers.Dense(FFN, activation="gelu", name=f"b{b}_mlp_in")(h)
            h = keras.layers.Dense(d, name=f"b{b}_mlp_out")(h)
        x = keras.layers.Add(name=f"b{b}_res2")([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    logits = keras.layers.Dense(256, name="head")(x)
    model = keras.Model(tokens, logits, name="moe_gpt" if moe else "dense_gpt")
    total = ARGS.rounds * ARGS.steps
    schedule = keras.optimizers.schedules.CosineDecay(0.0, decay_steps=max(total - total // 10, 1), alpha=0.1,
                                                      warmup_target=ARGS.lr, warmup_steps=max(total // 10, 1))
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, global_clipnorm=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  # the cross-entropy alone: the MoE's loss also holds its balancing loss
                  metrics=[keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="ce")])
    return model


def params(model: keras.Model) -> tuple[int, int]:
    """(total, active per token) trainable parameters: a token meets top_k of each MoE
    layer's experts (and its whole router)."""
    total = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    idle = 0
    for layer in model.layers:
        if isinstance(layer, MoE):
            expert = sum(int(np.prod(v.shape)) for name in ("w_in", "b_in", "w_out", "b_out")
                         for v in getattr(layer, name)) // layer.num_experts
            idle += (layer.num_experts - layer.top_k) * expert
    return total, total - idle


# -- timing --------------------------------------------------------------------------------------


class StepTimer(keras.callbacks.Callback):
    """The times between the ends of consecutive steps (the first step, which traces,
    is not one of them): the whole loop, batch slicing and metric reads included."""

    def __init__(self):
        super().__init__()
        self.ends: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def steps(self) -> list[float]:
        return list(np.diff(self.ends))


class Run:
    """One model trained by successive phalanx.fit calls in its own run directory."""

    def __init__(self, name: str, model: keras.Model, layout: tuple[str, ...], workdir: Path):
        self.name, self.model, self.layout = name, model, layout
        self.run_dir = workdir / name.replace(" ", "_")
        self.calls = 0
        self.step_times: list[float] = []   # median seconds per step of each call
        self.all_steps: list[float] = []    # every timed step of every call
        self.first: list[float] = []        # fit called -> end of the first step (set-up, tracing), per call
        self.loads: list[float] = []        # 1-minute load average after each call
        self.rows: list[dict] = []

    def fit(self, x: np.ndarray, steps: int) -> None:
        timer = StepTimer()
        self.calls += 1
        start = time.perf_counter()
        phalanx.fit(self.model, x[:, :-1], x[:, 1:], batch_size=ARGS.batch, epochs=self.calls, shuffle=False,
                    callbacks=[timer], verbose=0, overrides=(*self.layout, f"run.dir={self.run_dir}"))
        assert len(timer.ends) == steps, (self.name, len(timer.ends), steps)
        self.step_times.append(statistics.median(timer.steps()))
        self.all_steps += timer.steps()
        self.first.append(timer.ends[0] - start)
        self.loads.append(os.getloadavg()[0])
        self.rows = read_metrics(self.run_dir)

    @property
    def median(self) -> float:
        """Median seconds per step over every timed step of every call."""
        return statistics.median(self.all_steps)


class Contender:
    """A model and the engine phalanx.fit builds for it on ``layout``, stepped by hand."""

    def __init__(self, name: str, model: keras.Model, layout: tuple[str, ...], first_batch):
        cfg = load_config(None, list(layout))
        self.name, self.model, self.layout = name, model, layout
        self.engine = KerasModelEngine(model, cfg, build_mesh(cfg), first_batch)
        self.stats = MoEStats(model)
        self.times: list[float] = []
        start = time.perf_counter()
        self.step(first_batch)  # traces
        self.trace = time.perf_counter() - start

    def step(self, batch) -> float:
        start = time.perf_counter()
        self.engine.train_step(batch)
        self.model.get_metrics_result()["loss"].numpy()  # what phalanx.fit reads after every step
        self.stats.update()
        return time.perf_counter() - start


def interleaved(a: Contender, b: Contender, data: np.ndarray) -> list[float]:
    """``--pair-steps`` steps each, in turns, after one untimed turn (a step soon after
    tracing can stall for seconds); the per-turn ratios b / a."""
    warm = (data[:ARGS.batch, :-1], data[:ARGS.batch, 1:], None)
    a.step(warm), b.step(warm)
    ratios = []
    for i in range(ARGS.pair_steps):
        rows = data[(i * ARGS.batch) % (len(data) - ARGS.batch):][:ARGS.batch]
        batch = (rows[:, :-1], rows[:, 1:], None)
        if i % 2 == 0:
            ta, tb = a.step(batch), b.step(batch)
        else:
            tb, ta = b.step(batch), a.step(batch)
        a.times.append(ta)
        b.times.append(tb)
        ratios.append(tb / ta)
    return ratios


# -- report --------------------------------------------------------------------------------------




def main() -> None:
    info, load_before, started = machine(), load(), time.perf_counter()
    files = stdlib_files()
    train_files = [f for i, f in enumerate(files) if i % 10]
    held_out = [f for i, f in enumerate(files) if i % 10 == 0]
    per_call = ARGS.steps * ARGS.batch
    train = sequences(train_files, ARGS.rounds * per_call + (ARGS.pair_steps + 1) * ARGS.batch)
    test = sequences(held_out, ARGS.eval)
    tokens_per_step = ARGS.batch * ARGS.seq
    print(f"data: {len(train):,} training and {len(test):,} held-out sequences of {ARGS.seq}+1 bytes "
          f"({len(files):,} stdlib files)", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        workdir = Path(tmp)
        # -- part 1: dense vs MoE on one device ------------------------------------------------
        runs = [Run("dense", gpt(moe=False), (), workdir), Run("moe", gpt(moe=True), (), workdir)]
        for r in range(ARGS.rounds):
            chunk = train[r * per_call:(r + 1) * per_call]
            for run in (runs if r % 2 == 0 else runs[::-1]):
                run.fit(chunk, ARGS.steps)
            print(f"round {r + 1}/{ARGS.rounds}: " + ", ".join(
                f"{run.name} {1e3 * run.step_times[-1]:.0f} ms/step loss {run.rows[-1]['loss']:.3f}" for run in runs),
                  file=sys.stderr, flush=True)
        for run in runs:
            run.held_out = phalanx.evaluate(run.model, test[:, :-1], test[:, 1:], batch_size=ARGS.batch,
                                            return_dict=True, verbose=0)["ce"]
            run.params = params(run.model)
    # -- part 2: step times in turns ------------------------------------------------------------
    data = train[ARGS.rounds * per_call:]
    first = (data[:ARGS.batch, :-1], data[:ARGS.batch, 1:], None)
    pairs = []
    for names, layouts, moes, eps in ((("dense", "moe"), ((), ()), (False, True), (1, 1)),
                                      (("moe dp2 ep1", "moe dp2 ep2"),
                                       ((*LAYOUT2, "parallel.ep=1"), (*LAYOUT2, "parallel.ep=2")),
                                       (True, True), (1, 2))):
        a, b = (Contender(n, gpt(moe=m, ep=e), lay, first) for n, lay, m, e in zip(names, layouts, moes, eps))
        ratios = interleaved(a, b, data[ARGS.batch:])
        pairs.append((a, b, ratios, load()))
        print(f"{b.name} / {a.name}: {1e3 * statistics.median(b.times):.0f} / {1e3 * statistics.median(a.times):.0f}"
              f" ms, per-turn ratio {statistics.median(ratios):.3f}", file=sys.stderr, flush=True)
    report(runs, pairs, info, load_before, load(), time.perf_counter() - started, tokens_per_step)


def report(runs, pairs, info, load_before, load_after, elapsed, tokens_per_step) -> None:
    today = datetime.date.today().isoformat()
    dense, moe = runs
    tokens = ARGS.rounds * ARGS.steps * tokens_per_step
    argv = " ".join(sys.argv[1:])
    last = moe.rows[-1]
    (pd, pm, dm_ratios, dm_load), (e1, e2, ep_ratios, ep_load) = pairs
    med = lambda c: statistics.median(c.times)  # noqa: E731
    lines = [
        "# Mixture of experts: MoE GPT vs dense GPT, and expert parallelism",
        "",
        f"Written by `python benchmarks/bench_moe.py{' ' + argv if argv else ''}` on {today}.",
        "",
        f"Machine: {info['model']}, {info['cores']} cores ({info['flags']}); TensorFlow {info['tf']}, Keras "
        f"{info['keras']}; TF_ENABLE_ONEDNN_OPTS={info['onednn']}; {info['threads']}; load average (1/5/15 min) "
        f"{load_before} before, {load_after} after; {elapsed:.0f} s. The machine is shared: compare the "
        f"interleaved ratios (part 2), not absolute times across runs.",
        "",
        f"Models (Keras Functional): {ARGS.layers} pre-LN blocks, d_model {ARGS.d_model}, {ARGS.heads} heads, "
        f"seq {ARGS.seq}, byte vocabulary 256, untied head. Dense MLP: {ARGS.d_model} -> {FFN} (gelu) -> "
        f"{ARGS.d_model}. MoE in every block: `MoE({ARGS.experts}, hidden_dim={FFN // ARGS.top_k}, "
        f"top_k={ARGS.top_k}, capacity_factor={ARGS.capacity}, aux_loss_coef=0.01)`: a token runs {ARGS.top_k} "
        f"experts of width {FFN}/{ARGS.top_k}, i.e. the dense MLP's weights and matmul FLOPs per token, plus "
        f"the router and a second output bias. AdamW peak {ARGS.lr}, 10% warm-up, cosine to 10%, weight "
        f"decay 0.01, clip 1.0; batch {ARGS.batch} x {ARGS.seq} = {tokens_per_step:,} tokens a step.",
        "",
        f"## 1. Trained with `phalanx.fit` (one device): loss after the same {tokens:,} tokens",
        "",
        f"{ARGS.rounds} fit calls x {ARGS.steps} steps per model, alternating, on the stdlib corpus (each "
        f"sequence seen once, the same batches for both).",
        "",
        "| model | parameters | active / token | train cross-entropy, last call (loss) | held-out "
        f"cross-entropy ({ARGS.eval} seqs) | ms / step as run | tokens/s as run | set-up + first step, s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        total, active = run.params
        lines.append(f"| {run.name} | {total:,} | {active:,} | {run.rows[-1]['ce']:.4f} ({run.rows[-1]['loss']:.4f}) "
                     f"| {run.held_out:.4f} | {1e3 * run.median:.0f} | {tokens_per_step / run.median:,.0f} | "
                     f"{firsts(run)} |")
    lines += [
        "",
        "Cross-entropy in nats per byte; the loss (in brackets) is what was minimised: for the MoE the "
        "cross-entropy plus its balancing loss (moe_aux_loss). Held-out: `phalanx.evaluate` on sequences of "
        "every 10th stdlib file, which training never reads.",
        "",
        f"Cross-entropy per call (epoch means), dense: {losses(dense)}; MoE: {losses(moe)}. The MoE run's last "
        f"`metrics.jsonl` row (means over its last {ARGS.steps} steps): moe_aux_loss {last['moe_aux_loss']:.4f}, "
        f"moe_balance {last['moe_balance']:.3f}, moe_dropped {last['moe_dropped']:.3f}, moe_load_min "
        f"{last['moe_load_min']:.3f}, moe_load_max {last['moe_load_max']:.3f}. Per-call median ms / step, dense: "
        f"{', '.join(f'{1e3 * t:.0f}' for t in dense.step_times)}; MoE: "
        f"{', '.join(f'{1e3 * t:.0f}' for t in moe.step_times)}; 1-minute load after each call, dense: "
        f"{loads(dense)}; MoE: {loads(moe)}.",
        "",
        f"## 2. Step time, interleaved ({ARGS.pair_steps} steps each, in turns)",
        "",
        "| pair | layout | A ms / step | B ms / step | B tokens/s | B / A (median of per-turn ratios) | "
        "A / B trace + first step, s | load after |",
        "|---|---|---|---|---|---|---|---|",
        f"| A dense, B MoE | one device | {1e3 * med(pd):.0f} | {1e3 * med(pm):.0f} | "
        f"{tokens_per_step / med(pm):,.0f} (dense {tokens_per_step / med(pd):,.0f}) | "
        f"**{statistics.median(dm_ratios):.3f}x** | {pd.trace:.0f} / {pm.trace:.0f} | {dm_load} |",
        f"| A ep1, B ep2 (MoE) | cpu:2 dp2 | {1e3 * med(e1):.0f} | {1e3 * med(e2):.0f} | "
        f"{tokens_per_step / med(e2):,.0f} (ep1 {tokens_per_step / med(e1):,.0f}) | "
        f"**{statistics.median(ep_ratios):.3f}x** | {e1.trace:.0f} / {e2.trace:.0f} | {ep_load} |",
        "",
        f"ep2 / ep1 step time: **{statistics.median(ep_ratios):.3f}x** (target <= 1.15x). Per-turn ratios: "
        f"dense -> MoE {quartiles(dm_ratios)}; ep1 -> ep2 {quartiles(ep_ratios)} (min / quartiles / max).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    output = ARGS.output or str(RESULTS / f"moe_{today}.md")
    if output != "-":
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text)
        print(f"wrote {output}", file=sys.stderr)


def quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{min(values):.2f} / {q[0]:.2f} {q[1]:.2f} {q[2]:.2f} / {max(values):.2f}"


def losses(run) -> str:
    return ", ".join(f"{row['ce']:.3f}" for row in run.rows)


def firsts(run) -> str:
    return ", ".join(f"{t:.0f}" for t in run.first)


def loads(run) -> str:
    return ", ".join(f"{x:.1f}" for x in run.loads)


if __name__ == "__main__":
    main()
