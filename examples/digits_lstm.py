"""An LSTM reading each 8x8 digit row by row (8 time steps of 8 pixels), on any layout.

A recurrent model through ``phalanx.fit``: the 8 rows of each image are the 8 time
steps, a stacked LSTM reads them and a Dense head classifies the last state. On a
pipeline layout the two LSTMs land on different stages, and the whole sequence
crosses the cut between them. Data: the 1,797 8x8 digits bundled with scikit-learn,
a fixed stratified split of 1,440 train / 357 held out.

Expected: held-out accuracy >= 0.90 with the defaults (25 epochs, batch 32, Adam 3e-3)
on every layout; measured 0.961 on all four (see examples/README.md). 12-21 s on 2 cores.

    python examples/digits_lstm.py --layout pp2
"""

from __future__ import annotations

import phalanx
from _common import digits, overrides, parse_args, say

args = parse_args(__doc__, epochs=25, batch_size=32)
# First, before anything touches TensorFlow: make the layout's devices.
cfg = phalanx.init(*overrides(args))

import keras  # noqa: E402  (after phalanx.init, on purpose)

keras.utils.set_random_seed(args.seed)
(x_train, y_train), (x_test, y_test) = digits(args, images=True)  # [n, 8 rows = time steps, 8 pixels]

model = keras.Sequential([
    keras.Input((8, 8)),
    keras.layers.LSTM(64, return_sequences=True),
    keras.layers.LSTM(64),
    keras.layers.Dense(10, activation="softmax"),
], name="digits_lstm")
model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])

phalanx.fit(model, x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
            validation_data=(x_test, y_test), validation_batch_size=len(x_test), config=cfg, verbose=args.verbose)
result = phalanx.evaluate(model, x_test, y_test, batch_size=len(x_test), config=cfg, return_dict=True, verbose=0)
say(f"held-out accuracy: {result['accuracy']:.4f} (loss {result['loss']:.4f}, {len(x_test)} images, "
    f"layout {args.layout}, {args.epochs} epochs)")
