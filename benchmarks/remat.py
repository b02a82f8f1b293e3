"""Rematerialization on a deep residual MLP stack: peak memory and step time, remat vs plain, side by side.

Each run trains in its own subprocess (a fresh process, so neither inherits the other's freed memory) with
``model.fit`` for ``--steps`` steps after one compile step; runs alternate plain/remat in ABBA order
(``--repeats`` per variant) and each variant reports its fastest median step time, in wall-clock time and in
CPU time (all threads; on a machine shared with other jobs the CPU-time ratio is the reliable one).
Peak memory: on a GPU, TensorFlow's ``GPU:0`` peak allocation; on CPU, the process's peak RSS (``ru_maxrss``)
minus its RSS just before ``fit`` (the activations, gradients and optimizer state of the training steps; the
TensorFlow runtime itself is excluded).

    python benchmarks/remat.py                      # defaults sized for a 2-core CPU (1-2 minutes)
    python benchmarks/remat.py --depth 48 --width 1024 --batch 2048 --steps 10    # on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run_variant(args: argparse.Namespace) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import resource

    import numpy as np
    import psutil
    import tensorflow as tf

    import keras
    from keras_scale.remat import remat

    keras.utils.set_random_seed(0)
    use_remat = args.variant == "remat"
    inputs = keras.Input((args.width,))
    x = inputs
    for i in range(args.depth):
        block = keras.Sequential([
            keras.layers.Dense(args.width * 4, activation="gelu"),
            keras.layers.Dense(args.width),
        ], name=f"block{i}")
        h = remat(block)(x) if use_remat else block(x)
        x = keras.layers.Add()([x, h])
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(args.batch, args.width)).astype("float32") * 0.1
    ys = rng.normal(size=(args.batch, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensors((xs, ys)).repeat()

    step_s: list = []
    cpu_s: list = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # wait for the step
            step_s.append(time.perf_counter() - self.t0)
            cpu_s.append(time.process_time() - self.c0)  # CPU seconds of all threads: robust to a loaded machine

    gpu = "GPU:0" if tf.config.list_logical_devices("GPU") else None
    if gpu:
        tf.config.experimental.reset_memory_stats(gpu)
    rss_before = psutil.Process().memory_info().rss
    history = model.fit(dataset, steps_per_epoch=args.steps + 1, epochs=1, verbose=0, callbacks=[Timer()])
    if gpu:
        peak_mb = tf.config.experimental.get_memory_info(gpu)["peak"] / 2**20
        source = "GPU:0 peak allocation"
    else:
        peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before) / 2**20
        source = "host peak RSS - RSS before fit"
    return {"variant": args.variant, "peak_mb": peak_mb, "memory_source": source,
            "median_step_s": statistics.median(step_s[1:]), "first_step_s": step_s[0],
            "median_step_cpu_s": statistics.median(cpu_s[1:]),
            "loss": float(history.history["loss"][-1]), "params": model.count_params()}


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=24, help="residual MLP blocks (default 24)")
    parser.add_argument("--width", type=int, default=256, help="model width; blocks expand 4x (default 256)")
    parser.add_argument("--batch", type=int, default=512, help="batch size (default 512)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after the compile step (default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, in ABBA order (default 2)")
    parser.add_argument("--variant", choices=("plain", "remat"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0

    # ABBA order, repeated: a load change on a shared machine hits both variants; each variant keeps its fastest
    # median step time (the least disturbed run) and its largest peak memory.
    order = ["plain", "remat", "remat", "plain"] * args.repeats
    runs: dict = {"plain": [], "remat": []}
    for variant in order[: 2 * args.repeats]:
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--depth", str(args.depth),
               "--width", str(args.width), "--batch", str(args.batch), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return out.returncode
        runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {}
    for variant, variant_runs in runs.items():
        best = dict(min(variant_runs, key=lambda r: r["median_step_s"]))
        best["peak_mb"] = max(r["peak_mb"] for r in variant_runs)
        best["median_step_cpu_s"] = min(r["median_step_cpu_s"] for r in variant_runs)
        results[variant] = best
    plain, rem = results["plain"], results["remat"]
    print(f"deep residual MLP: depth={args.depth} width={args.width} (hidden {args.width * 4}) batch={args.batch} "
          f"params={plain['params']:,} steps={args.steps} repeats={args.repeats}; memory: {plain['memory_source']}")
    print(f"{'variant':<8} {'peak MiB':>10} {'step ms (wall)':>15} {'step ms (CPU)':>14} {'final loss':>12}")
    for r in (plain, rem):
        print(f"{r['variant']:<8} {r['peak_mb']:>10.1f} {r['median_step_s'] * 1e3:>15.1f} "
              f"{r['median_step_cpu_s'] * 1e3:>14.1f} {r['loss']:>12.6f}")
    print(f"remat/plain: peak memory x{rem['peak_mb'] / plain['peak_mb']:.2f}, "
          f"step time x{rem['median_step_s'] / plain['median_step_s']:.2f} (wall), "
          f"x{rem['median_step_cpu_s'] / plain['median_step_cpu_s']:.2f} (CPU time), "
          f"final loss rel diff {abs(rem['loss'] - plain['loss']) / abs(plain['loss']):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
