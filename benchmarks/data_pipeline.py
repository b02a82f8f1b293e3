"""Is keras_scale.data.optimize() as fast as a hand-tuned pipeline? Side by side, in one process.

Pipelines (graph-native maps, no Python; a few seconds each on 2 CPU cores):
  augment   - shuffle, then map(fn) where fn adds random noise with tf.random.uniform (a stateful op, as in
              most augmentation code, unseeded). TensorFlow's map_parallelization rewrite refuses stateful
              functions, so as written this map runs one element at a time; optimize() parallelizes it by
              default (no seed, no deterministic option: the user did not ask for reproducible draws).
  stateless - the same work with a stateless function: TensorFlow already parallelizes it at runtime.
  defaults_off - "stateless" with tf.data.Options(apply_default_optimizations=False), i.e. without that rewrite:
              shows what TensorFlow's default map_parallelization is worth, and optimize() turning it back on.
Arms: "as written", optimize() (the default), optimize(parallelize_random=False) (the old default), and the
hand-tuned pipeline (num_parallel_calls=AUTOTUNE + prefetch(AUTOTUNE)) built twice: "hand-tuned" is the peer every
ratio divides by, "control" is the same pipeline again, so its ratio (ideally 1.00) shows the noise. Each round
times every arm once, in an order rotated from round to round; a ratio is the median over rounds of
(arm / hand-tuned in the same round), which cancels slow drifts in machine load. The goal for optimize() on
"augment" is >= 0.95x hand-tuned.

Usage: python benchmarks/data_pipeline.py [--rounds 7] [--elements 768] [--pipelines augment,stateless,defaults_off]
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
    parser.add_argument("--pipelines", default="augment,stateless,defaults_off")
    args = parser.parse_args(argv)
    num_steps = args.elements // BATCH - 2
    wanted = args.pipelines.split(",")

    print(f"CPU cores visible: {os.cpu_count()}, load average at start {os.getloadavg()[0]:.1f}; "
          f"{args.elements} elements, batch {BATCH}, {num_steps} timed batches per run, "
          f"{args.rounds} interleaved rounds (median)")
    for name, build in pipelines(args.elements).items():
        if name not in wanted:
            continue
        slow = build()
        fast, changes = data.optimize(slow)
        fast_off, _ = data.optimize(slow, parallelize_random=False)
        print(f"\n== {name}")
        print("check(as written):", [(f.code, f.severity) for f in data.check(slow, warn=False)])
        print("optimize():", changes)
        print("check(optimize()):", [(f.code, f.severity) for f in data.check(fast, warn=False)])
        arms = {
            "as written": slow,
            "optimize()": fast,
            "optimize(parallelize_random=False)": fast_off,
            "hand-tuned": build(tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE),
            "control (hand-tuned again)": build(tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE),
        }
        labels = list(arms)
        rates = {label: [] for label in labels}
        for r in range(args.rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                rates[label].append(data.benchmark(arms[label], num_steps=num_steps, warmup_steps=2).batches_per_s)
        peer = rates["hand-tuned"]
        for label, values in rates.items():
            ratios = sorted(v / p for v, p in zip(values, peer))
            print(f"{label:>35}: median {statistics.median(values):6.1f} batches/s | "
                  f"x{statistics.median(ratios):.2f} hand-tuned [{ratios[0]:.2f}-{ratios[-1]:.2f}]   "
                  f"(runs: {', '.join(f'{v:.0f}' for v in values)})")
    print(f"\nload average at end {os.getloadavg()[0]:.1f} (other processes on these cores skew the ratios; "
          "read the control row for the noise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
