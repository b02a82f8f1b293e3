"""accum="auto": the cost of one OOM recovery, and the steady-state speed vs a run started at the right accum.

Same model, data and batch in one process, side by side, rounds interleaved:

- ``wrap(accum=N)``: started at the right accum (the baseline);
- ``auto, max_micro_batch_size``: auto mode told the right micro-batch up front (no OOM): the steady-state cost
  of auto mode itself (one Python ``next`` per batch, the on-device state copy before each step, the update
  waiting for every gradient);
- ``auto from unsplit``: starts at accum=1 and runs out of memory (a real allocator OOM, as in the tests) until
  the micro-batch fits: log2(N) recoveries at the first batch.

Printed: the first batch's wall time (trace + recoveries), the cost of ONE recovery = (first batch of "auto from
unsplit" - first batch of the baseline) / recoveries, in seconds, split into the time TF's allocator takes to
report one failed allocation (measured alone) and the rest (the failed attempt + the re-trace), and each configuration's steady-state
seconds per step over the later batches, as a ratio to the baseline. Two model sizes: a small step shows the
per-batch Python overhead, a larger one what a real step sees.

    python benchmarks/auto_accum.py [--rounds 3] [--steps 30] [--batch 256] [--accum 4]
    TF_ENABLE_ONEDNN_OPTS=0 python benchmarks/auto_accum.py     # a CPU allocator that reports an OOM at once
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's keras_scale

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

import keras_scale as ks  # noqa: E402


class OomAbove(keras.layers.Layer):
    """Identity; a real allocator OOM (2^35 floats per sample) when its batch exceeds ``threshold``."""

    def __init__(self, threshold, **kwargs):
        super().__init__(**kwargs)
        self.threshold = threshold

    def call(self, x):
        b = tf.shape(x)[0]

        def allocate():
            value = tf.random.uniform([]) * 0.0
            return tf.reduce_sum(tf.fill(tf.reshape(tf.cast(b, tf.int64) * (2 ** 35), [1]), value)) * 0.0

        return x + tf.cond(b > self.threshold, allocate, lambda: tf.constant(0.0))


class Timer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())


def run(how: str, width: int, steps: int, batch: int, accum: int, data):
    x, y = data
    keras.utils.set_random_seed(0)
    micro = batch // accum
    inner = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(width, activation="relu"),
                              OomAbove(micro), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(1)])
    if how == "fixed":
        model = ks.wrap(inner, accum=accum)
    elif how == "auto_right":
        model = ks.wrap(inner, accum="auto", max_micro_batch_size=micro)
    else:
        model = ks.wrap(inner, accum="auto")
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    if how != "fixed":
        model._keras_scale_auto.verbose = 0  # no change messages in the table
    timer = Timer()
    ds = tf.data.Dataset.from_tensor_slices((x[: steps * batch], y[: steps * batch])).batch(batch).prefetch(2)
    model.fit(ds, epochs=1, verbose=0, callbacks=[timer])
    assert model.accum == accum, (how, model.accum)
    first = timer.ends[0] - timer.start
    later = np.diff(timer.ends[len(timer.ends) // 3:])
    recoveries = model._keras_scale_auto.recoveries if how != "fixed" else 0
    return first, float(np.median(later)), recoveries


def bare_oom_s() -> float:
    """Seconds TF takes to report one failed allocation (its BFC allocator waits for memory to be freed first)."""
    @tf.function
    def allocate(n):
        return tf.reduce_sum(tf.fill(tf.reshape(tf.cast(n, tf.int64) * 2 ** 35, [1]), tf.random.uniform([]) * 0.0))

    allocate(tf.constant(0))  # trace
    start = time.perf_counter()
    try:
        allocate(tf.constant(64))
    except tf.errors.ResourceExhaustedError:
        pass
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--accum", type=int, default=4)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, 256)).astype("float32")
    y = rng.normal(size=(args.steps * args.batch, 1)).astype("float32")
    hows = [("fixed", f"wrap(accum={args.accum})"), ("auto_right", "auto, max_micro_batch_size"),
            ("auto_unsplit", "auto from unsplit")]
    print(f"batch {args.batch}, the right accum {args.accum}, {args.steps} steps, {args.rounds} rounds "
          f"(median), TF {tf.__version__}, Keras {keras.__version__}")
    wait_s = bare_oom_s()
    for width in (64, 1024):
        results = {h: [] for h, _ in hows}
        for _ in range(args.rounds):
            for how, _ in hows:
                results[how].append(run(how, width, args.steps, args.batch, args.accum, (x, y)))
        med = {h: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs), rs[0][2])
               for h, rs in results.items()}
        base_first, base_step, _ = med["fixed"]
        print(f"\nwidth {width}: steady-state {base_step * 1e3:.2f} ms/step at wrap(accum={args.accum})")
        print(f"  {'configuration':32s} {'first batch s':>14s} {'recoveries':>10s} {'s/step ratio':>13s}")
        for how, name in hows:
            first, step, rec = med[how]
            print(f"  {name:32s} {first:14.3f} {rec:10d} {step / base_step:13.3f}")
        first, _, rec = med["auto_unsplit"]
        if rec:
            cost = (first - base_first) / rec
            print(f"  cost of one OOM recovery: {cost:.3f} s, of which the allocator's wait before it reports the "
                  f"OOM {wait_s:.3f} s, the failed attempt + re-trace {cost - wait_s:.3f} s")
    print("\n(oneDNN's CPU allocator, TF's default here, waits up to 10 s for memory to be freed before it reports "
          "an OOM; TF_ENABLE_ONEDNN_OPTS=0 gives one that reports at once. max_micro_batch_size / "
          "ks.find_micro_batch avoid recoveries.)")


if __name__ == "__main__":
    main()
