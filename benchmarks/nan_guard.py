"""NanGuard overhead: epoch time of fit + NanGuard vs bare fit, interleaved in one process (floor: <= 1.02).

Two bare and two guarded copies of the same model train alternately on the same data (epoch 0 of every fit,
which traces, is dropped), so machine load hits all of them alike. Printed per model kind: the ratio of the
fastest epochs (robust to load bursts on a shared machine), the ratio of medians, and bare-vs-bare — the noise
floor of this measurement.

    python benchmarks/nan_guard.py [--rounds 6] [--steps 40]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=6)
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

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self, sink):
            super().__init__()
            self.sink = sink

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch > 0:  # epoch 0 of every fit includes tracing (NanGuard re-traces per fit by design)
                self.sink.append(time.perf_counter() - self.start)

    print(f"NanGuard overhead: conv net 32x32x3 + BatchNorm, batch {a.batch}, {a.steps} steps/epoch, "
          f"{a.rounds} interleaved rounds x 2 timed epochs, CPU")
    for label, accum in (("plain model", None), ("wrap(accum=4)", 4)):
        runs = {"bare": (build(accum), []), "guard": (build(accum), [ks.NanGuard(verbose=0)]),
                "bare2": (build(accum), []), "guard2": (build(accum), [ks.NanGuard(verbose=0)])}
        times = {k: [] for k in runs}
        for _ in range(a.rounds):
            for name, (model, callbacks) in runs.items():
                model.fit(x, y, batch_size=a.batch, epochs=3, verbose=0, shuffle=False,
                          callbacks=callbacks + [EpochTimer(times[name])])
        bare = times["bare"] + times["bare2"]
        guard = times["guard"] + times["guard2"]
        print(f"  {label:14s} fastest epoch: bare {min(bare):.3f} s, +NanGuard {min(guard):.3f} s -> ratio "
              f"{min(guard) / min(bare):.3f}   | medians: ratio {statistics.median(guard) / statistics.median(bare):.3f}"
              f"   | noise floor (bare vs bare, fastest): {min(times['bare2']) / min(times['bare']):.3f}")


if __name__ == "__main__":
    main()
