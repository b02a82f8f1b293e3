"""What a resume costs as the run grows: time from the rerun's ``fit`` call to its first new update, for a
checkpoint taken at batch 100, 10,000 and 100,000.

For each kind of data a training run (a fresh subprocess) trains a small model up to the largest position with
``ChiefCheckpoint(save_freq=100)`` and copies the checkpoint directory at each measured position. Each resume is
then a fresh subprocess (``--repeats`` per position, interleaved, median shown) (model built, ``fit`` called, the checkpoint restored, the data positioned, the first new
update applied): the wall time from its ``fit`` call to the end of its first new update, and what ChiefCheckpoint
said it did with the data (its position restored from the checkpoint, or the trained batches read forward).

Kinds: ``dataset`` (``fit(ds)``, one epoch longer than every position), ``repeated`` (a ``repeat()``ed dataset
with ``steps_per_epoch=500``: position 100,000 is epoch 201), ``arrays`` (``fit(x, y)``, shuffled by Keras) and
``mirrored`` (``fit(ds)`` under ``MirroredStrategy`` on 2 logical CPU devices: TensorFlow cannot serialize its
distributed iterator, so it reads forward). The pipeline's map costs a known time per batch (a chain of small
matmuls, ``--map-matmuls``), measured alone and printed; a read-forward resume pays it for every trained batch.

    python benchmarks/resume_cost.py                                  # all kinds, 100 / 10,000 / 100,000
    python benchmarks/resume_cost.py --kinds dataset --positions 100,2000   # quick smoke run

Goal (issue "costs that stay flat"): position 100,000 within 1.5x of position 100 wherever the pipeline can be
checkpointed (printed as the ratio column).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's keras_scale

FEATURES, BATCH, STEPS_PER_EPOCH = 16, 4, 500


def _setup(kind: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf

    if kind == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def _model(kind: str):
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)

    def build():
        m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        return m

    if kind == "mirrored":
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            return build()
    return build()


def _data(kind: str, num_batches: int, matmuls: int):
    """fit's keyword arguments: a synthetic pipeline whose map costs ``matmuls`` small matmuls per sample."""
    import numpy as np
    import tensorflow as tf

    def features(i):
        x = tf.random.stateless_uniform([FEATURES, FEATURES], seed=tf.stack([i, i]))
        for _ in range(matmuls):
            x = tf.tanh(tf.matmul(x, x))
        return x[0], tf.reduce_sum(x[1:2], axis=1)

    if kind == "arrays":
        rng = np.random.default_rng(0)
        x = rng.normal(size=(num_batches * BATCH, FEATURES)).astype("float32")
        return dict(x=x, y=x.sum(axis=1, keepdims=True), batch_size=BATCH, shuffle=True)
    ds = tf.data.Dataset.range(num_batches * BATCH)
    if kind == "repeated":
        ds = tf.data.Dataset.range(STEPS_PER_EPOCH * BATCH).shuffle(256, seed=1, reshuffle_each_iteration=False)
        ds = ds.repeat()
    ds = ds.map(features, num_parallel_calls=2).batch(BATCH).prefetch(2)
    return dict(x=ds, steps_per_epoch=STEPS_PER_EPOCH) if kind == "repeated" else dict(x=ds)


def _epochs(kind: str, num_batches: int) -> int:
    return (num_batches // STEPS_PER_EPOCH + 2) if kind == "repeated" else 1


def _pipeline_ms(kind: str, matmuls: int) -> float:
    """Time per batch of the pipeline alone (read and dropped), ms."""
    if kind == "arrays":
        return float("nan")
    data = _data(kind, 3000, matmuls)["x"]
    it = iter(data)
    for _ in range(50):
        next(it)
    started = time.perf_counter()
    for _ in range(1000):
        next(it)
    return (time.perf_counter() - started)


def train(args) -> None:
    """Train to the largest position; copy the checkpoint directory at each position."""
    _setup(args.kind)
    import keras

    import keras_scale as ks

    positions = sorted(int(p) for p in args.positions.split(","))
    last = positions[-1]
    model = _model(args.kind)
    directory = os.path.join(args.work, "ckpt")

    class Copy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            done = int(self.model.optimizer.iterations.numpy())
            if done in positions:
                shutil.copytree(directory, os.path.join(args.work, f"at-{done}"),
                                ignore=shutil.ignore_patterns(".keras_scale.lock"))
            if done >= last:
                self.model.stop_training = True

    data = _data(args.kind, max(last + 1000, 2 * STEPS_PER_EPOCH), args.map_matmuls)
    started = time.perf_counter()
    model.fit(epochs=_epochs(args.kind, last), verbose=0, callbacks=[ks.ChiefCheckpoint(directory, save_freq=100),
                                                                   Copy()], **data)
    print(json.dumps({"train_s": time.perf_counter() - started, "pipeline_ms": _pipeline_ms(args.kind, args.map_matmuls)}))


def resume(args) -> None:
    """Resume from the copy at ``args.position``: seconds from fit's call to the end of the first new update."""
    _setup(args.kind)
    import logging

    import keras

    import keras_scale as ks

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("keras_scale.checkpoint").addHandler(handler)
    logging.getLogger("keras_scale.checkpoint").setLevel(logging.INFO)
    model = _model(args.kind)
    position = int(args.position)
    data = _data(args.kind, max(position + 1000, 2 * STEPS_PER_EPOCH), args.map_matmuls)
    out = {}

    class FirstUpdate(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) > position and "s" not in out:
                out["s"] = time.perf_counter() - started
                self.model.stop_training = True

    directory = os.path.join(args.work, f"at-{position}")
    started = time.perf_counter()
    model.fit(epochs=_epochs(args.kind, position), verbose=0,
              callbacks=[ks.ChiefCheckpoint(directory, save_freq=10**9), FirstUpdate()], **data)
    how = [m for m in said if "data position restored" in m or "batches forward" in m]
    out["how"] = how[0].split(": ", 1)[-1] if how else "?"
    print(json.dumps(out))


def _child(kind: str, what: str, work: str, args, position: int = 0) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--kind", kind, "--work", work,
           "--positions", args.positions, "--position", str(position), "--map-matmuls", str(args.map_matmuls)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} {kind} {position} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="dataset,repeated,arrays,mirrored")
    parser.add_argument("--positions", default="100,10000,100000")
    parser.add_argument("--map-matmuls", type=int, default=4, help="matmuls per sample in the pipeline's map")
    parser.add_argument("--child", choices=["train", "resume"])
    parser.add_argument("--kind", default="dataset")
    parser.add_argument("--work")
    parser.add_argument("--position", default="0")
    parser.add_argument("--repeats", type=int, default=3, help="resumes per position (interleaved; the median is shown)")
    args = parser.parse_args()
    if args.child == "train":
        return train(args)
    if args.child == "resume":
        return resume(args)
    positions = sorted(int(p) for p in args.positions.split(","))
    print(f"time to first new update after a resume at batch {', '.join(map(str, positions))} (fresh process each)")
    print(f"{'kind':9} {'pipeline ms/batch':>17} " + " ".join(f"{p:>10}" for p in positions)
          + f" {'ratio':>6}  how the last resume positioned the data")
    rows = {}
    for kind in args.kinds.split(","):
        work = tempfile.mkdtemp(prefix=f"resume_cost_{kind}_")
        try:
            trained = _child(kind, "train", work, args)
            runs: dict = {p: [] for p in positions}
            how = ""
            for _ in range(args.repeats):  # interleaved: a load change on the machine hits every position alike
                for p in positions:
                    r = _child(kind, "resume", work, args, p)
                    runs[p].append(r["s"])
                    how = r["how"]
            times = [statistics.median(runs[p]) for p in positions]
            ratio = times[-1] / times[0]
            rows[kind] = {"pipeline_ms": trained["pipeline_ms"], "times_s": times, "ratio": ratio, "how": how,
                          "runs_s": runs}
            print(f"{kind:9} {trained['pipeline_ms']:17.3f} " + " ".join(f"{t:9.2f}s" for t in times)
                  + f" {ratio:6.2f}  {how}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
