"""ChiefCheckpoint vs Keras's BackupAndRestore and ModelCheckpoint: training-thread time blocked per save,
restore time, and what an async save costs the steps that run while it writes.

A ~50M-parameter MLP trained with Adam (checkpoint = weights + 2 moments, about 0.6 GB) is fit, each run in a
fresh subprocess and all variants interleaved, with: no checkpoint (baseline), ``ChiefCheckpoint`` sync and async,
Keras ``BackupAndRestore(save_freq=N)`` and ``ModelCheckpoint(save_weights_only=True, save_freq=N)`` (both write
weights + optimizer state to one ``.weights.h5``). Blocked time per save = the time the training thread spends in
the saver's batch hook at a save (for async: the copy to host memory, plus any wait for a previous write still
running) plus the extra time of the step right after it over the median step (on CPU TensorFlow's host copy can
share the variables' buffers, so the next optimizer update pays a copy-on-write). Restore: each saver's way to
load its newest checkpoint in a fresh process (ChiefCheckpoint: its whole ``on_train_begin``). Fit wall time: what
the saves cost the whole run (an async write competes with training for the CPU).

    python benchmarks/checkpoint.py                  # ~50M parameters, 8 saves per run, 3 interleaved runs
    python benchmarks/checkpoint.py --width 512 --depth 2 --saves 3 --repeats 1     # quick smoke run

Floors (issues 20, 28): sync save <= 1.0x BackupAndRestore, a run's first sync saves <= 1.0x its first saves,
restore <= 1.0x in a fresh process and in the process that trained, async block <= 0.2x. A control arm writes the
checkpoint's bytes with plain Python into new files in a fresh process: what the machine charges for that alone.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's keras_scale


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


class _Timed:
    """Wraps a callback and times its ``on_train_batch_end`` (where every saver under test writes)."""

    def __new__(cls, inner, hook_s):
        import keras

        class Timed(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def set_model(self, model):
                super().set_model(model)
                inner.set_model(model)

            def set_params(self, params):
                super().set_params(params)
                inner.set_params(params)

            def on_train_batch_end(self, batch, logs=None):
                t0 = time.perf_counter()
                inner.on_train_batch_end(batch, logs)
                hook_s.append(time.perf_counter() - t0)

        timed = Timed()
        for hook in ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
                     "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end"):
            setattr(timed, hook, getattr(inner, hook))
        return timed


def _saver(args):
    import keras

    from keras_scale.callbacks.checkpoint import ChiefCheckpoint

    if args.variant in ("sync", "async"):
        return ChiefCheckpoint(args.directory, save_freq=args.save_every, max_to_keep=1,
                               async_save=args.variant == "async", restore=False)
    if args.variant == "backup":
        return keras.callbacks.BackupAndRestore(args.directory, save_freq=args.save_every, delete_checkpoint=False)
    if args.variant == "modelcheckpoint":
        os.makedirs(args.directory, exist_ok=True)
        return keras.callbacks.ModelCheckpoint(os.path.join(args.directory, "w.weights.h5"), save_weights_only=True,
                                               save_freq=args.save_every)
    return None


def _restore(args, model, source: str) -> float:
    import keras

    from keras_scale.callbacks.checkpoint import ChiefCheckpoint

    model.optimizer.build(model.trainable_variables)
    t0 = time.perf_counter()
    if source == "sync":
        ckpt = ChiefCheckpoint(args.directory)
        ckpt.set_model(model)
        ckpt.on_train_begin()
        assert ckpt.restored_from is not None
    elif source == "backup":
        cb = keras.callbacks.BackupAndRestore(args.directory, save_freq=args.save_every)
        cb.set_model(model)
        cb.on_train_begin()
    else:
        model.load_weights(os.path.join(args.directory, "w.weights.h5"))
    return time.perf_counter() - t0


def run_variant(args: argparse.Namespace) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    if args.variant == "control_write":
        return {"variant": args.variant, "write_s": _plain_writes(args)}
    model = _build(args)
    if args.variant.startswith("restore_"):
        return {"variant": args.variant, "restore_s": _restore(args, model, args.variant[len("restore_"):]),
                "size_mb": _size_mb(args.directory)}

    hook_s: list = []
    step_s: list = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])  # wait for the step
            step_s.append(time.perf_counter() - self.t0)

    saver = _saver(args)
    callbacks = [StepTimer()] + ([_Timed(saver, hook_s)] if saver is not None else [])
    steps = args.save_every * args.saves + 1  # +1: no save on the step that compiles
    t0 = time.perf_counter()
    model.fit(_dataset(args), steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)
    fit_s = time.perf_counter() - t0  # includes the final flush of an async write (on_train_end)
    out = {"variant": args.variant, "params": model.count_params(), "fit_s": fit_s,
           "median_step_s": statistics.median(step_s[1:])}
    if saver is not None:
        median = statistics.median(step_s[1:])
        saves = [i for i in range(len(hook_s)) if (i + 1) % args.save_every == 0]
        # blocked = time in the hook at a save + the extra time of the step after it (on CPU TensorFlow's async
        # host copy can share the variables' buffers; the next optimizer update then pays a copy-on-write)
        out["blocked_s"] = [hook_s[i] + (max(step_s[i + 1] - median, 0.0) if i + 1 < len(step_s) else 0.0)
                            for i in saves]
        out["size_mb"] = _size_mb(args.directory)
        out["ks_blocked_s"] = getattr(saver, "blocked_s", None)
        if args.variant in ("sync", "backup"):  # restore in the process that trained: a fresh model, warm caches
            out["restore_here_s"] = _restore(args, _build(args), args.variant)
    return out


def _plain_writes(args) -> list:
    """Control: the first 2 writes of a checkpoint's bytes by plain Python in a fresh process (new files, then
    rename, as a saver does): what the machine charges for writing that much into new files, with no saver."""
    import numpy as np

    size = int(args.size_mb * 2**20)
    data = np.random.default_rng(0).bytes(size)
    os.makedirs(args.directory, exist_ok=True)
    out = []
    for i in range(2):
        path = os.path.join(args.directory, f"plain-{i}")
        t0 = time.perf_counter()
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        out.append(time.perf_counter() - t0)
    return out


def _size_mb(directory: str) -> float:
    """Size of the newest checkpoint in ``directory`` (any of the savers' layouts)."""
    from keras_scale.callbacks.checkpoint import list_checkpoints

    found = list_checkpoints(directory)
    if found:
        return _dir_mb(directory, found[0][0])
    total = 0
    for dirpath, _, files in os.walk(directory):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files if f.endswith(".h5"))
    return total / 2**20


def _spawn(args: argparse.Namespace, variant: str, directory: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--directory", directory,
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
           "--save-every", str(args.save_every), "--saves", str(args.saves), "--size-mb", str(args.size_mb)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


SAVERS = (("async", "ks.ChiefCheckpoint(async_save=True)"), ("backup", "keras BackupAndRestore(save_freq=N)"),
          ("modelcheckpoint", "keras ModelCheckpoint(save_weights_only)"), ("sync", "ks.ChiefCheckpoint(async_save=False)"))


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048, help="MLP width (default 2048: 4.2M params/layer)")
    parser.add_argument("--depth", type=int, default=12, help="hidden layers (default 12: ~50M params)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--save-every", type=int, default=12, help="batches between saves")
    parser.add_argument("--saves", type=int, default=8, help="saves per run (the first 2 are warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of every variant")
    parser.add_argument("--directory", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0

    root = tempfile.mkdtemp(prefix="ks_ckpt_bench_")
    runs: dict = {}
    try:
        for r in range(args.repeats):  # interleaved: a load change on the machine hits every variant alike
            for variant in ("baseline",) + tuple(v for v, _ in SAVERS):
                d = os.path.join(root, f"{variant}_{r}")
                runs.setdefault(variant, []).append(_spawn(args, variant, d))
            for source in ("sync", "backup", "modelcheckpoint"):
                runs.setdefault(f"restore_{source}", []).append(
                    _spawn(args, f"restore_{source}", os.path.join(root, f"{source}_{r}")))
            args.size_mb = runs["sync"][0]["size_mb"]
            runs.setdefault("control_write", []).append(
                _spawn(args, "control_write", os.path.join(root, f"control_{r}")))
            shutil.rmtree(os.path.join(root, f"control_{r}"), ignore_errors=True)
            for variant in ("baseline",) + tuple(v for v, _ in SAVERS):
                shutil.rmtree(os.path.join(root, f"{variant}_{r}"), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    warm = 2 if args.saves > 2 else 0  # 1st save builds the saver; with async_save the 2nd traces the host copy
    blocked = {v: statistics.median([b for run in runs[v] for b in run["blocked_s"][warm:]]) for v, _ in SAVERS}
    restore = {s: statistics.median([run["restore_s"] for run in runs[f"restore_{s}"]])
               for s in ("sync", "backup", "modelcheckpoint")}
    restore_here = {s: statistics.median([run["restore_here_s"] for run in runs[s]]) for s in ("sync", "backup")}
    fit_s = {v: statistics.median([run["fit_s"] for run in runs[v]]) for v in runs
             if not v.startswith(("restore", "control"))}
    size_mb = runs["sync"][0]["size_mb"]
    base = runs["baseline"][0]
    print(f"model: {base['params'] / 1e6:.1f}M parameters, checkpoint {size_mb:.0f} MB (weights + Adam moments); "
          f"{args.saves} saves per run, every {args.save_every} batches; {args.repeats} interleaved runs per variant")
    print(f"{'saver':44s}{'blocked per save':>18s}{'÷ BackupAndRestore':>20s}{'÷ ModelCheckpoint':>19s}")
    for variant, name in SAVERS:
        print(f"{name:44s}{blocked[variant]:16.3f} s{blocked[variant] / blocked['backup']:20.2f}"
              f"{blocked[variant] / blocked['modelcheckpoint']:19.2f}")
    if warm:  # the first saves of a run in a fresh directory, separately (first-call costs, a cold page cache)
        first = {v: statistics.median([b for run in runs[v] for b in run["blocked_s"][:warm]]) for v, _ in SAVERS}
        print(f"first {warm} saves of a run (new files): " + "; ".join(
            f"{name.split('(')[0].replace('keras ', '')}{'(async)' if v == 'async' else '(sync)' if v == 'sync' else ''} "
            f"{first[v]:.3f} s ({first[v] / first['backup']:.2f}x)" for v, name in SAVERS))
        plain = statistics.median([w for run in runs["control_write"] for w in run["write_s"]])
        print(f"control: plain Python writing the same {size_mb:.0f} MB into 2 new files in a fresh process: "
              f"{plain:.3f} s per write (median; the slowest {max(w for run in runs['control_write'] for w in run['write_s']):.3f} s)")
    print(f"{'restore':44s}{'seconds':>18s}{'÷ BackupAndRestore':>20s}")
    for source, name in (("sync", "ks.ChiefCheckpoint (fit start)"), ("backup", "keras BackupAndRestore"),
                         ("modelcheckpoint", "keras model.load_weights(.weights.h5)")):
        print(f"{name:44s}{restore[source]:16.3f} s{restore[source] / restore['backup']:20.2f}")
    print(f"restore in the process that trained (a fresh model): ks.ChiefCheckpoint {restore_here['sync']:.3f} s, "
          f"BackupAndRestore {restore_here['backup']:.3f} s "
          f"({restore_here['sync'] / restore_here['backup']:.2f}x)")
    print(f"fit wall time: no checkpoints {fit_s['baseline']:.2f} s; async {fit_s['async']:.2f} s "
          f"({fit_s['async'] / fit_s['baseline']:.2f}x); sync {fit_s['sync']:.2f} s "
          f"({fit_s['sync'] / fit_s['baseline']:.2f}x); BackupAndRestore {fit_s['backup']:.2f} s "
          f"({fit_s['backup'] / fit_s['baseline']:.2f}x)")
    floors = {"sync save <= 1.0x BackupAndRestore": blocked["sync"] / blocked["backup"] <= 1.0,
              "first sync saves <= 1.0x BackupAndRestore's": not warm or first["sync"] / first["backup"] <= 1.0,
              "restore <= 1.0x BackupAndRestore (fresh process)": restore["sync"] / restore["backup"] <= 1.0,
              "restore <= 1.0x BackupAndRestore (the training process)":
                  restore_here["sync"] / restore_here["backup"] <= 1.0,
              "async block <= 0.2x BackupAndRestore": blocked["async"] / blocked["backup"] <= 0.2}
    for name, ok in floors.items():
        print(f"floor {name}: {'OK' if ok else 'ABOVE FLOOR'}")
    return 0 if all(floors.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
