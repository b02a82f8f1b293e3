"""Kill-and-resume: a training process SIGKILLed at random moments (mid-step and mid-write included) and
restarted until it finishes ends with exactly the weights of an uninterrupted run."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests._helpers import load_weights_npz as _load, subprocess_env as _env


TRAIN_SCRIPT = r"""
import os, sys, time
import numpy as np, tensorflow as tf, keras
tf.config.experimental.enable_op_determinism()
import keras_scale as ks
from keras_scale.callbacks.checkpoint import checkpoint_for

directory, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
keras.utils.set_random_seed(3)
x = np.random.RandomState(0).rand(192, 4).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse", metrics=["mae"])


class Slow(keras.callbacks.Callback):
    # Stretches each step so that kills land inside training, not only in start-up.
    def on_train_begin(self, logs=None):
        ckpt = checkpoint_for(self.model)
        print("STARTED", ckpt.restored_from if ckpt else None, flush=True)

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.01)


callbacks = [Slow()]
if mode != "reference":
    callbacks.insert(0, ks.ChiefCheckpoint(directory, save_freq=3, max_to_keep=2, async_save=(mode == "async"), verbose=1))
model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)  # 4 x 24 batches
np.savez(out, *[v.numpy() for v in model.weights])
print("DONE", flush=True)
"""


class _Run:
    """One training process whose stdout lines are collected by a thread."""

    def __init__(self, script, directory, out, mode):
        self.proc = subprocess.Popen([sys.executable, script, directory, out, mode], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
        self.lines = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(predicate(line) for line in list(self.lines)):
                return True
            if self.proc.poll() is not None:
                self.thread.join(5)
                return any(predicate(line) for line in self.lines)
            time.sleep(0.01)
        return False

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.thread.join(5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_then_resume_equals_uninterrupted_run(tmp_path):
    script = str(tmp_path / "train.py")
    with open(script, "w") as f:
        f.write(TRAIN_SCRIPT)
    directory = str(tmp_path / "ckpt")

    reference = _Run(script, directory + "_unused", str(tmp_path / "reference.npz"), "reference")
    assert reference.wait_for(lambda l: l == "DONE", 120), "\n".join(reference.lines)
    reference.kill()

    rng = random.Random(20261129)
    kills, resumed_from, attempts = 0, [], 0
    while attempts < 12:
        mode = "async" if attempts % 2 else "sync"
        run = _Run(script, directory, str(tmp_path / "final.npz"), mode)
        attempts += 1
        assert run.wait_for(lambda l: l.startswith("STARTED"), 120), "\n".join(run.lines)
        resumed_from += [l.split(" ", 1)[1] for l in run.lines if l.startswith("STARTED")]
        if kills < 4:
            if attempts % 3 == 2:  # right after a save was issued: with async_save the write is still going on
                run.wait_for(lambda l: l.startswith("ChiefCheckpoint: sav"), 30)
                time.sleep(rng.uniform(0.0, 0.02))
            elif attempts % 3 == 1:  # anywhere in a step, a callback or a save, once this run has saved (so that
                # the reruns resume from different points however slow a loaded machine makes the start-up)
                run.wait_for(lambda l: l.startswith("ChiefCheckpoint: sav"), 60)
                time.sleep(rng.uniform(0.05, 0.6))
            else:  # anywhere: start-up, restore, a step, a callback or a save
                time.sleep(rng.uniform(0.4, 1.2))
            if run.proc.poll() is None:
                run.kill()
                kills += 1
                continue
        assert run.wait_for(lambda l: l == "DONE", 180), "\n".join(run.lines[-30:])
        run.kill()
        break
    print(f"attempts={attempts} kills={kills} resumed_from={resumed_from}")
    assert kills >= 3, f"only {kills} kills landed inside training"
    assert resumed_from[0] == "None" and len({r for r in resumed_from if r != "None"}) >= 2, resumed_from
    final, expected = _load(tmp_path / "final.npz"), _load(tmp_path / "reference.npz")
    assert len(final) == len(expected)
    for a, b in zip(final, expected):
        np.testing.assert_array_equal(a, b)
