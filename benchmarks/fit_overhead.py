"""Does ``keras_scale.fit``'s plumbing cost training time? Side by side with plain ``model.fit``, same process.

Question: ``keras_scale.fit`` feeds arrays through its own ``tf.data`` pipeline (an epoch-indexed shuffle that every
worker reproduces, a gather per batch, DATA sharding, AUTOTUNE prefetch) instead of Keras's array adapter. Is an
epoch slower? Runs, interleaved to share the machine's noise:

- ``plain``: ``model.fit(x, y, batch_size=B, shuffle=True)``
- ``ks.fit``: ``keras_scale.fit(build, x, y, global_batch_size=B, default_callbacks=False)`` (same model, default
  strategy: the data path alone)
- ``ks.fit+NanGuard``: the same with the default callbacks (NanGuard's in-graph non-finite check)

Each run trains ``--epochs`` epochs; the first epoch (tracing) is dropped; the median epoch time over all repeats is
reported with the ratio to ``plain``.

    python benchmarks/fit_overhead.py [--repeats 3] [--epochs 4] [--samples 16384] [--batch 256]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_scale as ks  # noqa: E402


class EpochTimer(keras.callbacks.Callback):
    """Wall time of each epoch, in seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_s: list = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_s.append(time.perf_counter() - self._start)


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 64)).astype("float32")
    y = rng.integers(0, 10, size=(args.samples,)).astype("int32")

    def plain(timer):
        build().fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=True, verbose=0, callbacks=[timer])

    def ks_fit(timer):
        ks.fit(build, x, y, global_batch_size=args.batch, epochs=args.epochs, strategy="default", verbose=0,
               callbacks=[timer], default_callbacks=False)

    def ks_fit_guarded(timer):
        ks.fit(build, x, y, global_batch_size=args.batch, epochs=args.epochs, strategy="default", verbose=0,
               callbacks=[timer])

    runs = {"plain model.fit": plain, "ks.fit": ks_fit, "ks.fit+NanGuard": ks_fit_guarded}
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            timer = EpochTimer()
            run(timer)
            times[name].extend(timer.epoch_s[1:])
            keras.backend.clear_session()

    base = statistics.median(times["plain model.fit"])
    steps = -(-args.samples // args.batch)
    print(f"{args.samples} samples, batch {args.batch} ({steps} steps/epoch), {args.repeats} repeats x "
          f"{args.epochs - 1} timed epochs each")
    print(f"{'run':<18} {'median epoch s':>15} {'ms/step':>9} {'ratio':>7}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<18} {median:>15.3f} {1000 * median / steps:>9.2f} {median / base:>7.2f}")


if __name__ == "__main__":
    main()
