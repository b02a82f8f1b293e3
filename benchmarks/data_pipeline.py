"""Does keras_scale.data.optimize() speed up a slow input pipeline? Side by side, in one process.

Pipelines (graph-native maps, no Python; a few seconds each on 2 CPU cores):
  augment   - shuffle, then map(fn) where fn adds random noise with tf.random.uniform (a stateful op, as in
              most augmentation code). TensorFlow's map_parallelization rewrite refuses stateful functions, so
              this map runs one element at a time.
  stateless - the same work with a stateless function: TensorFlow already parallelizes it at runtime (control).
  defaults_off - "stateless" with tf.data.Options(apply_default_optimizations=False), i.e. without that rewrite:
              shows what TensorFlow's default map_parallelization is worth, and optimize() turning it back on.
Each is timed as written ("slow"), after optimize(), after optimize(parallelize_random=True), and hand-fixed
(num_parallel_calls=AUTOTUNE + prefetch), one after the other in each of several rounds. The ratio is the median
over rounds of (variant / slow in the same round), which cancels slow drifts in machine load; "best run" compares
the least disturbed run of each. The speed-up is bounded by the free CPU cores (x2 at best on 2 cores).

Usage: python benchmarks/data_pipeline.py [--rounds 7] [--elements 768]
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from keras_scale import data  # noqa: E402

WIDTH = 4096
BATCH = 16


def expensive(x: tf.Tensor) -> tf.Tensor:
    """Per-element work made of graph-native ops (sort/cumsum/sin over 4096 floats, 6 times)."""
    v = tf.random.stateless_uniform([WIDTH], seed=tf.stack([x, x]))
    for _ in range(6):
        v = tf.math.cumsum(tf.sin(tf.sort(v)))
    return v


def augment(x: tf.Tensor) -> tf.Tensor:
    return expensive(x) + tf.random.uniform([WIDTH], -0.01, 0.01)


def pipelines(elements: int):
    def augmented(npc=None):
        ds = tf.data.Dataset.range(elements).shuffle(elements, seed=0)
        return ds.map(augment, num_parallel_calls=npc).batch(BATCH)

    def stateless(npc=None):
        return tf.data.Dataset.range(elements).map(expensive, num_parallel_calls=npc).batch(BATCH)

    def defaults_off(npc=None):
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        return stateless(npc).with_options(options)

    return {"augment": augmented, "stateless": stateless, "defaults_off": defaults_off}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--elements", type=int, default=768)
    args = parser.parse_args(argv)
    num_steps = args.elements // BATCH - 2

    print(f"CPU cores visible: {os.cpu_count()}, load average at start {os.getloadavg()[0]:.1f}; "
          f"{args.elements} elements, batch {BATCH}, {num_steps} timed batches per run, "
          f"{args.rounds} interleaved rounds (median)")
    for name, build in pipelines(args.elements).items():
        slow = build()
        fast, changes = data.optimize(slow)
        fast_random, changes_random = data.optimize(slow, parallelize_random=True)
        manual = build(tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
        print(f"\n== {name}")
        print("check(slow):", [(f.code, f.severity) for f in data.check(slow, warn=False)])
        print("optimize():", changes)
        print("optimize(parallelize_random=True):", changes_random)
        print("check(optimize(parallelize_random=True)):",
              [(f.code, f.severity) for f in data.check(fast_random, warn=False)])
        variants = {"slow": slow, "optimize()": fast, "optimize(random)": fast_random, "hand-fixed": manual}
        rates = {label: [] for label in variants}
        for _ in range(args.rounds):
            for label, ds in variants.items():
                rates[label].append(data.benchmark(ds, num_steps=num_steps, warmup_steps=2).batches_per_s)
        base_best = max(rates["slow"])
        for label, values in rates.items():
            med, best = statistics.median(values), max(values)
            paired = statistics.median(v / s for v, s in zip(values, rates["slow"]))
            print(f"{label:>17}: median {med:6.1f} batches/s ({med * BATCH:6.0f} samples/s) | x{paired:.2f} vs slow "
                  f"(median of per-round ratios) | best run x{best / base_best:.2f}   "
                  f"(runs: {', '.join(f'{v:.0f}' for v in values)})")
    print(f"\nload average at end {os.getloadavg()[0]:.1f} (other processes on these cores skew the ratios)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
