"""What does each keras_scale callback cost per training step, alone and all together? And a second fit?

Per step: the median steady-state step time of ``model.fit`` with each callback alone and with all of them, as a
ratio to bare ``fit`` (and Keras's own ``TerminateOnNaN`` beside ``NanGuard``), at two step sizes: an MLP (~1-2 ms
per step on 2 CPU cores) and a small conv net (~15-30 ms). All arms train the SAME model in one process, in
interleaved rounds (arm order shuffled each round) so machine noise hits every arm alike. A timing callback
(present in every arm, bare included) reads the clock at each batch end; the first ``--skip`` steps of each fit
call are not timed, so set-up, tracing and the callbacks' begin/end work are out. Keras already converts every
step's logs to Python (one device-to-host sync per step, whatever the callbacks), so the timing callback adds no
sync of its own.

Second fit: the one-off cost of a second ``fit`` call on an already-trained model (no new trace expected), plain
Keras vs the same fit with NanGuard + LearningRateLogger + ChiefCheckpoint: the median wall time of a short
fit call, as a ratio.

GpuMonitor samples the real NVML when a GPU is visible; without one it samples the FAKE NVML from
tests/fakes/fake_nvml.py (the sampling thread and hooks run for real; only driver calls are fabricated).

Floors (issue 15): every callback alone <= 1.01, all together <= 1.02 at the MLP size; second fit <= 1.05.

Usage: python benchmarks/callbacks_overhead.py [--rounds 7] [--steps 60] [--skip 10] [--sizes mlp,conv]
"""
from __future__ import annotations

import argparse
import os
import random
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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StepClock(keras.callbacks.Callback):
    """Durations of the steps after step ``skip``, batch end to batch end (every hook of the step is inside)."""

    def __init__(self, skip: int) -> None:
        super().__init__()
        self.skip = skip
        self.last = 0.0
        self.durations_s: list = []

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if batch > self.skip:
            self.durations_s.append(now - self.last)
        self.last = now


def make_model(size: str) -> keras.Model:
    if size == "mlp":
        layers = [keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
    else:
        layers = [keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                  keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
                  keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(ks.WarmupCosine(1e-3, total_steps=10_000, warmup_steps=100)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def make_dataset(size: str, steps: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    batch, shape = (128, (256,)) if size == "mlp" else (64, (32, 32, 3))
    x = rng.random((batch * 16, *shape), dtype=np.float32)
    y = rng.integers(0, 10, batch * 16)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat().take(steps).cache().prefetch(2)


def fake_or_real_nvml():
    from keras_scale import nvml as nvml_lib

    try:
        real = nvml_lib.open_nvml()
        count = real.device_count()
        real.close()
        if count > 0:
            return None, "real NVML"
    except Exception:  # noqa: BLE001 - no driver / no library: use the fake
        pass
    sys.path.insert(0, REPO_ROOT)
    from tests.fakes.fake_nvml import FakeNvml

    return FakeNvml.with_gpus(1), "FAKE NVML (no GPU here; tests/fakes/fake_nvml.py)"


def make_arms(log_dir: str, nvml) -> dict:
    far = 10 ** 9  # ProfileWindow idle: its window never opens in the timed steps

    def all_of_them():
        return [ks.NanGuard(verbose=0), ks.LearningRateLogger(os.path.join(log_dir, "lr_all")),
                ks.GpuMonitor(interval_s=0.5, verbose=0, nvml=nvml),
                ks.ChiefCheckpoint(os.path.join(log_dir, "ckpt_all"), save_freq="epoch", verbose=0, restore=False),
                ks.ProfileWindow(os.path.join(log_dir, "prof_all"), start_step=far, num_steps=2),
                ks.HostMemoryWatch()]

    return {
        "bare": [],
        "TerminateOnNaN (Keras)": [keras.callbacks.TerminateOnNaN()],
        "NanGuard": [ks.NanGuard(verbose=0)],
        "LearningRateLogger": [ks.LearningRateLogger(os.path.join(log_dir, "lr"))],
        "GpuMonitor": [ks.GpuMonitor(interval_s=0.5, verbose=0, nvml=nvml)],
        "ChiefCheckpoint(epoch)": [ks.ChiefCheckpoint(os.path.join(log_dir, "ckpt"), save_freq="epoch", verbose=0, restore=False)],
        "ProfileWindow (idle)": [ks.ProfileWindow(os.path.join(log_dir, "prof"), start_step=far, num_steps=2)],
        "HostMemoryWatch": [ks.HostMemoryWatch()],
        "all six": all_of_them(),
    }


def run_arm(model, size, steps, skip, callbacks) -> list:
    clock = StepClock(skip)
    model.fit(make_dataset(size, steps), epochs=1, verbose=0, callbacks=[*callbacks, clock])
    return clock.durations_s


def per_step(size: str, rounds: int, steps: int, skip: int, nvml) -> None:
    model = make_model(size)
    log_dir = tempfile.mkdtemp(prefix=f"callbacks_overhead_{size}_")
    arms = make_arms(log_dir, nvml)
    times = {name: [] for name in arms}
    for name, callbacks in arms.items():  # warm-up: tracing and first-call costs, untimed
        run_arm(model, size, skip + 3, skip, callbacks)
    order = list(arms)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            times[name].extend(run_arm(model, size, steps, skip, arms[name]))
    bare = statistics.median(times["bare"])
    print(f"\n== {size}: median steady-state step time, {rounds} interleaved rounds x {steps - skip - 1} steps")
    print(f"{'arm':28s} {'median ms':>10s} {'ratio':>7s}")
    for name in arms:
        med = statistics.median(times[name])
        print(f"{name:28s} {med * 1e3:10.3f} {med / bare:7.3f}")


def second_fit(rounds: int) -> None:
    """Wall time of a short second fit call: plain Keras vs with NanGuard + LR logger + checkpoint."""
    log_dir = tempfile.mkdtemp(prefix="callbacks_second_fit_")
    plain, pack = make_model("mlp"), make_model("mlp")
    ds = make_dataset("mlp", 5)

    def pack_callbacks(tag):
        return [ks.NanGuard(verbose=0), ks.LearningRateLogger(os.path.join(log_dir, f"lr{tag}")),
                ks.ChiefCheckpoint(os.path.join(log_dir, f"ckpt{tag}"), save_freq="epoch", verbose=0, restore=False)]

    plain.fit(ds, epochs=1, verbose=0)
    pack.fit(ds, epochs=1, verbose=0, callbacks=pack_callbacks(0))
    walls = {"plain Keras": [], "with the pack": []}
    for r in range(rounds):
        for name, model, cbs in (("plain Keras", plain, lambda: []), ("with the pack", pack,
                                                                        lambda: pack_callbacks(r + 1))):
            callbacks = cbs()
            t = time.perf_counter()
            model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
            walls[name].append(time.perf_counter() - t)
    base = statistics.median(walls["plain Keras"])
    traces = ks.step.get_step(pack).traces
    print(f"\n== second fit call (5 steps, 1 epoch), median of {rounds}; composed-step traces over all fits: {traces}")
    for name, values in walls.items():
        print(f"{name:28s} {statistics.median(values) * 1e3:10.1f} ms {statistics.median(values) / base:7.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60, help="steps per fit call")
    parser.add_argument("--skip", type=int, default=10, help="untimed steps at the start of each fit call")
    parser.add_argument("--sizes", default="mlp,conv")
    args = parser.parse_args(argv)
    nvml, nvml_desc = fake_or_real_nvml()
    print(f"callbacks_overhead: GpuMonitor samples the {nvml_desc}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for size in args.sizes.split(","):
            per_step(size, args.rounds, args.steps if size == "mlp" else max(args.skip + 12, args.steps // 3),
                     args.skip, nvml)
        second_fit(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
