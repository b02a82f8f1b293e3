"""Preemption signals end a run with status 42 once its state is saved, however the signals arrive: repeated
SIGTERMs up to the last moment of the process's exit (one process; ``keras-scale launch`` with two workers), a
SIGTERM to one worker only, and multi-worker agreement with no collective per step (real signals, loopback
workers)."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from keras_scale.callbacks.checkpoint import list_checkpoints
from tests._helpers import REPO_ROOT, subprocess_env

TRAIN_SCRIPT = r"""
import sys, time
import numpy as np, keras
import keras_scale as ks

directory = sys.argv[1]
keras.utils.set_random_seed(3)
x = np.random.RandomState(0).rand(160, 4).astype("float32")
y = x.sum(1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")


class Report(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print("BATCH", int(self.model.optimizer.iterations.numpy()), flush=True)
        time.sleep(0.02)


ckpt = ks.ChiefCheckpoint(directory, save_freq=1000)
model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[ckpt, Report()])
print("DONE", flush=True)
"""


def _signal_repeatedly(pids, proc, every_s):
    """SIGTERM to every pid in ``pids`` every ``every_s`` until ``proc`` has exited: the first one asks for the
    save, the others land in every later moment of the process's life, its exit included."""
    sent = 0
    while proc.poll() is None:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
                sent += 1
            except ProcessLookupError:
                pass
        time.sleep(every_s)
    return sent


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterms_until_the_process_is_gone_never_change_the_exit_status_42(tmp_path):
    """A SIGTERM, then one every 5 ms until the process is gone (a scheduler repeating its signal, as in the
    reported two SIGTERMs 50 ms apart, but landing in every moment of the exit, the interpreter's teardown
    included): the state is saved and the status is 42 every time, never 143."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    for run in range(3):
        d = str(tmp_path / f"ckpt{run}")
        proc = subprocess.Popen([sys.executable, str(script), d], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=subprocess_env())
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("BATCH 3"):
                break
        reader = threading.Thread(target=lambda: lines.extend(l.rstrip("\n") for l in proc.stdout), daemon=True)
        reader.start()
        sent = _signal_repeatedly([proc.pid], proc, 0.005)
        reader.join(10)
        assert proc.returncode == 42, (run, sent, "\n".join(lines[-15:]))
        assert sent >= 5
        assert not any(l == "DONE" for l in lines)
        assert list_checkpoints(d)[0][0] >= 3
