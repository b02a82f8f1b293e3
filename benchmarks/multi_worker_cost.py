"""What does each keras_scale callback cost per step on 1, 2 and 4 loopback workers, and how long from a SIGTERM to
one worker until every worker has saved and exited?

Step cost: every worker (``MultiWorkerMirroredStrategy``, started by ``keras_scale.launch.launch_local_workers``)
trains the SAME small MLP (the worst case for per-step costs: a few ms per step, mostly overhead) with each callback
alone and all together, as a ratio to bare ``fit``, in interleaved rounds (the arm order shuffled per round, the same
on every worker) so machine noise hits every arm alike. A timing callback in every arm reads the clock at each batch
end; the first ``--skip`` steps of each fit are not timed. The chief's medians are reported (the workers are in
lock-step: every step holds an all-reduce). Arms:

- ``ChiefCheckpoint`` with its defaults: the workers agree on a preemption step through TensorFlow's coordination
  service (no per-step collective);
- ``ChiefCheckpoint, all-reduce agreement``: the same with the agreement by an eager all-reduce after every step
  (what the defaults did before, and what a cluster without a coordination service still gets);
- ``NanGuard``, ``GpuMonitor`` (the FAKE NVML of tests/fakes/ without a GPU: its thread and hooks run for real),
  ``Goodput``, ``Heartbeat``, ``ProfileWindow`` (idle: its window never opens in the timed steps), all together;
- ``bare (again)``: the control (two identical arms differ by this run's noise).

Signal-to-exit: the workers train with ``ChiefCheckpoint`` defaults; after step ~40 the LAST worker alone gets
SIGTERM. Reported: signal -> every worker decided to stop (the agreement: the signalled worker's next step boundary,
then one more step), -> state saved (the chief's write), -> the last worker process gone (Keras's train end,
TensorFlow's teardown), and that every worker stopped at the same step and exited 42.

Goal (issue 40): ChiefCheckpoint with its defaults <= 1.03x bare on 2 workers.

Usage: python benchmarks/multi_worker_cost.py [--workers 1,2,4] [--rounds 3] [--steps 200] [--skip 20]
       [--latency-runs 2] [--no-latency]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ["bare", "bare (again)", "ChiefCheckpoint", "ChiefCheckpoint, all-reduce agreement", "NanGuard", "GpuMonitor",
        "Goodput", "Heartbeat", "ProfileWindow (idle)", "all together"]


# ------------------------------------------------------------------------------------------------ worker side
def _worker_setup():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_scale.distribute import patch_keras_multi_worker

    patch_keras_multi_worker()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
    x = np.random.RandomState(0).rand(64 * 50, 32).astype("float32")
    y = x.sum(1, keepdims=True)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(64).with_options(options)
    return keras, tf, strategy, model, ds


def _arm_callbacks(arm, base, nvml, task):
    import keras_scale as ks
    from keras_scale.callbacks.checkpoint import preemption
    from keras_scale.callbacks.heartbeat import Heartbeat

    far = 10 ** 9

    def ckpt(tag):
        return ks.ChiefCheckpoint(os.path.join(base, tag))

    def one(name, tag):
        if name == "ChiefCheckpoint":
            return [ckpt(tag)]
        if name == "NanGuard":
            return [ks.NanGuard(verbose=0)]
        if name == "GpuMonitor":
            return [ks.GpuMonitor(interval_s=0.5, verbose=0, nvml=nvml)]
        if name == "Goodput":
            return [ks.Goodput(os.path.join(base, tag + "_goodput"), verbose=0)]
        if name == "Heartbeat":
            return [Heartbeat(os.path.join(base, f"{tag}_beat_{task}.json"))]
        if name == "ProfileWindow (idle)":
            return [ks.ProfileWindow(os.path.join(base, tag + "_prof"), start_step=far, num_steps=2, verbose=0)]
        return []

    if arm == "ChiefCheckpoint, all-reduce agreement":
        preemption.SignalChannel.for_strategy = classmethod(lambda cls, strategy: None)  # the fallback path
        return [ckpt(arm.replace(" ", "_").replace(",", ""))]
    preemption.SignalChannel.for_strategy = _ORIGINAL_FOR_STRATEGY[0]
    if arm == "all together":
        return [cb for name in ("NanGuard", "GpuMonitor", "Goodput", "Heartbeat", "ProfileWindow (idle)",
                                "ChiefCheckpoint") for cb in one(name, "all_" + name)]
    return one(arm, arm.replace(" ", "_"))


_ORIGINAL_FOR_STRATEGY = [None]


def _fake_or_real_nvml():
    from keras_scale import nvml as nvml_lib

    try:
        real = nvml_lib.open_nvml()
        count = real.device_count()
        real.close()
        if count > 0:
            return None
    except Exception:  # noqa: BLE001 - no driver: the fake
        pass
    sys.path.insert(0, REPO_ROOT)
    from tests.fakes.fake_nvml import FakeNvml

    return FakeNvml.with_gpus(1)


def worker_cost(base, rounds, steps, skip, out):
    keras, tf, strategy, model, ds = _worker_setup()
    from keras_scale.callbacks.checkpoint import preemption

    _ORIGINAL_FOR_STRATEGY[0] = preemption.SignalChannel.for_strategy
    task = strategy.cluster_resolver.task_id if strategy.cluster_resolver.task_type else 0
    nvml = _fake_or_real_nvml()

    class StepClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.last, self.durations_s = 0.0, []

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if batch > skip:
                self.durations_s.append(now - self.last)
            self.last = now

    model.fit(ds, epochs=1, steps_per_epoch=skip + 5, verbose=0)  # trace once
    medians = {arm: [] for arm in ARMS}
    for r in range(rounds):
        order = list(ARMS)
        random.Random(r).shuffle(order)  # the same order on every worker
        for arm in order:
            clock = StepClock()
            callbacks = _arm_callbacks(arm, os.path.join(base, f"r{r}"), nvml, task)
            own = _time_own_code(callbacks[0]) if arm.startswith("ChiefCheckpoint") else None
            model.fit(ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[*callbacks, clock])
            medians[arm].append(statistics.median(clock.durations_s))
            if own is not None:
                medians.setdefault(arm + " own", []).append(statistics.median(own[skip:]))
    with open(out + f".{task}", "w") as f:
        json.dump(medians, f)


def _time_own_code(ckpt):
    """Per-step seconds spent in ChiefCheckpoint's own code: its batch hooks and its train-function wrapper minus
    the wrapped step (a figure the machine's noise barely moves, unlike a ratio of step times)."""
    per_step = []
    pending = [0.0]

    def timed(name):
        original = getattr(ckpt, name)

        def call(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                pending[0] += time.perf_counter() - started
                if name == "on_train_batch_end":
                    per_step.append(pending[0])
                    pending[0] = 0.0
        setattr(ckpt, name, call)

    timed("on_train_batch_begin")
    timed("on_train_batch_end")
    original_call = ckpt._train_call

    def train_call(inner, iterator):
        inside = [0.0]

        def timed_inner(it):
            started = time.perf_counter()
            try:
                return inner(it)
            finally:
                inside[0] += time.perf_counter() - started
        started = time.perf_counter()
        try:
            return original_call(timed_inner, iterator)
        finally:
            pending[0] += time.perf_counter() - started - inside[0]
    ckpt._train_call = train_call
    return per_step


def worker_latency(base, out):
    keras, tf, strategy, model, ds = _worker_setup()
    import keras_scale as ks

    task = strategy.cluster_resolver.task_id if strategy.cluster_resolver.task_type else 0
    stamps = {}

    class Before(keras.callbacks.Callback):  # listed before ChiefCheckpoint: its train end runs after the save
        def on_train_batch_end(self, batch, logs=None):
            if batch % 10 == 0:
                print("STEP", batch, flush=True)

        def on_train_end(self, logs=None):
            stamps["saved"] = time.time()

    class After(keras.callbacks.Callback):  # after ChiefCheckpoint: sees the step it decided to stop at
        def on_train_batch_end(self, batch, logs=None):
            if self.model.stop_training and "stop" not in stamps:
                stamps["stop"] = time.time()

    ckpt = ks.ChiefCheckpoint(base)
    try:
        model.fit(ds, epochs=1, steps_per_epoch=10 ** 6, verbose=0, callbacks=[Before(), ckpt, After()])
    finally:
        stamps["global_step"] = ckpt.global_step
        with open(out + f".{task}", "w") as f:
            json.dump(stamps, f)


# ------------------------------------------------------------------------------------------------ parent side
def _env():
    env = dict(os.environ)
    env.update({"PYTHONPATH": REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""), "TF_CPP_MIN_LOG_LEVEL": "2",
                "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", ""), "PYTHONUNBUFFERED": "1"})
    return env


def measure_cost(num_workers, rounds, steps, skip):
    from keras_scale.launch import launch_local_workers

    with tempfile.TemporaryDirectory() as base:
        out = os.path.join(base, "medians.json")
        launch_local_workers([sys.executable, os.path.abspath(__file__), "--worker", "cost", base, str(rounds),
                              str(steps), str(skip), out], num_workers=num_workers, env=_env(), check=True,
                             timeout_s=3600)
        with open(out + ".0") as f:
            medians = json.load(f)
    return {arm: statistics.median(v) for arm, v in medians.items()}


def measure_latency(num_workers):
    from keras_scale.launch import free_ports, make_tf_config

    with tempfile.TemporaryDirectory() as base:
        out = os.path.join(base, "stamps.json")
        ports = free_ports(num_workers)
        procs = []
        for i in range(num_workers):
            env = _env()
            env["TF_CONFIG"] = json.dumps(make_tf_config(ports, i))
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "latency",
                                           os.path.join(base, "ckpt"), out], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True))
        try:
            for p in procs:  # every worker past step 40 (stdout read line by line)
                for line in p.stdout:
                    if line.startswith("STEP") and int(line.split()[1]) >= 40:
                        break
            sent = time.time()
            procs[-1].send_signal(signal.SIGTERM)  # the last worker alone
            gone = [None] * num_workers
            while any(g is None for g in gone):
                for i, p in enumerate(procs):
                    if gone[i] is None and p.poll() is not None:
                        gone[i] = time.time()
                if time.time() - sent > 300:
                    raise RuntimeError("the workers did not exit within 300 s of the signal")
                time.sleep(0.002)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        stamps = []
        for i in range(num_workers):
            with open(out + f".{i}") as f:
                stamps.append(json.load(f))
    return {
        "codes": [p.returncode for p in procs],
        "steps": [s["global_step"] for s in stamps],
        "to_stop_ms": (max(s["stop"] for s in stamps) - sent) * 1e3,
        "to_saved_ms": (stamps[0]["saved"] - sent) * 1e3,
        "to_exit_ms": (max(gone) - sent) * 1e3,
        "gone_ms": [round((g - sent) * 1e3) for g in gone], "saved_ms": [round((s["saved"] - sent) * 1e3) for s in stamps],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=20)
    parser.add_argument("--latency-runs", type=int, default=2)
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--no-cost", action="store_true")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.workers.split(",")]
    if not args.no_cost:
        table = {}
        for n in counts:
            started = time.perf_counter()
            table[n] = measure_cost(n, args.rounds, args.steps, args.skip)
            print(f"# {n} worker(s): {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        print(f"\nstep time / bare (median of {args.rounds} rounds x {args.steps - args.skip - 1} steps, chief)")
        print("| arm | " + " | ".join(f"{n} worker{'s' if n > 1 else ''}" for n in counts) + " |")
        print("| --- |" + " --- |" * len(counts))
        print("| bare step (ms) | " + " | ".join(f"{table[n]['bare'] * 1e3:.2f}" for n in counts) + " |")
        for arm in ARMS[1:]:
            print(f"| {arm} | " + " | ".join(f"{table[n][arm] / table[n]['bare']:.3f}" for n in counts) + " |")
        for arm in ("ChiefCheckpoint", "ChiefCheckpoint, all-reduce agreement"):
            print(f"| {arm}: its own code per step, us (1 + own / bare) | " + " | ".join(
                f"{table[n][arm + ' own'] * 1e6:.0f} ({1 + table[n][arm + ' own'] / table[n]['bare']:.3f})"
                for n in counts) + " |")
    if not args.no_latency:
        print("\nSIGTERM to the last worker only -> (ms after the signal) every worker decided to stop / the chief's "
              "save done / every worker process gone")
        print("| workers | run | stop | saved | exit | steps | exit codes |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for n in counts:
            for run in range(args.latency_runs):
                r = measure_latency(n)
                print(f"| {n} | {run + 1} | {r['to_stop_ms']:.0f} | {r['to_saved_ms']:.0f} | {r['to_exit_ms']:.0f} | "
                      f"{'same' if len(set(r['steps'])) == 1 else r['steps']} | {r['codes']} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        if sys.argv[2] == "cost":
            worker_cost(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
        else:
            worker_latency(sys.argv[3], sys.argv[4])
    else:
        main()
