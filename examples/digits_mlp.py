"""An MLP on the 8x8 handwritten digits, trained with phalanx.fit on any layout.

The smallest complete recipe: a Keras Sequential model compiled the Keras way, trained
with ``phalanx.fit`` (Keras's arguments plus ``config=``), then scored on held-out
images with ``phalanx.evaluate``. Data: the 1,797 8x8 digits bundled with
scikit-learn (no download), a fixed stratified split of 1,440 train / 357 held out.

Expected: held-out accuracy >= 0.95 with the defaults (20 epochs, batch 32, Adam 1e-3)
on every layout; measured 0.972 on all four (see examples/README.md). About 10 s on 2 cores.

    python examples/digits_mlp.py                    # one device
    python examples/digits_mlp.py --layout dp2       # data parallel over 2 logical CPUs
    python examples/digits_mlp.py --layout pp2       # two pipeline stages, 2 micro-batches
    python examples/digits_mlp.py --layout dp2pp2    # both, on 4 logical CPUs
"""

from __future__ import annotations

import phalanx
from _common import digits, overrides, parse_args, say

args = parse_args(__doc__, epochs=20, batch_size=32)
# First, before anything touches TensorFlow: make the layout's devices.
cfg = phalanx.init(*overrides(args))

import keras  # noqa: E402  (after phalanx.init, on purpose)

keras.utils.set_random_seed(args.seed)
(x_train, y_train), (x_test, y_test) = digits(args)

model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(128, activation="relu"),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
], name="digits_mlp")
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])

phalanx.fit(model, x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
            validation_data=(x_test, y_test), validation_batch_size=len(x_test), config=cfg, verbose=args.verbose)
result = phalanx.evaluate(model, x_test, y_test, batch_size=len(x_test), config=cfg, return_dict=True, verbose=0)
say(f"held-out accuracy: {result['accuracy']:.4f} (loss {result['loss']:.4f}, {len(x_test)} images, "
    f"layout {args.layout}, {args.epochs} epochs)")
