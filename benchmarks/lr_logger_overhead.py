"""What does LearningRateLogger cost per epoch? Bare fit vs fit + LearningRateLogger, side by side.

Three arms train the same MLP with a WarmupCosine schedule in one process, interleaved (A B C, C B A, ...):

- bare ``model.fit``;
- ``ks.LearningRateLogger(every_n_steps=1)``: no batch hook; at each epoch end one read of ``iterations``, one
  vectorised evaluation of the schedule, one TensorBoard point per update;
- a per-step logger as LearningRateLogger was before (reads ``iterations`` and the LR on the host and writes a
  TensorBoard point in ``on_train_batch_begin``), for reference.

Each epoch is timed from its ``on_epoch_begin`` (a clock first in the callback list) to its ``on_epoch_end`` (a
clock last in the list), so the epoch-end writing of the logger is inside the timed span. The first epoch of each
fit call (tracing) is dropped. Ratios are medians of the per-epoch times, bare = 1.

Usage: python benchmarks/lr_logger_overhead.py [--rounds 8] [--epochs 4] [--steps 64]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_scale as ks  # noqa: E402

BATCH = 128


class EpochStart(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()


class EpochEnd(keras.callbacks.Callback):
    def __init__(self, start: EpochStart) -> None:
        super().__init__()
        self.start = start
        self.durations_s: list = []

    def on_epoch_end(self, epoch, logs=None):
        if epoch > 0:
            self.durations_s.append(time.perf_counter() - self.start.t0)


class PerStepLrLogger(keras.callbacks.Callback):
    """The previous LearningRateLogger: a host read and a TensorBoard point in every step's batch hook."""

    def __init__(self, log_dir: str) -> None:
        super().__init__()
        self.writer = tf.summary.create_file_writer(os.path.join(log_dir, "learning_rate"))

    def on_train_batch_begin(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        with self.writer.as_default():
            tf.summary.scalar("learning_rate", float(self.model.optimizer.learning_rate), step=step)


def make_model() -> keras.Model:
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    schedule = ks.WarmupCosine(1e-3, total_steps=10 ** 6, warmup_steps=1000)
    model.compile(optimizer=keras.optimizers.Adam(schedule),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_dataset() -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * 64, 256), dtype=np.float32)
    y = rng.integers(0, 10, BATCH * 64)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().prefetch(2)


def run_arm(model, dataset, epochs, steps, callbacks) -> list:
    start = EpochStart()
    end = EpochEnd(start)
    model.fit(dataset, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=[start, *callbacks, end])
    return end.durations_s


def timed(hook, durations_s: list):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return hook(*args, **kwargs)
        finally:
            durations_s.append(time.perf_counter() - t)

    return wrapper


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4, help="epochs per fit call (the first is not timed)")
    parser.add_argument("--steps", type=int, default=64, help="steps per epoch")
    args = parser.parse_args(argv)

    model, dataset = make_model(), make_dataset()  # one model for all arms: same memory layout, same step
    log_dir = tempfile.mkdtemp(prefix="lr_logger_overhead_")
    arms = {
        "bare": lambda: [],
        "LearningRateLogger": lambda: [ks.LearningRateLogger(log_dir, every_n_steps=1)],
        "per-step (previous)": lambda: [PerStepLrLogger(log_dir)],
    }
    times = {name: [] for name in arms}
    written, hook_s = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, make in arms.items():  # warm-up, untimed
            run_arm(model, dataset, 2, 8, make())
        for r in range(args.rounds):
            order = list(arms.items())
            if r % 2:
                order.reverse()
            for name, make in order:
                callbacks = make()
                if name == "LearningRateLogger":
                    callbacks[0].on_epoch_end = timed(callbacks[0].on_epoch_end, hook_s)
                times[name] += run_arm(model, dataset, args.epochs, args.steps, callbacks)
                if name == "LearningRateLogger":
                    written.append(callbacks[0].points_written)

    bare = statistics.median(times["bare"])
    print(f"{args.rounds} interleaved rounds x {args.epochs - 1} timed epochs x {args.steps} steps, batch {BATCH}, "
          f"MLP 256-512-512-10, WarmupCosine; {tf.config.list_logical_devices()[0].device_type}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<22}: median epoch {1000 * median:8.1f} ms ({1000 * median / args.steps:6.3f} ms/step), "
              f"ratio vs bare {median / bare:.3f}")
    print(f"  LearningRateLogger's epoch-end hook (read iterations, evaluate the schedule, write): median "
          f"{1000 * statistics.median(hook_s):.2f} ms per epoch = {1000 * statistics.median(hook_s) / args.steps:.3f} "
          "ms per update")
    print(f"  LearningRateLogger wrote {written[-1]} points per fit call ({args.epochs} epochs x {args.steps} "
          "updates: one per update)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
