"""Gradient accumulation: throughput and peak memory, side by side.

Each configuration trains the same conv net on the same synthetic data in a fresh child process (peak RSS is
per process), rounds interleaved so machine load hits all of them alike. Printed: samples/s ratio to plain
fit at batch B*N (floors for wrap: >= 0.95 on one device, >= 0.98 on two replicas) and peak RSS, and each run's
samples/s. Two replicas on 2 CPU cores run at one of two speeds per process (seen: ~190 or ~310 samples/s, for
plain fit and wrap alike, whatever the arm): read the runs, and use several rounds before trusting a 2-replica
ratio.

    python benchmarks/accumulation.py [--rounds 2] [--steps 12] [--batch 128] [--accum 8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = [
    # name, replicas, how
    ("plain B*N", 1, "plain_big"),
    ("plain B*N (again)", 1, "plain_big"),  # the control: the baseline measured twice
    ("wrap(accum=N) B*N", 1, "wrap"),
    ("keras native accum, batch B", 1, "native"),
    ("plain B", 1, "plain_small"),
    ("2-replica plain B*N", 2, "plain_big"),
    ("2-replica plain B*N (again)", 2, "plain_big"),
    ("2-replica wrap(accum=N) B*N", 2, "wrap"),
    ("2-replica keras native accum", 2, "native"),
    # synchronized BatchNorm: the micro-batch loop is unrolled in Python (its all-reduce cannot sit in a
    # tf.while_loop); control dependencies keep one micro-batch alive at a time
    ("2-replica plain B*N, sync BN", 2, "plain_big_syncbn"),
    ("2-replica wrap(accum=N), sync BN", 2, "wrap_syncbn"),
]


def child(how: str, replicas: int, steps: int, batch: int, accum: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import resource

    import numpy as np
    import tensorflow as tf

    if replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    import keras

    import keras_scale as ks

    strategy = (tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)]) if replicas > 1
                else tf.distribute.get_strategy())
    keras.utils.set_random_seed(0)
    n = batch * steps
    x = np.random.default_rng(0).normal(size=(n, 64, 64, 3)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, size=(n,))
    sync_bn = how.endswith("_syncbn")
    how = how.replace("_syncbn", "")
    fit_batch = batch // accum if how in ("native", "plain_small") else batch
    with strategy.scope():
        inner = keras.Sequential([
            keras.Input((64, 64, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            *([keras.layers.BatchNormalization(synchronized=True)] if sync_bn else []),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        model = ks.wrap(inner, accum=accum) if how == "wrap" else inner
        opt = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accum if how == "native" else None)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        model.fit(x[:fit_batch * 2], y[:fit_batch * 2], batch_size=fit_batch, epochs=1, verbose=0)  # trace
    except Exception as e:  # noqa: BLE001 - recorded, e.g. Keras native accumulation under MirroredStrategy
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    start = time.perf_counter()
    model.fit(x, y, batch_size=fit_batch, epochs=1, verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    return {"samples_per_s": n / seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=128, help="B*N, the batch the optimizer sees")
    p.add_argument("--accum", type=int, default=8)
    p.add_argument("--child", nargs=2, metavar=("HOW", "REPLICAS"))
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), a.steps, a.batch, a.accum)))
        return
    results: dict = {name: [] for name, _, _ in CONFIGS}
    for r in range(a.rounds):
        for name, replicas, how in CONFIGS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", how, str(replicas), "--steps", str(a.steps), "--batch",
                 str(a.batch), "--accum", str(a.accum)], capture_output=True, text=True, timeout=900)
            line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else json.dumps(
                {"error": out.stderr.strip().splitlines()[-1][:160] if out.stderr.strip() else "no output"})
            results[name].append(json.loads(line))
            print(f"round {r} {name}: {line}", file=sys.stderr, flush=True)
    B, N = a.batch // a.accum, a.accum
    print(f"\naccumulation benchmark: conv net 64x64x3, B*N={a.batch} (B={B}, N={N}), {a.steps} steps, "
          f"median of {a.rounds} rounds, CPU")
    base = {1: "plain B*N", 2: "2-replica plain B*N"}
    for name, replicas, _ in CONFIGS:
        runs = results[name]
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            print(f"  {name:32s} CRASHED: {errors[0]}")
            continue
        sps = statistics.median(r["samples_per_s"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        ref_name = "2-replica plain B*N, sync BN" if "sync BN" in name else base[replicas]
        ref = results[ref_name]
        ref_sps = statistics.median(r["samples_per_s"] for r in ref)
        ref_rss = statistics.median(r["peak_rss_mb"] for r in ref)
        each = ", ".join(f"{r['samples_per_s']:.0f}" for r in runs)
        print(f"  {name:32s} {sps:8.1f} samples/s  ratio {sps / ref_sps:5.2f}   peak RSS {rss:7.0f} MB "
              f"(x{rss / ref_rss:4.2f} of {ref_name})   runs: {each}")


if __name__ == "__main__":
    main()
