"""NanGuard overhead: step time of fit + NanGuard vs bare fit, interleaved in one process (floor: <= 1.02).

Two identical models on the same data; epochs alternate between them so machine load hits both alike; the
ratio of median epoch times is printed (and the same for a wrapped model, accum=4).

    python benchmarks/nan_guard.py [--rounds 8] [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()

    import keras
    import numpy as np

    import keras_scale as ks

    rng = np.random.default_rng(0)
    n = a.steps * a.batch
    x = rng.normal(size=(n, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(n,))

    def build(accum=None):
        keras.utils.set_random_seed(0)
        inner = keras.Sequential([
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        model = ks.wrap(inner, accum=accum) if accum else inner
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    print(f"NanGuard overhead: conv net 32x32x3, batch {a.batch}, {a.steps} steps/epoch, {a.rounds} interleaved "
          "rounds, CPU")
    for label, accum in (("plain model", None), ("wrap(accum=4)", 4)):
        bare, guarded = build(accum), build(accum)
        guard = ks.NanGuard(verbose=0)
        times = {"bare": [], "guard": []}

        class EpochTimer(keras.callbacks.Callback):
            def __init__(self, sink):
                super().__init__()
                self.sink = sink

            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                if epoch > 0:  # epoch 0 of every fit includes tracing (NanGuard re-traces per fit by design)
                    self.sink.append(time.perf_counter() - self.start)

        for _ in range(a.rounds):
            for name, model, callbacks in (("bare", bare, []), ("guard", guarded, [guard])):
                model.fit(x, y, batch_size=a.batch, epochs=3, verbose=0, shuffle=False,
                          callbacks=callbacks + [EpochTimer(times[name])])
        ratio = statistics.median(times["guard"]) / statistics.median(times["bare"])
        print(f"  {label:14s} bare {statistics.median(times['bare']):6.3f} s/epoch   +NanGuard "
              f"{statistics.median(times['guard']):6.3f} s/epoch   ratio {ratio:5.3f}")


if __name__ == "__main__":
    main()
