"""What does each keras_scale callback cost per training step, alone and all together? And a second fit?

Per step: the median steady-state step time of ``model.fit`` with each callback alone and with all of them, as a
ratio to bare ``fit`` (and Keras's own ``TerminateOnNaN`` beside ``NanGuard``), at two step sizes: an MLP (~1-2 ms
per step on 2 CPU cores) and a small conv net (~15-30 ms). All arms train the SAME model in one process, in
interleaved rounds (arm order shuffled each round) so machine noise hits every arm alike. A timing callback
(present in every arm, bare included) reads the clock at each batch end; the first ``--skip`` steps of each fit
call are not timed, so set-up, tracing and the callbacks' begin/end work are out. Keras already converts every
step's logs to Python (one device-to-host sync per step, whatever the callbacks), so the timing callback adds no
sync of its own.

Second fit: the one-off cost of a second ``fit`` call on an already-trained model (no new trace expected): each
piece's short fit call beside plain Keras's and beside its Keras counterpart (NanGuard / TerminateOnNaN,
LearningRateLogger / TensorBoard, ChiefCheckpoint / BackupAndRestore, both saving once per call).

Note on host syncs: on the TensorFlow backend Keras converts every step's logs to Python on the training thread
whatever the callbacks (``keras/src/callbacks/callback_list.py``: async dispatch needs ``backend.IS_THREAD_SAFE``,
which is ``False`` in ``keras/src/backend/tensorflow/core.py``), so no callback adds or removes a per-step sync.

GpuMonitor samples the real NVML when a GPU is visible; without one it samples the FAKE NVML from
tests/fakes/fake_nvml.py (the sampling thread and hooks run for real; only driver calls are fabricated).

Floors (issue 15): every callback alone <= 1.01, all together <= 1.02 at the MLP size; second fit <= 1.05
(NanGuard vs plain Keras); issue 28: all six <= 1.05 at ~2 ms steps, <= 1.02 at >= 20 ms. NanGuard's default
checks every gradient before any variable changes; on one replica the update is computed ahead and only its writes
wait (keras_scale/deferred_update.py): benchmarks/nan_guard_cost.py measures the parts. The arm "bare (again)" is
the control: two identical arms differ by this run's noise.

Usage: python benchmarks/callbacks_overhead.py [--rounds 7] [--steps 60] [--skip 10] [--sizes mlp,conv]
       [--no-second-fit]
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


def make_model(size: str, optimizer: keras.optimizers.Optimizer = None) -> keras.Model:
    """The benchmarks' MLP or conv net, compiled with ``optimizer`` (default: Adam over a WarmupCosine schedule)."""
    if size == "mlp":
        layers = [keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
    else:
        layers = [keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                  keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
                  keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    if optimizer is None:
        optimizer = keras.optimizers.Adam(ks.WarmupCosine(1e-3, total_steps=10_000, warmup_steps=100))
    model.compile(optimizer=optimizer,
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

    def all_of_them(check_gradients=True):
        return [ks.NanGuard(verbose=0, check_gradients=check_gradients), ks.LearningRateLogger(os.path.join(log_dir, "lr_all")),
                ks.GpuMonitor(interval_s=0.5, verbose=0, nvml=nvml),
                ks.ChiefCheckpoint(os.path.join(log_dir, "ckpt_all"), save_freq="epoch", verbose=0, restore=False),
                ks.ProfileWindow(os.path.join(log_dir, "prof_all"), start_step=far, num_steps=2),
                ks.HostMemoryWatch()]

    return {
        "bare": [],
        "bare (again)": [],  # the control arm: how far two identical arms differ in this run
        "TerminateOnNaN (Keras)": [keras.callbacks.TerminateOnNaN()],
        "NanGuard": [ks.NanGuard(verbose=0)],
        "NanGuard(check_gradients=False)": [ks.NanGuard(verbose=0, check_gradients=False)],
        "LearningRateLogger": [ks.LearningRateLogger(os.path.join(log_dir, "lr"))],
        "GpuMonitor": [ks.GpuMonitor(interval_s=0.5, verbose=0, nvml=nvml)],
        "ChiefCheckpoint(epoch)": [ks.ChiefCheckpoint(os.path.join(log_dir, "ckpt"), save_freq="epoch", verbose=0, restore=False)],
        "ProfileWindow (idle)": [ks.ProfileWindow(os.path.join(log_dir, "prof"), start_step=far, num_steps=2)],
        "HostMemoryWatch": [ks.HostMemoryWatch()],
        "all six": all_of_them(),
        "all six, NanGuard loss only": all_of_them(check_gradients=False),
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
    print(f"{'arm':32s} {'median ms':>10s} {'ratio':>7s}")
    for name in arms:
        med = statistics.median(times[name])
        print(f"{name:32s} {med * 1e3:10.3f} {med / bare:7.3f}")


def second_fit(rounds: int) -> None:
    """Wall time of a short second ``fit`` call on an already-trained model: each piece beside plain Keras (and
    beside its Keras counterpart where one exists), fresh callback instances every call, as a user fitting in a
    loop would. A per-fit re-trace shows here as ~100+ ms."""
    log_dir = tempfile.mkdtemp(prefix="callbacks_second_fit_")
    ds = make_dataset("mlp", 5)
    arms = {  # name: (callback factory, Keras counterpart's arm or None)
        "plain Keras": (lambda i: [], None),
        "TerminateOnNaN (Keras)": (lambda i: [keras.callbacks.TerminateOnNaN()], None),
        "NanGuard": (lambda i: [ks.NanGuard(verbose=0)], "TerminateOnNaN (Keras)"),
        "NanGuard(check_gradients=False)": (lambda i: [ks.NanGuard(verbose=0, check_gradients=False)],
                                            "TerminateOnNaN (Keras)"),
        "TensorBoard (Keras)": (lambda i: [keras.callbacks.TensorBoard(os.path.join(log_dir, f"tb{i}"))], None),
        "LearningRateLogger": (lambda i: [ks.LearningRateLogger(os.path.join(log_dir, f"lr{i}"))],
                               "TensorBoard (Keras)"),
        "BackupAndRestore (Keras)": (lambda i: [keras.callbacks.BackupAndRestore(os.path.join(log_dir, f"br{i}"))],
                                     None),
        "ChiefCheckpoint": (lambda i: [ks.ChiefCheckpoint(os.path.join(log_dir, f"ck{i}"), verbose=0,
                                                          restore=False)], "BackupAndRestore (Keras)"),
        "Goodput": (lambda i: [ks.Goodput(verbose=0)], None),
        "NanGuard+LRLogger+Goodput": (lambda i: [ks.NanGuard(verbose=0), ks.Goodput(verbose=0),
                                                 ks.LearningRateLogger(os.path.join(log_dir, f"p{i}"))], None),
    }
    models = {name: make_model("mlp") for name in arms}
    for name, (factory, _) in arms.items():  # the first fit: traces, builds, first save
        models[name].fit(ds, epochs=1, verbose=0, callbacks=factory(0))
    walls = {name: [] for name in arms}
    order = list(arms)
    for r in range(rounds):
        random.Random(100 + r).shuffle(order)
        for name in order:
            callbacks = arms[name][0](r + 1)
            t = time.perf_counter()
            models[name].fit(ds, epochs=1, verbose=0, callbacks=callbacks)
            walls[name].append(time.perf_counter() - t)
    med = {name: statistics.median(v) for name, v in walls.items()}
    base = med["plain Keras"]
    print(f"\n== second fit call (5 steps, 1 epoch, fresh callbacks), median of {rounds} interleaved rounds")
    print(f"{'arm':32s} {'ms':>8s} {'+ms':>7s} {'/ plain':>8s} {'/ Keras counterpart':>20s}")
    for name, (_, counterpart) in arms.items():
        vs = f"{med[name] / med[counterpart]:8.3f} ({counterpart})" if counterpart else ""
        print(f"{name:32s} {med[name] * 1e3:8.1f} {(med[name] - base) * 1e3:7.1f} {med[name] / base:8.3f}   {vs}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60, help="steps per fit call")
    parser.add_argument("--skip", type=int, default=10, help="untimed steps at the start of each fit call")
    parser.add_argument("--sizes", default="mlp,conv")
    parser.add_argument("--no-second-fit", action="store_true", help="per-step figures only")
    args = parser.parse_args(argv)
    nvml, nvml_desc = fake_or_real_nvml()
    print(f"callbacks_overhead: GpuMonitor samples the {nvml_desc}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for size in args.sizes.split(","):
            per_step(size, args.rounds, args.steps if size == "mlp" else max(args.skip + 12, args.steps // 3),
                     args.skip, nvml)
        if not args.no_second_fit:
            second_fit(args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
