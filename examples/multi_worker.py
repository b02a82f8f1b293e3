"""Multi-worker training with ``keras_scale.fit`` — one command starts 2 local workers.

    python examples/multi_worker.py                    # 2 workers on 127.0.0.1 (re-executes itself per worker)
    python examples/multi_worker.py --workers 3 --epochs 5 --checkpoint-dir /tmp/mw_ckpt

Without ``TF_CONFIG`` (or a Slurm step with several tasks) the script is the launcher: it starts N copies of itself
with ``keras_scale.launch.launch_local_workers`` (each gets its own ``TF_CONFIG``), waits, and prints what each
worker reported. With ``TF_CONFIG`` set — or under ``srun`` — it is one worker: exactly what you run on each machine
of a real cluster (see docs/fit.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="local workers to start (launcher mode)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--per-replica-batch-size", type=int, default=32)
    parser.add_argument("--checkpoint-dir", default=None, help="ChiefCheckpoint directory: rerun to resume")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    return parser.parse_args(argv)


def in_cluster() -> bool:
    from keras_scale.distribute import strategy_plan

    return strategy_plan("auto", num_gpus=0)[0] == "multi_worker"


def worker(args) -> None:
    """One worker: pick the strategy FIRST (before any TensorFlow op), then fit."""
    import keras_scale as ks

    strategy = ks.choose_strategy()  # TF_CONFIG / Slurm -> MultiWorkerMirroredStrategy

    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1)) + 0.1 * rng.normal(size=(2048, 1))).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", metrics=["mae"])
        return model

    history = ks.fit(build, x, y, per_replica_batch_size=args.per_replica_batch_size, epochs=args.epochs,
                     strategy=strategy, lr_scaling=("linear", 32), checkpoint_dir=args.checkpoint_dir,
                     verbose=2 if ks.is_chief(strategy) else 0)
    digest = hashlib.sha256(b"".join(w.tobytes() for w in history.model.get_weights())).hexdigest()[:16]
    print("RESULT " + json.dumps({"loss": history.history["loss"], "weights_sha256": digest,
                                  "replicas": strategy.num_replicas_in_sync}), flush=True)


def launcher(args) -> int:
    from keras_scale.launch import launch_local_workers

    env = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),  # CPU workers unless you say so
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    print(f"starting {args.workers} workers on 127.0.0.1 ...", flush=True)
    results = launch_local_workers(argv, num_workers=args.workers, timeout_s=args.timeout_s, env=env)
    reports = []
    for r in results:
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        status = "ok" if r.ok else f"FAILED (exit {r.returncode}{', timed out' if r.timed_out else ''})"
        print(f"===== worker {r.index}: {status}")
        if r.index == 0 or not r.ok:
            print("\n".join(line for line in r.stdout.splitlines() if not line.startswith("RESULT ")))
        if not r.ok:
            print(r.stderr[-3000:])
        if lines:
            reports.append(json.loads(lines[-1][len("RESULT "):]))
            print(f"  final loss {reports[-1]['loss'][-1]:.4f}, weights sha256 {reports[-1]['weights_sha256']}")
    if len(reports) == len(results) and all(r.ok for r in results):
        same = len({rep["weights_sha256"] for rep in reports}) == 1
        print(f"{len(results)} workers, {reports[0]['replicas']} replicas in sync; identical weights on every "
              f"worker: {same}")
        return 0 if same else 1
    return 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if in_cluster():
        worker(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
