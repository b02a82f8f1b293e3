"""Goodput overhead: step time of fit + Goodput vs bare fit at ~2 ms steps, interleaved in one process
(floor: median ratio <= 1.01).

Two bare and two Goodput copies of the same small MLP train alternately on the same in-memory data, so machine
load hits all of them alike. A step's time is the time between two consecutive ``on_train_batch_end`` calls
of a timer callback listed last (so it includes Goodput's hooks); epoch 0 of every fit (tracing) is dropped.
Printed: the ratio of median steady-state step times, paired per round (the claim), the ratio of mean step times (includes the
rare probe steps, which sleep ~1.5 step-times), the ratio of whole-epoch times, bare-vs-bare — the noise
floor of this measurement — and the time spent inside Goodput's batch hooks per step.

    python benchmarks/goodput.py [--rounds 6] [--steps 200] [--hidden 512] [--batch 64]
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
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=512)
    a = p.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_scale as ks

    rng = np.random.default_rng(0)
    n = a.steps * a.batch
    x = rng.normal(size=(n, 64)).astype("float32")
    y = rng.integers(0, 10, size=(n,))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(a.batch).cache().prefetch(tf.data.AUTOTUNE)

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(a.hidden, activation="relu"),
                                  keras.layers.Dense(a.hidden, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class Timer(keras.callbacks.Callback):
        def __init__(self, steps, epochs):
            super().__init__()
            self.steps, self.epochs = steps, epochs

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            self.last = self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if self.epoch > 0:  # epoch 0 of every fit traces
                self.steps.append(now - self.last)
            self.last = now

        def on_epoch_end(self, epoch, logs=None):
            if epoch > 0:
                self.epochs.append(time.perf_counter() - self.start)

    class TimedGoodput(ks.Goodput):
        """Goodput that also adds up the time spent in its per-step hooks (probe sleeps taken out)."""

        hook_s = 0.0
        hook_calls = 0

        def on_train_batch_begin(self, batch, logs=None):
            start, slept = time.perf_counter(), self._sleep_s
            super().on_train_batch_begin(batch, logs)
            TimedGoodput.hook_s += time.perf_counter() - start - (self._sleep_s - slept)
            TimedGoodput.hook_calls += 1

        def on_train_batch_end(self, batch, logs=None):
            start = time.perf_counter()
            super().on_train_batch_end(batch, logs)
            TimedGoodput.hook_s += time.perf_counter() - start

    names = ("bare", "goodput", "bare2", "goodput2")
    models = {name: build() for name in names}
    rounds = []  # per round: name -> (step times, epoch times)
    for _ in range(a.rounds):
        this = {name: ([], []) for name in names}
        for name in names:
            callbacks = [TimedGoodput(verbose=0)] if name.startswith("goodput") else []
            models[name].fit(ds, epochs=3, verbose=0, callbacks=callbacks + [Timer(*this[name])])
        rounds.append(this)

    def median_of(name_a, name_b, which=0):
        return statistics.median(v for r in rounds for k in (name_a, name_b) for v in r[k][which])

    def paired(num, den):
        # per round (runs minutes apart share the machine's load), then the median over rounds
        return statistics.median(statistics.median(r[num][0]) / statistics.median(r[den][0]) for r in rounds)

    med_b, med_g = median_of("bare", "bare2"), median_of("goodput", "goodput2")
    ratio = statistics.median([paired("goodput", "bare"), paired("goodput2", "bare2")])
    floor = paired("bare2", "bare")
    mean_b = statistics.mean(v for r in rounds for k in ("bare", "bare2") for v in r[k][0])
    mean_g = statistics.mean(v for r in rounds for k in ("goodput", "goodput2") for v in r[k][0])
    print(f"Goodput overhead: MLP 64-{a.hidden}-{a.hidden}-10, batch {a.batch}, {a.steps} steps/epoch, "
          f"{a.rounds} interleaved rounds x 2 timed epochs x 2 copies, CPU")
    print(f"  median step: bare {1e3 * med_b:.3f} ms, +Goodput {1e3 * med_g:.3f} ms; paired ratio (per round, "
          f"median over rounds) {ratio:.4f}   | noise floor (bare vs bare, paired): {floor:.4f}")
    print(f"  mean step (probes included): ratio {mean_g / mean_b:.4f}   | median epoch: ratio "
          f"{median_of('goodput', 'goodput2', 1) / median_of('bare', 'bare2', 1):.4f}")
    per_step = TimedGoodput.hook_s / max(TimedGoodput.hook_calls, 1)
    print(f"  inside Goodput's batch hooks: {1e6 * per_step:.1f} us per step = {100 * per_step / med_b:.2f}% of a "
          f"bare step (probe sleeps excluded: they are reported as measure_s)")
    noise = abs(floor - 1.0)
    verdict = "PASS" if ratio <= 1.01 else ("within the noise floor" if ratio - 1.0 <= noise else "FAIL")
    print(f"  floor <= 1.01 on the median step: {verdict}")


if __name__ == "__main__":
    main()
