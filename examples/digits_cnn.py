"""A convnet (Conv2D, BatchNormalization, Dropout, MaxPooling) on the 8x8 digits, on any layout.

The keras.io MNIST convnet, shrunk to 8x8 images: it shows that layers with state
that is not trained — BatchNormalization's moving statistics, Dropout's random seed —
work on every phalanx layout. On pipeline layouts each micro-batch is normalised with
its own batch statistics and moves the averages once, in micro-batch order (as GPipe
does), and draws its own dropout mask; with one device it is exactly Keras's own step.
Data: the 1,797 8x8 digits bundled with scikit-learn, 1,440 train / 357 held out.

Expected: held-out accuracy >= 0.95 with the defaults (15 epochs, batch 32, Adam 2e-3)
on every layout; measured 0.992-0.994 (see examples/README.md). 10-15 s on 2 cores.

    python examples/digits_cnn.py --layout dp2
"""

from __future__ import annotations

import phalanx
from _common import digits, digits_cnn, overrides, parse_args, say

args = parse_args(__doc__, epochs=15, batch_size=32)
# First, before anything touches TensorFlow: make the layout's devices.
cfg = phalanx.init(*overrides(args))

import keras  # noqa: E402  (after phalanx.init, on purpose)

keras.utils.set_random_seed(args.seed)
(x_train, y_train), (x_test, y_test) = digits(args, images=True)
x_train, x_test = x_train[..., None], x_test[..., None]  # [n, 8, 8, 1]: one channel
model = digits_cnn()  # examples/_common.py: the convnet the benchmarks time too

phalanx.fit(model, x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
            validation_data=(x_test, y_test), validation_batch_size=len(x_test), config=cfg, verbose=args.verbose)
result = phalanx.evaluate(model, x_test, y_test, batch_size=len(x_test), config=cfg, return_dict=True, verbose=0)
say(f"held-out accuracy: {result['accuracy']:.4f} (loss {result['loss']:.4f}, {len(x_test)} images, "
    f"layout {args.layout}, {args.epochs} epochs)")
