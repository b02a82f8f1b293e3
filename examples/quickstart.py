"""keras_scale quickstart: every piece on built-in synthetic data, in about a minute on a laptop CPU.

    make demo            # or: .venv/bin/python examples/quickstart.py [--out runs/quickstart]

1. lints the input pipeline (keras_scale.data.check) and applies the safe fixes (optimize);
2. trains a small conv net with plain ``model.fit`` + keras_scale pieces:
   ``wrap(accum=4)`` (gradient accumulation), ``WarmupCosine`` with the linear-scaling rule, ``NanGuard`` (one
   batch is deliberately poisoned with NaN: the guard skips it and says why), ``GpuMonitor`` (NVML; says so
   when there is no GPU), ``ChiefCheckpoint`` (kill this script and rerun with --resume: it continues at the
   same step), ``HostMemoryWatch``, ``LearningRateLogger``, Keras's TensorBoard and ``Goodput`` (prints where the
   wall-clock went: productive steps, input wait, compile, checkpoints, ...; FLOPs per step and MFU);
3. trains again with the strategy-aware ``keras_scale.fit`` (1 device here; N GPUs / N machines unchanged)
   and ``ProfileWindow`` (profiles 4 steps and prints the step-time verdict); ``keras_scale.fit`` adds ``Goodput``
   itself, which prints its table again;
4. prints where to look.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_scale as ks  # noqa: E402

NUM_CLASSES = 10
IMAGE = (16, 16, 3)


def synthetic_images(num_samples: int, seed: int = 0):
    """Class-dependent colour blobs + noise: learnable in a few epochs, generated in code (no download)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=num_samples)
    centres = rng.normal(size=(NUM_CLASSES,) + IMAGE).astype("float32")
    images = centres[labels] + 0.8 * rng.normal(size=(num_samples,) + IMAGE).astype("float32")
    return images.astype("float32"), labels.astype("int64")


def build_model() -> keras.Model:
    return keras.Sequential([
        keras.Input(IMAGE),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(NUM_CLASSES, dtype="float32"),  # float32 logits: the classic mixed-precision NaN fix
    ], name="quickstart_cnn")


def make_callbacks(out: str, nvml=None) -> list:
    """The demo's callbacks: keras_scale's and Keras's TensorBoard share ``out`` (one ``train`` run).

    ``tests/test_tensorboard_layout.py`` reads what they write back from a TensorBoard server."""
    return [
        ks.NanGuard(policy="skip"),
        ks.GpuMonitor(interval_s=0.5, log_dir=out, nvml=nvml),
        ks.ChiefCheckpoint(os.path.join(out, "checkpoints"), save_freq=16, max_to_keep=2),
        ks.HostMemoryWatch(log_dir=out),
        ks.LearningRateLogger(out, every_n_steps=1),
        keras.callbacks.TensorBoard(out, update_freq=4),  # the same train/validation runs as keras_scale's; loss every 4 steps
        ks.Goodput(log_dir=out),  # last: it also sees the checkpoint written at the end; prints its table
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/quickstart", help="where logs and checkpoints go")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--resume", action="store_true", help="keep --out and resume from its checkpoint")
    args = p.parse_args()
    if os.path.exists(args.out) and not args.resume:
        shutil.rmtree(args.out)
    os.makedirs(args.out, exist_ok=True)
    keras.utils.set_random_seed(0)

    # ------------------------------------------------------------------ 1. input pipeline
    x, y = synthetic_images(4096)
    x[5 * 128 + 3, 0, 0, 0] = np.nan  # one poisoned sample in batch 5: NanGuard will skip that update
    batch_size = 128  # the batch the optimizer sees; wrap(accum=4) keeps 32 on the device at a time
    naive = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 1.0, b)).batch(batch_size)
    print("\n== 1. input pipeline lint (keras_scale.data.check)")
    for finding in ks.data.check(naive, warn=False):
        print(f"  - {finding}")
    ds, changes = ks.data.optimize(naive)
    for change in changes:
        print(f"  fixed: {change}")

    # ------------------------------------------------------------------ 2. model.fit + callbacks
    print("\n== 2. model.fit with wrap(accum=4), WarmupCosine, NanGuard, GpuMonitor, ChiefCheckpoint, "
          "HostMemoryWatch, Goodput")
    steps_per_epoch = len(x) // batch_size
    peak_lr = ks.scale_lr(1e-3, global_batch=batch_size, base_batch=32)  # linear scaling rule: 4e-3
    schedule = ks.WarmupCosine.from_epochs(peak_lr, epochs=args.epochs, steps_per_epoch=steps_per_epoch,
                                           warmup_epochs=1)
    model = ks.wrap(build_model(), accum=4)
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    callbacks = make_callbacks(args.out)
    guard = callbacks[0]
    history = model.fit(ds, epochs=args.epochs, callbacks=callbacks, verbose=2)
    print(f"  NanGuard skipped {guard.skipped_steps} non-finite step(s); per epoch: {history.history.get('nan_skipped')}")
    print(f"  final accuracy {history.history['accuracy'][-1]:.3f}, optimizer updates "
          f"{int(model.optimizer.iterations.numpy())}")

    # ------------------------------------------------------------------ 3. strategy-aware fit
    print("\n== 3. keras_scale.fit: strategy chosen for you (1 device here; same call on N GPUs / N machines)")

    def build_and_compile() -> keras.Model:
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(ks.WarmupCosine(1e-3, total_steps=2 * 16, warmup_steps=4)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return model

    clean_x, clean_y = synthetic_images(2048, seed=1)
    # ProfileWindow profiles steps 12..15 and prints the verdict. (Profile a run without accumulation: xprof
    # ignores step markers when the step runs a tf.while_loop, as wrap(accum>1) and steps_per_execution>1 do.)
    history = ks.fit(build_and_compile, clean_x, clean_y, per_replica_batch_size=64, epochs=2,
                     lr_scaling=("linear", 32), verbose=2,
                     callbacks=[ks.ProfileWindow(os.path.join(args.out, "profile"), start_step=12, num_steps=4)])
    print(f"  keras_scale.fit accuracy {history.history['accuracy'][-1]:.3f}")

    # ------------------------------------------------------------------ 4. where to look
    print(where_to_look(args.out))


def command(name: str) -> str:
    """How to run ``name`` (``tensorboard``, ``keras-scale``) from here: the script beside this Python
    (``.venv/bin/tensorboard`` when the venv is not activated), else ``name`` as it is on ``PATH``.

    Example:
        command("tensorboard")   # '.venv/bin/tensorboard' after `make demo`
    """
    import sys

    on_path = shutil.which(name)
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.access(beside, os.X_OK) and (on_path is None or os.path.realpath(on_path) != os.path.realpath(beside)):
        rel = os.path.relpath(beside)
        return rel if not rel.startswith("..") else beside
    return name


def where_to_look(out: str) -> str:
    """The closing lines of the demo: commands that run as printed (the venv's scripts when it is not active)."""
    q = shlex.quote  # a path with a space (or any shell character) still runs as printed
    raw_tensorboard = command("tensorboard")
    tensorboard, keras_scale_cmd = q(raw_tensorboard), q(command("keras-scale"))
    lines = [
        (f"{tensorboard} --logdir {q(out)}", "loss, learning rate per step, NaN counter, host RSS,"),
        ("", "GPU scalars (with a GPU), Profile tab (step-time breakdown)"),
        ("", "keras_scale tab: goodput bars, the NaN skips on the loss"),
        ("", "curve, checkpoint saves, the profile verdict (docs/dashboard.md)"),
        (f"{keras_scale_cmd} profile-summary {q(os.path.join(out, 'profile'))}", "the profiler verdict, offline"),
        (f"{keras_scale_cmd} checkpoint ls {q(os.path.join(out, 'checkpoints'))}",
         "rerun with --resume after a kill: continues at the same step"),
        (f"{keras_scale_cmd} doctor", "drivers, CUDA, GPUs, leftover processes"),
    ]
    width = max(len(cmd) for cmd, _ in lines) + 2
    text = "\n== done. Look at:\n" + "\n".join(f"  {cmd:<{width}}# {why}" for cmd, why in lines)
    if raw_tensorboard != "tensorboard":
        text += (f"\n  (or `source {q(os.path.join(os.path.dirname(raw_tensorboard), 'activate'))}` first, then "
                 "`tensorboard`, `keras-scale` ... as they are)")
    return text + "\n"


if __name__ == "__main__":
    main()
