"""ChiefCheckpoint: training-thread time blocked per save, sync vs async, and save/restore throughput.

A ~50M-parameter MLP trained with Adam (checkpoint = weights + 2 moments, about 0.6 GB) is fit with
``ChiefCheckpoint(save_freq=N)`` three ways, each in a fresh subprocess: no checkpoint (baseline),
``async_save=False`` and ``async_save=True``. Blocked time per save = the time the training thread spends in
the callback hook (for async: the copy to host memory, plus any wait for a previous write still running) plus
the extra time of the step right after the save over the median step (on CPU TensorFlow's host copy can share
the variables' buffers, so the next optimizer update pays a copy-on-write). Also
printed: whole-``fit`` wall time per variant (the background write competes for CPU with training), and
restore throughput at ``fit`` start in a fresh process.

    python benchmarks/checkpoint.py                  # ~50M parameters, 6 saves per variant
    python benchmarks/checkpoint.py --width 1024 --depth 4 --saves 2     # quick smoke run

Floor: async blocks the training thread for <= 20% of the sync time per save.
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


def _build(args):
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((args.width,))]
    layers += [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)]
    layers += [keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-5), loss="mse")
    return model


def _dataset(args):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(args.batch, args.width)).astype("float32")
    ys = rng.normal(size=(args.batch, 1)).astype("float32")
    return tf.data.Dataset.from_tensors((xs, ys)).repeat()


def _dir_mb(directory: str, number: int) -> float:
    total = 0
    for name in os.listdir(directory):
        if name.startswith(f"ckpt-{number}."):
            total += os.path.getsize(os.path.join(directory, name))
    return total / 2**20


def run_variant(args: argparse.Namespace) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from keras_scale.callbacks.checkpoint import ChiefCheckpoint, list_checkpoints

    model = _build(args)
    steps = args.save_every * args.saves + 1  # +1: the first step compiles
    if args.variant == "restore":
        model.optimizer.build(model.trainable_variables)
        ckpt = ChiefCheckpoint(args.directory, verbose=0)
        ckpt.set_model(model)
        t0 = time.perf_counter()
        ckpt.on_train_begin()
        restore_s = time.perf_counter() - t0
        number = list_checkpoints(args.directory)[0][0]
        return {"variant": "restore", "restore_s": restore_s, "size_mb": _dir_mb(args.directory, number),
                "restored_from": ckpt.restored_from}

    blocked_s: list = []  # time the training thread spent in the save hook, waiting included
    wait_s: list = []  # of which: waiting for the previous async write to finish
    next_step: list = []  # index of the step after each save (a host copy sharing buffers is paid there)
    step_s: list = []

    class Timed(ChiefCheckpoint):
        def on_train_batch_end(self, batch, logs=None):
            saving = self._global_step // self.save_freq > self._last_saved_step // self.save_freq
            t0 = time.perf_counter()
            if saving:
                self._wait()  # an async write still running from the previous save (a save would wait too)
            t1 = time.perf_counter()
            super().on_train_batch_end(batch, logs)
            if saving:
                wait_s.append(t1 - t0)
                blocked_s.append(time.perf_counter() - t0)
                next_step.append(len(step_s) + 1)  # StepTimer has not yet recorded this step

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # wait for the step
            step_s.append(time.perf_counter() - self.t0)

    callbacks = [StepTimer()]
    if args.variant != "baseline":
        # Saving at batch `save_every + 1`, `2 * save_every + 1`, ...: never on the compile step.
        callbacks.insert(0, Timed(args.directory, save_freq=args.save_every, max_to_keep=1,
                                  async_save=args.variant == "async", restore=False, verbose=0))
    t0 = time.perf_counter()
    model.fit(_dataset(args), steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)
    fit_s = time.perf_counter() - t0  # includes the final flush of an async write (on_train_end)
    out = {"variant": args.variant, "params": model.count_params(), "fit_s": fit_s,
           "median_step_s": statistics.median(step_s[1:])}
    if args.variant != "baseline":
        number = list_checkpoints(args.directory)[0][0]
        median = statistics.median(step_s[1:])
        extra = [max(step_s[i] - median, 0.0) for i in next_step if i < len(step_s)]
        out.update({"next_step_extra_s": extra, "blocked_s": blocked_s, "wait_s": wait_s, "size_mb": _dir_mb(args.directory, number)})
    return out


def _spawn(args: argparse.Namespace, variant: str, directory: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--directory", directory,
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
           "--save-every", str(args.save_every), "--saves", str(args.saves)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048, help="MLP width (default 2048: 4.2M params/layer)")
    parser.add_argument("--depth", type=int, default=12, help="hidden layers (default 12: ~50M params)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=20, help="batches between saves")
    parser.add_argument("--saves", type=int, default=6, help="saves per variant (the first 2 are warm-up)")
    parser.add_argument("--directory", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0

    root = tempfile.mkdtemp(prefix="ks_ckpt_bench_")
    try:
        results = {}
        for variant in ("baseline", "sync", "async"):
            results[variant] = _spawn(args, variant, os.path.join(root, variant))
        results["restore"] = _spawn(args, "restore", os.path.join(root, "sync"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    sync, asyn, base, restore = results["sync"], results["async"], results["baseline"], results["restore"]
    size_mb = sync["size_mb"]
    # The first save builds the saver; with async_save the 2nd traces TensorFlow's copy-to-host function.
    warm = 2 if args.saves > 2 else 0
    # Blocked = time in the save hook + the extra time of the step after it (on CPU, TensorFlow's copy to host can
    # share the variables' buffers; the next optimizer update then copies them: copy-on-write).
    def blocked(r):
        return [b + e for b, e in zip(r["blocked_s"], r["next_step_extra_s"])]

    sync_block = statistics.median(blocked(sync)[warm:])
    async_block = statistics.median(blocked(asyn)[warm:])
    print(f"model: {base['params'] / 1e6:.1f}M parameters, checkpoint {size_mb:.0f} MB "
          f"(weights + Adam moments), {args.saves} saves per variant, every {args.save_every} batches")
    print(f"{'':34s}{'sync':>12s}{'async':>12s}")
    print(f"{'blocked per save, median (s)':34s}{sync_block:12.3f}{async_block:12.3f}   (saves {warm + 1}..)")
    for name, r in (("sync ", sync), ("async", asyn)):
        print(f"{name} per save (s): in hook {' '.join(f'{v:.3f}' for v in r['blocked_s'])} | waiting for the "
              f"previous write {' '.join(f'{v:.3f}' for v in r['wait_s'])} | next step's extra time "
              f"{' '.join(f'{v:.3f}' for v in r['next_step_extra_s'])}")
    print(f"{'fit wall time (s), baseline %.2f' % base['fit_s']:34s}{sync['fit_s']:12.2f}{asyn['fit_s']:12.2f}")
    print(f"{'median step (s), baseline %.3f' % base['median_step_s']:34s}{sync['median_step_s']:12.3f}"
          f"{asyn['median_step_s']:12.3f}")
    ratio = async_block / sync_block
    print(f"async / sync blocked time per save: {ratio:.3f}  (floor: <= 0.20) -> {'OK' if ratio <= 0.2 else 'ABOVE FLOOR'}")
    print(f"save throughput (sync, blocked): {size_mb / sync_block:.0f} MB/s; "
          f"restore at fit start: {restore['size_mb'] / restore['restore_s']:.0f} MB/s "
          f"({restore['restore_s']:.2f} s for {restore['size_mb']:.0f} MB)")
    return 0 if ratio <= 0.2 else 1


if __name__ == "__main__":
    sys.exit(main())
