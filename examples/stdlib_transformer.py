"""A small Transformer language model on the Python standard library's own source, bytes as tokens.

A Functional Keras model — token embedding + learned positional embedding, 2 blocks of
causal ``MultiHeadAttention`` (``use_causal_mask=True``) and an MLP, each with a
pre-LayerNorm and a residual, then a Dense head over the 256 byte values — trained with
``phalanx.fit`` on any layout. On ``pp2`` the blocks are cut across two stages and the
residual stream crosses the cut.

Data that needs no download: the ``*.py`` files at the top of the standard library
(``sysconfig.get_paths()["stdlib"]``, ~4.7 MB on CPython 3.11), read in sorted order.
Every 10th file is held out (a deterministic split by file, so no held-out line was
seen in training). Each file is cut into sequences of 64 + 1 bytes (input = the first
64, target = the last 64). The optimizer is the model's own: AdamW with a linear
warm-up and cosine decay (a Keras learning-rate schedule, which phalanx runs as compiled).

Expected with the defaults (1 epoch over ~2 MB of training text: 31,008 sequences, 969
steps of batch 32; 2,048 held-out sequences): held-out loss <= 1.65 nats per byte
(perplexity <= 5.2); measured 1.532 (perplexity 4.63) on all four layouts (see
examples/README.md). 75-95 s on 2 cores (dp/pp layouts take longer there: their logical
devices share the same 2 cores). Ends with a sample: the model continues the first 64
bytes of a held-out file.

    python examples/stdlib_transformer.py --layout pp2
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import phalanx
from _common import fail, overrides, parse_args, say

SEQ = 64  # tokens the model sees; each sample holds SEQ + 1 bytes


def extra_flags(parser):
    parser.add_argument("--train-bytes", type=int, default=2_000_000,
                        help="bytes of training text to read (default: 2,000,000)")
    parser.add_argument("--generate", type=int, default=160, help="bytes to generate at the end (default: 160)")


args = parse_args(__doc__, epochs=1, batch_size=32, extra=extra_flags)
# First, before anything touches TensorFlow: make the layout's devices.
cfg = phalanx.init(*overrides(args))

import keras  # noqa: E402  (after phalanx.init, on purpose)
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

keras.utils.set_random_seed(args.seed)


# -- data ----------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if len(files) < 20:
        fail(f"found only {len(files)} .py files in {root}; this recipe needs the Python standard library's sources")
    return files


def sequences(files: list[Path], budget: int) -> np.ndarray:
    """Non-overlapping windows of SEQ + 1 bytes of each file, until ``budget`` bytes are read."""
    rows, used = [], 0
    for path in files:
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        n = len(data) // (SEQ + 1)
        if n:
            rows.append(data[:n * (SEQ + 1)].reshape(n, SEQ + 1))
            used += n * (SEQ + 1)
        if used >= budget:
            break
    return np.concatenate(rows).astype(np.int32)


files = stdlib_files()
held_out_files = files[::10]
train_files = [f for i, f in enumerate(files) if i % 10]
train = sequences(train_files, args.train_bytes)
test = sequences(held_out_files, 10 ** 12)
limit = args.max_samples or len(train)
train = train[:limit - limit % args.batch_size]                # full batches only: each splits over every layout
test_limit = min(len(test), 2048, args.max_samples or len(test))
test = test[:test_limit - test_limit % args.batch_size]
if not len(train) or not len(test):
    fail("no full batch of data; raise --max-samples or --train-bytes")
x_train, y_train = train[:, :-1], train[:, 1:]
x_test, y_test = test[:, :-1], test[:, 1:]
say(f"data: {len(x_train):,} training sequences of {SEQ} bytes from {len(train_files)} stdlib files, "
    f"{len(x_test):,} held-out sequences from {len(held_out_files)} other files")


# -- model ---------------------------------------------------------------------------------


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position to the token embeddings."""

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.table = self.add_weight(shape=(self.length, input_shape[-1]), name="table",
                                     initializer=keras.initializers.RandomNormal(stddev=0.02))

    def call(self, x):
        return x + ops.cast(self.table[None, :ops.shape(x)[1]], x.dtype)

    def get_config(self):
        return {**super().get_config(), "length": self.length}


def transformer_lm(d_model=128, heads=4, ffn=512, blocks=2) -> keras.Model:
    tokens = keras.Input((SEQ,), dtype="int32", name="bytes")
    x = keras.layers.Embedding(256, d_model, name="embed")(tokens)
    x = PositionEmbedding(SEQ, name="positions")(x)
    for b in range(blocks):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{b}_ln1")(x)
        h = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f"block{b}_attention")(
            h, h, use_causal_mask=True)
        x = keras.layers.Add(name=f"block{b}_residual1")([x, h])
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{b}_ln2")(x)
        h = keras.layers.Dense(ffn, activation="gelu", name=f"block{b}_mlp_in")(h)
        h = keras.layers.Dense(d_model, name=f"block{b}_mlp_out")(h)
        x = keras.layers.Add(name=f"block{b}_residual2")([x, h])
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    logits = keras.layers.Dense(256, name="head")(x)
    return keras.Model(tokens, logits, name="stdlib_transformer")


steps = args.epochs * len(x_train) // args.batch_size
schedule = keras.optimizers.schedules.CosineDecay(0.0, decay_steps=max(steps - steps // 10, 1), alpha=0.1,
                                                  warmup_target=3e-3, warmup_steps=steps // 10)
model = transformer_lm()
model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, global_clipnorm=1.0),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

phalanx.fit(model, x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
            validation_data=(x_test, y_test), config=cfg, verbose=args.verbose)
result = phalanx.evaluate(model, x_test, y_test, batch_size=args.batch_size, config=cfg, return_dict=True,
                          verbose=0)


# -- a sample: continue the first SEQ bytes of a held-out file ----------------------------------


def sample(prompt: np.ndarray, n: int, temperature: float = 0.7) -> bytes:
    rng = np.random.default_rng(args.seed)
    window = list(prompt[-SEQ:])
    out = []
    for _ in range(n):
        logits = np.asarray(model(np.array([window], np.int32), training=False))[0, -1].astype(np.float64)
        p = np.exp((logits - logits.max()) / temperature)
        token = int(rng.choice(256, p=p / p.sum()))
        out.append(token)
        window = window[1:] + [token]
    return bytes(out)


if args.generate:
    prompt = x_test[0]
    text = sample(prompt, args.generate)
    say("sample (prompt | continuation):\n" + bytes(prompt.astype(np.uint8)).decode("utf-8", "replace")
        + "|" + text.decode("utf-8", "replace"))
say(f"held-out loss: {result['loss']:.4f} nats/byte, perplexity {np.exp(result['loss']):.2f}, "
    f"accuracy {result['accuracy']:.4f} ({len(x_test):,} sequences, layout {args.layout}, {args.epochs} epochs)")
