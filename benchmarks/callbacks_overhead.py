"""What do GpuMonitor + ProfileWindow cost per training step? Bare fit vs fit with both, side by side.

Both arms train the same small MLP in one process, interleaved (A B, B A, A B, ...) so machine noise hits both.
Only steady steps are timed: a timing callback (last in the list, present in both arms) reads the clock after
step ``--skip`` and after the last step, so fit set-up, tracing and the callbacks' train-begin/end work are out.
ProfileWindow's window is placed outside the timed steps (``start_step`` beyond them): this measures its cost
when idle, which is what every step of a long run pays. The one-off cost of a window that does open (profiler
start/stop plus the printed summary) is measured separately at the end and reported, not compared.

GpuMonitor samples the real NVML when a GPU is visible; without one it samples the FAKE NVML from
tests/fakes/fake_nvml.py (the sampling thread and the batch-hook timestamps run for real; only the driver
calls are fabricated) -- the output says which.

Floor: the per-step time with the callbacks is at most 2% above the bare one (ratio <= 1.02), compared at the
10th percentile of all timed steps of each arm (robust to bursts of load from other processes; the median ratio
and the time spent inside the hooks, measured directly, are printed next to it).

Usage: python benchmarks/callbacks_overhead.py [--rounds 30] [--steps 65] [--skip 5]
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

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR_RATIO = 1.02
BATCH = 128


class StepClock(keras.callbacks.Callback):
    """The duration of each step after step ``skip``: batch-end to batch-end, so every hook of the step is in."""

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


class HookTimer:
    """Wraps the batch hooks of callbacks (instance attributes) and adds up the time spent inside them."""

    def __init__(self, callbacks) -> None:
        self.total_s = 0.0
        self.calls = 0
        for cb in callbacks:
            for name in ("on_train_batch_begin", "on_train_batch_end"):
                setattr(cb, name, self._timed(getattr(cb, name)))

    def _timed(self, hook):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.total_s += time.perf_counter() - t
                self.calls += 1

        return timed


def make_model() -> keras.Model:
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def make_dataset(steps: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.random((BATCH * 64, 256), dtype=np.float32)
    y = rng.integers(0, 10, BATCH * 64)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().take(steps).prefetch(2)


def gpu_monitor_nvml():
    """(nvml argument for GpuMonitor, description): the real NVML with GPUs, else the fake."""
    from keras_scale import nvml as nvml_lib

    try:
        real = nvml_lib.open_nvml()
        if real.device_count() > 0:
            real.close()
            return None, "real NVML"
        real.close()
    except Exception:  # noqa: BLE001 - no driver / no library: use the fake
        pass
    sys.path.insert(0, REPO_ROOT)
    from tests.fakes.fake_nvml import FakeNvml

    return FakeNvml.with_gpus(1), "FAKE NVML (no GPU here; tests/fakes/fake_nvml.py)"


def run_arm(model, steps, skip, callbacks) -> list:
    clock = StepClock(skip)
    model.fit(make_dataset(steps), epochs=1, verbose=0, callbacks=[*callbacks, clock])
    return clock.durations_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=65, help="steps per fit call")
    parser.add_argument("--only", choices=("both", "monitor", "window"), default="both",
                        help="which callbacks the second arm adds (default both)")
    parser.add_argument("--skip", type=int, default=5, help="untimed steps at the start of each fit call")
    args = parser.parse_args(argv)

    nvml, nvml_desc = gpu_monitor_nvml()
    # one model for both arms: two model instances can differ by a few % (memory layout), which is not the
    # callbacks' cost; the step's cost does not depend on the weights' values
    model = make_model()
    log_dir = tempfile.mkdtemp(prefix="callbacks_overhead_")
    far = 10 ** 9  # the window never opens inside the timed runs
    monitor = ks.GpuMonitor(interval_s=0.1, verbose=0, nvml=nvml)
    window = ks.ProfileWindow(log_dir, start_step=far, num_steps=5)
    callbacks = {"both": [monitor, window], "monitor": [monitor], "window": [window]}[args.only]

    hooks = HookTimer(callbacks)

    # warm-up both (tracing, first-call costs), untimed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_arm(model, args.skip + 5, args.skip, [])
        run_arm(model, args.skip + 5, args.skip, callbacks)

        bare, with_cb = [], []
        for r in range(args.rounds):
            order = [("bare", []), ("cb", callbacks)]
            if r % 2:
                order.reverse()
            for name, cbs in order:
                (bare if name == "bare" else with_cb).append(run_arm(model, args.steps, args.skip, cbs))

    # Per-step times of each arm over all its timed steps. On a machine shared with other processes, load comes
    # in bursts that slow whole stretches of one arm; the 10th percentile is the step's cost without that
    # interference (as timeit's min), the median is shown next to it.
    def pct(rounds, q):
        flat = sorted(d for r in rounds for d in r)
        return 1000 * flat[min(len(flat) - 1, int(q * len(flat)))]

    ratios = [statistics.median(c) / statistics.median(b) for b, c in zip(bare, with_cb)]
    bare_p10, cb_p10 = pct(bare, 0.10), pct(with_cb, 0.10)
    bare_ms, cb_ms = pct(bare, 0.5), pct(with_cb, 0.5)
    ratio = cb_p10 / bare_p10
    print(f"GpuMonitor(interval_s=0.1) on {nvml_desc}; ProfileWindow idle (window outside the timed steps)")
    print(f"{args.rounds} interleaved rounds x {args.steps - args.skip - 1} timed steps, batch {BATCH}, "
          f"MLP 256-512-512-10 on {tf.config.list_logical_devices()[0].device_type}, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"  bare fit                    : p10 {bare_p10:7.3f} ms/step, median {bare_ms:7.3f} ms/step")
    print(f"  + {args.only:<26}: p10 {cb_p10:7.3f} ms/step, median {cb_ms:7.3f} ms/step")
    print(f"  ratio p10: {ratio:.4f}   ratio median: {cb_ms / bare_ms:.4f}   per-round ratios of medians: "
          + " ".join(f"{x:.2f}" for x in ratios))
    hook_us = 1e6 * hooks.total_s / (hooks.calls / (2 * len(callbacks)))  # two hooks per callback per step
    print(f"  time inside the added callbacks' batch hooks (timer overhead included): {hook_us:.1f} us/step = "
          f"{100 * hook_us / (1000 * bare_p10):.3f}% of the bare p10 step (direct, insensitive to machine load)")
    ok = ratio <= FLOOR_RATIO
    print(f"  floor: ratio p10 <= {FLOOR_RATIO:.2f}: {'PASS' if ok else 'FAIL'}")

    # One-off cost of a window that opens: the time inside its hooks (profiler start, 5 marked steps, stop,
    # xprof summary), measured directly; for the docs, not compared.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opened = ks.ProfileWindow(log_dir, start_step=args.skip, num_steps=5, print_summary=True)
        window_hooks = HookTimer([opened])
        run_arm(model, args.skip + 10, args.skip, [opened])
    print(f"  one 5-step window that opens (start, markers, stop, summary): {window_hooks.total_s:.2f} s once, "
          "inside its hooks")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
